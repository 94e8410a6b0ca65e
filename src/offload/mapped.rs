//! Mapped masters: which sections of a streamed unit can be served straight from their checkpoint file.
//!
//! A section (one dtype of one unit, [`Section`]) is *mappable* when every storage in it is homed in the same mapped
//! file ([`Home::File`]) and the storages lie there back to back exactly as the section lays them out: storage `k`
//! at file offset `start + off_k`. Then the file range `start .. start + used` (`used` = the last storage's end) is
//! the section's master: one host-to-device copy, no host copy. [`order_by_files`] sorts each unit's storages by
//! their place in the files before packing, which makes every section mappable whose tensors the checkpoint stores
//! contiguously with sizes that keep the device alignment. Packing is order-independent in size (every storage takes
//! its aligned size), so reordering never changes a plan's device bytes.

use super::layout::{Section, UnitLayout};
use crate::config::HostMasters;
use crate::model::{Home, HostModel};
use crate::plan::PipelineDesc;
use weightferry_actors::platform::HostBufferId;

/// A section served from its file: the copy's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedSection {
    /// The file's mapped buffer.
    pub buf: HostBufferId,
    /// File offset of the section's first byte.
    pub offset: u64,
    /// Bytes to copy (the section without its tail padding).
    pub len: u64,
}

/// Repacks every unit whose storages come from mapped files with its storages in file order (file, then offset);
/// storages not from a file keep their order, after the others. No-op for a model without files.
pub fn order_by_files(p: &PipelineDesc, model: &HostModel, units: &mut [UnitLayout]) {
    if model.mapped_files().is_empty() {
        return;
    }
    for unit in units.iter_mut() {
        let mut storages: Vec<_> = unit.storages().collect();
        storages.sort_by_key(|&s| model.file_origin(s).map_or((u64::MAX, u64::MAX), |(b, o)| (b.0, o)));
        *unit = UnitLayout::pack(p, &unit.path, &storages);
    }
}

/// Whether `sec` can be served from its file, and from where; otherwise why not (a sentence naming a storage).
pub fn mapped_section(model: &HostModel, sec: &Section) -> Result<MappedSection, String> {
    let mut first: Option<(HostBufferId, u64)> = None;
    let mut used = 0u64;
    for &(s, off) in &sec.storages {
        let Some(Home::File { buf, offset }) = model.home(s) else {
            return Err(format!("storage {} is not read from a checkpoint file", s.0));
        };
        let (fbuf, start) = *first.get_or_insert((buf, offset.wrapping_sub(off)));
        if fbuf != buf {
            return Err(format!("storage {} lies in another file than the section's first tensor", s.0));
        }
        if offset.checked_sub(off) != Some(start) {
            return Err(format!(
                "storage {} is not where the packed section needs it (its tensors are not contiguous in the file, \
                 or a tensor's size is not a multiple of the device alignment)",
                s.0
            ));
        }
        used = off + model.storage_bytes(s);
    }
    let (buf, offset) = first.ok_or_else(|| "the section is empty".to_string())?;
    Ok(MappedSection { buf, offset, len: used })
}

/// How each section of each unit is served: `Some` where from its file.
pub type ServedSections = Vec<Vec<Option<MappedSection>>>;

/// Why a section cannot be served from its file: (unit path, dtype, reason).
pub type Unmappable = (String, &'static str, String);

/// How every section of `units` is served under `mode`: `Some` where from its file. `Err` (unit path, dtype, reason)
/// when `mode` is [`HostMasters::Mapped`] and a section cannot be.
pub fn plan_sections(model: &HostModel, units: &[UnitLayout], mode: HostMasters) -> Result<ServedSections, Unmappable> {
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
