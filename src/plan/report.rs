//! The resolved plan as a report: what `weightferry plan` prints and `weightferry.plan()` returns (one serialisable
//! struct with a readable text rendering), touching nothing.
//!
//! The JSON field names are a public contract: `strategy` (`none|model|layer|distributed_layer`), `components` (each
//! with `path`, `kind`, `selected` and `stacks` of `{blocks, resident, streaming}`), `skip_reason` and
//! `device_weight_bytes` are always there.

use super::bytes::human_bytes;
use super::resolved::{ComponentKind, ResolvedComponent, ResolvedPlan};
use super::stack::StackPlan;
use crate::config::{OffloadConfig, Strategy};
use crate::pipeline::PipelineDesc;
use serde::Serialize;
use std::fmt;

/// One stack of a resolved plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanStack {
    /// Stack name.
    pub name: String,
    /// Blocks in the stack.
    pub blocks: usize,
    /// Leading blocks kept resident.
    pub resident: usize,
    /// Blocks streamed through the ring.
    pub streaming: usize,
    /// Bytes of all blocks.
    pub bytes: u64,
    /// Bytes of the resident head.
    pub resident_bytes: u64,
    /// Largest streamed block.
    pub max_streaming_block_bytes: u64,
    /// Prefetch depth.
    pub prefetch_depth: u32,
    /// Ring slots.
    pub slots: usize,
    /// Bytes of the ring slots.
    pub slot_bytes: u64,
    /// Bytes its blocks copy host-to-device on each forward pass of the component once the ring is warm (0 when
    /// the component does not stream).
    pub pass_h2d_bytes: u64,
    /// A static schedule: every streamed block in the same slot on every pass (`static_slots`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub static_slots: bool,
}

/// One component of a resolved plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanComponent {
    /// Path from the pipeline root.
    pub path: String,
    /// Role (`dit`, `text_encoder`, `encoder`, `vae`, `resident`, `auxiliary`, `dit_child`).
    pub kind: String,
    /// Module class.
    pub class: String,
    /// Whether the strategy offloads it.
    pub selected: bool,
    /// Staged through the pipeline's lifecycle.
    pub on_demand: bool,
    /// Bytes of its weights.
    pub bytes: u64,
    /// What happens to it, in words.
    pub action: String,
    /// Its block stacks.
    pub stacks: Vec<PlanStack>,
    /// Nested children staged or streamed separately.
    pub children: Vec<PlanComponent>,
}

/// The device memory side of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanBudget {
    /// Configured budget.
    pub budget: Option<u64>,
    /// Bytes that stay on the device.
    pub always_resident_bytes: u64,
    /// Bytes of resident heads.
    pub resident_head_bytes: u64,
    /// Bytes of ring slots.
    pub slot_bytes: u64,
    /// Largest on-demand component.
    pub on_demand_peak_bytes: u64,
    /// Whether the planner chose residency and depth.
    pub planner_chose: bool,
}

/// The host memory side of a plan: what `enable` will hold in host memory for the weights, predicted before
/// anything is allocated (`offload/predict.rs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PlanHost {
    /// Configured `host_budget`.
    pub budget: Option<u64>,
    /// Bytes of the host masters `enable` builds: one copy of every streamed or staged unit, packed per dtype at
    /// the device alignment (pinned, or pageable with `pin_memory = false`). With weights from a checkpoint, the
    /// sections its file serves (`host_masters`) are `mapped_bytes` instead.
    pub master_bytes: u64,
    /// Bytes the checkpoint's files serve as masters (mapped, registered read-only; counted in the page cache, not
    /// the process): known once the files are open (the session's report), 0 in `plan`'s.
    pub mapped_bytes: u64,
    /// Bytes of the blocks of AllGather stacks, not in `master_bytes`: each rank's masters hold its shard of them.
    pub sharded_bytes: u64,
    /// Bytes of the blocks of the disk tier: read from their checkpoint file on every pass (no master, no
    /// mapping), so that the masters fit `host_budget`. Known once the files are open (the session's report).
    pub disk_bytes: u64,
    /// Host bytes of the disk tier's staging buffers (pinned like the masters).
    pub staging_bytes: u64,
    /// Whether the masters are pinned.
    pub pinned: bool,
    /// Whether the weights are bound from checkpoint files (the disk tier's source); in errors only, not reported.
    #[serde(skip)]
    pub from_files: bool,
}

