//! The `run` driver: runs a pipeline fully resident, then offloaded under a config, on the simulated platform, and
//! reports the comparison.
//!
//! Order of a run: load synthetic weights (or the checkpoint's) → allocate activations → open a library
//! [`Session`] over the model (the plan resolved once; a bad config/pipeline combination fails here, before
//! anything is offloaded) → [`compare`] (checksum the host weights, resident run, offloaded run through the
//! session, checksum again) with the simulated device's trace and counters armed around the offloaded run. The report compares outputs and weights bit for bit, and sets the offloaded run's peak device
//! weight memory (peak minus the activations allocated before it) against the plan's bound.

use super::compare::{compare, Comparison, OffloadedStage};
use crate::engine::compute::SimCompute;
use crate::engine::synthetic::SyntheticWeights;
use crate::engine::timing::{hook_percentiles_us, ms};
use crate::engine::Engine;
use crate::engine::{EngineError, ExecOptions, Progress};
use crate::report::progress::{RunObserver, StepWatch};
use crate::report::trace::RunTrace;
use crate::report::RunReport;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry::checkpoint::{Checkpoint, CheckpointError};
use weightferry::config::{OffloadConfig, Strategy};
use weightferry::model::HostModel;
use weightferry::offload::backend::EnableProgress;
use weightferry::pipeline::PipelineDesc;
use weightferry::plan::ResolvedPlan;
use weightferry::scheduler::{OrderingFault, Platform, PlatformRef, SimConfig, SimPlatform, SimStats};
use weightferry::session::{Session, SessionOptions};

pub use super::compare::RunStage;

/// How many blocks the host may run ahead of the simulated device. The simulated streams queue without bound (a GPU's
/// launch queue pushes back on its own), so without this a long run's memory grows with its steps; the bound changes
/// no result, only where the host waits.
pub const SIM_MAX_BLOCKS_AHEAD: u32 = 256;

/// Largest pipeline (bytes of weights) the sim reference engine accepts by default.
pub const DEFAULT_MAX_WEIGHT_BYTES: u64 = 1 << 30;

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
    /// Weights read from a checkpoint instead of synthetic ones (`pipeline` is then the description derived from
    /// it).
    pub checkpoint: Option<CheckpointWeights>,
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
            checkpoint: None,
        }
    }
}

/// A checkpoint whose bytes a run computes over: the description's tensor `<component>.K` is its tensor `K`.
#[derive(Debug, Clone)]
pub struct CheckpointWeights {
    /// The checkpoint, mapped.
    pub checkpoint: Arc<Checkpoint>,
    /// The DiT component its tensors belong to.
    pub component: String,
}

/// A checkpoint that cannot be loaded is invalid input, unless the platform failed.
pub(crate) fn checkpoint_error(e: CheckpointError) -> EngineError {
    match e {
        CheckpointError::Platform { source, .. } => EngineError::Platform(source),
        e => EngineError::Invalid(format!("checkpoint {e}")),
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

fn wait_of(stats: &SimStats, stream: &str) -> Duration {
    stats.wait_time_per_stream.iter().filter(|(n, _)| n == stream).map(|(_, d)| *d).sum()
}

/// The offloaded side of a sim run: the simulated device's trace and counters armed around the offloaded run.
struct SimOffload<'a> {
    spec: &'a RunSpec,
    sim: &'a SimPlatform,
    epoch: Instant,
    /// Counters when the offloaded run began, and when it ended.
    stats: (SimStats, SimStats),
}

impl OffloadedStage for SimOffload<'_> {
    fn options(&self, resident: &ExecOptions) -> ExecOptions {
        ExecOptions { span_epoch: self.spec.trace.then_some(self.epoch), ..resident.clone() }
    }
    fn begin(&mut self) {
        self.sim.clear_trace();
        self.sim.set_tracing(self.spec.trace);
        self.stats.0 = self.sim.stats();
    }
    fn end(&mut self) {
        self.sim.set_tracing(false);
        self.stats.1 = self.sim.stats();
    }
}

