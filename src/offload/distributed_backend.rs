//! Distributed layerwise offload end to end, one rank at a time: [`run_rank`] runs one rank of a group on any
//! platform (one process per GPU with CUDA + NCCL, one process per rank on the simulated device with a TCP
//! collective, or one thread per rank); [`run_distributed_sim`] runs `N` ranks as threads of this process, each
//! with its own [`SimPlatform`], its own synthetic model (same seed on every rank), its own reference [`Engine`]
//! and hook registry, sharing one [`SimCollectiveGroup`].
//!
//! Per rank: the communicator is warmed up by one small AllGather first; the DiT stacks of the layerwise plan keep
//! only the rank's sharded host masters ([`build_sharded_masters`]); every block is rebuilt in a device slot by the
//! H2D of the rank's shard then one AllGather per dtype section (or per chunk of one, with
//! [`DistributedRunSpec::chunk_bytes`]), through gather-path [`BlockStack`]s that share one [`GatherSequence`] and
//! one collective actor. Everything outside the DiT stacks is placed on the device once ([`ResidentPlacement`]).
//! No block is prefetched before the first forward, so every rank's first gather happens inside the same hook
//! sequence.
//!
//! Host memory ([`DistributedRunSpec::release_loaded`]): right after a unit's shards are built, the rank frees the
//! loaded host buffer of every storage of the unit that no later unit needs ([`HostModel::release_to_shards`]), so
//! while it runs the rank holds only its 1/N shard of the streamed blocks and host memory across the group totals
//! one copy of them. At the end (success, or a failure that left the collective usable) one final gather to host
//! ([`shard_restore`](super::shard_restore)) gives every released storage a loaded buffer again, bit-exactly; when
//! the collective is poisoned no restore collective is attempted, the released storages stay [`Home::Sharded`]
//! (a typed error to every read, never stale bytes) and the error says to reload the pipeline.
//!
//! Timing ([`DistributedRunSpec::timed_steps`]): a rank runs a warm-up step, then `lo` and `hi` steps through the
//! same stacks and reports [`RankTiming`] (seconds per step and bytes per step from the stacks' counters, derived
//! as the single-GPU bench does); [`resident_run_with_model`] times the resident baseline the same way, on the
//! same model ([`run_rank_with_model`]).
//!
//! Invariants: every rank runs the same deterministic hook sequence (same plan, same program, no block skips), so
//! every rank issues the same AllGathers in the same order (invariant 4); a failed AllGather anywhere poisons the
//! group and every rank's run then returns an error — none hangs — and a rank whose collective actor is poisoned
//! reports [`DistributedRunError::Poisoned`] ("reload the pipeline", invariant 8). Each rank releases everything it
//! allocated (device buffers, shard masters, actors) before returning, success or not; a storage it released is
//! either restored bit-exactly or still released when it returns (the model's checksum after a successful run equals
//! the one before).