/// What `weightferry plan` resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanReport {
    /// Pipeline (preset name or file).
    pub pipeline: String,
    /// Strategy (`none`, `model`, `layer`, `distributed_layer`).
    pub strategy: String,
    /// Components in plan order (DiTs, encoders, VAEs, residents).
    pub components: Vec<PlanComponent>,
    /// Why the backend will do nothing, if so.
    pub skip_reason: Option<String>,
    /// Bound on device memory used by weights at the configured prefetch depth.
    pub device_weight_bytes: u64,
    /// Bytes of all weights (what a fully resident run holds).
    pub total_weight_bytes: u64,
    /// Breakdown of the bound.
    pub budget: PlanBudget,
    /// Bytes the streamed components copy host-to-device in one forward pass of each, once their rings are warm
    /// (the sum of their stacks' `pass_h2d_bytes`; of them, `host.disk_bytes` are read from disk first). A pass
    /// takes at least the longest of its compute, these bytes at the pinned host-to-device rate, and the disk bytes
    /// at the disk's read rate.
    pub pass_h2d_bytes: u64,
    /// Host memory the weights will take.
    pub host: PlanHost,
    /// Budget notes (planner choices).
    pub notes: Vec<String>,
    /// Warnings raised while resolving.
    pub warnings: Vec<String>,
}

fn plan_stack(s: &StackPlan, streams: bool) -> PlanStack {
    PlanStack {
        name: s.name.clone(),
        blocks: s.blocks.len(),
        resident: s.resident().len(),
        streaming: s.streaming().len(),
        bytes: s.block_bytes.iter().sum(),
        resident_bytes: s.resident_bytes(),
        max_streaming_block_bytes: s.max_streaming_block_bytes(),
        prefetch_depth: s.prefetch_depth,
        slots: s.slot_count(),
        slot_bytes: s.slot_bytes(),
        pass_h2d_bytes: if streams { s.pass_h2d_bytes() } else { 0 },
        static_slots: s.static_slots,
    }
}

/// Whether the backend streams `c`'s block stacks through their rings on every forward (layer-wise strategies, a
/// selected component that is not staged whole on demand, offload not skipped).
fn streams(strategy: Strategy, plan: &ResolvedPlan, c: &ResolvedComponent) -> bool {
    matches!(strategy, Strategy::LayerWise | Strategy::DistributedLayerWise)
        && plan.skip_reason.is_none()
        && c.selected
        && !c.on_demand
}

fn action(strategy: Strategy, plan: &ResolvedPlan, c: &ResolvedComponent, keep_dit: bool) -> String {
    if !c.selected {
        return "stays on the device (not offloaded)".to_string();
    }
    match strategy {
        Strategy::None => "stays on the device (offload disabled)".to_string(),
        Strategy::ModelLevel => {
            if plan.skip_reason.is_some() {
                "untouched (offload skipped)".to_string()
            } else if c.kind == ComponentKind::Dit && keep_dit {
                "stays on the device (keep_dit_resident); other components swap around it".to_string()
            } else {
                "swapped onto the device for its phase, then released (model-level)".to_string()
            }
        }
        Strategy::LayerWise | Strategy::DistributedLayerWise => {
            if plan.skip_reason.is_some() {
                return "untouched (offload skipped)".to_string();
            }
            if c.on_demand {
                return "staged on demand for its phase (pipeline-managed lifecycle)".to_string();
            }
            if c.stacks.is_empty() {
                return "stays on the device (no block stack declared)".to_string();
            }
            let parts: Vec<String> = c
                .stacks
                .iter()
                .map(|s| {
                    format!(
                        "{} of {} blocks stream (depth {}, {} slots{}), {} resident",
                        s.streaming().len(),
                        s.blocks.len(),
                        s.prefetch_depth,
                        s.slot_count(),
                        if s.static_slots { ", static" } else { "" },
                        s.resident().len()
                    )
                })
                .collect();
            format!("{}; non-block weights stay on the device", parts.join("; "))
        }
    }
}

fn plan_component(strategy: Strategy, plan: &ResolvedPlan, c: &ResolvedComponent, keep_dit: bool) -> PlanComponent {
    PlanComponent {
        path: c.path.clone(),
        kind: c.kind.name().to_string(),
        class: c.class.clone(),
        selected: c.selected,
        on_demand: c.on_demand,
        bytes: c.bytes,
        action: action(strategy, plan, c, keep_dit),
        stacks: c.stacks.iter().map(|s| plan_stack(s, streams(strategy, plan, c))).collect(),
        children: c.children.iter().map(|ch| plan_component(strategy, plan, ch, keep_dit)).collect(),
    }
}

