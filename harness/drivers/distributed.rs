//! Distributed layerwise offload end to end, one rank at a time: [`run_rank`] runs one rank of a group on any
//! platform (one process per GPU with CUDA + NCCL, one process per rank on the simulated device with a TCP
//! collective, or one thread per rank); [`run_distributed_sim`] runs `N` ranks as threads of this process, each
//! with its own [`SimPlatform`], its own synthetic model (same seed on every rank), its own reference [`Engine`]
//! and hook registry, sharing one [`SimCollectiveGroup`].
//!
//! Per rank: the communicator is warmed up by one small AllGather first; the DiT stacks of the layerwise plan keep
//! only the rank's sharded host masters ([`build_sharded_masters`](weightferry::offload::distributed::build_sharded_masters)); every block is rebuilt in a device slot by the
//! H2D of the rank's shard then one AllGather per dtype section (or per chunk of one, with
//! [`DistributedRunSpec::chunk_bytes`]), through gather-path `BlockStack`s that share one `GatherSequence` and
//! one collective actor. Everything outside the DiT stacks is placed on the device once
//! ([`ResidentPlacement`](weightferry::offload::ResidentPlacement)). No block is prefetched before the first forward, so
//! every rank's first gather happens inside the same hook sequence.
//!
//! Host memory: right after a unit's shards are built, the rank frees the
//! loaded host buffer of every storage of the unit that no later unit needs ([`HostModel::release_to_shards`]), so
//! while it runs the rank holds only its 1/N shard of the streamed blocks and host memory across the group totals
//! one copy of them. At the end (success, or a failure that left the collective usable) one final gather to host
//! ([`shard_restore`](weightferry::offload::shard_restore)) gives every released storage a loaded buffer again, bit-exactly; when
//! the collective is poisoned no restore collective is attempted, the released storages stay [`Home::Sharded`]
//! (a typed error to every read, never stale bytes) and the error says to reload the pipeline.
//!
//! Timing ([`DistributedRunSpec::timed_steps`]): a rank runs a warm-up step, then `lo` and `hi` steps through the
//! same stacks and reports [`RankTiming`] (seconds per step and bytes per step from the stacks' counters, derived
//! as the single-GPU bench does); [`resident_run_with_model`] times the resident baseline the same way, on the
//! same model, which a library session owns ([`rank_session`], [`run_rank_in_session`]). The two run the
//! comparison's stages apart
//! ([`run_resident`], [`run_offloaded`]: `disable` also after a failure).
//!
//! Invariants: every rank runs the same deterministic hook sequence (same plan, same program, no block skips), so
//! every rank issues the same AllGathers in the same order (invariant 4); a failed AllGather anywhere poisons the
//! group and every rank's run then returns an error — none hangs — and a rank whose collective actor is poisoned
//! reports [`DistributedRunError::Poisoned`] ("reload the pipeline", invariant 8). Each rank releases everything it
//! allocated (device buffers, shard masters, actors) before returning, success or not; a storage it released is
//! either restored bit-exactly or still released when it returns (the model's checksum after a successful run equals
//! the one before).

use crate::drivers::compare::{run_offloaded, run_resident, UPLOAD_STREAM};
use crate::engine::compute::{Compute, SimCompute};
use crate::engine::math::Phase;
use crate::engine::synthetic::{splitmix64, SyntheticWeights};
use crate::engine::timeline::{in_modules, summarize, trace_execution, DeviceSpan, DeviceTracer, TimelineSummary};
use crate::engine::{Engine, EngineError, ExecOptions};
use std::sync::Arc;
use std::time::Duration;
use weightferry::config::{Component, OffloadConfig, Strategy};
use weightferry::hooks::{HookFailure, HookRegistry, ModelHook, Residency};
use weightferry::model::{Home, HostModel, ModelError};
use weightferry::offload::distributed::DistributedError;
use weightferry::offload::units::{build_unit_plan, UnitPlan};
use weightferry::offload::{OffloadError, StreamingBackend};
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::scheduler::{
    Collective, CollectiveFactory, GatherError, PlatformError, PlatformRef, SimCollectiveGroup, SimCollectiveOptions,
    SimConfig, SimPlatform,
};
use weightferry::session::{CollectiveSource, Session, SessionOptions};

/// Name of a rank's comm stream (the collective actor's stream).
pub const COMM_STREAM: &str = "comm";

