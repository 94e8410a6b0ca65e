//! The `run` driver: runs a pipeline fully resident, then offloaded under a config, on the simulated platform, and
//! compares.
//!
//! Order of a run: resolve the plan (a bad config/pipeline combination fails here, before anything is allocated) →
//! load synthetic weights and checksum them → allocate activations → resident run (every storage placed on the
//! device with [`ResidentPlacement`], no hooks) → release the placement → reset the device peak → offloaded run
//! (`get_offload_backend` → `enable` → execute → `disable`) → checksum the host weights again. The report compares
//! outputs and weights bit for bit, and sets the offloaded run's peak device weight memory (peak minus the
//! activations allocated before the reset) against the plan's bound.
//!
//! Invariant: whatever fails after `enable`, the driver calls `disable` before returning, so host weights are back
//! in their own buffers.

use super::{EngineError, ExecOptions, ExecOutput, Progress};
use crate::config::{OffloadConfig, Strategy};
use crate::engine::compute::SimCompute;
use crate::engine::Engine;
use crate::hooks::HookRegistry;
use crate::model::HostModel;
use crate::offload::backend::EnableProgress;
use crate::offload::{get_offload_backend, ResidentPlacement, StreamingBackend, WeightSource};
use crate::plan::{resolve_offload_plan, PipelineDesc, StorageId};
use crate::progress::{RunObserver, StepWatch};
use crate::report::{RunReport, RunStack};
use crate::trace::RunTrace;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry_actors::platform::{HostBufferId, Platform, PlatformRef};
use weightferry_actors::sim::{SimConfig, SimPlatform};
use weightferry_actors::OrderingFault;

/// Largest pipeline (bytes of weights) the sim reference engine accepts by default.
pub const DEFAULT_MAX_WEIGHT_BYTES: u64 = 1 << 30;

/// Which of the two executions is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStage {
    /// The fully resident baseline.
    Resident,
    /// The offloaded execution.
    Offloaded,
}

impl RunStage {
    /// `"resident"` or `"offloaded"`.
    pub fn name(self) -> &'static str {
        match self {
            RunStage::Resident => "resident",
            RunStage::Offloaded => "offloaded",
        }
    }
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Name shown in the report (preset name or file).
    pub pipeline_name: String,
    /// The pipeline.
    pub pipeline: PipelineDesc,
    /// The offload config of the offloaded run.
    pub config: OffloadConfig,
    /// DiT steps.
    pub steps: u32,
    /// The simulated device.
    pub sim: SimConfig,
    /// Seed of the synthetic weights and the inputs.
    pub seed: u64,
    /// Seed of the block-skip pattern (a step cache), if any.
    pub skip_seed: Option<u64>,
    /// Record a timeline trace of the offloaded run.
    pub trace: bool,
    /// Refuse pipelines with more weight bytes than this.
    pub max_weight_bytes: u64,
    /// Test hook: run the backend's stacks with a deliberately broken ordering (proves the checks can fail).
    pub ordering_fault: OrderingFault,
    /// Told how `enable` builds masters and how each execution's DiT steps complete on the device (progress bars);
    /// `None`: nothing is observed.
    pub observer: Option<Arc<dyn RunObserver>>,
}

impl RunSpec {
    /// A spec with 4 steps, the default sim device (tracing off), seed 0, no skips, no trace.
    pub fn new(pipeline_name: impl Into<String>, pipeline: PipelineDesc, config: OffloadConfig) -> RunSpec {
        RunSpec {
            pipeline_name: pipeline_name.into(),
            pipeline,
            config,
            steps: 4,
            sim: SimConfig { tracing: false, ..SimConfig::default() },
            seed: 0,
            skip_seed: None,
            trace: false,
            max_weight_bytes: DEFAULT_MAX_WEIGHT_BYTES,
            ordering_fault: OrderingFault::None,
            observer: None,
        }
    }
}

/// A run's report and, if asked for, its trace.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The report.
    pub report: RunReport,
    /// The offloaded run's trace.
    pub trace: Option<RunTrace>,
}

