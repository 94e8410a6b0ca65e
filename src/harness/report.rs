//! Reports: what `weightferry run` measured ([`RunReport`]) and what `weightferry plan` resolved ([`PlanReport`]),
//! as serialisable structs with a readable text rendering (`Display`).
//!
//! The JSON field names are a public contract of the CLI: `run --json` always carries `outputs_match`,
//! `peak_device_weight_bytes`, `planned_device_weight_bytes`, `h2d_bytes` and `sync_fetches`; `plan --json` always
//! carries `strategy` (`none|model|layer|distributed_layer`), `components` (each with `path`, `kind`, `selected`
//! and `stacks` of `{blocks, resident, streaming}`), `skip_reason` and `device_weight_bytes`.

use crate::config::{OffloadConfig, Strategy};
use crate::plan::{resolve_offload_plan, PipelineDesc, PlanError, ResolvedComponent, ResolvedPlan};
use serde::Serialize;
use std::fmt;

/// Per-stack figures of the offloaded run (the backend's own report).
pub use crate::offload::backend::StackReport as RunStack;

/// What `weightferry run` measured: a resident run and an offloaded run of the same pipeline, compared.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// Pipeline (preset name or file).
    pub pipeline: String,
    /// Platform (`sim`).
    pub platform: String,
    /// DiT steps.
    pub steps: u32,
    /// Seed of the synthetic weights and inputs.
    pub seed: u64,
    /// Seed of the block-skip pattern, if any.
    pub skip_seed: Option<u64>,
    /// Strategy (`none`, `model`, `layer`, `distributed_layer`).
    pub strategy: String,
    /// Whether the backend installed hooks (false when the plan had nothing to offload).
    pub offload_enabled: bool,
    /// Why offload did nothing, if it did nothing.
    pub skip_reason: Option<String>,
    /// Per-stack residency, depth and counters.
    pub stacks: Vec<RunStack>,
    /// Peak device memory used by weights during the offloaded run (platform peak minus activations).
    pub peak_device_weight_bytes: u64,
    /// The planner's bound on device weight memory.
    pub planned_device_weight_bytes: u64,
    /// `peak_device_weight_bytes <= planned_device_weight_bytes`.
    pub within_plan: bool,
    /// Device weight bytes of the fully resident run.
    pub resident_device_weight_bytes: u64,
    /// Device bytes of the activations (allocated before offload, not counted as weights).
    pub activation_bytes: u64,
    /// Bytes copied host → device during the offloaded run.
    pub h2d_bytes: u64,
    /// Bytes copied device → host during the offloaded run.
    pub d2h_bytes: u64,
    /// Units found prefetched.
    pub prefetch_hits: u64,
    /// Units found in a released slot.
    pub reuse_hits: u64,
    /// Units fetched synchronously.
    pub sync_fetches: u64,
    /// Blocks run per execution.
    pub blocks_run: u64,
    /// Blocks skipped per execution by the skip pattern.
    pub blocks_skipped: u64,
    /// Kernels per execution.
    pub kernels: u64,
    /// Time the compute stream waited on copies during the offloaded run, in milliseconds.
    pub compute_wait_ms: f64,
    /// Hook pairs (pre + post) measured on components and blocks.
    pub hook_calls: usize,
    /// Median hook pair latency, in microseconds.
    pub hook_latency_p50_us: f64,
    /// 99th percentile hook pair latency, in microseconds.
    pub hook_latency_p99_us: f64,
    /// Wall time of the resident execution, in milliseconds.
    pub resident_wall_ms: f64,
    /// Wall time of the offloaded execution (enable to output read back), in milliseconds.
    pub offloaded_wall_ms: f64,
    /// Wall time of the whole command, in milliseconds.
    pub wall_ms: f64,
    /// Hazard violations the sim detector recorded over both runs.
    pub hazard_violations: usize,
    /// The first violation, described.
    pub first_violation: Option<String>,
    /// Checksum of the resident output (hex).
    pub resident_checksum: String,
    /// Checksum of the offloaded output (hex).
    pub offloaded_checksum: String,
    /// The outputs are bit-identical.
    pub outputs_match: bool,
    /// The host weights are bit-identical before and after (model checksums).
    pub weights_match: bool,
    /// Planner notes and warnings.
    pub notes: Vec<String>,
}

impl RunReport {
    /// Whether every check passed: outputs and weights match, no hazard, peak within the plan.
    pub fn passed(&self) -> bool {
        self.outputs_match && self.weights_match && self.hazard_violations == 0 && self.within_plan
    }
}