/// Errors of a distributed run (per rank).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DistributedRunError {
    /// The request cannot be run (zero ranks, a fault on a rank outside the group, nothing to stream).
    #[error("{0}")]
    Invalid(String),
    /// The engine or the platform failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Building the stacks or placing fixed state failed.
    #[error(transparent)]
    Offload(#[from] OffloadError),
    /// The sharded masters could not be built.
    #[error(transparent)]
    Shards(#[from] DistributedError),
    /// The collective actor could not be started.
    #[error(transparent)]
    Collective(#[from] GatherError),
    /// An AllGather failed to start: the rank's collective is poisoned and issues no further collective.
    #[error("rank {rank}: collective poisoned ({cause}); the run failed with: {run}; the pipeline must be reloaded")]
    Poisoned {
        /// The rank.
        rank: usize,
        /// The failure that poisoned the collective actor.
        cause: PlatformError,
        /// The error the run itself returned.
        run: String,
    },
    /// A rank thread panicked.
    #[error("rank {rank} panicked")]
    Panicked {
        /// The rank.
        rank: usize,
    },
    /// The final gather to host of the storages the run released failed on this rank while its collective stayed
    /// usable (a device allocation, a copy, a host allocation): the storages it did not restore stay released.
    #[error(
        "rank {rank}: restoring the released DiT weights failed ({cause}); {unrestored} storage(s) stay released \
         (reading them is an error); {run}the pipeline must be reloaded"
    )]
    RestoreFailed {
        /// The rank.
        rank: usize,
        /// Released storages that were not restored.
        unrestored: usize,
        /// The first failure.
        cause: String,
        /// `"the run failed with: …; "` when the run had failed before the restore, else empty.
        run: String,
    },
}

impl From<PlatformError> for DistributedRunError {
    fn from(e: PlatformError) -> Self {
        DistributedRunError::Engine(EngineError::Platform(e))
    }
}

impl From<ModelError> for DistributedRunError {
    fn from(e: ModelError) -> Self {
        DistributedRunError::Engine(e.into())
    }
}

/// What a distributed run does.
#[derive(Debug, Clone)]
pub struct DistributedRunSpec {
    /// The pipeline (every rank loads it with synthetic weights of `seed`).
    pub pipeline: PipelineDesc,
    /// Ranks.
    pub world: usize,
    /// Prefetch depth of the DiT stacks (at least 1).
    pub depth: usize,
    /// DiT steps.
    pub steps: u32,
    /// Seed of the weights and the inputs.
    pub seed: u64,
    /// Fault injection: `(rank, n)` makes that rank's `n`-th AllGather call (0-based) fail to start.
    pub fail_gather: Option<(usize, u64)>,
    /// Longest time a rank's AllGather waits for its peers before the group is poisoned.
    pub timeout: Duration,
    /// Chunked transport: gathered bytes per AllGather (each section is cut into chunks so the AllGather of one
    /// chunk overlaps the copy of the next). `None` or 0: one AllGather per section.
    pub chunk_bytes: Option<u64>,
    /// Testing aid: randomized per-rank timing (hooks sleep, and on the simulated device each rank's comm stream
    /// is slowed by its own amount), so ranks reach their hooks at different times.
    pub jitter: Option<Jitter>,
    /// Timing mode: `Some((lo, hi))` runs the pipeline three times through the same enabled stacks (one untimed
    /// warm-up step, then `lo` steps, then `hi` steps) and reports [`RankRun::timing`]; the output is the `hi`
    /// run's and `steps` is ignored. Needs `1 <= lo < hi`.
    pub timed_steps: Option<(u32, u32)>,
    /// Timing mode: rounds of alternating `lo` / `hi` executions (default 1). The reported `lo` / `hi` are the
    /// median round's, and [`RankTiming`] gives the spread of the rounds' step times.
    pub timed_rounds: u32,
    /// Testing aid: called on every rank once while its run executes (at the start of the first DiT step of its
    /// first execution), with the rank's model as it is then.
    pub probe: Option<RunProbe>,
    /// Timing mode only: after the timed executions, one more `lo`-step execution with this device timeline
    /// armed (kernels, shard copies and AllGathers as the platform brackets them), summarised over the DiT window
    /// into [`RankRun::trace`]. Untimed, so it never changes the timed figures.
    pub trace: Option<RunTracer>,
}

/// The device tracer of [`DistributedRunSpec::trace`] (the CUDA platform, or a test's fake).
#[derive(Clone)]
pub struct RunTracer(
    /// Arms and collects the timeline.
    pub Arc<dyn DeviceTracer>,
);

impl std::fmt::Debug for RunTracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunTracer(..)")
    }
}

/// What the traced execution of [`DistributedRunSpec::trace`] recorded on one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTrace {
    /// Steps of the traced execution (the timed `lo`).
    pub steps: u32,
    /// Every span, sorted by start.
    pub spans: Vec<DeviceSpan>,
    /// Spans dropped for want of timing events.
    pub dropped: u64,
    /// The DiT window: kernels of the pipeline's DiT modules, and the copies and AllGathers inside it.
    pub summary: TimelineSummary,
}

