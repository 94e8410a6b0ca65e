//! The benchmark matrix behind `weightferry bench`: the step time of every offload configuration as a ratio to its
//! physical bound, measured in the same process as the bound's inputs.
//!
//! Timing: a pipeline execution runs encoders → DiT × steps → VAE and ends by reading the output back (a device
//! synchronisation), so wall time is device time. The time of one DiT step is the difference between executions
//! with `hi` and `lo` steps divided by `hi − lo`, which removes encoders, VAE and the first (cold) step; bytes
//! streamed per step are taken the same way from the scheduler's counters. The bound of a configuration is
//! `max(resident step time, streamed bytes per step / pinned H2D bandwidth)`, all measured in the same run.

use crate::drivers::compare::run_resident;
use crate::engine::cuda::{default_tokens, CudaCompute, GpuShape};
use crate::engine::synthetic::SyntheticWeights;
use crate::engine::timeline::{in_modules, summarize, to_chrome_json, trace_execution, StepTimeline};
use crate::engine::timing::{hook_percentiles_us, median, stack_h2d_bytes, time_rounds, timed_execution, Timed};
use crate::engine::{Engine, EngineError, ExecOptions, ExecOutput};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use weightferry::config::{CopySubmission, OffloadConfig};
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::{get_offload_backend, StreamingBackend, WeightSource};
use weightferry::pipeline::PipelineDesc;
use weightferry::plan::resolve_offload_plan;
use weightferry::platform::cuda::CudaPlatform;
use weightferry::scheduler::{Platform, PlatformRef};

/// Label of the configuration that keeps every block resident through the backend.
pub const RESIDENT_VIA_BACKEND: &str = "all resident (backend)";

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// Preset.
    pub preset: String,
    /// What was run (`resident`, `depth=2`, `budget=50%`, …).
    pub config: String,
    /// Strategy that ran.
    pub strategy: String,
    /// Resident leading DiT blocks.
    pub resident_blocks: usize,
    /// Prefetch depth of the DiT ring.
    pub depth: usize,
    /// Device budget of the config, if any.
    pub budget_bytes: Option<u64>,
    /// Seconds per DiT step (the median of the rounds).
    pub step_s: f64,
    /// Seconds per DiT step of each round, in order.
    pub step_samples: Vec<f64>,
    /// The bound: max(compute, streamed bytes / bandwidth), seconds.
    pub bound_s: f64,
    /// `step_s / bound_s`.
    pub ratio: f64,
    /// Bytes streamed host → device per step.
    pub streamed_bytes_per_step: u64,
    /// Peak device memory of weights during the timed executions.
    pub peak_weight_bytes: u64,
    /// The plan's bound on device weight memory.
    pub planned_weight_bytes: u64,
    /// Median pre_forward + post_forward wall time, µs.
    pub hook_p50_us: f64,
    /// 99th percentile of the same, µs.
    pub hook_p99_us: f64,
    /// Whether the output equals the resident run's bit for bit.
    pub outputs_match: bool,
    /// Where the DiT time went in one traced execution (with `--trace`).
    pub timeline: Option<StepTimeline>,
}