use super::backend::StackHook;
use super::distributed::{build_sharded_masters, DistributedError, ShardedMasters};
use super::layout::UnitLayout;
use super::resident::ResidentPlacement;
use super::shard_restore::{restore_released, RestoreFailure, MAX_STACKS};
use super::units::build_unit_plan;
use super::{OffloadError, WeightSource};
use crate::config::{Component, OffloadConfig, Strategy};
use crate::engine::compute::{Compute, SimCompute};
use crate::engine::math::Phase;
use crate::engine::timeline::{in_modules, summarize, trace_execution, DeviceSpan, DeviceTracer, TimelineSummary};
use crate::engine::{Engine, EngineError, ExecOptions};
use crate::hooks::{HookRegistry, ModelHook, DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK};
use crate::model::splitmix64;
use crate::model::{Home, HostModel, ModelError};
use crate::plan::{resolve_offload_plan, PipelineDesc, StorageId};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry_actors::collective::{Collective, SimCollectiveGroup, SimCollectiveOptions};
use weightferry_actors::collective_actor::{CollectiveFactory, CollectiveHandle, GatherError};
use weightferry_actors::platform::{DeviceBufferId, HostMemoryKind, PlatformError, PlatformRef};
use weightferry_actors::sim::{SimConfig, SimPlatform};
use weightferry_actors::{
    BlockSpec, BlockStack, GatherBlock, GatherPath, GatherSection, GatherSequence, StackSpec, StreamHandle,
    StreamOptions,
};

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
    /// Keep only the shards on host while running (the contract of distributed layerwise offload: host memory
    /// across the group totals one copy of the streamed blocks). When set, right after a unit's shards are built the
    /// rank frees the loaded host buffer of each of the unit's storages that no later unit needs (the storage
    /// becomes [`Home::Sharded`]; storages homed elsewhere, e.g. in a backend's master, are left alone), and at the
    /// end it restores them by one final AllGather to host (see the module documentation). Default `false`: the
    /// rank reads the caller's model and leaves it as it was, holding the full model and its shards while it runs.
    /// The `weightferry run` driver of a distributed run sets it.
    pub release_loaded: bool,
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
        if let Some((lo, hi)) = self.timed_steps {
            if lo == 0 || hi <= lo {
                return Err(DistributedRunError::Invalid(format!(
                    "timed steps ({lo}, {hi}): need 1 <= lo < hi, e.g. (1, 3)"
                )));
            }
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

/// A hook that sleeps a random amount, then runs the wrapped hook.
struct JitterHook {
    inner: Arc<dyn ModelHook>,
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
    fn pre_forward(&self, module: &str) -> Result<(), String> {
        self.sleep();
        self.inner.pre_forward(module)
    }
    fn post_forward(&self, module: &str) -> Result<(), String> {
        self.sleep();
        self.inner.post_forward(module)
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
            release_loaded: false,
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
    /// streamed DiT storages it did not release (all of them without [`DistributedRunSpec::release_loaded`], so
    /// then one full copy of the streamed blocks more; with it, just the shards).
    pub dit_host_bytes_while_running: u64,
    /// Loaded host bytes the rank released while it ran (and restored at its end); 0 without
    /// [`DistributedRunSpec::release_loaded`].
    pub released_bytes: u64,
    /// `(sequence number, tag)` of the AllGathers of the final restore to host, in issue order (after `issued`;
    /// empty when nothing was released). Tags are [`restore_tag`](super::shard_restore::restore_tag)s.
    pub restore_issued: Vec<(u64, u64)>,
    /// Bytes of one full copy of the streamed sections (what the shards of all ranks rebuild).
    pub full_section_bytes: u64,
    /// Streamed sections (AllGathers per pass over every block).
    pub sections: u64,
    /// Host → device bytes the DiT stacks copied (shards only).
    pub h2d_bytes: u64,
    /// AllGathers that went between symmetric windows ([`weightferry_actors::collective::Collective::windowed_gathers`]:
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
use crate::engine::timing::{bytes_per_step, more_rounds};

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
    if let Some((lo, hi)) = timed {
        if lo == 0 || hi <= lo {
            return Err(EngineError::Invalid(format!("timed steps ({lo}, {hi}): need 1 <= lo < hi, e.g. (1, 3)")));
        }
    }
    let platform = compute.platform();
    let mut engine = Engine::new(compute, pipeline)?;
    let upload = platform.create_stream("resident-upload")?;
    let all: Vec<StorageId> = pipeline.storages.keys().copied().collect();
    let mut placement = ResidentPlacement::upload(&platform, model, &all, upload)?;
    let run = |n: u32| -> Result<(Duration, Vec<u8>), EngineError> {
        let opts =
            ExecOptions { steps: n, input_seed: seed, skip_seed: None, span_epoch: None, max_blocks_ahead: None };
        let t = Instant::now();
        let out = engine.execute(&placement, &HookRegistry::new(), &opts, &mut |_| {})?;
        Ok((t.elapsed(), out.output))
    };
    let result = match timed {
        None => run(steps).map(|(_, output)| ResidentRun { output, timing: None }),
        Some((lo, hi)) => (|| {
            run(1)?;
            let (t_lo, _) = run(lo)?;
            let (t_hi, mut output) = run(hi)?;
            let r = more_rounds((lo, hi), (t_lo, t_hi), rounds, run, &mut output)?;
            Ok(ResidentRun { output, timing: Some(((lo, hi), r.lo, r.hi)) })
        })(),
    };
    let released = engine.release();
    placement.release()?;
    let result = result?;
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

/// Tag of chunk `j` of section `k` of unit `ui` of stack `si`: equal on every rank, distinct per gather (chunks
/// stay below 2^20, sections below 2^8, units below 2^24).
pub(crate) fn tag_of(si: usize, ui: usize, k: usize, j: u64) -> u64 {
    ((si as u64 + 1) << 52) | ((ui as u64) << 28) | ((k as u64) << 20) | j
}

/// Where a rank's weights are: gathered stacks for streamed storages, the fixed placement for the rest.
struct RankSource<'a> {
    stacks: &'a [Arc<BlockStack>],
    locations: HashMap<StorageId, (usize, usize, u64)>,
    fixed: &'a ResidentPlacement,
}

impl WeightSource for RankSource<'_> {
    fn locate(&self, storage: StorageId) -> Result<(DeviceBufferId, u64), OffloadError> {
        match self.locations.get(&storage) {
            Some(&(si, ui, off)) => match self.stacks.get(si).and_then(|s| s.location(ui)) {
                Some(loc) => Ok((loc.buffer, loc.offset + off)),
                None => Err(OffloadError::NotResident {
                    storage: storage.0,
                    reason: "its block is not gathered (call pre_forward on the module first)".into(),
                }),
            },
            None => self.fixed.locate(storage),
        }
    }
}

/// What a rank allocated, released in reverse order whatever happened.
#[derive(Default)]
struct RankParts {
    stream: Option<StreamHandle>,
    collective: Option<CollectiveHandle>,
    fixed: Option<ResidentPlacement>,
    masters: Vec<ShardedMasters>,
    stacks: Vec<Arc<BlockStack>>,
    /// Per stack, the layouts of the units in `masters` (same order).
    layouts: Vec<Vec<UnitLayout>>,
    /// The rank's gather numbering (the restore continues it).
    sequence: Option<GatherSequence>,
    /// Storages released to the shards, in release order.
    released: Vec<StorageId>,
}

/// Runs rank `rank` of a `world`-rank distributed layerwise run of `spec` on `platform`: this process's (or this
/// thread's) part of the group. Generic over the platform: the simulated device with a
/// [`SimCollective`](weightferry_actors::collective::SimCollective) (as
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
/// [`WARM_UP_TAG`](weightferry_actors::collective_actor::WARM_UP_TAG), before anything else is gathered: NCCL's
/// first AllGather on a new communicator takes about 2.5 s, which must not land inside the first step), runs
/// `spec.steps` steps through gather-path block stacks, restores what it released
/// ([`DistributedRunSpec::release_loaded`]) and releases everything before returning, success or not.
/// [`RankRun::hazard_violations`] is left at 0: a caller on the simulated device fills it in from its platform.
///
/// Errors: an invalid spec or mismatched rank / world ([`DistributedRunError::Invalid`]); any failure of the
/// run. When an AllGather failed to start on this rank — or, with `release_loaded`, when the collective turns out
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
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(spec.pipeline.clone()), spec.seed)?;
    let result = run_rank_with_model(platform, compute, collective, rank, world, spec, &mut model);
    model.release();
    result
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

