//! Flat layouts: how the storages of one block (or one staged component) are packed into one host master per dtype
//! and into one device region, so a block moves with one copy per dtype instead of one per tensor.
//!
//! Invariant: a storage appears once per layout (tied and aliased tensors share it), at an offset aligned to
//! [`ALIGN`]; the host master of a dtype has exactly the byte layout of that dtype's section of the device region,
//! so the copy is a single flat run and every tensor keeps its strides (tensors are views into storages).

use crate::model::{HostModel, ModelError};
use crate::pipeline::{DType, PipelineDesc, StorageId};
use std::collections::BTreeMap;
use weightferry_actors::platform::{HostBufferId, PlatformError, PlatformRef};

pub use crate::pipeline::{align_up, DEVICE_ALIGN as ALIGN};

/// One dtype's section: the storages it holds and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// Element type of the section.
    pub dtype: DType,
    /// Offset of the section in the device region.
    pub device_offset: u64,
    /// Bytes of the section (also the size of its host master).
    pub len: u64,
    /// `(storage, offset within the section)`.
    pub storages: Vec<(StorageId, u64)>,
}

/// The packed layout of one unit (block or staged component).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayout {
    /// Module path of the unit.
    pub path: String,
    /// Sections in dtype order.
    pub sections: Vec<Section>,
    /// Bytes of the device region.
    pub device_bytes: u64,
}

impl UnitLayout {
    /// Packs `storages` (deduplicated, in the given order within each dtype).
    pub fn pack(p: &PipelineDesc, path: &str, storages: &[StorageId]) -> UnitLayout {
        let mut by_dtype: BTreeMap<DType, Vec<StorageId>> = BTreeMap::new();
        for &s in storages {
            let Some(d) = p.storages.get(&s) else { continue };
            let list = by_dtype.entry(d.dtype).or_default();
            if !list.contains(&s) {
                list.push(s);
            }
        }
        let mut sections = Vec::new();
        let mut dev = 0u64;
        for (dtype, list) in by_dtype {
            let mut off = 0u64;
            let mut placed = Vec::new();
            for s in list {
                placed.push((s, off));
                off = align_up(off + p.storages[&s].byte_size());
            }
            sections.push(Section { dtype, device_offset: dev, len: off, storages: placed });
            dev = align_up(dev + off);
        }
        UnitLayout { path: path.to_string(), sections, device_bytes: dev }
    }

    /// Device offset of a storage inside the unit's region.
    pub fn device_offset_of(&self, s: StorageId) -> Option<u64> {
        self.sections
            .iter()
            .find_map(|sec| sec.storages.iter().find(|(id, _)| *id == s).map(|(_, o)| sec.device_offset + o))
    }

    /// Every storage in the unit.
    pub fn storages(&self) -> impl Iterator<Item = StorageId> + '_ {
        self.sections.iter().flat_map(|s| s.storages.iter().map(|(id, _)| *id))
    }
}

/// Bytes of a section's contents as they must appear in its master, read from the model's current homes, as one
/// whole-section vector (the reference layout; the streaming backend fills its masters with [`write_section`]
/// instead, which never holds a section in memory twice).
pub fn section_bytes(model: &HostModel, sec: &Section) -> Result<Vec<u8>, ModelError> {
    let mut out = vec![0u8; sec.len as usize];
    for &(s, off) in &sec.storages {
        let b = model.read_storage(s)?;
        out[off as usize..off as usize + b.len()].copy_from_slice(&b);
    }
    Ok(out)
}

/// Bytes of the bounce buffer through which the streaming backend copies storages into a master
/// ([`write_section`]): bounds the transient host memory of building one master to this, whatever the section's size.
pub const MASTER_BOUNCE_BYTES: usize = 8 << 20;

