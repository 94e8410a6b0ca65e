//! The disk tier's plan: which streamed units are read from their checkpoint file on every pass instead of holding a
//! host master, so that the host masters and the staging ring fit `host_budget`; and the block spec of such a unit
//! (its file ranges, read into a staging buffer, and its copies from there).
//!
//! Only a model whose weights come from checkpoint files has a disk tier, and only the sections of a unit every
//! storage of which lies in a file as the module holds it; a unit's other sections (a GGUF file's F32 tensors
//! converted to the module's bf16) keep host masters and are copied from them beside the staged ones. Units are
//! moved to the disk tier from the end of the last stack backwards until the masters of the others plus
//! [`STAGING_BUFFERS`] staging buffers of the largest disk unit fit the budget (or none is left: then
//! `check_host_budget` refuses the plan). A disk unit's staging buffer holds its file ranges as read
//! ([`staging_layout`]: aligned windows, so `O_DIRECT` reads land in it with no copy), and its copies go from there
//! to its device region.
//!
//! Invariant: the prediction ([`super::predict::host_of`]) and the backend call `plan_disk` with the same units and
//! served sections, so the bytes `plan` reports are the bytes `enable` holds.

use super::layout::UnitLayout;
use super::mapped::ServedSections;
use crate::model::{Home, HostModel};
use std::collections::BTreeMap;
use std::sync::Arc;
use weightferry_actors::messages::{FileRead, STAGING_HOST};
use weightferry_actors::platform::{read_window_len, BlockFile, HostBufferId, DIRECT_READ_ALIGN};
use weightferry_actors::{BlockSpec, Segment};

/// Staging buffers of a reader: one being filled while the copies of the other run.
pub const STAGING_BUFFERS: usize = 2;

/// Which units of each stack are read from disk, and the host bytes that leaves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskPlan {
    /// Per stack, per unit: read from its file on every pass.
    pub disk: Vec<Vec<bool>>,
    /// Bytes of the disk units' sections (read from disk per pass, per stack pass).
    pub disk_bytes: u64,
    /// Host bytes of the staging buffers, all stacks with disk units together.
    pub staging_bytes: u64,
}

impl DiskPlan {
    /// Whether unit `ui` of stack `si` is on disk.
    pub fn on_disk(&self, si: usize, ui: usize) -> bool {
        self.disk.get(si).and_then(|s| s.get(ui)).copied().unwrap_or(false)
    }
}

/// Per section of `unit`: whether every storage of it lies in a checkpoint file as the module holds it (the disk
/// tier reads those; a section converted from another dtype keeps a host master).
pub(crate) fn file_sections(model: &HostModel, unit: &UnitLayout) -> Vec<bool> {
    let in_file = |s| matches!(model.home(s), Some(Home::File { .. }));
    unit.sections.iter().map(|sec| sec.storages.iter().all(|&(s, _)| in_file(s))).collect()
}

/// The part of a disk unit that keeps host masters: its sections not in a file (same device offsets), or `None`.
pub(crate) fn master_part(model: &HostModel, unit: &UnitLayout) -> Option<UnitLayout> {
    let in_file = file_sections(model, unit);
    let sections: Vec<_> = unit.sections.iter().zip(&in_file).filter(|(_, f)| !**f).map(|(s, _)| s.clone()).collect();
    (!sections.is_empty()).then(|| UnitLayout { path: unit.path.clone(), sections, device_bytes: unit.device_bytes })
}

/// Bytes of `unit`'s sections that need a master (not served from their file), of those `which` selects.
fn master_bytes(
    unit: &UnitLayout,
    served: Option<&Vec<Option<super::mapped::MappedSection>>>,
    which: &dyn Fn(usize) -> bool,
) -> u64 {
    unit.sections
        .iter()
        .enumerate()
        .filter(|(j, _)| which(*j) && served.and_then(|s| s.get(*j)).copied().flatten().is_none())
        .map(|(_, s)| s.len)
        .sum()
}

/// The disk plan for `stacks` (`(gathered, units)`: gathered stacks take no part) with `served` their sections served
/// from files, under `budget`. No disk unit without a budget, without files, or when the masters fit.
pub(crate) fn plan_disk(
    model: Option<&HostModel>,
    budget: Option<u64>,
    stacks: &[(bool, &[UnitLayout])],
    served: &[ServedSections],
) -> DiskPlan {
    let mut plan = DiskPlan { disk: stacks.iter().map(|(_, u)| vec![false; u.len()]).collect(), ..DiskPlan::default() };
    let (Some(model), Some(budget)) = (model, budget) else { return plan };
    if model.mapped_files().is_empty() {
        return plan;
    }
    let served_of = |si: usize, ui: usize| served.get(si).and_then(|s| s.get(ui));
    let masters_of = |si: usize, ui: usize, u: &UnitLayout| master_bytes(u, served_of(si, ui), &|_| true);
    let mut masters: u64 = 0;
    for (si, (gathered, units)) in stacks.iter().enumerate() {
        if !gathered {
            masters += units.iter().enumerate().map(|(ui, u)| masters_of(si, ui, u)).sum::<u64>();
        }
    }
    let mut largest = 0u64;
    let fits = |masters: u64, largest: u64| masters + STAGING_BUFFERS as u64 * largest <= budget;
    if fits(masters, 0) {
        return plan;
    }
    'all: for (si, (gathered, units)) in stacks.iter().enumerate().rev() {
        if *gathered {
            continue;
        }
        for (ui, u) in units.iter().enumerate().rev() {
            let in_file = file_sections(model, u);
            if !in_file.contains(&true) {
                continue;
            }
            plan.disk[si][ui] = true;
            // Its sections in a file need no master any more; the others (never served: not in a file) keep theirs.
            masters -= master_bytes(u, served_of(si, ui), &|j| in_file[j]);
            largest = largest.max(staging_layout(model, u).map_or(u.device_bytes, |l| l.bytes));
            plan.disk_bytes += u.sections.iter().zip(&in_file).filter(|(_, f)| **f).map(|(s, _)| s.len).sum::<u64>();
            if fits(masters, largest) {
                break 'all;
            }
        }
    }
    plan.staging_bytes = if largest > 0 { STAGING_BUFFERS as u64 * largest } else { 0 };
    plan
}