/// [`run_rank`] on the caller's `model` instead of a fresh one: `model` must hold `spec.pipeline` with synthetic
/// weights of `spec.seed`, loaded on `platform` (so one weight generation serves this run and a resident baseline
/// on the same device, see [`resident_run_with_model`]; run the baseline first, while every storage is loaded).
/// Without [`DistributedRunSpec::release_loaded`] the model is only read and left as it was. With it, the streamed
/// DiT storages are released while the run executes and restored bit-exactly at its end; if the collective is
/// poisoned (the error is then [`DistributedRunError::Poisoned`]) or the restore fails on this rank
/// ([`DistributedRunError::RestoreFailed`]), the storages not restored stay [`Home::Sharded`] — reading them is a
/// typed error — and the pipeline must be reloaded. Everything else this rank allocated is released before
/// returning, success or not.
pub fn run_rank_with_model(
    platform: PlatformRef,
    compute: Arc<dyn Compute>,
    collective: CollectiveFactory,
    rank: usize,
    world: usize,
    spec: &DistributedRunSpec,
    model: &mut HostModel,
) -> Result<RankRun, DistributedRunError> {
    check_rank(rank, world, spec)?;
    let mut parts = RankParts::default();
    let result = rank_run(spec, (rank, world), &platform, compute, model, collective, &mut parts);
    let mut poisoned = parts.collective.as_ref().and_then(|c| c.poisoned());
    let mut disabled = None;
    let mut restore: Result<Vec<(u64, u64)>, (usize, String)> = Ok(Vec::new());
    if !parts.released.is_empty() {
        // The stacks' slots go first: the restore needs one unit's worth of device memory of its own.
        for s in &parts.stacks {
            if let Err(e) = s.disable() {
                disabled.get_or_insert(DistributedRunError::from(OffloadError::from(e)));
            }
        }
        if poisoned.is_none() {
            match restore_rank(&platform, &mut parts, model) {
                Ok(issued) => restore = Ok(issued),
                Err(RestoreFailure::Collective(cause)) => poisoned = Some(cause),
                Err(RestoreFailure::Local(e)) => {
                    let unrestored = parts.released.iter().filter(|s| model.home(**s) == Some(Home::Sharded)).count();
                    restore = Err((unrestored, e.to_string()));
                }
            }
        }
    }
    let released = !parts.released.is_empty();
    let unrestored = parts.released.iter().filter(|s| model.home(**s) == Some(Home::Sharded)).count();
    let windowed = parts.collective.as_ref().map(|c| c.windowed_gathers());
    let cleanup = release(&platform, parts);
    let cleanup = match (disabled, cleanup) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(()),
    };
    let run = match (result, cleanup) {
        (Ok(run), Ok(())) => Ok(run),
        (Err(e), _) | (Ok(_), Err(e)) => Err(e),
    };
    match (run, poisoned, restore) {
        (Err(e), Some(cause), _) => Err(DistributedRunError::Poisoned { rank, cause, run: e.to_string() }),
        // Released weights that a poisoned collective cannot bring back: the run's output is no use either.
        (Ok(_), Some(cause), _) if released => Err(DistributedRunError::Poisoned {
            rank,
            cause,
            run: format!("the run finished, but {unrestored} released DiT storage(s) cannot be restored"),
        }),
        (run, _, Err((unrestored, cause))) => {
            let run = run.err().map_or_else(String::new, |e| format!("the run failed with: {e}; "));
            Err(DistributedRunError::RestoreFailed { rank, unrestored, cause, run })
        }
        (Ok(mut run), _, Ok(issued)) => {
            run.restore_issued = issued;
            run.windowed_all_gathers = windowed.unwrap_or(run.windowed_all_gathers);
            Ok(run)
        }
        (Err(e), _, Ok(_)) => Err(e),
    }
}