/// Everything `bench` measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Device name.
    pub device: String,
    /// Who enqueued the streamed blocks' copies (`"actor"`, `"hook"`, or `"actor,hook"` when every streamed
    /// configuration ran in both modes; those rows' labels then end in `[actor]` / `[hook]`).
    pub copy_submission: String,
    /// Rows, per preset.
    pub rows: Vec<BenchRow>,
    /// Pinned H2D bandwidth per preset run, bytes/s.
    pub h2d_bytes_per_s: Vec<(String, f64)>,
    /// Resident step time per preset (the compute time), seconds.
    pub compute_s: Vec<(String, f64)>,
    /// Host memory: (preset, weights bytes, master bytes, peak RSS bytes over the whole preset run, RSS while
    /// offloaded — after the timed runs, before `disable`).
    pub host_memory: Vec<(String, u64, u64, u64, u64)>,
    /// Enable per preset: (preset, seconds `enable` took — host masters built and pinned, fixed placement
    /// uploaded —, peak RSS bytes during `enable`: the process's high-water mark, reset just before `enable`
    /// through `/proc/self/clear_refs` where the kernel allows it, else the peak since the process started).
    pub enable: Vec<(String, f64, u64)>,
    /// Tokens per preset (DiT, encoder).
    pub tokens: Vec<(String, usize, usize)>,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// Presets to run.
    pub presets: Vec<String>,
    /// Token override (DiT tokens) for every preset.
    pub tokens: Option<usize>,
    /// Prefetch depths to run with every block streamed.
    pub depths: Vec<u32>,
    /// Device budgets as fractions of the DiT's bytes (added to the bytes that stay resident anyway).
    pub budgets: Vec<f64>,
    /// Also run the alternative depths (1 and 4, each with as many resident blocks as fit) at every budget.
    pub sweep: bool,
    /// Steps of the shorter and longer execution.
    pub steps: (u32, u32),
    /// Seed of weights and inputs.
    pub seed: u64,
    /// Trace every configuration once more and write Chrome traces here.
    pub trace_dir: Option<std::path::PathBuf>,
    /// Rounds over the configuration list (interleaved, so slow drifts of the GPU's clocks hit every
    /// configuration alike); each row reports the median (`timing::median`: the slower middle value of an even count).
    pub rounds: u32,
    /// Bound on how many blocks the engine's host thread runs ahead of the device (`None`: unbounded).
    pub max_blocks_ahead: Option<u32>,
    /// Who enqueues the streamed blocks' copies (`layer_options.dit.copy_submission`). With more than one mode,
    /// every depth and budget configuration runs once per mode, next to each other in each round (an interleaved
    /// A/B on the same weights); the all-resident row uses the first mode. Empty means `[Actor]`.
    pub copy_submission: Vec<CopySubmission>,
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS (`5` into `/proc/self/clear_refs`, Linux ≥ 4.0);
/// false where that is not allowed.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A `/proc/self/status` memory line (`VmHWM:` peak resident set, `VmRSS:` current) in bytes; 0 if unreadable.
fn rss_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).map(|kb| kb * 1024))
        })
        .unwrap_or(0)
}

/// Runs `lo` then `hi` steps and derives the per-step time and the stacks' per-step bytes.
fn timed(
    engine: &Engine,
    source: &dyn WeightSource,
    hooks: &HookRegistry,
    backend: Option<&StreamingBackend>,
    steps: (u32, u32),
    seed: u64,
    ahead: Option<u32>,
) -> Result<Timed<ExecOutput>, EngineError> {
    let run = |n: u32| {
        let opts = ExecOptions { steps: n, input_seed: seed, max_blocks_ahead: ahead, ..ExecOptions::default() };
        timed_execution(engine, source, hooks, &opts, &mut |_| {})
    };
    time_rounds(steps, 1, run, || backend.map_or(0, |b| stack_h2d_bytes(&b.report())))
}

/// Traces one more execution of each configuration when the spec asks for traces ([`BenchSpec::trace_dir`]).
struct Tracer<'a> {
    cuda: &'a CudaPlatform,
    engine: &'a Engine,
    /// The DiT's module paths: the window the timeline is summarised over.
    dit: Vec<String>,
    /// The traced execution's options.
    opts: ExecOptions,
    dir: Option<&'a std::path::Path>,
    preset: &'a str,
}

impl Tracer<'_> {
    /// With a trace directory: runs configuration `label` once with the device timeline armed, writes its Chrome
    /// trace there and summarises the DiT window per step. Without one: `None`.
    fn trace(
        &self,
        source: &dyn WeightSource,
        hooks: &HookRegistry,
        label: &str,
    ) -> Result<Option<StepTimeline>, EngineError> {
        let Some(dir) = self.dir else { return Ok(None) };
        let engine = self.engine;
        let (_, spans, dropped) = trace_execution(self.cuda, engine.stream(), 1 << 16, || {
            engine.execute(source, hooks, &self.opts, &mut |_| {})
        })?;
        let summary = summarize(&spans, |l| in_modules(l, &self.dit));
        let path = trace_file(dir, self.preset, label);
        let text = to_chrome_json(&spans, &format!("{} {label}", self.preset)).to_string();
        std::fs::write(&path, text)
            .map_err(|e| EngineError::Invalid(format!("cannot write trace `{}`: {e}", path.display())))?;
        Ok(Some(StepTimeline::per_step(summary, self.opts.steps, dropped)))
    }
}

/// A file name for a configuration's trace.
fn trace_file(dir: &std::path::Path, preset: &str, config: &str) -> std::path::PathBuf {
    let slug: String =
        config.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect::<String>().replace("--", "-");
    dir.join(format!("{preset}-{}.json", slug.trim_matches('-')))
}