impl PlanReport {
    /// Builds the report of an already resolved plan, with its predicted host memory (`host`).
    pub fn from_plan(
        pipeline: &str,
        desc: &PipelineDesc,
        config: &OffloadConfig,
        plan: &ResolvedPlan,
        host: PlanHost,
    ) -> PlanReport {
        let b = &plan.budget;
        let components: Vec<PlanComponent> =
            plan.components().map(|c| plan_component(plan.strategy, plan, c, config.keep_dit_resident)).collect();
        PlanReport {
            pipeline: pipeline.to_string(),
            strategy: plan.strategy.report_name().to_string(),
            pass_h2d_bytes: components.iter().map(pass_h2d).sum(),
            components,
            skip_reason: plan.skip_reason.clone(),
            device_weight_bytes: b.device_weight_bytes,
            total_weight_bytes: desc.storages.values().map(|s| s.byte_size()).sum(),
            budget: PlanBudget {
                budget: b.budget,
                always_resident_bytes: b.always_resident_bytes,
                resident_head_bytes: b.resident_head_bytes,
                slot_bytes: b.slot_bytes,
                on_demand_peak_bytes: b.on_demand_peak_bytes,
                planner_chose: b.planner_chose,
            },
            host,
            notes: b.notes.clone(),
            warnings: plan.warnings.clone(),
        }
    }
}

/// A component's and its children's `pass_h2d_bytes`.
fn pass_h2d(c: &PlanComponent) -> u64 {
    c.stacks.iter().map(|s| s.pass_h2d_bytes).sum::<u64>() + c.children.iter().map(pass_h2d).sum::<u64>()
}

fn write_component(f: &mut fmt::Formatter<'_>, c: &PlanComponent, indent: &str) -> fmt::Result {
    writeln!(
        f,
        "{indent}{} [{}, {}] {}: {}",
        c.path,
        c.kind,
        c.class,
        human_bytes(c.bytes),
        if c.selected { "selected" } else { "not selected" }
    )?;
    writeln!(f, "{indent}  -> {}", c.action)?;
    for s in &c.stacks {
        writeln!(
            f,
            "{indent}  stack {}: {} blocks ({}), {} resident ({}), {} streaming; depth {}, {}{} slots of {} = {}",
            s.name,
            s.blocks,
            human_bytes(s.bytes),
            s.resident,
            human_bytes(s.resident_bytes),
            s.streaming,
            s.prefetch_depth,
            s.slots,
            if s.static_slots { " static" } else { "" },
            human_bytes(s.max_streaming_block_bytes),
            human_bytes(s.slot_bytes)
        )?;
    }
    for ch in &c.children {
        write_component(f, ch, &format!("{indent}  "))?;
    }
    Ok(())
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "weightferry plan: {}", self.pipeline)?;
        writeln!(f, "strategy: {}", self.strategy)?;
        if let Some(r) = &self.skip_reason {
            writeln!(f, "skipped: {r}")?;
        }
        writeln!(f, "components:")?;
        for c in &self.components {
            write_component(f, c, "  ")?;
        }
        let b = &self.budget;
        writeln!(f, "device weight memory (bound): {}", human_bytes(self.device_weight_bytes))?;
        writeln!(f, "  always resident  {}", human_bytes(b.always_resident_bytes))?;
        writeln!(f, "  resident blocks  {}", human_bytes(b.resident_head_bytes))?;
        writeln!(f, "  ring slots       {}", human_bytes(b.slot_bytes))?;
        writeln!(f, "  on-demand peak   {}", human_bytes(b.on_demand_peak_bytes))?;
        writeln!(f, "  all weights      {}", human_bytes(self.total_weight_bytes))?;
        match b.budget {
            Some(budget) => writeln!(
                f,
                "  budget           {}{}",
                human_bytes(budget),
                if b.planner_chose { " (planner chose residency and depth)" } else { "" }
            )?,
            None => writeln!(f, "  budget           none set")?,
        }
        let h = &self.host;
        let kind = if h.pinned { "pinned" } else { "pageable" };
        writeln!(f, "host weight memory (masters): {} {kind}", human_bytes(h.master_bytes))?;
        if h.mapped_bytes > 0 {
            writeln!(f, "  from the files   {} (mapped)", human_bytes(h.mapped_bytes))?;
        }
        if h.sharded_bytes > 0 {
            writeln!(f, "  AllGather blocks {} (each rank holds its shard)", human_bytes(h.sharded_bytes))?;
        }
        if h.disk_bytes > 0 {
            writeln!(f, "  disk tier        {} read on every pass", human_bytes(h.disk_bytes))?;
            writeln!(f, "  staging buffers  {} {kind}", human_bytes(h.staging_bytes))?;
        }
        match h.budget {
            Some(budget) => writeln!(f, "  budget           {}", human_bytes(budget))?,
            None => writeln!(f, "  budget           none set")?,
        }
        if self.pass_h2d_bytes > 0 {
            writeln!(f, "per forward pass (rings warm): {} host-to-device", human_bytes(self.pass_h2d_bytes))?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        Ok(())
    }
}