/// The final gather to host of everything the rank released, if its collective is still usable: a fence first
/// (it fails on an AllGather that failed on the device, a poisoned actor, or a gap in the gather order — then no
/// restore collective is issued), then [`restore_released`]. Returns the restore's `(sequence number, tag)`s.
fn restore_rank(
    platform: &PlatformRef,
    parts: &mut RankParts,
    model: &mut HostModel,
) -> Result<Vec<(u64, u64)>, RestoreFailure> {
    let (Some(collective), Some(sequence)) = (parts.collective.clone(), parts.sequence.clone()) else {
        let gone = PlatformError::Driver("the run stopped before its collective existed".into());
        return Err(RestoreFailure::Collective(gone));
    };
    collective.fence().map_err(|e| RestoreFailure::Collective(e.into()))?;
    let before = collective.issued().len();
    let result = restore_released(platform, &collective, &sequence, &mut parts.masters, &parts.layouts, model);
    let issued = collective.issued().split_off(before);
    result.map(|()| issued)
}

fn release(platform: &PlatformRef, parts: RankParts) -> Result<(), DistributedRunError> {
    let mut first: Option<DistributedRunError> = None;
    for s in parts.stacks {
        if let Err(e) = s.disable() {
            first.get_or_insert(OffloadError::from(e).into());
        }
    }
    if let Some(c) = parts.collective {
        c.shutdown();
    }
    if let Some(s) = parts.stream {
        s.shutdown();
    }
    if let Some(mut f) = parts.fixed {
        if let Err(e) = f.release() {
            first.get_or_insert(e.into());
        }
    }
    for m in parts.masters {
        if let Err(e) = m.free(platform) {
            first.get_or_insert(e.into());
        }
    }
    match first {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn rank_run(
    spec: &DistributedRunSpec,
    (rank, world): (usize, usize),
    platform: &PlatformRef,
    compute: Arc<dyn Compute>,
    model: &mut HostModel,
    make_collective: CollectiveFactory,
    parts: &mut RankParts,
) -> Result<RankRun, DistributedRunError> {
    let desc = &spec.pipeline;
    let config = OffloadConfig::from_json_str(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
            "layer_options": {{"dit": {{"prefetch_depth": {}}}}}}}}}"#,
        spec.depth
    ))
    .map_err(|e| DistributedRunError::Invalid(format!("distributed run config: {e}")))?;
    let plan = resolve_offload_plan(desc, &config).map_err(OffloadError::from)?;
    let units = build_unit_plan(desc, &config, &plan);
    if units.stacks.is_empty() {
        return Err(DistributedRunError::Invalid("the plan streams no DiT stack".into()));
    }
    if let Some(sp) = units.stacks.iter().find(|s| s.depth == 0) {
        return Err(DistributedRunError::Invalid(format!("stack '{}' is staged, not layerwise", sp.name)));
    }
    if units.stacks.len() > MAX_STACKS {
        return Err(DistributedRunError::Invalid(format!(
            "the plan streams {} DiT stacks; a distributed run gathers at most {MAX_STACKS}",
            units.stacks.len()
        )));
    }
    let mut engine = Engine::new(compute, desc)?;
    let collective = CollectiveHandle::spawn(platform.clone(), COMM_STREAM, make_collective)?;
    parts.collective = Some(collective.clone());
    if (collective.rank(), collective.world()) != (rank, world) {
        return Err(DistributedRunError::Invalid(format!(
            "the communicator is rank {} of {} ranks, but this is rank {rank} of {world}; build it from the same \
             rank and world size",
            collective.rank(),
            collective.world()
        )));
    }
    let sequence = GatherSequence::new();
    parts.sequence = Some(sequence.clone());
    collective.warm_up(sequence.claim(1))?;
    let stream = StreamHandle::spawn(platform.clone(), "copy", StreamOptions::default()).map_err(OffloadError::from)?;
    parts.stream = Some(stream.clone());
    let upload = platform.create_stream("placement")?;
    parts.fixed = Some(ResidentPlacement::upload(platform, model, &units.fixed, upload)?);

    // With `release_loaded`, a storage is released once the last unit holding it has its shards.
    let mut last_unit: HashMap<StorageId, (usize, usize)> = HashMap::new();
    for (si, sp) in units.stacks.iter().enumerate() {
        for (ui, unit) in sp.units.iter().enumerate() {
            for s in unit.storages() {
                last_unit.insert(s, (si, ui));
            }
        }
    }
    let mut dit_storages: Vec<StorageId> = last_unit.keys().copied().collect();
    dit_storages.sort_unstable();
    let mut released_bytes = 0u64;
    let mut locations = HashMap::new();
    let (mut full, mut sections, mut pass_shard) = (0u64, 0u64, 0u64);
    for (si, sp) in units.stacks.iter().enumerate() {
        parts.masters.push(ShardedMasters { rank, world, units: Vec::with_capacity(sp.units.len()) });
        parts.layouts.push(Vec::with_capacity(sp.units.len()));
        for (ui, unit) in sp.units.iter().enumerate() {
            let kind = HostMemoryKind::Pinned;
            let built = build_sharded_masters(model, std::slice::from_ref(unit), world, rank, kind, spec.chunk_bytes)?;
            parts.masters[si].units.extend(built.units);
            parts.layouts[si].push(unit.clone());
            if spec.release_loaded {
                for s in unit.storages() {
                    if last_unit.get(&s) == Some(&(si, ui)) && matches!(model.home(s), Some(Home::Loaded { .. })) {
                        model.release_to_shards(s)?;
                        parts.released.push(s);
                        released_bytes += model.storage_bytes(s);
                    }
                }
            }
        }
        let gather_blocks: Vec<GatherBlock> = parts.masters[si]
            .units
            .iter()
            .enumerate()
            .map(|(ui, u)| GatherBlock {
                sections: u
                    .sections
                    .iter()
                    .enumerate()
                    .flat_map(|(k, s)| {
                        s.spec.chunks().map(move |c| GatherSection {
                            host: s.host,
                            host_offset: c.shard_offset,
                            shard_bytes: c.shard_bytes,
                            output_offset: s.device_offset + c.gathered_offset,
                            tag: tag_of(si, ui, k, c.index),
                        })
                    })
                    .collect(),
            })
            .collect();
        pass_shard += gather_blocks.iter().flat_map(|b| &b.sections).map(|s| s.shard_bytes).sum::<u64>();
        for (ui, unit) in sp.units.iter().enumerate() {
            for sec in &unit.sections {
                full += sec.len;
                sections += 1;
                for &(s, off) in &sec.storages {
                    locations.insert(s, (si, ui, sec.device_offset + off));
                }
            }
        }
        let stack_spec = StackSpec {
            name: sp.name.clone(),
            blocks: sp.units.iter().map(|u| BlockSpec { segments: Vec::new(), device_bytes: u.device_bytes }).collect(),
            resident_head: 0,
            prefetch_depth: sp.depth,
            eager_prefetch: false,
            ordering_fault: Default::default(),
            submission: Default::default(),
        };
        let path = GatherPath { collective: collective.clone(), sequence: sequence.clone(), blocks: gather_blocks };
        let stack = BlockStack::with_gather(
            platform.clone(),
            stack_spec,
            Some(vec![false; sp.units.len()]),
            engine.stream(),
            stream.clone(),
            path,
        )
        .map_err(OffloadError::from)?;
        parts.stacks.push(Arc::new(stack));
    }
    let hooks = HookRegistry::new();
    hooks.claim_offload(DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK).map_err(OffloadError::from)?;
    let mut jitter_state = spec.jitter.map(|j| j.state(rank));
    for (si, sp) in units.stacks.iter().enumerate() {
        for (ui, unit) in sp.units.iter().enumerate() {
            let mut hook: Arc<dyn ModelHook> = Arc::new(StackHook { stack: parts.stacks[si].clone(), unit: ui });
            if let (Some(j), Some(st)) = (&spec.jitter, jitter_state.as_mut()) {
                let state = std::sync::Mutex::new(splitmix64(st));
                hook = Arc::new(JitterHook { inner: hook, state, max: j.max_hook_sleep });
            }
            let name = DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK;
            hooks.register(&unit.path, name, name, hook).map_err(OffloadError::from)?;
        }
    }
    let Some(fixed) = parts.fixed.as_ref() else {
        return Err(DistributedRunError::Invalid("fixed placement missing".into()));
    };
    let source = RankSource { stacks: &parts.stacks, locations, fixed };
    let shard_host_bytes: u64 = parts.masters.iter().map(|m| m.host_bytes()).sum();
    let model: &HostModel = model;
    let still_held = |s: &&StorageId| matches!(model.home(**s), Some(Home::Loaded { .. } | Home::Master { .. }));
    let dit_host_bytes =
        shard_host_bytes + dit_storages.iter().filter(still_held).map(|s| model.storage_bytes(*s)).sum::<u64>();
    let probed = std::cell::Cell::new(false);
    let run = |steps: u32| -> Result<(Duration, Vec<u8>), EngineError> {
        let opts =
            ExecOptions { steps, input_seed: spec.seed, skip_seed: None, span_epoch: None, max_blocks_ahead: None };
        let t = Instant::now();
        let mut progress = |p: crate::engine::Progress<'_>| {
            if let (Some(probe), Phase::Dit, false) = (&spec.probe, p.phase, probed.get()) {
                probed.set(true);
                let dit_storages = &dit_storages;
                (probe.0)(&RunningRank { rank, model, dit_storages, shard_host_bytes, dit_host_bytes });
            }
        };
        let out = engine.execute(&source, &hooks, &opts, &mut progress)?;
        Ok((t.elapsed(), out.output))
    };
    let h2d = || parts.stacks.iter().map(|s| s.stats().h2d_bytes).sum::<u64>();
    let dit_roots: Vec<String> = desc.components.as_ref().map_or_else(Vec::new, |c| c.dit.clone());
    // Timed: every execution runs through the same stacks (the shard masters are built once, above).
    let result = match spec.timed_steps {
        None => run(spec.steps).map(|(_, output)| (output, None, None)),
        Some(steps) => (|| {
            run(1)?;
            let b0 = h2d();
            let (t_lo, _) = run(steps.0)?;
            let b1 = h2d();
            let (t_hi, mut output) = run(steps.1)?;
            let b2 = h2d();
            let rounds = more_rounds(steps, (t_lo, t_hi), spec.timed_rounds, run, &mut output)?;
            let shard = bytes_per_step(steps, b0, b1, b2);
            let full_per_step = if pass_shard == 0 {
                0
            } else {
                u64::try_from(u128::from(shard) * u128::from(full) / u128::from(pass_shard)).unwrap_or(u64::MAX)
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
                    let (_, spans, dropped) =
                        trace_execution(tracer.0.as_ref(), engine.stream(), TRACE_CAPACITY, || run(steps.0))?;
                    let summary = summarize(&spans, |label| in_modules(label, &dit_roots));
                    Some(RankTrace { steps: steps.0, spans, dropped, summary })
                }
                None => None,
            };
            Ok((output, Some(timing), trace))
        })(),
    };
    hooks.remove_owned_by(DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK);
    let released = engine.release();
    let (output, timing, trace) = result?;
    released?;
    for s in &parts.stacks {
        s.fence().map_err(OffloadError::from)?;
    }
    Ok(RankRun {
        rank,
        output,
        issued: collective.issued(),
        hazard_violations: 0,
        shard_host_bytes,
        dit_host_bytes_while_running: dit_host_bytes,
        released_bytes,
        restore_issued: Vec::new(),
        full_section_bytes: full,
        sections,
        h2d_bytes: parts.stacks.iter().map(|s| s.stats().h2d_bytes).sum(),
        windowed_all_gathers: collective.windowed_gathers(),
        timing,
        trace,
    })
}