/// The session options of `spec`: its name, ordering fault and enable observer.
fn session_options(spec: &RunSpec) -> SessionOptions {
    let enable_progress = spec.observer.clone().map(|o| EnableProgress::new(move |done, total| o.masters(done, total)));
    SessionOptions {
        name: spec.pipeline_name.clone(),
        ordering_fault: spec.ordering_fault,
        enable_progress,
        ..SessionOptions::default()
    }
}

/// Bytes every tensor's view shows (elements × element size, saturating), and the path of the largest view.
fn viewed_bytes(desc: &PipelineDesc) -> (u64, String) {
    let mut total = 0u64;
    let mut widest = (0u64, String::new());
    for (path, t) in desc.root.tensors_recursive() {
        let b = t.numel().saturating_mul(t.dtype.size_bytes());
        total = total.saturating_add(b);
        if b > widest.0 {
            widest = (b, path);
        }
    }
    (total, widest.1)
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
    // The engine reads every element a view shows: a stride-0 or overlapping view of a small storage can show far
    // more bytes than it holds, so the limit applies to what the views show too, before anything is allocated.
    let (viewed, widest) = viewed_bytes(desc);
    if viewed > spec.max_weight_bytes {
        return Err(EngineError::Invalid(format!(
            "pipeline {} shows {viewed} bytes through its tensors' views (stride-0 and overlapping views count every \
             element they show; the largest is `{widest}`); the sim reference engine runs pipelines up to {} bytes",
            spec.pipeline_name, spec.max_weight_bytes
        )));
    }
    let epoch = Instant::now();
    let sim = Arc::new(SimPlatform::new(spec.sim.clone())?);
    sim.set_tracing(false);
    let platform: PlatformRef = sim.clone();
    let compute = Arc::new(SimCompute::new(sim.clone()));
    let model = match &spec.checkpoint {
        None => HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), spec.seed)?,
        Some(w) => HostModel::from_checkpoint(platform.clone(), Arc::new(desc.clone()), &w.checkpoint, &w.component)
            .map_err(checkpoint_error)?,
    };
    let Compared { cmp, stats: (stats0, stats1), trace, activation_bytes, plan } =
        compare_on(spec, &sim, compute, model, epoch, progress)?;

    let violations = sim.violations();
    let enabled = cmp.backend.is_some();
    let (outputs_match, weights_match) = (cmp.outputs_match(), cmp.weights_match());
    let (master_host_bytes, mapped_host_bytes) =
        cmp.backend.as_ref().map_or((0, 0), |b| (b.master_host_bytes, b.mapped_host_bytes));
    let (disk_bytes, staging_host_bytes) =
        cmp.backend.as_ref().map_or((0, 0), |b| (b.disk_bytes, b.staging_host_bytes));
    let stacks = cmp.backend.map(|b| b.stacks).unwrap_or_default();
    let (p50, p99) = hook_percentiles_us(&cmp.offloaded.hook_latencies);
    let peak = cmp.offloaded_peak_bytes;
    let planned = plan.budget.device_weight_bytes;
    let report = RunReport {
        pipeline: spec.pipeline_name.clone(),
        platform: sim.name().to_string(),
        steps: spec.steps,
        seed: spec.seed,
        skip_seed: spec.skip_seed,
        strategy: plan.strategy.report_name().to_string(),
        offload_enabled: enabled,
        skip_reason: plan.skip_reason.clone().or_else(|| {
            (!enabled && plan.strategy != Strategy::None)
                .then(|| "the plan has nothing to offload for this pipeline".to_string())
        }),
        peak_device_weight_bytes: peak,
        planned_device_weight_bytes: planned,
        within_plan: peak <= planned,
        resident_device_weight_bytes: cmp.resident_weight_bytes,
        activation_bytes,
        master_host_bytes,
        mapped_host_bytes,
        disk_bytes,
        staging_host_bytes,
        h2d_bytes: stats1.h2d_bytes - stats0.h2d_bytes,
        d2h_bytes: stats1.d2h_bytes - stats0.d2h_bytes,
        prefetch_hits: stacks.iter().map(|s| s.prefetch_hits).sum(),
        reuse_hits: stacks.iter().map(|s| s.reuse_hits).sum(),
        sync_fetches: stacks.iter().map(|s| s.sync_fetches).sum(),
        stacks,
        blocks_run: cmp.offloaded.blocks_run,
        blocks_skipped: cmp.offloaded.blocks_skipped,
        kernels: cmp.offloaded.kernels,
        compute_wait_ms: ms(wait_of(&stats1, "compute").saturating_sub(wait_of(&stats0, "compute"))),
        hook_calls: cmp.offloaded.hook_latencies.len(),
        hook_latency_p50_us: p50,
        hook_latency_p99_us: p99,
        resident_wall_ms: ms(cmp.resident.wall),
        offloaded_wall_ms: ms(cmp.offloaded_wall),
        wall_ms: ms(t_all.elapsed()),
        hazard_violations: violations.len(),
        first_violation: violations.first().map(|v| {
            format!(
                "{:?}: '{}' on {} started while '{}' on {} was pending ({:?} bytes {:?})",
                v.kind, v.later.label, v.later.stream_name, v.earlier.label, v.earlier.stream_name, v.buffer, v.range
            )
        }),
        resident_checksum: format!("{:016x}", cmp.resident.checksum),
        offloaded_checksum: format!("{:016x}", cmp.offloaded.checksum),
        outputs_match,
        weights_match,
        notes: plan.budget.notes.iter().chain(&plan.warnings).cloned().collect(),
    };
    sim.shutdown();
    Ok(RunOutcome { report, trace })
}