/// Timing events a traced execution may use (two per span).
pub const TRACE_CAPACITY: usize = 1 << 17;

/// What [`DistributedRunSpec::probe`] sees of a rank while its run executes.
#[derive(Debug)]
pub struct RunningRank<'a> {
    /// The rank.
    pub rank: usize,
    /// Its model (released storages are [`Home::Sharded`]).
    pub model: &'a HostModel,
    /// The storages of the streamed DiT units.
    pub dit_storages: &'a [StorageId],
    /// Host bytes of its shard masters.
    pub shard_host_bytes: u64,
    /// Host bytes it holds for DiT weights: [`RankRun::dit_host_bytes_while_running`].
    pub dit_host_bytes: u64,
}

/// A callback of [`DistributedRunSpec::probe`], shared by every rank.
#[derive(Clone)]
pub struct RunProbe(
    /// Called with what the rank holds while it runs.
    pub Arc<dyn Fn(&RunningRank<'_>) + Send + Sync>,
);

impl std::fmt::Debug for RunProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunProbe(..)")
    }
}

impl DistributedRunSpec {
    /// Checks what every rank needs: at least one rank, a prefetch depth of at least 1.
    pub fn validate(&self) -> Result<(), DistributedRunError> {
        if self.world == 0 {
            return Err(DistributedRunError::Invalid("a distributed run needs at least one rank".into()));
        }
        if self.depth == 0 {
            return Err(DistributedRunError::Invalid(
                "distributed layerwise needs a prefetch depth of at least 1".into(),
            ));
        }
        if let Some(steps) = self.timed_steps {
            check_timed_steps(steps).map_err(DistributedRunError::Invalid)?;
        }
        if !(1..=MAX_TIMED_ROUNDS).contains(&self.timed_rounds) {
            return Err(DistributedRunError::Invalid(format!(
                "timed rounds {}: need 1 to {MAX_TIMED_ROUNDS}",
                self.timed_rounds
            )));
        }
        if self.timed_rounds > 1 && self.timed_steps.is_none() {
            return Err(DistributedRunError::Invalid(format!(
                "timed rounds {}: rounds repeat the timed executions, so they need timed steps",
                self.timed_rounds
            )));
        }
        if self.trace.is_some() && self.timed_steps.is_none() {
            return Err(DistributedRunError::Invalid(
                "a traced distributed run needs timed steps (it traces one more execution of the timed lo steps)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The run `config` describes for `pipeline`: `world` = the config's offload group size (1 when the DiT is not
    /// gathered across a group), the DiT's `prefetch_depth` (default 2) and `allgather_chunk_size`; 3 steps, seed
    /// 0. Fails (naming the key and the fix) for a config this runner cannot run: not `mode = "layer"`, or resident
    /// DiT layers (those run rank-local through the single-process backend).
    pub fn from_config(pipeline: PipelineDesc, config: &OffloadConfig) -> Result<Self, DistributedRunError> {
        if !matches!(config.strategy, Strategy::LayerWise | Strategy::DistributedLayerWise) {
            return Err(DistributedRunError::Invalid(format!(
                "a distributed run needs layerwise offload, but the config selects {}; set \
                 diffusion_offload_config.mode = \"layer\"",
                config.strategy.report_name()
            )));
        }
        if config.resident_layers > 0 {
            return Err(DistributedRunError::Invalid(
                "resident DiT layers use rank-local transfer, which the distributed runner does not stream; remove \
                 layer_options.dit.resident_layers (or run without a group)"
                    .into(),
            ));
        }
        let world = if config.uses_allgather(Component::Dit) { config.group.size as usize } else { 1 };
        let mut spec = DistributedRunSpec::new(pipeline, world);
        spec.depth = config.prefetch_depth(Component::Dit).map_or(2, |d| d as usize);
        spec.chunk_bytes = config.allgather_chunk_bytes(Component::Dit);
        Ok(spec)
    }
}

/// Randomized per-rank timing for tests: every rank draws from its own generator seeded by `seed` and its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jitter {
    /// Seed of every rank's generator.
    pub seed: u64,
    /// Longest sleep before a hook (each hook sleeps a random amount below it).
    pub max_hook_sleep: Duration,
    /// Longest extra time per op on a rank's comm stream (simulated device only; each rank draws one amount).
    pub max_stream_delay: Duration,
}

impl Jitter {
    /// The generator state of `rank`.
    fn state(&self, rank: usize) -> u64 {
        self.seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// A duration in `[0, max)` drawn from `state`.
    fn draw(state: &mut u64, max: Duration) -> Duration {
        let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        if nanos == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(splitmix64(state) % nanos)
    }

    /// The extra time per op of `rank`'s comm stream.
    pub fn stream_delay(&self, rank: usize) -> Duration {
        let mut st = self.state(rank).rotate_left(17);
        Self::draw(&mut st, self.max_stream_delay)
    }
}

/// A hook that sleeps a random amount (registered beside the offload hook of every gathered block).
struct JitterHook {
    state: std::sync::Mutex<u64>,
    max: Duration,
}

impl JitterHook {
    fn sleep(&self) {
        let d = {
            let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            Jitter::draw(&mut st, self.max)
        };
        std::thread::sleep(d);
    }
}

impl ModelHook for JitterHook {
    fn pre_forward(&self, _module: &str) -> Result<Option<Residency>, HookFailure> {
        self.sleep();
        Ok(None)
    }
    fn post_forward(&self, _module: &str) -> Result<(), HookFailure> {
        self.sleep();
        Ok(())
    }
}

impl DistributedRunSpec {
    /// `world` ranks, depth 1, 3 steps, seed 0, no fault, a 30 s group timeout, unchunked, loaded weights kept.
    pub fn new(pipeline: PipelineDesc, world: usize) -> Self {
        DistributedRunSpec {
            pipeline,
            world,
            depth: 1,
            steps: 3,
            seed: 0,
            fail_gather: None,
            timeout: Duration::from_secs(30),
            chunk_bytes: None,
            jitter: None,
            timed_steps: None,
            timed_rounds: 1,
            probe: None,
            trace: None,
        }
    }
}

/// What one rank saw.
#[derive(Debug, Clone, PartialEq)]
pub struct RankRun {
    /// The rank.
    pub rank: usize,
    /// The engine's output (little-endian `f32` latents).
    pub output: Vec<u8>,
    /// `(sequence number, tag)` of every AllGather the rank's collective actor started, in issue order.
    pub issued: Vec<(u64, u64)>,
    /// Hazard violations the rank's simulated device detected.
    pub hazard_violations: usize,
    /// Host bytes of the rank's shard masters (padding included).
    pub shard_host_bytes: u64,
    /// Host bytes the rank held for DiT weights while it ran: its shard masters plus the loaded bytes of the
    /// streamed DiT storages it did not release (the run releases every one no later unit needs, so just the
    /// shards).
    pub dit_host_bytes_while_running: u64,
    /// Loaded host bytes the rank released while it ran (and restored at its end).
    pub released_bytes: u64,
    /// `(sequence number, tag)` of the AllGathers of the final restore to host, in issue order (after `issued`;
    /// empty when nothing was released). Tags are restore tags ([`is_restore_tag`](weightferry::offload::shard_restore::is_restore_tag)).
    pub restore_issued: Vec<(u64, u64)>,
    /// Bytes of one full copy of the streamed sections (what the shards of all ranks rebuild).
    pub full_section_bytes: u64,
    /// Streamed sections (AllGathers per pass over every block).
    pub sections: u64,
    /// Host → device bytes the DiT stacks copied (shards only).
    pub h2d_bytes: u64,
    /// AllGathers that went between symmetric windows ([`weightferry::scheduler::Collective::windowed_gathers`]:
    /// NCCL's copy-engine path, or the simulated group's model of it), the final restore's included.
    pub windowed_all_gathers: u64,
    /// With [`DistributedRunSpec::timed_steps`]: the timed executions and the bytes one step moved.
    pub timing: Option<RankTiming>,
    /// With [`DistributedRunSpec::trace`]: the traced execution's device timeline.
    pub trace: Option<RankTrace>,
}

/// Most rounds of timed executions ([`DistributedRunSpec::timed_rounds`]).
pub const MAX_TIMED_ROUNDS: u32 = 50;

/// The timed executions of one rank ([`DistributedRunSpec::timed_steps`]): wall times of the `lo`- and `hi`-step
/// executions (each ends by reading the output back, so wall time is device time) and what one step moved, taken
/// from the stacks' copy counters as the difference between the two executions divided by `hi − lo` — which
/// removes the encoders, the VAE and the first step of each execution, as the single-GPU bench does. With several
/// rounds, `lo` and `hi` are the median round's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankTiming {
    /// `(lo, hi)` steps.
    pub steps: (u32, u32),
    /// Wall time of the `lo`-step execution (of the median round).
    pub lo: Duration,
    /// Wall time of the `hi`-step execution (of the median round).
    pub hi: Duration,
    /// Rounds of `lo` / `hi` executions.
    pub rounds: u32,
    /// Shortest and longest step time of a round, s.
    pub step_range_s: (f64, f64),
    /// Shard bytes this rank copied host → device per step (padding included).
    pub shard_bytes_per_step: u64,
    /// Bytes the AllGathers of one step wrote on this rank (`shard_bytes_per_step × world`, padding included).
    pub gathered_bytes_per_step: u64,
    /// Full-block bytes one step rebuilt (padding excluded): what a single GPU would copy host → device per step
    /// to stream the same blocks. Derived as the passes over every block one step made (shard bytes per step /
    /// shard bytes of one pass) × the full bytes of one pass.
    pub full_bytes_per_step: u64,
}

impl RankTiming {
    /// Seconds per step: `(hi − lo) / (hi_steps − lo_steps)`.
    pub fn step_s(&self) -> f64 {
        step_seconds(self.steps, self.lo, self.hi)
    }
}

pub use crate::engine::timing::step_seconds;
use crate::engine::timing::{stack_h2d_bytes, time_rounds, timed_execution};

/// Timed steps `(lo, hi)` need `1 <= lo < hi`; the error is the message naming the fix.
fn check_timed_steps((lo, hi): (u32, u32)) -> Result<(), String> {
    if lo == 0 || hi <= lo {
        return Err(format!("timed steps ({lo}, {hi}): need 1 <= lo < hi, e.g. (1, 3)"));
    }
    Ok(())
}

/// A resident run on a caller's model ([`resident_run_with_model`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidentRun {
    /// The output (little-endian `f32` latents): of the `hi`-step execution when timed.
    pub output: Vec<u8>,
    /// Timed: `(lo, hi)` steps and the wall times of the two executions.
    pub timing: Option<((u32, u32), Duration, Duration)>,
}

/// The output of the fully resident single-rank run of `pipeline` (every storage on the device, no hooks), as
/// the `run` driver's baseline computes it.
pub fn resident_output(pipeline: &PipelineDesc, steps: u32, seed: u64) -> Result<Vec<u8>, EngineError> {
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() })?);
    let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
    let result = resident_output_on(compute, pipeline, steps, seed);
    sim.shutdown();
    result
}

