//! Reports: what `weightferry run` measured ([`RunReport`]), as a serialisable struct with a readable text rendering
//! (`Display`); what `weightferry plan` resolved is the library's [`PlanReport`], re-exported. Beside it: what
//! `weightferry inspect` prints ([`checkpoint`]), the Chrome / Perfetto timeline ([`trace`]), the terminal progress
//! bars ([`progress`]) and, on GPUs, the markdown of `bench` (`bench`, feature `cuda`) and `bench-gather`
//! (`gather`, feature `nccl`).
//!
//! The JSON field names are a public contract of the CLI: `run --json` always carries `outputs_match`,
//! `peak_device_weight_bytes`, `planned_device_weight_bytes`, `h2d_bytes` and `sync_fetches`; `plan --json` always
//! carries `strategy` (`none|model|layer|distributed_layer`), `components` (each with `path`, `kind`, `selected`
//! and `stacks` of `{blocks, resident, streaming}`), `skip_reason` and `device_weight_bytes`.

#[cfg(feature = "cuda")]
pub mod bench;
pub mod checkpoint;
#[cfg(feature = "nccl")]
pub mod gather;
pub mod progress;
pub mod trace;

use serde::Serialize;
use std::fmt;

pub use weightferry::plan::bytes::human_bytes;
pub use weightferry::plan::report::{PlanBudget, PlanComponent, PlanReport, PlanStack};

/// Per-stack figures of the offloaded run (the backend's own report).
pub use weightferry::offload::backend::StackReport as RunStack;

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
    /// Host bytes of the backend's masters (pinned or pageable) during the offloaded run.
    pub master_host_bytes: u64,
    /// Bytes of streamed sections served straight from the checkpoint's files (`host_masters`), no master.
    pub mapped_host_bytes: u64,
    /// Bytes of the blocks the disk tier read from the checkpoint's files on every pass (beyond `host_budget`).
    pub disk_bytes: u64,
    /// Host bytes of the disk tier's staging buffers.
    pub staging_host_bytes: u64,
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
        writeln!(
            f,
            "host masters: {} in masters, {} served from the checkpoint's files",
            human_bytes(self.master_host_bytes),
            human_bytes(self.mapped_host_bytes)
        )?;
        if self.disk_bytes > 0 {
            writeln!(
                f,
                "disk tier: {} read from the files on every pass, {} of staging buffers",
                human_bytes(self.disk_bytes),
                human_bytes(self.staging_host_bytes)
            )?;
        }
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
        // A run that offloaded nothing compares the model with itself: say so where the verdict is read.
        let what = if self.offload_enabled { "offloaded" } else { "not offloaded: nothing was streamed" };
        writeln!(
            f,
            "outputs match: {} (resident {}, {what} {})",
            yes_no(self.outputs_match),
            self.resident_checksum,
            self.offloaded_checksum
        )?;
        write!(f, "weights match: {}", yes_no(self.weights_match))
    }
}