fn layer_config(
    depth: Option<u32>,
    budget: Option<u64>,
    submission: CopySubmission,
) -> Result<OffloadConfig, EngineError> {
    let mut opts = serde_json::Map::new();
    if let Some(d) = depth {
        opts.insert("prefetch_depth".into(), serde_json::json!(d));
    }
    opts.insert("copy_submission".into(), serde_json::json!(submission.as_str()));
    let mut doc = serde_json::json!({
        "diffusion_offload_config": {
            "mode": "layer",
            "components": ["dit"],
            "layer_options": {"dit": opts},
        }
    });
    if let Some(b) = budget {
        doc["diffusion_offload_config"]["device_budget"] = serde_json::json!(b);
    }
    OffloadConfig::from_value(&doc).map_err(|e| EngineError::Invalid(e.to_string()))
}

/// A configuration to measure: its label, its config and its device budget.
type BenchConfig = (String, OffloadConfig, Option<u64>);

/// What every measurement of one preset shares.
struct PresetRun<'a> {
    spec: &'a BenchSpec,
    name: &'a str,
    cuda: &'a CudaPlatform,
    platform: PlatformRef,
    engine: &'a Engine,
    tracer: Tracer<'a>,
    /// When the preset's measurement started (progress lines give the time since).
    t0: Instant,
}

impl PresetRun<'_> {
    /// Seconds since the preset's measurement started.
    fn elapsed(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// Times `lo` then `hi` steps of the engine over `source` with this spec's seed and bound on blocks ahead.
    fn timed(
        &self,
        source: &dyn WeightSource,
        hooks: &HookRegistry,
        backend: Option<&StreamingBackend>,
    ) -> Result<Timed<ExecOutput>, EngineError> {
        let spec = self.spec;
        timed(self.engine, source, hooks, backend, spec.steps, spec.seed, spec.max_blocks_ahead)
    }
}

/// The resident baseline of one preset: a warm-up execution (the first pays cuBLAS handle creation and kernel
/// loading), the timed executions, then a traced one when the spec asks for traces.
fn measure_resident(
    p: &PresetRun<'_>,
    model: &HostModel,
) -> Result<(Timed<ExecOutput>, Option<StepTimeline>), EngineError> {
    let upload = p.platform.create_stream("bench-upload")?;
    let (measured, _) = run_resident(model, upload, |placement, hooks| {
        let warm = ExecOptions { steps: 1, input_seed: p.spec.seed, ..ExecOptions::default() };
        p.engine.execute(placement, hooks, &warm, &mut |_| {})?;
        let t = p.timed(placement, hooks, None)?;
        Ok((t, p.tracer.trace(placement, hooks, "resident")?))
    })?;
    Ok(measured)
}

/// The resident baseline's row: its step time is the compute time, and its own bound.
fn resident_row(name: &str, compute_s: f64, weight_bytes: u64, timeline: Option<StepTimeline>) -> BenchRow {
    BenchRow {
        preset: name.to_string(),
        config: "resident".into(),
        strategy: "none".into(),
        resident_blocks: 0,
        depth: 0,
        budget_bytes: None,
        step_s: compute_s,
        step_samples: vec![compute_s],
        bound_s: compute_s,
        ratio: 1.0,
        streamed_bytes_per_step: 0,
        peak_weight_bytes: weight_bytes,
        planned_weight_bytes: 0,
        hook_p50_us: 0.0,
        hook_p99_us: 0.0,
        outputs_match: true,
        timeline,
    }
}