/// Nearest-rank percentile of sorted durations, in microseconds (0 for no samples).
pub fn percentile_us(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn wait_of(stats: &weightferry_actors::sim::SimStats, stream: &str) -> Duration {
    stats.wait_time_per_stream.iter().filter(|(n, _)| n == stream).map(|(_, d)| *d).sum()
}

/// What the offloaded phase measured.
struct Offloaded {
    out: ExecOutput,
    enabled: bool,
    stacks: Vec<RunStack>,
    /// The unit each host master held (names the trace's copies).
    masters: Vec<(HostBufferId, String)>,
}

/// Runs `spec`: resident, then offloaded, then compares. `progress` sees every component (and DiT step) start.
pub fn run(spec: &RunSpec, progress: &mut dyn FnMut(RunStage, Progress<'_>)) -> Result<RunOutcome, EngineError> {
    let t_all = Instant::now();
    let desc = &spec.pipeline;
    let total: u64 = desc.storages.values().map(|s| s.byte_size()).sum();
    if total > spec.max_weight_bytes {
        return Err(EngineError::Invalid(format!(
            "pipeline {} has {total} bytes of weights; the sim reference engine runs pipelines up to {} bytes \
             (use a -tiny preset)",
            spec.pipeline_name, spec.max_weight_bytes
        )));
    }
    // Fail before touching anything on an unsupported combination.
    let plan = resolve_offload_plan(desc, &spec.config).map_err(crate::offload::OffloadError::from)?;

    let epoch = Instant::now();
    let sim = Arc::new(SimPlatform::new(spec.sim.clone())?);
    sim.set_tracing(false);
    let platform: PlatformRef = sim.clone();
    let compute = Arc::new(SimCompute::new(sim.clone()));
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), spec.seed)?;
    let before = model.checksum()?;
    let result = run_on(spec, &sim, &platform, compute, &mut model, epoch, progress);
    let after = model.checksum();
    model.release();
    let (mut report, trace, resident_out, offloaded) = result?;
    let after = after?;

    let violations = sim.violations();
    let mut lat = offloaded.out.hook_latencies.clone();
    lat.sort();
    report.strategy = plan.strategy.report_name().to_string();
    report.offload_enabled = offloaded.enabled;
    report.skip_reason = plan.skip_reason.clone().or_else(|| {
        (!offloaded.enabled && plan.strategy != Strategy::None)
            .then(|| "the plan has nothing to offload for this pipeline".to_string())
    });
    report.planned_device_weight_bytes = plan.budget.device_weight_bytes;
    report.within_plan = report.peak_device_weight_bytes <= report.planned_device_weight_bytes;
    report.prefetch_hits = offloaded.stacks.iter().map(|s| s.prefetch_hits).sum();
    report.reuse_hits = offloaded.stacks.iter().map(|s| s.reuse_hits).sum();
    report.sync_fetches = offloaded.stacks.iter().map(|s| s.sync_fetches).sum();
    report.stacks = offloaded.stacks;
    report.blocks_run = offloaded.out.blocks_run;
    report.blocks_skipped = offloaded.out.blocks_skipped;
    report.kernels = offloaded.out.kernels;
    report.hook_calls = lat.len();
    report.hook_latency_p50_us = percentile_us(&lat, 50.0);
    report.hook_latency_p99_us = percentile_us(&lat, 99.0);
    report.resident_wall_ms = ms(resident_out.wall);
    report.hazard_violations = violations.len();
    report.first_violation = violations.first().map(|v| {
        format!(
            "{:?}: '{}' on {} started while '{}' on {} was pending ({:?} bytes {:?})",
            v.kind, v.later.label, v.later.stream_name, v.earlier.label, v.earlier.stream_name, v.buffer, v.range
        )
    });
    report.resident_checksum = format!("{:016x}", resident_out.checksum);
    report.offloaded_checksum = format!("{:016x}", offloaded.out.checksum);
    report.outputs_match = resident_out.output == offloaded.out.output;
    report.weights_match = before == after;
    report.notes = plan.budget.notes.iter().chain(&plan.warnings).cloned().collect();
    report.wall_ms = ms(t_all.elapsed());
    sim.shutdown();
    Ok(RunOutcome { report, trace })
}

type RunParts = (RunReport, Option<RunTrace>, ExecOutput, Offloaded);

