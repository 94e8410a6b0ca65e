//! Mapped masters: which sections of a streamed unit can be served straight from their checkpoint file.
//!
//! A section (one dtype of one unit, [`Section`]) is *mappable* when every storage in it is homed in the same mapped
//! file ([`Home::File`]) and the storages lie there back to back exactly as the section lays them out: storage `k`
//! at file offset `start + off_k`. Then the file range `start .. start + used` (`used` = the last storage's end) is
//! the section's master: one host-to-device copy, no host copy. `order_by_files` sorts each unit's storages by
//! their place in the files before packing, which makes every section mappable whose tensors the checkpoint stores
//! contiguously with sizes that keep the device alignment. Packing is order-independent in size (every storage takes
//! its aligned size), so reordering never changes a plan's device bytes.

use super::layout::{align_up, Section, UnitLayout};
use crate::config::HostMasters;
use crate::model::{Home, HostModel};
use crate::pipeline::PipelineDesc;
use weightferry_actors::platform::HostBufferId;

/// A section served from its file: the copy's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MappedSection {
    /// The file's mapped buffer.
    pub buf: HostBufferId,
    /// File offset of the section's first byte.
    pub offset: u64,
    /// Bytes to copy (the section without its tail padding).
    pub len: u64,
}

/// Repacks every unit whose storages come from mapped files with its storages in file order (file, then offset);
/// storages not from a file keep their order, after the others. No-op for a model without files.
pub(crate) fn order_by_files(p: &PipelineDesc, model: &HostModel, units: &mut [UnitLayout]) {
    if model.mapped_files().is_empty() {
        return;
    }
    for unit in units.iter_mut() {
        let mut storages: Vec<_> = unit.storages().collect();
        storages.sort_by_key(|&s| model.file_origin(s).map_or((u64::MAX, u64::MAX), |(b, o)| (b.0, o)));
        *unit = UnitLayout::pack(p, &unit.path, &storages);
    }
}

/// A tensor's place in a checkpoint: `(file, file offset, bytes)`.
pub type FileRange = (u64, u64, u64);

/// The rule: tensors given in section order (sorted by file and offset) can be one file range exactly when each lies
/// in the first one's file at the previous one's end rounded up to the device alignment, which is where the section
/// packs it. Returns the index of the first tensor that does not, `None` when all do.
pub fn first_misplaced(ranges: &[FileRange]) -> Option<usize> {
    let &(file, start, _) = ranges.first()?;
    let mut at = 0u64;
    for (i, &(f, off, len)) in ranges.iter().enumerate() {
        if f != file || off.checked_sub(start) != Some(at) {
            return Some(i);
        }
        at = align_up(at + len);
    }
    None
}

/// Whether `sec` can be served from its file, and from where; otherwise why not (a sentence naming a storage).
pub(crate) fn mapped_section(model: &HostModel, sec: &Section) -> Result<MappedSection, String> {
    let mut ranges = Vec::with_capacity(sec.storages.len());
    for &(s, _) in &sec.storages {
        let Some(Home::File { buf, offset }) = model.home(s) else {
            return Err(format!("storage {} is not read from a checkpoint file", s.0));
        };
        ranges.push((buf.0, offset, model.storage_bytes(s)));
    }
    let (&(file, start, _), &(_, last_at, last_len)) =
        ranges.first().zip(ranges.last()).ok_or("the section is empty")?;
    if let Some(i) = first_misplaced(&ranges) {
        let s = sec.storages[i].0 .0;
        return Err(if ranges[i].0 != file {
            format!("storage {s} lies in another file than the section's first tensor")
        } else {
            format!(
                "storage {s} is not where the packed section needs it (its tensors are not contiguous in the file, \
                 or a tensor's size is not a multiple of the device alignment)"
            )
        });
    }
    Ok(MappedSection { buf: HostBufferId(file), offset: start, len: last_at - start + last_len })
}

/// How each section of each unit is served: `Some` where from its file.
pub(crate) type ServedSections = Vec<Vec<Option<MappedSection>>>;

/// Why a section cannot be served from its file: (unit path, dtype, reason).
pub(crate) type Unmappable = (String, &'static str, String);

/// How every section of `units` is served under `mode`: `Some` where from its file. `Err` (unit path, dtype, reason)
/// when `mode` is [`HostMasters::Mapped`] and a section cannot be.
pub(crate) fn plan_sections(
    model: &HostModel,
    units: &[UnitLayout],
    mode: HostMasters,
) -> Result<ServedSections, Unmappable> {
    units
        .iter()
        .map(|u| {
            u.sections
                .iter()
                .map(|sec| match mode {
                    HostMasters::Pinned => Ok(None),
                    HostMasters::Auto => Ok(mapped_section(model, sec).ok()),
                    HostMasters::Mapped => {
                        mapped_section(model, sec).map(Some).map_err(|why| (u.path.clone(), sec.dtype.name(), why))
                    }
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::first_misplaced;

    #[test]
    fn tensors_lie_as_packed_only_back_to_back_in_one_file_at_aligned_offsets() {
        assert_eq!(first_misplaced(&[]), None);
        assert_eq!(first_misplaced(&[(0, 100, 12)]), None);
        assert_eq!(first_misplaced(&[(0, 100, 512), (0, 612, 256), (0, 868, 12)]), None);
        // A 12-byte tensor first: the next one packs at 256, the file has it at 12 ...
        assert_eq!(first_misplaced(&[(0, 100, 12), (0, 112, 256)]), Some(1));
        // ... unless the file leaves the same padding.
        assert_eq!(first_misplaced(&[(0, 100, 12), (0, 356, 256)]), None);
        assert_eq!(first_misplaced(&[(0, 100, 512), (1, 612, 256)]), Some(1));
        assert_eq!(first_misplaced(&[(0, 100, 512), (0, 612, 256), (0, 1000, 8)]), Some(2));
    }
}