/// The output of the fully resident single-rank run of `pipeline` on `compute`'s platform (a GPU, say): the
/// baseline a rank of a distributed run on that platform compares its output with.
pub fn resident_output_on(
    compute: Arc<dyn Compute>,
    pipeline: &PipelineDesc,
    steps: u32,
    seed: u64,
) -> Result<Vec<u8>, EngineError> {
    let platform = compute.platform();
    let model = HostModel::synthetic(platform.clone(), Arc::new(pipeline.clone()), seed)?;
    let result = resident_run_with_model(compute, &model, pipeline, steps, seed, None, 1);
    model.release();
    result.map(|r| r.output)
}

/// The fully resident run of `pipeline` on `compute`'s platform with the caller's `model` (loaded on that platform
/// from `pipeline`; it is left loaded): every storage uploaded once, no hooks. Untimed (`timed = None`): one
/// execution of `steps` steps. Timed (`Some((lo, hi))`, `1 <= lo < hi`; `steps` is ignored): one untimed warm-up
/// step (cuBLAS handles, kernel loading), then `rounds` rounds of `lo` and `hi` steps, each timed; the output is
/// the last `hi` run's, and the timing the median round's — the compute time of a step is [`step_seconds`] of its
/// two.
pub fn resident_run_with_model(
    compute: Arc<dyn Compute>,
    model: &HostModel,
    pipeline: &PipelineDesc,
    steps: u32,
    seed: u64,
    timed: Option<(u32, u32)>,
    rounds: u32,
) -> Result<ResidentRun, EngineError> {
    if let Some(steps) = timed {
        check_timed_steps(steps).map_err(EngineError::Invalid)?;
    }
    let mut engine = Engine::new(compute, pipeline)?;
    let upload = model.platform().create_stream(UPLOAD_STREAM)?;
    let result = run_resident(model, upload, |placement, hooks| {
        let run = |n: u32| {
            let opts = ExecOptions { steps: n, input_seed: seed, ..ExecOptions::default() };
            timed_execution(&engine, placement, hooks, &opts, &mut |_| {}).map(|(t, out)| (t, out.output))
        };
        match timed {
            None => run(steps).map(|(_, output)| ResidentRun { output, timing: None }),
            Some(steps) => {
                run(1)?;
                let t = time_rounds(steps, rounds, run, || 0)?;
                Ok(ResidentRun { output: t.out, timing: Some((steps, t.rounds.lo, t.rounds.hi)) })
            }
        }
    });
    let released = engine.release();
    let (result, _) = result?;
    released?;
    Ok(result)
}