fn run_on(
    spec: &RunSpec,
    sim: &Arc<SimPlatform>,
    platform: &PlatformRef,
    compute: Arc<SimCompute>,
    model: &mut HostModel,
    epoch: Instant,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<RunParts, EngineError> {
    let mut engine = Engine::new(compute, &spec.pipeline)?;
    let mut watch = StepWatch::new(platform.clone(), engine.stream(), spec.observer.clone());
    let progress = &mut |stage, p: Progress<'_>| {
        watch.observe(stage, p);
        progress(stage, p)
    };
    let upload = platform.create_stream("resident-upload")?;
    let all: Vec<StorageId> = spec.pipeline.storages.keys().copied().collect();
    let opts = ExecOptions {
        steps: spec.steps,
        input_seed: spec.seed,
        skip_seed: spec.skip_seed,
        span_epoch: None,
        max_blocks_ahead: None,
    };

    // Resident baseline.
    let mut placement = ResidentPlacement::upload(platform, model, &all, upload)?;
    let resident_bytes = placement.bytes();
    let resident = engine.execute(&placement, &HookRegistry::new(), &opts, &mut |p| progress(RunStage::Resident, p));
    placement.release()?;
    let resident = resident?;

    // Offloaded run.
    let hooks = HookRegistry::new();
    let mut backend = get_offload_backend(&spec.config, platform.clone(), None)?;
    if let Some(b) = backend.as_mut() {
        b.set_ordering_fault(spec.ordering_fault);
        let observer = spec.observer.clone();
        b.set_progress(observer.map(|o| EnableProgress::new(move |done, total| o.masters(done, total))));
    }
    sim.clear_trace();
    sim.set_tracing(spec.trace);
    let off_opts = ExecOptions { span_epoch: spec.trace.then_some(epoch), ..opts };
    sim.reset_peak();
    let base_in_use = sim.device_memory().in_use;
    let stats0 = sim.stats();
    let t0 = Instant::now();
    let offloaded = match backend.as_mut() {
        Some(b) => run_backend(b, &engine, model, &hooks, &off_opts, upload, platform, progress),
        None => run_placement(&engine, model, &all, &off_opts, upload, platform, progress).map(|out| Offloaded {
            out,
            enabled: false,
            stacks: Vec::new(),
            masters: Vec::new(),
        }),
    };
    let off_wall = t0.elapsed();
    sim.set_tracing(false);
    let offloaded = offloaded?;
    watch.finish();
    let peak = sim.device_memory().peak.saturating_sub(base_in_use);
    let stats1 = sim.stats();
    let trace = spec.trace.then(|| RunTrace {
        events: sim.trace(),
        hooks: offloaded.out.hook_spans.clone(),
        copy_names: offloaded.masters.iter().cloned().collect(),
    });
    engine.release()?;

    let report = RunReport {
        pipeline: spec.pipeline_name.clone(),
        platform: sim.name().to_string(),
        steps: spec.steps,
        seed: spec.seed,
        skip_seed: spec.skip_seed,
        strategy: String::new(),
        offload_enabled: false,
        skip_reason: None,
        stacks: Vec::new(),
        peak_device_weight_bytes: peak,
        planned_device_weight_bytes: 0,
        within_plan: false,
        resident_device_weight_bytes: resident_bytes,
        activation_bytes: engine.activation_bytes(),
        h2d_bytes: stats1.h2d_bytes - stats0.h2d_bytes,
        d2h_bytes: stats1.d2h_bytes - stats0.d2h_bytes,
        prefetch_hits: 0,
        reuse_hits: 0,
        sync_fetches: 0,
        blocks_run: 0,
        blocks_skipped: 0,
        kernels: 0,
        compute_wait_ms: ms(wait_of(&stats1, "compute").saturating_sub(wait_of(&stats0, "compute"))),
        hook_calls: 0,
        hook_latency_p50_us: 0.0,
        hook_latency_p99_us: 0.0,
        resident_wall_ms: 0.0,
        offloaded_wall_ms: ms(off_wall),
        wall_ms: 0.0,
        hazard_violations: 0,
        first_violation: None,
        resident_checksum: String::new(),
        offloaded_checksum: String::new(),
        outputs_match: false,
        weights_match: false,
        notes: Vec::new(),
    };
    Ok((report, trace, resident, offloaded))
}

/// Offloaded execution through a backend: enable → execute → report → disable (disable also on failure).
#[allow(clippy::too_many_arguments)]
fn run_backend(
    backend: &mut StreamingBackend,
    engine: &Engine,
    model: &mut HostModel,
    hooks: &HookRegistry,
    opts: &ExecOptions,
    upload: weightferry_actors::platform::StreamId,
    platform: &PlatformRef,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<Offloaded, EngineError> {
    backend.enable(model, hooks, engine.stream())?;
    if !backend.is_enabled() {
        // The plan had nothing to offload: the pipeline runs resident.
        let all: Vec<StorageId> = model.desc().storages.keys().copied().collect();
        let out = run_placement(engine, model, &all, opts, upload, platform, progress)?;
        return Ok(Offloaded { out, enabled: false, stacks: Vec::new(), masters: Vec::new() });
    }
    let out = engine.execute(backend as &dyn WeightSource, hooks, opts, &mut |p| progress(RunStage::Offloaded, p));
    let stacks = backend.report().stacks;
    let masters = backend.master_units();
    let disabled = backend.disable(model, hooks);
    let out = out?;
    disabled?;
    Ok(Offloaded { out, enabled: true, stacks, masters })
}

/// Execution with every storage placed on the device (no offload).
fn run_placement(
    engine: &Engine,
    model: &HostModel,
    all: &[StorageId],
    opts: &ExecOptions,
    upload: weightferry_actors::platform::StreamId,
    platform: &PlatformRef,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<ExecOutput, EngineError> {
    let mut placement = ResidentPlacement::upload(platform, model, all, upload)?;
    let out = engine.execute(&placement, &HookRegistry::new(), opts, &mut |p| progress(RunStage::Offloaded, p));
    placement.release()?;
    out
}
