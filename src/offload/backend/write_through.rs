//! Writes while enabled: new bytes for storages the backend holds (a `load_state_dict`, a fused LoRA, an in-place
//! edit) become the authoritative copy — the host master or loaded buffer — and every device copy of them is
//! refreshed before the next forward reads it, so the next forward and `disable` see exactly the written bytes.
//!
//! Order: every write is checked before anything changes; then the backend waits for every copy reading the masters
//! and for the compute stream (kernels reading the fixed placement); the host bytes are written; the fixed placement
//! copies its written storages again; and, when a streamed storage was written, the block stacks are rebuilt (as a
//! retune with the same config does), so no slot or resident block keeps the old bytes.

use super::StreamingBackend;
use crate::hooks::HookRegistry;
use crate::model::{Home, HostModel};
use crate::offload::OffloadError;
use crate::pipeline::StorageId;
use weightferry_actors::platform::StreamId;

impl StreamingBackend {
    /// Writes `writes` (storage, its new bytes: exactly its size) through to the host copy and every device copy.
    /// Refused before anything changes: a backend that is not enabled, a distributed run's gathered weights, an
    /// unknown storage, a wrong length, a storage served read-only from its checkpoint file. If refreshing the
    /// device copies fails after the host bytes were written, the host copy holds the new bytes and the error is
    /// returned (a failed stack rebuild leaves the backend without hooks, as a failed retune does; `disable` still
    /// restores everything).
    pub fn write_weights(
        &mut self,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
        writes: &[(StorageId, &[u8])],
    ) -> Result<(), OffloadError> {
        let Some(st) = self.state.as_ref().filter(|_| self.enabled) else {
            return Err(OffloadError::Unsupported("writing weights through needs an enabled backend".into()));
        };
        if st.group.is_some() {
            return Err(OffloadError::Unsupported(
                "a distributed run's weights cannot be written while enabled (each rank holds a shard); disable, \
                 write, and enable again"
                    .into(),
            ));
        }
        let is_fixed = |s: StorageId| st.fixed.as_ref().is_some_and(|f| f.contains(s));
        for &(s, bytes) in writes {
            check_write(model, s, bytes.len() as u64, is_fixed(s))?;
        }
        for stack in &st.stacks {
            stack.fence()?;
        }
        self.platform.stream_synchronize(compute)?;
        let fixed: Vec<StorageId> = writes.iter().map(|w| w.0).filter(|&s| is_fixed(s)).collect();
        let streamed = writes.iter().any(|w| st.locations.contains_key(&w.0));
        for &(s, bytes) in writes {
            model.write_through(s, bytes, is_fixed(s))?;
        }
        if let (Some(placement), Some(stream)) = (st.fixed.as_ref(), st.placement_stream) {
            if !fixed.is_empty() {
                placement.refresh(model, &fixed, stream)?;
            }
        }
        if !streamed {
            return Ok(());
        }
        let (config, plan) = (self.config.clone(), self.plan.clone());
        let plan = plan.ok_or_else(|| OffloadError::Unsupported("internal: an enabled backend has no plan".into()))?;
        self.retune_planned(config, plan, model, hooks, compute)
    }
}

/// Whether `bytes` new bytes can be written to storage `s` now (see [`StreamingBackend::write_weights`]); `fixed`:
/// the fixed placement holds it (copied to the device through its home, so one served from its checkpoint file can
/// move to a buffer of its own; a streamed one's copies read the file's address).
fn check_write(model: &HostModel, s: StorageId, bytes: u64, fixed: bool) -> Result<(), OffloadError> {
    let expected = model.storage_bytes(s);
    match model.home(s) {
        None => Err(OffloadError::Unsupported(format!("storage {} is not part of this pipeline", s.0))),
        Some(Home::File { .. }) if !fixed => Err(OffloadError::Unsupported(format!(
            "storage {} is streamed read-only from its checkpoint file (host_masters = \"auto\" or \"mapped\" \
             served its block from the file, or host_budget left the block to the disk tier); to write weights while \
             enabled, enable with host_masters = \"pinned\" and a host_budget that holds every block, or disable \
             first",
            s.0
        ))),
        Some(Home::Sharded) => Err(OffloadError::Unsupported(format!(
            "storage {} is held as shards by a distributed run; disable first",
            s.0
        ))),
        Some(_) if bytes != expected => {
            Err(OffloadError::Unsupported(format!("storage {} holds {expected} bytes; the write has {bytes}", s.0)))
        }
        Some(_) => Ok(()),
    }
}