/// Runs `spec` on `spec.world` simulated ranks; returns each rank's result, indexed by rank.
pub fn run_distributed_sim(
    spec: &DistributedRunSpec,
) -> Result<Vec<Result<RankRun, DistributedRunError>>, DistributedRunError> {
    spec.validate()?;
    if let Some((rank, _)) = spec.fail_gather {
        if rank >= spec.world {
            return Err(DistributedRunError::Invalid(format!("fault on rank {rank} of {} ranks", spec.world)));
        }
    }
    let sims: Vec<Arc<SimPlatform>> = (0..spec.world)
        .map(|rank| {
            let mut config = SimConfig { tracing: false, ..SimConfig::default() };
            if let Some(j) = &spec.jitter {
                config.faults.slow_stream = Some((COMM_STREAM.to_string(), j.stream_delay(rank)));
            }
            SimPlatform::new(config).map(Arc::new)
        })
        .collect::<Result<_, _>>()?;
    let comms = SimCollectiveGroup::with_options(sims.clone(), SimCollectiveOptions { timeout: spec.timeout });
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = sims
            .iter()
            .cloned()
            .zip(comms)
            .enumerate()
            .map(|(rank, (sim, comm))| {
                if let Some((r, n)) = spec.fail_gather {
                    if r == rank {
                        comm.fail_nth_call(n);
                    }
                }
                let world = spec.world;
                std::thread::Builder::new().name(format!("wf-rank-{rank}")).spawn_scoped(scope, move || {
                    let platform: PlatformRef = sim.clone();
                    let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
                    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
                    run_rank(platform, compute, factory, rank, world, spec).map(|mut r| {
                        r.hazard_violations = sim.violations().len();
                        r
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or(Err(DistributedRunError::Panicked { rank })),
                Err(e) => Err(DistributedRunError::Invalid(format!("spawn rank {rank}: {e}"))),
            })
            .collect()
    });
    for s in &sims {
        s.shutdown();
    }
    Ok(results)
}

/// Runs rank `rank` of a `world`-rank distributed layerwise run of `spec` on `platform`: this process's (or this
/// thread's) part of the group. Generic over the platform: the simulated device with a
/// [`SimCollective`](weightferry::scheduler::SimCollective) (as
/// [`run_distributed_sim`] does, one thread per rank), or one process per rank — the simulated device with a
/// TCP collective, or CUDA with an NCCL collective.
///
/// - `compute` runs the engine's kernels on `platform`.
/// - `collective` builds the communicator (on the collective actor's own thread); it must report `rank` and
///   `world`.
/// - `world` must equal `spec.world`.
///
/// Loads the pipeline with synthetic weights of `spec.seed`, builds this rank's sharded masters of the DiT stacks,
/// spawns the collective actor and **warms the communicator** (one small AllGather, sequence number 0, tag
/// [`WARM_UP_TAG`](weightferry::scheduler::WARM_UP_TAG), before anything else is gathered: NCCL's
/// first AllGather on a new communicator takes about 2.5 s, which must not land inside the first step), runs
/// `spec.steps` steps through gather-path block stacks, restores what it released and releases everything before returning, success or not.
/// [`RankRun::hazard_violations`] is left at 0: a caller on the simulated device fills it in from its platform.
///
/// Errors: an invalid spec or mismatched rank / world ([`DistributedRunError::Invalid`]); any failure of the
/// run. When an AllGather failed to start on this rank — or when the collective turns out
/// unusable for the final restore (an AllGather failed on the device, a gap in the gather order, a failed restore
/// AllGather) — the error is [`DistributedRunError::Poisoned`]: no further collective is issued and the pipeline
/// must be reloaded. A failure of the final restore on this rank alone is [`DistributedRunError::RestoreFailed`].
pub fn run_rank(
    platform: PlatformRef,
    compute: Arc<dyn Compute>,
    collective: CollectiveFactory,
    rank: usize,
    world: usize,
    spec: &DistributedRunSpec,
) -> Result<RankRun, DistributedRunError> {
    check_rank(rank, world, spec)?;
    let model = HostModel::synthetic(platform, Arc::new(spec.pipeline.clone()), spec.seed)?;
    let mut session = rank_session(model, collective, rank, world, spec)?;
    run_rank_in_session(compute, &mut session, rank, world, spec)
}

/// The spec is valid and `rank` of `world` fits it.
fn check_rank(rank: usize, world: usize, spec: &DistributedRunSpec) -> Result<(), DistributedRunError> {
    spec.validate()?;
    if world != spec.world || rank >= world {
        return Err(DistributedRunError::Invalid(format!(
            "rank {rank} of {world} ranks does not fit a run of {} ranks; give every rank the same world size and \
             a rank below it",
            spec.world
        )));
    }
    Ok(())
}

/// The library session of `rank` of a run of `spec`: `spec`'s distributed DiT config
/// ([`OffloadConfig::distributed_dit`]) over the caller's `model` (holding `spec.pipeline` with synthetic weights
/// of `spec.seed`, or a checkpoint's bytes), the rank's `collective`, and a new compute stream on the model's
/// platform for the engine ([`run_rank_in_session`]) to run on. One weight generation serves this run and a
/// resident baseline on the same device: run [`resident_run_with_model`] on [`Session::model`] first, while every
/// storage is loaded. The model is released when the session is dropped (also when this fails).
pub fn rank_session(
    model: HostModel,
    collective: CollectiveFactory,
    rank: usize,
    world: usize,
    spec: &DistributedRunSpec,
) -> Result<Session, DistributedRunError> {
    let stream = match check_rank(rank, world, spec).and_then(|()| Ok(model.platform().create_stream("compute")?)) {
        Ok(stream) => stream,
        Err(e) => {
            model.release();
            return Err(e);
        }
    };
    let config = OffloadConfig::distributed_dit(world as u32, spec.depth as u32, spec.chunk_bytes);
    let options = SessionOptions { collective: CollectiveSource::Factory(collective), ..SessionOptions::default() };
    Session::from_model(model, stream, config, options).map_err(|e| DistributedRunError::Engine(e.into()))
}

/// Runs this rank's part of the group run through `session` ([`rank_session`]), the engine on the session's
/// compute stream: `enable`, the engine's executions, `disable`. While it runs the rank holds only its shards of
/// the DiT blocks on host (the backend released the loaded copies at enable); `disable` restores them bit-exactly.
/// If the collective is poisoned (the error is then [`DistributedRunError::Poisoned`]) or the restore fails on
/// this rank ([`DistributedRunError::RestoreFailed`]), the storages not restored stay [`Home::Sharded`] — reading
/// them is a typed error — and the pipeline must be reloaded. Everything else this rank allocated is released
/// before returning, success or not.
pub fn run_rank_in_session(
    compute: Arc<dyn Compute>,
    session: &mut Session,
    rank: usize,
    world: usize,
    spec: &DistributedRunSpec,
) -> Result<RankRun, DistributedRunError> {
    check_rank(rank, world, spec)?;
    let Some(config) = session.backend().map(|b| b.config().clone()) else {
        return Err(DistributedRunError::Invalid("the config disables offload".into()));
    };
    let units = build_unit_plan(&spec.pipeline, &config, session.plan());
    if !units.stacks.iter().any(|s| s.allgather) {
        return Err(DistributedRunError::Invalid("the plan streams no DiT stack".into()));
    }
    let mut engine = Engine::on_stream(compute, &spec.pipeline, session.compute_stream())?;
    let (result, disabled) = run_offloaded(session, |session| {
        let backend = session.backend().expect("checked above");
        let run = run_enabled(spec, rank, &units, backend, &engine, session.hooks(), session.model());
        session.hooks().remove_owned_by(JITTER_HOOK);
        let released = engine.release();
        let issued = backend.gather_log();
        run.and_then(|run| released.map(|()| RankRun { issued, ..run }).map_err(DistributedRunError::from))
    });
    let backend = session.backend().expect("checked above");
    let restore_issued = backend.restore_log().to_vec();
    let windowed = backend.windowed_gathers();
    let poisoned = backend.poisoned();
    rank_outcome(rank, result, disabled, poisoned, restore_issued, windowed)
}

/// A rank's result from its run's, `disable`'s and the collective's state.
fn rank_outcome(
    rank: usize,
    result: Result<RankRun, DistributedRunError>,
    disabled: Result<(), OffloadError>,
    poisoned: Option<PlatformError>,
    restore_issued: Vec<(u64, u64)>,
    windowed: u64,
) -> Result<RankRun, DistributedRunError> {
    let run_error = |r: &Result<RankRun, DistributedRunError>| r.as_ref().err().map(ToString::to_string);
    match disabled {
        Err(OffloadError::Poisoned { cause, unrestored, .. }) => {
            let run = run_error(&result).unwrap_or_else(|| {
                format!("the run finished, but {unrestored} released DiT storage(s) cannot be restored")
            });
            Err(DistributedRunError::Poisoned { rank, cause, run })
        }
        Err(OffloadError::RestoreFailed { unrestored, cause, .. }) => {
            let run = run_error(&result).map_or_else(String::new, |e| format!("the run failed with: {e}; "));
            Err(DistributedRunError::RestoreFailed { rank, unrestored, cause, run })
        }
        Err(e) => match (result, poisoned) {
            (Err(run), Some(cause)) => Err(DistributedRunError::Poisoned { rank, cause, run: run.to_string() }),
            (Err(run), None) => Err(run),
            (Ok(_), _) => Err(e.into()),
        },
        Ok(()) => {
            let mut run = match (result, poisoned) {
                (Err(run), Some(cause)) => {
                    return Err(DistributedRunError::Poisoned { rank, cause, run: run.to_string() })
                }
                (result, _) => result?,
            };
            run.restore_issued = restore_issued;
            run.windowed_all_gathers = windowed;
            Ok(run)
        }
    }
}

/// Owner and name of the jitter hooks ([`DistributedRunSpec::jitter`]).
const JITTER_HOOK: &str = "test_jitter";

/// The executions of an enabled rank: jitter hooks (a testing aid), the probe, the untimed or timed runs, the trace.
fn run_enabled(
    spec: &DistributedRunSpec,
    rank: usize,
    units: &UnitPlan,
    backend: &StreamingBackend,
    engine: &Engine,
    hooks: &HookRegistry,
    model: &HostModel,
) -> Result<RankRun, DistributedRunError> {
    let world = spec.world;
    let group = backend.report().group.unwrap_or_default();
    if let Some(j) = &spec.jitter {
        let mut st = j.state(rank);
        for unit in units.stacks.iter().filter(|s| s.allgather).flat_map(|s| &s.units) {
            let hook =
                Arc::new(JitterHook { state: std::sync::Mutex::new(splitmix64(&mut st)), max: j.max_hook_sleep });
            hooks.register(&unit.path, JITTER_HOOK, JITTER_HOOK, hook).map_err(OffloadError::from)?;
        }
    }
    let gathered = || units.stacks.iter().filter(|s| s.allgather).flat_map(|s| &s.units);
    let mut dit_storages: Vec<StorageId> = gathered().flat_map(|u| u.storages()).collect();
    dit_storages.sort_unstable();
    let full: u64 = gathered().flat_map(|u| &u.sections).map(|s| s.len).sum();
    let sections = gathered().map(|u| u.sections.len() as u64).sum::<u64>();
    let shard_host_bytes = group.shard_host_bytes;
    let still_held = |s: &&StorageId| matches!(model.home(**s), Some(Home::Loaded { .. } | Home::Master { .. }));
    let dit_host_bytes =
        shard_host_bytes + dit_storages.iter().filter(still_held).map(|s| model.storage_bytes(*s)).sum::<u64>();
    let probed = std::cell::Cell::new(false);
    let run = |steps: u32| {
        let opts = ExecOptions { steps, input_seed: spec.seed, ..ExecOptions::default() };
        let mut progress = |p: crate::engine::Progress<'_>| {
            if let (Some(probe), Phase::Dit, false) = (&spec.probe, p.phase, probed.get()) {
                probed.set(true);
                let dit_storages = &dit_storages;
                (probe.0)(&RunningRank { rank, model, dit_storages, shard_host_bytes, dit_host_bytes });
            }
        };
        timed_execution(engine, backend, hooks, &opts, &mut progress).map(|(t, out)| (t, out.output))
    };
    let h2d = || stack_h2d_bytes(&backend.report());
    let dit_roots: Vec<String> = spec.pipeline.components.as_ref().map_or_else(Vec::new, |c| c.dit.clone());
    let (output, timing, trace) = match spec.timed_steps {
        None => run(spec.steps).map(|(_, output)| (output, None, None))?,
        Some(steps) => {
            run(1)?;
            let timed = time_rounds(steps, spec.timed_rounds, run, h2d)?;
            let (rounds, shard) = (timed.rounds, timed.bytes_per_step);
            let full_per_step = if shard_host_bytes == 0 {
                0
            } else {
                u64::try_from(u128::from(shard) * u128::from(full) / u128::from(shard_host_bytes)).unwrap_or(u64::MAX)
            };
            let timing = RankTiming {
                steps,
                lo: rounds.lo,
                hi: rounds.hi,
                rounds: rounds.rounds,
                step_range_s: (rounds.step_min_s, rounds.step_max_s),
                shard_bytes_per_step: shard,
                gathered_bytes_per_step: shard.saturating_mul(world as u64),
                full_bytes_per_step: full_per_step,
            };
            let trace = match &spec.trace {
                Some(tracer) => {
                    tracer.0.name_spans(backend.master_units(), Some(backend.gather_names().into_namer()));
                    let (_, spans, dropped) =
                        trace_execution(tracer.0.as_ref(), engine.stream(), TRACE_CAPACITY, || run(steps.0))?;
                    let summary = summarize(&spans, |label| in_modules(label, &dit_roots));
                    Some(RankTrace { steps: steps.0, spans, dropped, summary })
                }
                None => None,
            };
            (timed.out, Some(timing), trace)
        }
    };
    backend.fence()?;
    Ok(RankRun {
        rank,
        output,
        issued: Vec::new(),
        hazard_violations: 0,
        shard_host_bytes,
        dit_host_bytes_while_running: dit_host_bytes,
        released_bytes: group.released_bytes,
        restore_issued: Vec::new(),
        full_section_bytes: full,
        sections,
        h2d_bytes: h2d(),
        windowed_all_gathers: 0,
        timing,
        trace,
    })
}