/// The streamed configurations of one preset, in order: every block resident through the backend (each block in
/// its own buffer, hooks running, nothing streamed: the second measurement of the compute time, the bound uses the
/// faster of the two), each depth, each budget (with the sweep's depths where they resolve); all but the first
/// once per copy-submission mode, labelled with the mode when there are several.
fn bench_configs(spec: &BenchSpec, desc: &PipelineDesc, dit_bytes: u64) -> Result<Vec<BenchConfig>, EngineError> {
    let modes = submission_modes(spec);
    let first = modes[0];
    // Bytes that stay on the device whatever the budget (everything but the DiT's blocks), for budget configs.
    let probe = layer_config(Some(1), None, first)?;
    let plan = resolve_offload_plan(desc, &probe).map_err(weightferry::offload::OffloadError::from)?;
    let fixed = plan.budget.always_resident_bytes;
    let mut configs: Vec<BenchConfig> = Vec::new();
    let everything = fixed + dit_bytes + dit_bytes / 50;
    configs.push((RESIDENT_VIA_BACKEND.to_string(), layer_config(None, Some(everything), first)?, Some(everything)));
    let mut push_modes = |label: String, depth: Option<u32>, budget: Option<u64>| -> Result<(), EngineError> {
        for &m in modes {
            let label = if modes.len() > 1 { format!("{label} [{}]", m.as_str()) } else { label.clone() };
            configs.push((label, layer_config(depth, budget, m)?, budget));
        }
        Ok(())
    };
    for &d in &spec.depths {
        push_modes(format!("depth={d}"), Some(d), None)?;
    }
    for &f in &spec.budgets {
        let budget = fixed + (f * dit_bytes as f64) as u64;
        let pct = (f * 100.0).round();
        push_modes(format!("budget={pct}% planner"), None, Some(budget))?;
        if spec.sweep {
            for d in [1u32, 4] {
                if let Ok(cfg) = layer_config(Some(d), Some(budget), first) {
                    if resolve_offload_plan(desc, &cfg).is_ok() {
                        push_modes(format!("budget={pct}% depth={d}"), Some(d), Some(budget))?;
                    }
                }
            }
        }
    }
    Ok(configs)
}

/// One timed measurement of a streamed configuration.
struct Measured {
    t: Timed<ExecOutput>,
    /// Whether the output equals the resident run's bit for bit.
    matches: bool,
    /// Peak device memory above the engine's own (the weights').
    peak: u64,
}

/// The backend's side of one preset's measurements: enabled once (host masters built once), then retuned per
/// configuration, so only the block stacks change.
struct Streamed {
    hooks: HookRegistry,
    backend: Option<StreamingBackend>,
    /// Seconds and peak RSS of the one `enable`.
    enable: Option<(f64, u64)>,
    /// The peak RSS of the preset run before `enable` reset it, kept for `host_memory`.
    peak_before_enable: u64,
    /// Largest host master bytes of any configuration.
    master_bytes: u64,
    /// One row per configuration measured in the first round; later rounds add their samples.
    rows: Vec<BenchRow>,
    /// Device memory that is not weights (activations, engine workspace).
    base: u64,
}

impl Streamed {
    fn new(base: u64) -> Streamed {
        let (hooks, backend, enable) = (HookRegistry::new(), None, None);
        Streamed { hooks, backend, enable, peak_before_enable: 0, master_bytes: 0, rows: Vec::new(), base }
    }

    /// Runs every configuration `rounds` times, interleaved (so slow drifts of the GPU hit them alike).
    fn measure_all(
        &mut self,
        p: &PresetRun<'_>,
        model: &mut HostModel,
        configs: &[BenchConfig],
        resident: &ExecOutput,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), EngineError> {
        for round in 0..p.spec.rounds.max(1) {
            for (i, (label, cfg, budget)) in configs.iter().enumerate() {
                self.apply(p, model, cfg, progress)?;
                let Some(b) = self.backend.as_ref() else { continue };
                p.cuda.reset_peak();
                let t = p.timed(b, &self.hooks, Some(b))?;
                let matches = t.out.output == resident.output;
                let peak = p.cuda.device_memory().peak.saturating_sub(self.base);
                let m = Measured { t, matches, peak };
                if round > 0 {
                    if let Some(row) = self.rows.get_mut(i) {
                        row.step_samples.push(m.t.step_s());
                        row.outputs_match &= m.matches;
                        row.peak_weight_bytes = row.peak_weight_bytes.max(m.peak);
                        let (step_s, secs) = (m.t.step_s(), p.elapsed());
                        progress(&format!(
                            "{} {label} (round {}): {step_s:.4} s/step ({secs:.1} s)",
                            p.name,
                            round + 1
                        ));
                    }
                    continue;
                }
                let (row, master_bytes) = config_row(p, b, &self.hooks, label, *budget, m)?;
                self.master_bytes = self.master_bytes.max(master_bytes);
                progress(&format!(
                    "{} {}: {:.4} s/step, {} resident, depth {}, bit-exact {} ({:.1} s)",
                    p.name,
                    row.config,
                    row.step_s,
                    row.resident_blocks,
                    row.depth,
                    row.outputs_match,
                    p.elapsed()
                ));
                self.rows.push(row);
            }
        }
        Ok(())
    }

