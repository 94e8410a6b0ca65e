//! The disk tier in the streaming backend: which units `enable` reads from their checkpoint file on every pass
//! ([`disk_tier::plan_disk`], the same call the prediction makes), the readers of those files (`O_DIRECT` where the
//! filesystem allows it, see [`DiskSource`]), each disk unit's block spec, and a reader actor per stack that has
//! disk units (its staging ring sized for the stack's largest one). The readers live as long as the stacks' block
//! specs (a `retune` rebuilds the stacks over the same readers) and are destroyed before the copy stream.

use super::State;
use crate::checkpoint::DiskSource;
use crate::model::HostModel;
use crate::offload::disk_tier::{disk_block, file_sections, plan_disk, DiskPlan, STAGING_BUFFERS};
use crate::offload::mapped::ServedSections;
use crate::offload::units::UnitPlan;
use crate::offload::OffloadError;
use std::collections::BTreeMap;
use std::sync::Arc;
use weightferry_actors::platform::{BlockFile, HostBufferId, HostMemoryKind, PlatformRef};
use weightferry_actors::{BlockSpec, ReaderHandle, StreamHandle};

/// The disk plan of `units` under the config's `host_budget`; the disk units' sections are taken out of `served`
/// (no mapping, no registration for them).
pub(super) fn plan(
    model: &HostModel,
    budget: Option<u64>,
    units: &UnitPlan,
    served: &mut [ServedSections],
) -> DiskPlan {
    let views: Vec<(bool, &[crate::offload::layout::UnitLayout])> =
        units.stacks.iter().map(|s| (s.allgather, s.units.as_slice())).collect();
    let disk = plan_disk(Some(model), budget, &views, served);
    for (si, stack) in served.iter_mut().enumerate() {
        for (ui, sections) in stack.iter_mut().enumerate() {
            if disk.on_disk(si, ui) {
                sections.iter_mut().for_each(|m| *m = None);
            }
        }
    }
    disk
}

/// The disk tier's checkpoint files by the model's mapped buffer of each.
pub(super) type Files = BTreeMap<HostBufferId, Arc<dyn BlockFile>>;

/// A reader for every checkpoint file a disk unit reads, and the paths of those the filesystem will not read
/// around the page cache (logged as a warning here; the report names them for hosts without a log, and Python warns).
pub(super) fn open_files(
    model: &HostModel,
    units: &UnitPlan,
    disk: &DiskPlan,
) -> Result<(Files, Vec<String>), OffloadError> {
    let mut files: BTreeMap<HostBufferId, Arc<dyn BlockFile>> = BTreeMap::new();
    let mut buffered = Vec::new();
    for (si, sp) in units.stacks.iter().enumerate() {
        for (_, unit) in sp.units.iter().enumerate().filter(|(ui, _)| disk.on_disk(si, *ui)) {
            for s in unit.storages() {
                let Some((buf, _)) = model.file_origin(s) else { continue };
                if files.contains_key(&buf) {
                    continue;
                }
                let origin = model.file(buf).ok_or_else(|| {
                    OffloadError::Unsupported(format!("internal: the checkpoint file of `{}` has no path", unit.path))
                })?;
                let path = origin.path();
                let source = DiskSource::open(origin.clone()).map_err(|e| OffloadError::Unsupported(e.to_string()))?;
                if !source.is_direct() {
                    tracing::warn!(
                        "{}: the filesystem refuses O_DIRECT; the disk tier reads it through the page cache",
                        path.display()
                    );
                    buffered.push(path.display().to_string());
                }
                files.insert(buf, Arc::new(source));
            }
        }
    }
    Ok((files, buffered))
}

/// The block spec of unit `ui` of stack `si`, a disk unit: the copies of its sections in a file (the caller adds
/// those of the sections that keep masters, [`disk_tier::master_part`](crate::offload::disk_tier::master_part)).
pub(super) fn block(
    st: &mut State,
    model: &HostModel,
    units: &UnitPlan,
    files: &BTreeMap<HostBufferId, Arc<dyn BlockFile>>,
    (si, ui): (usize, usize),
) -> Result<BlockSpec, OffloadError> {
    let unit = &units.stacks[si].units[ui];
    let spec = disk_block(model, unit, files).map_err(|e| OffloadError::Unsupported(format!("internal: {e}")))?;
    for (sec, in_file) in unit.sections.iter().zip(file_sections(model, unit)) {
        for &(s, off) in sec.storages.iter().filter(|_| in_file) {
            st.locations.insert(s, (si, ui, sec.device_offset + off));
        }
        st.disk_bytes += if in_file { sec.len } else { 0 };
    }
    Ok(spec)
}

/// A reader per stack with disk units (staging buffers of `kind` sized for its disk units' largest staging layout), forwarding to
/// `stream`; `None` for the other stacks. On failure the readers made are destroyed.
pub(super) fn readers(
    platform: &PlatformRef,
    st: &mut State,
    stream: &StreamHandle,
    kind: HostMemoryKind,
) -> Result<(), OffloadError> {
    for (si, blocks) in st.block_specs.iter().enumerate() {
        let windows = blocks.iter().flat_map(|b| b.reads.iter().map(|r| r.window()));
        let largest = windows.map(|(start, len)| start + len).max();
        let reader = match largest {
            Some(bytes) => {
                let name = format!("disk-{si}");
                let made = ReaderHandle::spawn(platform.clone(), &name, stream.clone(), STAGING_BUFFERS, bytes, kind);
                match made {
                    Ok(r) => {
                        st.staging_bytes += r.staging_bytes()?;
                        Some(r)
                    }
                    Err(e) => {
                        destroy(st);
                        return Err(e.into());
                    }
                }
            }
            None => None,
        };
        st.readers.push(reader);
    }
    Ok(())
}

/// Destroys every reader (after the stacks that sent through them), freeing the staging buffers, and forgets the
/// disk units' bytes. Their errors are
/// the stream's, reported by the stacks' own fences; a reader is destroyed either way.
pub(super) fn destroy(st: &mut State) {
    for r in std::mem::take(&mut st.readers).into_iter().flatten() {
        let _ = r.destroy();
    }
    (st.staging_bytes, st.disk_bytes) = (0, 0);
    st.buffered_files.clear();
}