/// Formats a byte count with a binary unit.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {} ({b} B)", UNITS[u])
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "weightferry run: {} on {}, {} steps, seed {}",
            self.pipeline, self.platform, self.steps, self.seed
        )?;
        if let Some(s) = self.skip_seed {
            writeln!(f, "  skip pattern seed {s}: {} blocks skipped, {} run", self.blocks_skipped, self.blocks_run)?;
        }
        writeln!(f, "strategy: {}{}", self.strategy, if self.offload_enabled { "" } else { " (not enabled)" })?;
        if let Some(r) = &self.skip_reason {
            writeln!(f, "  skipped: {r}")?;
        }
        for s in &self.stacks {
            // Hook submission is opt-in: only then is it named (the default reads as before).
            let how = if s.submission == "hook" { "; copies submitted by the hooks" } else { "" };
            writeln!(
                f,
                "  stack {}: {} units, {} resident, depth {}; {} loads, {} prefetch hits, {} reuse hits, {} sync \
                 fetches{how}",
                s.name, s.units, s.resident, s.depth, s.loads, s.prefetch_hits, s.reuse_hits, s.sync_fetches
            )?;
        }
        writeln!(f, "device weight memory:")?;
        writeln!(f, "  peak (offloaded)   {}", human_bytes(self.peak_device_weight_bytes))?;
        writeln!(
            f,
            "  planned bound      {}  {}",
            human_bytes(self.planned_device_weight_bytes),
            if self.within_plan { "(peak within bound)" } else { "(PEAK EXCEEDS BOUND)" }
        )?;
        writeln!(f, "  fully resident     {}", human_bytes(self.resident_device_weight_bytes))?;
        writeln!(f, "  activations        {} (not counted)", human_bytes(self.activation_bytes))?;
        writeln!(f, "transfers: h2d {}, d2h {}", human_bytes(self.h2d_bytes), human_bytes(self.d2h_bytes))?;
        writeln!(
            f,
            "fetches: {} prefetch hits, {} reuse hits, {} synchronous",
            self.prefetch_hits, self.reuse_hits, self.sync_fetches
        )?;
        writeln!(f, "compute stream waited on copies: {:.3} ms", self.compute_wait_ms)?;
        writeln!(
            f,
            "hook latency (pre+post, {} pairs): p50 {:.2} us, p99 {:.2} us",
            self.hook_calls, self.hook_latency_p50_us, self.hook_latency_p99_us
        )?;
        writeln!(
            f,
            "wall time: resident {:.1} ms, offloaded {:.1} ms, total {:.1} ms",
            self.resident_wall_ms, self.offloaded_wall_ms, self.wall_ms
        )?;
        writeln!(f, "hazard violations: {}", self.hazard_violations)?;
        if let Some(v) = &self.first_violation {
            writeln!(f, "  first: {v}")?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        writeln!(
            f,
            "outputs match: {} (resident {}, offloaded {})",
            yes_no(self.outputs_match),
            self.resident_checksum,
            self.offloaded_checksum
        )?;
        write!(f, "weights match: {}", yes_no(self.weights_match))
    }
}

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
    /// Budget notes (planner choices).
    pub notes: Vec<String>,
    /// Warnings raised while resolving.
    pub warnings: Vec<String>,
}

fn plan_stack(s: &crate::plan::BlockStack) -> PlanStack {
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
    }
}

fn action(strategy: Strategy, plan: &ResolvedPlan, c: &ResolvedComponent, keep_dit: bool) -> String {
    use crate::plan::ComponentKind;
    if !c.selected {
        return "stays on the device (not offloaded)".to_string();
    }
    match strategy {
        Strategy::None => "stays on the device (offload disabled)".to_string(),
        Strategy::ModelLevel => {
            if c.kind == ComponentKind::Dit && keep_dit {
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
                        "{} of {} blocks stream (depth {}, {} slots), {} resident",
                        s.streaming().len(),
                        s.blocks.len(),
                        s.prefetch_depth,
                        s.slot_count(),
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
        stacks: c.stacks.iter().map(plan_stack).collect(),
        children: c.children.iter().map(|ch| plan_component(strategy, plan, ch, keep_dit)).collect(),
    }
}

impl PlanReport {
    /// Builds the report of an already resolved plan.
    pub fn from_plan(pipeline: &str, desc: &PipelineDesc, config: &OffloadConfig, plan: &ResolvedPlan) -> PlanReport {
        let b = &plan.budget;
        PlanReport {
            pipeline: pipeline.to_string(),
            strategy: plan.strategy.report_name().to_string(),
            components: plan
                .components()
                .map(|c| plan_component(plan.strategy, plan, c, config.keep_dit_resident))
                .collect(),
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
            notes: b.notes.clone(),
            warnings: plan.warnings.clone(),
        }
    }

    /// Resolves `config` against `desc` and reports the plan.
    pub fn resolve(pipeline: &str, desc: &PipelineDesc, config: &OffloadConfig) -> Result<PlanReport, PlanError> {
        let plan = resolve_offload_plan(desc, config)?;
        Ok(Self::from_plan(pipeline, desc, config, &plan))
    }
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
            "{indent}  stack {}: {} blocks ({}), {} resident ({}), {} streaming; depth {}, {} slots of {} = {}",
            s.name,
            s.blocks,
            human_bytes(s.bytes),
            s.resident,
            human_bytes(s.resident_bytes),
            s.streaming,
            s.prefetch_depth,
            s.slots,
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
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        Ok(())
    }
}