    /// Puts `cfg` in force: the first configuration with a backend enables it (measuring the time and the peak RSS
    /// of `enable`), every later one retunes it.
    fn apply(
        &mut self,
        p: &PresetRun<'_>,
        model: &mut HostModel,
        cfg: &OffloadConfig,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), EngineError> {
        if let Some(b) = self.backend.as_mut() {
            b.retune(cfg.clone(), model, &self.hooks, p.engine.stream())?;
            return Ok(());
        }
        let Some(mut b) = get_offload_backend(cfg, p.platform.clone(), None)? else { return Ok(()) };
        self.peak_before_enable = rss_bytes("VmHWM:");
        reset_peak_rss();
        let t = Instant::now();
        b.enable(model, &self.hooks, p.engine.stream())?;
        let (secs, rss) = (t.elapsed().as_secs_f64(), rss_bytes("VmHWM:"));
        progress(&format!("{}: enable {secs:.1} s, peak RSS during enable {:.2} GB", p.name, rss as f64 / 1e9));
        self.enable = Some((secs, rss));
        self.backend = Some(b);
        Ok(())
    }
}

/// Row of configuration `label` from its first round (its bound and ratio are settled once every round ran), and
/// the host master bytes of the backend under it. Traces one more execution when the spec asks for traces.
fn config_row(
    p: &PresetRun<'_>,
    b: &StreamingBackend,
    hooks: &HookRegistry,
    label: &str,
    budget: Option<u64>,
    m: Measured,
) -> Result<(BenchRow, u64), EngineError> {
    if p.tracer.dir.is_some() {
        p.tracer.cuda.timeline_name(b.master_units(), None);
    }
    let timeline = p.tracer.trace(b, hooks, label)?;
    let rep = b.report();
    let planned = b.plan().map_or(0, |p| p.budget.device_weight_bytes);
    let dit_stack = rep.stacks.first();
    let (hook_p50, hook_p99) = hook_percentiles_us(&m.t.out.hook_latencies);
    let row = BenchRow {
        preset: p.name.to_string(),
        config: label.to_string(),
        strategy: rep.strategy.clone(),
        resident_blocks: dit_stack.map_or(0, |s| s.resident),
        depth: dit_stack.map_or(0, |s| s.depth),
        budget_bytes: budget,
        step_s: m.t.step_s(),
        step_samples: vec![m.t.step_s()],
        bound_s: 0.0,
        ratio: 0.0,
        streamed_bytes_per_step: m.t.bytes_per_step,
        peak_weight_bytes: m.peak,
        planned_weight_bytes: planned,
        hook_p50_us: hook_p50,
        hook_p99_us: hook_p99,
        outputs_match: m.matches,
        timeline,
    };
    Ok((row, rep.master_host_bytes))
}

/// Settles the rows once every round ran and appends them to `report`: a configuration's step time is the median
/// of its rounds; the compute time is the faster of the resident placement (`compute_s`) and the median of the
/// configuration that keeps every block resident through the backend; each row's bound is
/// `max(compute time, streamed bytes per step / bw)`.
fn settle_rows(
    name: &str,
    mut rows: Vec<BenchRow>,
    mut compute_s: f64,
    bw: f64,
    report: &mut BenchReport,
    progress: &mut dyn FnMut(&str),
) {
    for row in &mut rows {
        row.step_s = median(row.step_samples.clone());
        if row.config == RESIDENT_VIA_BACKEND && row.streamed_bytes_per_step == 0 {
            compute_s = compute_s.min(row.step_s);
        }
    }
    if let Some(c) = report.compute_s.iter_mut().find(|(p, _)| p == name) {
        c.1 = compute_s;
    }
    for mut row in rows {
        row.bound_s = compute_s.max(row.streamed_bytes_per_step as f64 / bw);
        row.ratio = row.step_s / row.bound_s;
        progress(&format!(
            "{name} {}: median {:.4} s/step of {} rounds, bound {:.4} s, ratio {:.3}",
            row.config,
            row.step_s,
            row.step_samples.len(),
            row.bound_s,
            row.ratio
        ));
        report.rows.push(row);
    }
}