/// Fills the host buffer `buf` (a section's master) without assembling the section in memory: writes zeros to every
/// byte of `buf` that no storage of `sec` covers (the gaps between storages, their alignment padding and the tail up
/// to the buffer's end), then copies each storage, read from the model's current home, to its offset through a bounce
/// buffer of at most `chunk_bytes` bytes (at least 1). The buffer ends up byte-identical to [`section_bytes`] followed
/// by zeros, whatever it held before (nothing relies on `alloc_host` zeroing). Storages are written in section order,
/// so even overlapping storages (which [`UnitLayout::pack`] never produces) end as in `section_bytes`.
///
/// A storage reaching past `sec.len`, or a buffer shorter than `sec.len`, is [`PlatformError::OutOfBounds`] before
/// anything is written; read and write failures are passed on (the buffer's contents are then unspecified), a
/// released storage as [`ModelError::Sharded`].
pub fn write_section(
    platform: &PlatformRef,
    buf: HostBufferId,
    model: &HostModel,
    sec: &Section,
    chunk_bytes: usize,
) -> Result<(), ModelError> {
    let (buf_len, _) = platform.host_buffer_info(buf)?;
    if buf_len < sec.len {
        return Err(
            PlatformError::OutOfBounds { what: "section master", offset: 0, len: sec.len, size: buf_len }.into()
        );
    }
    let mut bounce = vec![0u8; usize::try_from(buf_len).unwrap_or(usize::MAX).clamp(1, chunk_bytes.max(1))];
    write_section_range(platform, buf, 0, model, sec, 0..buf_len, &mut bounce)
}

/// Writes bytes `range` of section `sec` — as [`section_bytes`] lays them out, zero wherever no storage covers
/// them, past `sec.len` too — into `buf` at offset `at`, through `bounce` (its contents are overwritten): zeros
/// first, then the covered parts of each storage in section order. The one mechanism behind full masters
/// ([`write_section`]) and a rank's shard of a section (`distributed::build_sharded_masters`, which reads only its
/// own byte ranges). A storage reaching past `sec.len` is [`PlatformError::OutOfBounds`] before anything is written;
/// an empty `bounce` writes nothing.
pub(crate) fn write_section_range(
    platform: &PlatformRef,
    buf: HostBufferId,
    at: u64,
    model: &HostModel,
    sec: &Section,
    range: std::ops::Range<u64>,
    bounce: &mut [u8],
) -> Result<(), ModelError> {
    let mut covered = Vec::with_capacity(sec.storages.len());
    for &(s, off) in &sec.storages {
        let len = model.storage_bytes(s);
        if off.checked_add(len).is_none_or(|end| end > sec.len) {
            return Err(PlatformError::OutOfBounds { what: "section storage", offset: off, len, size: sec.len }.into());
        }
        covered.push((off, off + len));
    }
    covered.sort_unstable();
    if bounce.is_empty() || range.end <= range.start {
        return Ok(());
    }
    // The zero source for the gaps, then the bounce buffer for the storages.
    let zeros = bounce.len().min(usize::try_from(range.end - range.start).unwrap_or(usize::MAX));
    bounce[..zeros].fill(0);
    let write_zeros = |from: u64, to: u64| -> Result<(), PlatformError> {
        let mut pos = from;
        while pos < to {
            let n = (to - pos).min(zeros as u64);
            platform.write_host(buf, at + (pos - range.start), &bounce[..n as usize])?;
            pos += n;
        }
        Ok(())
    };
    let mut cursor = range.start;
    for &(start, end) in &covered {
        if start > cursor {
            write_zeros(cursor, start.min(range.end))?;
        }
        cursor = cursor.max(end);
    }
    write_zeros(cursor, range.end)?;
    for &(s, off) in &sec.storages {
        let (from, to) = (off.max(range.start), (off + model.storage_bytes(s)).min(range.end));
        let mut pos = from;
        while pos < to {
            let n = (to - pos).min(bounce.len() as u64) as usize;
            let chunk = &mut bounce[..n];
            model.read_storage_range(s, pos - off, chunk)?;
            platform.write_host(buf, at + (pos - range.start), chunk)?;
            pos += n as u64;
        }
    }
    Ok(())
}

/// Distinct storages under each of `paths`, in tensor declaration order.
pub(crate) fn storages_of(p: &PipelineDesc, path: &str) -> Vec<StorageId> {
    let mut out = Vec::new();
    if let Some(m) = p.module(path) {
        for (_, t) in m.tensors_recursive() {
            if !out.contains(&t.storage) {
                out.push(t.storage);
            }
        }
    }
    out
}