/// Gaps up to this many bytes between two ranges of one disk unit in one file are read through: one large read
/// instead of two smaller ones (a block's tensors usually lie together in a file, with other blocks' around them).
pub const READ_THROUGH_GAP: u64 = 64 * 1024;

/// How a disk unit lies in its staging buffer: its file ranges (storages that lie together in a file merged, gaps up
/// to [`READ_THROUGH_GAP`] read through), each read into its own window aligned to [`DIRECT_READ_ALIGN`] so direct
/// I/O reads straight into the buffer, and a copy per run of storages contiguous both there and on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingLayout {
    /// `(file, offset in the file, bytes, offset in the staging buffer)` of each read.
    pub reads: Vec<(HostBufferId, u64, u64, u64)>,
    /// The copies from the staging buffer (host offsets in it) to the unit's device region.
    pub segments: Vec<Segment>,
    /// Bytes of staging buffer the unit needs: the end of its last window.
    pub bytes: u64,
}

/// The staging layout of `unit`'s sections that lie in checkpoint files (those whose every storage does).
pub fn staging_layout(model: &HostModel, unit: &UnitLayout) -> Result<StagingLayout, String> {
    // (file, offset in it, bytes, device offset), in file order.
    let mut pieces = Vec::new();
    let in_file = file_sections(model, unit);
    for sec in unit.sections.iter().zip(&in_file).filter(|(_, f)| **f).map(|(s, _)| s) {
        for &(s, off) in &sec.storages {
            let Some(Home::File { buf, offset }) = model.home(s) else {
                return Err(format!("storage {} of `{}` is not in a checkpoint file", s.0, unit.path));
            };
            pieces.push((buf, offset, model.storage_bytes(s), sec.device_offset + off));
        }
    }
    pieces.sort_unstable();
    let mut ranges: Vec<(HostBufferId, u64, u64)> = Vec::new(); // (file, start, end)
    for &(buf, offset, len, _) in &pieces {
        match ranges.last_mut() {
            Some(r) if r.0 == buf && offset <= r.2.saturating_add(READ_THROUGH_GAP) => r.2 = r.2.max(offset + len),
            _ => ranges.push((buf, offset, offset + len)),
        }
    }
    let mut window = 0u64;
    let reads: Vec<(HostBufferId, u64, u64, u64)> = ranges
        .iter()
        .map(|&(buf, start, end)| {
            let read = (buf, start, end - start, window + start % DIRECT_READ_ALIGN);
            window += read_window_len(start, end - start);
            read
        })
        .collect();
    let mut segments: Vec<Segment> = pieces
        .iter()
        .map(|&(buf, offset, len, device_offset)| {
            let r = reads.iter().find(|r| r.0 == buf && r.1 <= offset && offset + len <= r.1 + r.2);
            let r = r.expect("every piece lies in the range made of it");
            Segment { host: STAGING_HOST, host_offset: r.3 + (offset - r.1), len, device_offset }
        })
        .collect();
    segments.sort_unstable_by_key(|g| g.device_offset);
    segments.dedup_by(|next, prev| {
        let joins =
            prev.host_offset + prev.len == next.host_offset && prev.device_offset + prev.len == next.device_offset;
        if joins {
            prev.len += next.len;
        }
        joins
    });
    Ok(StagingLayout { reads, segments, bytes: window })
}

/// The block spec of a disk unit: its [`staging_layout`], with `files` giving each mapped file's reader. The
/// segments' host buffer is a placeholder: the reader puts in the staging buffer it fills.
pub fn disk_block(
    model: &HostModel,
    unit: &UnitLayout,
    files: &BTreeMap<HostBufferId, Arc<dyn BlockFile>>,
) -> Result<BlockSpec, String> {
    let layout = staging_layout(model, unit)?;
    let reads = layout
        .reads
        .iter()
        .map(|&(buf, offset, len, staging_offset)| {
            let file = files.get(&buf).ok_or_else(|| format!("no reader for the file of `{}`", unit.path))?;
            Ok(FileRead { file: file.clone(), offset, len, staging_offset })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(BlockSpec { segments: layout.segments, reads, device_bytes: unit.device_bytes })
}