/// Measures one preset: the resident baseline, then every streamed configuration under one enabled backend.
/// Appends rows to `report`.
fn bench_preset(
    spec: &BenchSpec,
    name: &str,
    report: &mut BenchReport,
    progress: &mut dyn FnMut(&str),
) -> Result<(), EngineError> {
    let t0 = Instant::now();
    let desc = weightferry::pipeline::presets::preset(name)
        .ok_or_else(|| EngineError::Invalid(format!("unknown preset '{name}'")))?;
    let (mut tokens, ctx_tokens) = default_tokens(name);
    if let Some(t) = spec.tokens {
        tokens = t;
    }
    report.tokens.push((name.to_string(), tokens, ctx_tokens));
    let total: u64 = desc.storages.values().map(|s| s.byte_size()).sum();
    // No pinned-buffer cache: the bench enables once per preset, and a cache would keep every master pinned after
    // `disable` (host memory would then read as two copies of the weights).
    let cuda = Arc::new(CudaPlatform::new(0)?);
    report.device = cuda.device_name().to_string();
    let platform: PlatformRef = cuda.clone();
    let bw = cuda.measure_h2d_bandwidth(256 << 20, 16)?;
    report.h2d_bytes_per_s.push((name.to_string(), bw));
    let compute = Arc::new(CudaCompute::new(cuda.clone(), &desc, GpuShape { tokens, context_tokens: ctx_tokens })?);
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), spec.seed)?;
    progress(&format!("{name}: weights generated ({:.1} s)", t0.elapsed().as_secs_f64()));
    let engine = Engine::new(compute, &desc)?;
    let dit_bytes: u64 = desc.components.as_ref().map_or(0, |c| c.dit.iter().map(|d| desc.subtree_bytes(d)).sum());
    let tracer = Tracer {
        cuda: &cuda,
        engine: &engine,
        dit: desc.components.as_ref().map_or_else(Vec::new, |c| c.dit.clone()),
        opts: ExecOptions {
            steps: spec.steps.0.max(1),
            input_seed: spec.seed,
            max_blocks_ahead: spec.max_blocks_ahead,
            ..ExecOptions::default()
        },
        dir: spec.trace_dir.as_deref(),
        preset: name,
    };
    let p = PresetRun { spec, name, cuda: &cuda, platform: platform.clone(), engine: &engine, tracer, t0 };

    let (resident, resident_timeline) = measure_resident(&p, &model)?;
    let compute_s = resident.step_s();
    progress(&format!("{name}: resident {compute_s:.4} s/step ({:.1} s)", p.elapsed()));
    report.compute_s.push((name.to_string(), compute_s));
    let weight_bytes = desc.storages.keys().map(|s| model.storage_bytes(*s)).sum();
    report.rows.push(resident_row(name, compute_s, weight_bytes, resident_timeline));

    let configs = bench_configs(spec, &desc, dit_bytes)?;
    let mut streamed = Streamed::new(cuda.device_memory().in_use);
    let result = streamed.measure_all(&p, &mut model, &configs, &resident.out, progress);
    let rows = std::mem::take(&mut streamed.rows);
    settle_rows(name, rows, compute_s, bw, report, progress);
    let rss_offloaded = rss_bytes("VmRSS:");
    if let Some(mut b) = streamed.backend {
        let d = b.disable(&mut model, &streamed.hooks);
        result?;
        d?;
    } else {
        result?;
    }
    let peak = rss_bytes("VmHWM:").max(streamed.peak_before_enable);
    report.host_memory.push((name.to_string(), total, streamed.master_bytes, peak, rss_offloaded));
    if let Some((secs, rss)) = streamed.enable {
        report.enable.push((name.to_string(), secs, rss));
    }
    drop(p);
    drop(engine);
    model.release();
    Ok(())
}

/// The copy-submission modes a spec runs: its list, or the actor alone when the list is empty.
fn submission_modes(spec: &BenchSpec) -> &[CopySubmission] {
    if spec.copy_submission.is_empty() {
        &[CopySubmission::Actor]
    } else {
        &spec.copy_submission
    }
}

/// Runs the benchmark matrix on GPU 0. `progress` gets one line per measured configuration as it completes.
pub fn bench(spec: &BenchSpec, progress: &mut dyn FnMut(&str)) -> Result<BenchReport, EngineError> {
    let mut report = BenchReport {
        device: String::new(),
        copy_submission: submission_modes(spec).iter().map(|m| m.as_str()).collect::<Vec<_>>().join(","),
        rows: Vec::new(),
        h2d_bytes_per_s: Vec::new(),
        compute_s: Vec::new(),
        host_memory: Vec::new(),
        enable: Vec::new(),
        tokens: Vec::new(),
    };
    for p in &spec.presets {
        bench_preset(spec, p, &mut report, progress)?;
    }
    Ok(report)
}
