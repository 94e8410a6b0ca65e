//! Host memory predicted before anything is allocated: the bytes of the host masters `enable` will build for a
//! resolved plan, from the same units, layouts and file ranges the backend builds them from ([`build_unit_plan`],
//! `mapped::plan_sections`), and the check of `host_budget` against them. The plan report (`weightferry plan`,
//! `weightferry.plan()`) reads its host side from [`plan_report`], the session from [`host_of`] and
//! [`check_host_budget`] (before its backend exists), so what `plan` prints is what `enable` checks.
//!
//! Invariant: [`host_of`]'s `master_bytes` and `mapped_bytes` equal the backend's `master_host_bytes` and
//! `mapped_host_bytes` after `enable` (every section of every non-AllGather unit gets one master of its length,
//! unless its checkpoint file serves it). Without the host model (`plan`), no section counts as served.

use super::disk_tier::{file_sections, plan_disk};
use super::layout::UnitLayout;
use super::mapped::{order_by_files, plan_sections};
use super::units::build_unit_plan;
use crate::config::{HostMasters, OffloadConfig};
use crate::model::HostModel;
use crate::pipeline::PipelineDesc;
use crate::plan::bytes::human_bytes;
use crate::plan::report::{PlanHost, PlanReport};
use crate::plan::{resolve_offload_plan, PlanError, ResolvedPlan};

/// The host memory `enable` will take for the weights of `plan`; with `model` (weights read from a checkpoint),
/// the sections its files serve under `host_masters` count as mapped, not as masters.
pub fn host_of(
    desc: &PipelineDesc,
    config: &OffloadConfig,
    plan: &ResolvedPlan,
    model: Option<&HostModel>,
) -> PlanHost {
    let units = build_unit_plan(desc, config, plan);
    let from_files = model.is_some_and(|m| !m.mapped_files().is_empty());
    let mut host =
        PlanHost { budget: config.host_budget, pinned: config.pin_memory, from_files, ..PlanHost::default() };
    let mut stacks = Vec::new();
    let mut served_all = Vec::new();
    for stack in units.stacks {
        let gathered = stack.allgather && config.group.size > 1;
        let mut layouts = stack.units;
        let served = match model.filter(|m| !m.mapped_files().is_empty() && !gathered) {
            Some(m) => {
                order_by_files(desc, m, &mut layouts);
                // Under "mapped" an unservable section fails enable; counting it as a master is what "auto" does.
                let mode =
                    if config.host_masters == HostMasters::Mapped { HostMasters::Auto } else { config.host_masters };
                plan_sections(m, &layouts, mode).unwrap_or_default()
            }
            None => Vec::new(),
        };
        stacks.push((gathered, layouts));
        served_all.push(served);
    }
    let views: Vec<(bool, &[UnitLayout])> = stacks.iter().map(|(g, l)| (*g, l.as_slice())).collect();
    let disk = plan_disk(model, config.host_budget, &views, &served_all);
    (host.disk_bytes, host.staging_bytes) = (disk.disk_bytes, disk.staging_bytes);
    for (si, (gathered, layouts)) in stacks.iter().enumerate() {
        if *gathered {
            host.sharded_bytes += layouts.iter().flat_map(|u| &u.sections).map(|s| s.len).sum::<u64>();
            continue;
        }
        for (k, unit) in layouts.iter().enumerate() {
            if disk.on_disk(si, k) {
                // A disk unit's sections not in a file keep their masters.
                let in_file = model.map(|m| file_sections(m, unit)).unwrap_or_default();
                let kept = unit.sections.iter().zip(&in_file).filter(|(_, f)| !**f);
                host.master_bytes += kept.map(|(s, _)| s.len).sum::<u64>();
                continue;
            }
            for (j, sec) in unit.sections.iter().enumerate() {
                match served_all[si].get(k).and_then(|u| u.get(j)).copied().flatten() {
                    Some(m) => host.mapped_bytes += m.len,
                    None => host.master_bytes += sec.len,
                }
            }
        }
    }
    host
}

/// Resolves `config` against `desc` and reports the plan, its host memory predicted as if no checkpoint served a
/// block; a plan whose masters exceed `host_budget` gets a warning (enable refuses it, unless a checkpoint file
/// serves enough of it).
pub fn plan_report(name: &str, desc: &PipelineDesc, config: &OffloadConfig) -> Result<PlanReport, PlanError> {
    plan_report_of(name, desc, config, None)
}

/// [`plan_report`] of a loaded `model` when given: with weights from a checkpoint, what its files serve (mapped)
/// and the disk tier (blocks beyond `host_budget` read from the file on every pass, and its staging buffers) are
/// predicted too, as `enable` will find them.
pub fn plan_report_of(
    name: &str,
    desc: &PipelineDesc,
    config: &OffloadConfig,
    model: Option<&HostModel>,
) -> Result<PlanReport, PlanError> {
    let plan = resolve_offload_plan(desc, config)?;
    let host = host_of(desc, config, &plan, model);
    let over = check_host_budget(&host).err();
    let mut report = PlanReport::from_plan(name, desc, config, &plan, host);
    report.warnings.extend(over.map(|e| format!("enable will refuse this plan: {}", e.0)));
    if config.host_budget_auto {
        report.notes.push(
            "host_budget = \"auto\": resolved when a session opens, from the memory the process may still take \
             and the weights it holds then"
                .into(),
        );
    }
    Ok(report)
}

/// `Err` when the masters (and the disk tier's staging buffers) exceed `host_budget`, naming both and what to
/// change.
pub fn check_host_budget(host: &PlanHost) -> Result<(), PlanError> {
    let need = host.master_bytes + host.staging_bytes;
    match host.budget {
        Some(budget) if need > budget => Err(PlanError(format!(
            "host_budget: the host masters of the offloaded weights need {}{}, over the budget of {}; raise \
             host_budget{}",
            human_bytes(need),
            if host.staging_bytes > 0 { " with the disk tier's staging buffers" } else { "" },
            human_bytes(budget),
            if host.from_files {
                " or offload fewer components (the disk tier reads only the parts of blocks whose tensors the \
                 checkpoint holds as the module does, and needs two staging buffers of the largest block)"
            } else {
                ", offload fewer components, or bind the weights from a checkpoint (its file then serves the blocks \
                 beyond the budget, read from disk on every pass)"
            },
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(master_bytes: u64, budget: Option<u64>) -> PlanHost {
        PlanHost { budget, master_bytes, pinned: true, ..PlanHost::default() }
    }

    #[test]
    fn a_budget_at_or_above_the_masters_passes_and_one_byte_less_is_refused_naming_both() {
        assert_eq!(check_host_budget(&host(4096, None)), Ok(()));
        assert_eq!(check_host_budget(&host(4096, Some(4096))), Ok(()));
        let e = check_host_budget(&host(4096, Some(4095))).unwrap_err();
        assert_eq!(
            e.0,
            "host_budget: the host masters of the offloaded weights need 4.00 KiB (4096 B), over the budget of \
             4.00 KiB (4095 B); raise host_budget, offload fewer components, or bind the weights from a checkpoint \
             (its file then serves the blocks beyond the budget, read from disk on every pass)"
        );
    }
}
