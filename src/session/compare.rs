//! Whether a caller's bytes are the bytes a session holds for its storages: how an engine that hands a checkpoint
//! over a module already holding weights learns, before anything moves, that a tensor differs from the file (an
//! edit, a fused adapter) and would be dropped if the file's bytes served it.

use super::error::offload_err;
use super::{Session, SessionError};
use crate::model::{HostModel, ModelError};
use crate::pipeline::StorageId;
use std::sync::atomic::{AtomicUsize, Ordering};
use weightferry_actors::platform::PlatformError;

/// Bytes read from a storage's home per comparison step.
const COMPARE_READ_BYTES: usize = 8 << 20;

impl Session {
    /// The storages of `items` (`(storage, the caller's bytes for it)`) whose bytes differ from the session's (read
    /// through each storage's home: its checkpoint file, a master, a loaded buffer), in the order of `items`. A
    /// length other than the storage's size differs. Compared on all available cores (at most 16); nothing is
    /// written.
    pub fn storages_differing(&self, items: &[(StorageId, &[u8])]) -> Result<Vec<StorageId>, SessionError> {
        let model = &self.model;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 16).min(items.len().max(1));
        let next = AtomicUsize::new(0);
        type Found = Vec<(usize, Result<bool, ModelError>)>;
        let per_thread: Vec<Found> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let next = &next;
                    scope.spawn(move || {
                        let (mut buf, mut out) = (Vec::new(), Vec::new());
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&(id, bytes)) = items.get(i) else { break };
                            out.push((i, equal(model, id, bytes, &mut buf)));
                        }
                        out
                    })
                })
                .collect();
            let joined = handles.into_iter().map(|h| h.join());
            joined.map(|r| r.unwrap_or_else(|_| vec![(0, Err(ModelError::Platform(panicked())))])).collect()
        });
        let mut found: Found = per_thread.into_iter().flatten().collect();
        found.sort_by_key(|(i, _)| *i);
        let mut differing = Vec::new();
        for (i, same) in found {
            if !same.map_err(offload_err)? {
                differing.push(items[i].0);
            }
        }
        Ok(differing)
    }
}

/// The error of a comparing thread that panicked.
fn panicked() -> PlatformError {
    PlatformError::Driver("a thread comparing storages panicked".into())
}

/// Whether storage `id` holds exactly `bytes`, read through `buf`.
fn equal(model: &HostModel, id: StorageId, bytes: &[u8], buf: &mut Vec<u8>) -> Result<bool, ModelError> {
    if bytes.len() as u64 != model.storage_bytes(id) {
        return Ok(false);
    }
    for (k, want) in bytes.chunks(COMPARE_READ_BYTES).enumerate() {
        buf.resize(want.len(), 0);
        model.read_storage_range(id, (k * COMPARE_READ_BYTES) as u64, buf)?;
        if buf.as_slice() != want {
            return Ok(false);
        }
    }
    Ok(true)
}
