//! The disk tier's plan: which streamed units are read from their checkpoint file on every pass instead of holding a
//! host master, so that the host masters and the staging ring fit `host_budget`; and the block spec of such a unit
//! (its file ranges, read into a staging buffer, and its copies from there).
//!
//! Only a model whose weights come from checkpoint files has a disk tier, and only a unit every storage of which
//! lies in a file. Units are moved to the disk tier from the end of the last stack backwards until the masters of
//! the others plus [`STAGING_BUFFERS`] staging buffers of the largest disk unit fit the budget (or none is left:
//! then `check_host_budget` refuses the plan). A disk unit's staging buffer holds it laid out as its device region,
//! so its copies are its sections' copies with host offsets equal to their device offsets.
//!
//! Invariant: the prediction ([`super::predict::host_of`]) and the backend call `plan_disk` with the same units and
//! served sections, so the bytes `plan` reports are the bytes `enable` holds.

use super::layout::UnitLayout;
use super::mapped::ServedSections;
use crate::model::{Home, HostModel};
use std::collections::BTreeMap;
use std::sync::Arc;
use weightferry_actors::messages::FileRead;
use weightferry_actors::platform::{BlockFile, HostBufferId};
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

/// Whether every storage of `unit` lies in a checkpoint file.
fn in_files(model: &HostModel, unit: &UnitLayout) -> bool {
    unit.storages().all(|s| matches!(model.home(s), Some(Home::File { .. })))
}

/// Bytes of `unit`'s sections that need a master (not served from their file).
fn master_bytes(unit: &UnitLayout, served: Option<&Vec<Option<super::mapped::MappedSection>>>) -> u64 {
    unit.sections
        .iter()
        .enumerate()
        .filter(|(j, _)| served.and_then(|s| s.get(*j)).copied().flatten().is_none())
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
    let masters_of = |si: usize, ui: usize, u: &UnitLayout| master_bytes(u, served.get(si).and_then(|s| s.get(ui)));
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
            if !in_files(model, u) {
                continue;
            }
            plan.disk[si][ui] = true;
            masters -= masters_of(si, ui, u);
            largest = largest.max(u.device_bytes);
            plan.disk_bytes += u.sections.iter().map(|s| s.len).sum::<u64>();
            if fits(masters, largest) {
                break 'all;
            }
        }
    }
    plan.staging_bytes = if largest > 0 { STAGING_BUFFERS as u64 * largest } else { 0 };
    plan
}

/// The block spec of a disk unit: its storages' file ranges (neighbours merged) read into a staging buffer laid out
/// as its device region, and one copy per section from there. `files` gives each mapped file's reader.
pub fn disk_block(
    model: &HostModel,
    unit: &UnitLayout,
    files: &BTreeMap<HostBufferId, Arc<dyn BlockFile>>,
) -> Result<BlockSpec, String> {
    let mut reads: Vec<FileRead> = Vec::new();
    let mut segments = Vec::new();
    for sec in &unit.sections {
        segments.push(Segment {
            host: HostBufferId(u64::MAX), // the reader's staging buffer, put in by the reader
            host_offset: sec.device_offset,
            len: sec.len,
            device_offset: sec.device_offset,
        });
        for &(s, off) in &sec.storages {
            let Some(Home::File { buf, offset }) = model.home(s) else {
                return Err(format!("storage {} of `{}` is not in a checkpoint file", s.0, unit.path));
            };
            let file = files.get(&buf).ok_or_else(|| format!("no reader for the file of `{}`", unit.path))?;
            let (len, at) = (model.storage_bytes(s), sec.device_offset + off);
            match reads.last_mut() {
                Some(r)
                    if Arc::ptr_eq(&r.file, file) && r.offset + r.len == offset && r.staging_offset + r.len == at =>
                {
                    r.len += len
                }
                _ => reads.push(FileRead { file: file.clone(), offset, len, staging_offset: at }),
            }
        }
    }
    Ok(BlockSpec { segments, reads, device_bytes: unit.device_bytes })
}