/// What [`compare_on`] measured besides the comparison, and the plan the session resolved.
struct Compared {
    cmp: Comparison,
    stats: (SimStats, SimStats),
    trace: Option<RunTrace>,
    activation_bytes: u64,
    plan: ResolvedPlan,
}

/// The comparison of `spec` on `sim` with the engine's activations allocated around it, through a session over
/// `model` (released when it returns).
fn compare_on(
    spec: &RunSpec,
    sim: &Arc<SimPlatform>,
    compute: Arc<SimCompute>,
    model: HostModel,
    epoch: Instant,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<Compared, EngineError> {
    let mut engine = match Engine::new(compute, &spec.pipeline) {
        Ok(engine) => engine,
        Err(e) => {
            model.release();
            return Err(e);
        }
    };
    let mut session = Session::from_model(model, engine.stream(), spec.config.clone(), session_options(spec))?;
    let opts = ExecOptions {
        steps: spec.steps,
        input_seed: spec.seed,
        skip_seed: spec.skip_seed,
        max_blocks_ahead: Some(SIM_MAX_BLOCKS_AHEAD),
        ..ExecOptions::default()
    };
    let mut offload = SimOffload { spec, sim, epoch, stats: Default::default() };
    let platform: PlatformRef = sim.clone();
    let mut watch = StepWatch::new(platform, engine.stream(), spec.observer.clone());
    let progress = &mut |stage, p: Progress<'_>| {
        watch.observe(stage, p);
        progress(stage, p)
    };
    let cmp = compare(&engine, &mut session, &opts, &mut offload, progress)?;
    watch.finish();
    let trace = spec.trace.then(|| RunTrace {
        events: sim.trace(),
        hooks: cmp.offloaded.hook_spans.clone(),
        copy_names: cmp.master_units.iter().cloned().collect(),
    });
    let plan = session.plan().clone();
    drop(session);
    engine.release()?;
    Ok(Compared { cmp, stats: offload.stats, trace, activation_bytes: engine.activation_bytes(), plan })
}
