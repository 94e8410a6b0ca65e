//! The reference engine: runs a pipeline description with deterministic synthetic weights and real compute per
//! module, exactly as a host engine would drive the offload hooks.
//!
//! - [`program`]: the execution order (components, block lists, non-block children) computed from the description.
//! - [`math`]: what one module does to the activations (matrix products, bounded mixing, byte hashing).
//! - [`compute`]: the [`compute::Compute`] trait kernels are enqueued through, and its sim implementation.
//! - [`synthetic`]: the deterministic synthetic weights the engine runs on when no checkpoint is given.
//! - `cuda` (feature `cuda`): the GPU engine's compute, cuBLAS GEMMs over the module's real weights; `slow`: a
//!   platform whose copies are slowed behind dummy ones (a check that the hazards are real on a GPU).
//! - [`timing`]: per-step time and bytes from two executions, and the median of repeated runs.
//! - [`timeline`]: device timelines (GPU timing spans) summarised into compute busy time, stalls and copy overlap.
//!
//! [`Engine`] owns the compute stream and the activation buffers (allocated at construction, before any offload is
//! enabled, so they are never counted as weight memory). [`Engine::execute`] runs encoders → DiT × steps → VAE,
//! calling `pre_forward` / `post_forward` around every component, every entered module and every block, and
//! enqueueing one kernel per block or non-block module whose weight ranges come from a
//! [`WeightSource`] looked up between the hooks. The output is the latent matrix read
//! back after the compute stream is synchronised.

pub mod compute;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod math;
pub mod program;
#[cfg(feature = "cuda")]
pub mod slow;
pub mod synthetic;
pub mod timeline;
pub mod timing;

use compute::{Activations, Compute, ModuleKernel, WeightRange};
use math::Phase;
use program::{ComponentProgram, Op, Program};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use synthetic::splitmix64;
use weightferry::hooks::{HookError, HookRegistry, Residency};
use weightferry::model::{fnv1a, ModelError, FNV_OFFSET};
use weightferry::offload::{OffloadError, WeightSource};
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::scheduler::{EventId, PlatformError, PlatformRef, StreamId};

/// Errors of the reference engine and the run driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The platform failed (allocation, stream, kernel).
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// A hook failed.
    #[error(transparent)]
    Hook(#[from] HookError),
    /// The offload backend failed.
    #[error(transparent)]
    Offload(#[from] OffloadError),
    /// The library session could not be opened or driven.
    #[error(transparent)]
    Session(#[from] weightferry::session::SessionError),
    /// The input cannot be run (pipeline too large for the reference engine, nothing to run, bad options).
    #[error("{0}")]
    Invalid(String),
    /// A check failed in a way that leaves no result (e.g. weights could not be read back).
    #[error("{0}")]
    Failed(String),
    /// The host model could not be read: a storage is released to the shards of a distributed run, or cannot move
    /// between homes. (A platform failure reading it is [`EngineError::Platform`].)
    #[error(transparent)]
    Model(ModelError),
}

impl From<ModelError> for EngineError {
    /// A platform failure stays one; every other model error is [`EngineError::Model`].
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Platform(p) => EngineError::Platform(p),
            other => EngineError::Model(other),
        }
    }
}

/// Options of one execution.
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    /// DiT passes.
    pub steps: u32,
    /// Seed of the initial activations.
    pub input_seed: u64,
    /// Seed of the skip pattern (a step cache): `None` runs every block.
    pub skip_seed: Option<u64>,
    /// Record hook spans relative to this instant (for traces).
    pub span_epoch: Option<Instant>,
    /// Bound how far the host runs ahead of the device: before launching a block, wait until the block launched
    /// this many blocks earlier has finished (`None`: run ahead until the driver's launch queue pushes back, as
    /// eager frameworks do). Changes no result, only where the host waits.
    pub max_blocks_ahead: Option<u32>,
}

/// Which hook a span is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HookKind {
    /// `pre_forward`.
    Pre,
    /// `post_forward`.
    Post,
}

/// One hook call on the engine thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookSpan {
    /// Module path.
    pub module: String,
    /// Pre or post.
    pub kind: HookKind,
    /// Start, since the span epoch.
    pub start: Duration,
    /// Wall time of the call.
    pub duration: Duration,
}

/// What an execution produced.
#[derive(Debug, Clone, Default)]
pub struct ExecOutput {
    /// The final latent matrix (little-endian `f32`).
    pub output: Vec<u8>,
    /// FNV-1a of `output`.
    pub checksum: u64,
    /// Wall time of each `pre_forward` + `post_forward` pair of a component or block.
    pub hook_latencies: Vec<Duration>,
    /// Every hook call, when a span epoch was given.
    pub hook_spans: Vec<HookSpan>,
    /// Kernels enqueued (activation fills excluded).
    pub kernels: u64,
    /// Blocks run.
    pub blocks_run: u64,
    /// Blocks skipped by the skip pattern.
    pub blocks_skipped: u64,
    /// Wall time of the execution (until the output was read back).
    pub wall: Duration,
}

/// Where an execution is, for progress indicators.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// Phase being run.
    pub phase: Phase,
    /// Component path.
    pub component: &'a str,
    /// DiT step (0-based; 0 outside the DiT phase).
    pub step: u32,
    /// DiT steps in all.
    pub steps: u32,
}

/// Whether the skip pattern of `seed` skips block `block` in DiT pass `pass`. Pass 0 never skips; later passes
/// skip about a third of their blocks.
pub fn skips_block(seed: u64, pass: u32, block: usize) -> bool {
    if pass == 0 {
        return false;
    }
    let mut st = seed ^ (u64::from(pass) << 32) ^ (block as u64).wrapping_mul(0x2545_F491_4F6C_DD1D);
    splitmix64(&mut st) % 3 == 0
}

/// The reference engine for one pipeline on one compute device.
#[derive(Debug)]
pub struct Engine {
    compute: Arc<dyn Compute>,
    program: Program,
    storage_len: HashMap<StorageId, u64>,
    stream: StreamId,
    acts: Option<Activations>,
}

impl Engine {
    /// Builds the program of `desc`, creates the compute stream and allocates the activations.
    pub fn new(compute: Arc<dyn Compute>, desc: &PipelineDesc) -> Result<Engine, EngineError> {
        let stream = compute.platform().create_stream("compute")?;
        Self::on_stream(compute, desc, stream)
    }

    /// [`new`](Self::new) on a compute stream the caller created on `compute`'s platform (the one a library
    /// session orders its copies against).
    pub fn on_stream(compute: Arc<dyn Compute>, desc: &PipelineDesc, stream: StreamId) -> Result<Engine, EngineError> {
        let program = Program::build(desc);
        if program.components().next().is_none() {
            return Err(EngineError::Invalid(format!(
                "pipeline {} has no DiT, encoder or VAE component to run; declare `components` in the pipeline",
                desc.class
            )));
        }
        let platform = compute.platform();
        let latent = platform.alloc_device(compute.activation_bytes(Phase::Dit))?;
        let context = match platform.alloc_device(compute.activation_bytes(Phase::Encoder)) {
            Ok(c) => c,
            Err(e) => {
                let _ = platform.free_device(latent);
                return Err(e.into());
            }
        };
        let storage_len = desc.storages.iter().map(|(id, s)| (*id, s.byte_size())).collect();
        Ok(Engine { compute, program, storage_len, stream, acts: Some(Activations { latent, context }) })
    }

    /// The engine's compute stream (offload backends make it wait on their ready events).
    pub fn stream(&self) -> StreamId {
        self.stream
    }
    /// The execution program.
    pub fn program(&self) -> &Program {
        &self.program
    }
    /// Device bytes of the activations.
    pub fn activation_bytes(&self) -> u64 {
        self.compute.activation_bytes(Phase::Dit)
            + self.compute.activation_bytes(Phase::Encoder)
            + self.compute.workspace_bytes()
    }
    /// The activation buffers (`None` after [`Engine::release`]).
    pub fn activations(&self) -> Option<Activations> {
        self.acts
    }

    /// Runs the pipeline once: encoders, the DiT for `opts.steps` passes, the VAE. Weights are located through
    /// `source` between each module's hooks. Returns the output read back after the compute stream finished.
    pub fn execute(
        &self,
        source: &dyn WeightSource,
        hooks: &HookRegistry,
        opts: &ExecOptions,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<ExecOutput, EngineError> {
        let acts = self.acts.ok_or_else(|| EngineError::Invalid("the engine was released".into()))?;
        let start = Instant::now();
        let platform = self.compute.platform();
        let mut ahead = AheadRing::default();
        if let Some(k) = opts.max_blocks_ahead.filter(|k| *k > 0) {
            for _ in 0..k {
                match platform.create_event() {
                    Ok(e) => ahead.free.push(e),
                    Err(e) => {
                        ahead.destroy(&platform);
                        return Err(e.into());
                    }
                }
            }
        }
        let mut run =
            Run { engine: self, source, hooks, opts, acts, out: ExecOutput::default(), ahead, placed: Vec::new() };
        let result = run.all(progress);
        let mut ahead = std::mem::take(&mut run.ahead);
        if let Err(e) = result {
            // Leave no kernel of ours running behind the caller's cleanup.
            let _ = platform.stream_synchronize(self.stream);
            ahead.destroy(&platform);
            return Err(e);
        }
        let mut out = run.out;
        // `read_back` waits for the compute stream first, so the run-ahead events are idle when destroyed.
        let read = self.compute.read_back(self.stream, acts.latent, self.compute.activation_bytes(Phase::Dit));
        ahead.destroy(&platform);
        out.output = read?;
        out.checksum = fnv1a(FNV_OFFSET, &out.output);
        out.wall = start.elapsed();
        Ok(out)
    }

    /// Waits for the compute stream and frees the activations, also when the stream failed (a failed stream has
    /// drained: nothing still runs on them); returns the first error. Idempotent.
    pub fn release(&mut self) -> Result<(), EngineError> {
        if let Some(a) = self.acts.take() {
            let platform = self.compute.platform();
            let synced = platform.stream_synchronize(self.stream);
            let latent = platform.free_device(a.latent);
            let context = platform.free_device(a.context);
            synced?;
            latent?;
            context?;
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// Events marking the ends of the last launched blocks, for [`ExecOptions::max_blocks_ahead`].
#[derive(Default)]
struct AheadRing {
    free: Vec<EventId>,
    in_flight: std::collections::VecDeque<EventId>,
}

impl AheadRing {
    fn destroy(&mut self, platform: &PlatformRef) {
        for e in self.free.drain(..).chain(self.in_flight.drain(..)) {
            let _ = platform.destroy_event(e);
        }
    }
}

/// State of one execution.
struct Run<'a> {
    engine: &'a Engine,
    source: &'a dyn WeightSource,
    hooks: &'a HookRegistry,
    opts: &'a ExecOptions,
    acts: Activations,
    out: ExecOutput,
    ahead: AheadRing,
    /// Residencies of the modules whose forward is open (innermost last), as their `pre_forward` returned them.
    placed: Vec<Option<Residency>>,
}

impl Run<'_> {
    fn all(&mut self, progress: &mut dyn FnMut(Progress<'_>)) -> Result<(), EngineError> {
        let compute = &self.engine.compute;
        let stream = self.engine.stream;
        compute.fill(stream, self.acts.latent, compute.initial_activation(Phase::Dit, self.opts.input_seed))?;
        compute.fill(stream, self.acts.context, compute.initial_activation(Phase::Encoder, self.opts.input_seed))?;
        let program = &self.engine.program;
        let steps = self.opts.steps;
        for c in &program.encoders {
            progress(Progress { phase: Phase::Encoder, component: &c.path, step: 0, steps });
            self.component(c, None)?;
        }
        for step in 0..steps {
            for c in &program.dits {
                progress(Progress { phase: Phase::Dit, component: &c.path, step, steps });
                self.component(c, Some(step))?;
            }
        }
        for c in &program.vaes {
            progress(Progress { phase: Phase::Vae, component: &c.path, step: 0, steps });
            self.component(c, None)?;
        }
        Ok(())
    }

    /// Runs one hook and returns its wall time. Every `pre_forward` pushes the residency it returned (if any) and
    /// the matching `post_forward` pops it (the program's pre/post calls nest), so kernels find their block's weights
    /// without asking the source.
    fn hook(&mut self, module: &str, kind: HookKind) -> Result<Duration, EngineError> {
        let t0 = Instant::now();
        let r = match kind {
            HookKind::Pre => self.hooks.pre_forward(module),
            HookKind::Post => self.hooks.post_forward(module).map(|()| None),
        };
        let d = t0.elapsed();
        if let Some(epoch) = self.opts.span_epoch {
            self.out.hook_spans.push(HookSpan {
                module: module.to_string(),
                kind,
                start: t0.saturating_duration_since(epoch),
                duration: d,
            });
        }
        let placed = r?;
        match kind {
            HookKind::Pre => self.placed.push(placed),
            HookKind::Post => {
                self.placed.pop();
            }
        }
        Ok(d)
    }

    fn component(&mut self, c: &ComponentProgram, pass: Option<u32>) -> Result<(), EngineError> {
        let pre = self.hook(&c.path, HookKind::Pre)?;
        for op in &c.ops {
            match op {
                Op::Enter(path) => {
                    self.hook(path, HookKind::Pre)?;
                }
                Op::Exit(path) => {
                    self.hook(path, HookKind::Post)?;
                }
                Op::Kernel(k) => {
                    if let (Some(b), Some(pass), Some(seed)) = (k.block, pass, self.opts.skip_seed) {
                        if skips_block(seed, pass, b) {
                            self.out.blocks_skipped += 1;
                            continue;
                        }
                    }
                    if !k.hooked {
                        self.launch(c.phase, k)?;
                        continue;
                    }
                    if k.block.is_some() {
                        self.wait_for_room()?;
                    }
                    let pre = self.hook(&k.path, HookKind::Pre)?;
                    self.launch(c.phase, k)?;
                    let post = self.hook(&k.path, HookKind::Post)?;
                    if k.block.is_some() {
                        self.mark_block_end()?;
                        self.out.blocks_run += 1;
                        self.out.hook_latencies.push(pre + post);
                    }
                }
            }
        }
        let post = self.hook(&c.path, HookKind::Post)?;
        self.out.hook_latencies.push(pre + post);
        Ok(())
    }

    /// With a run-ahead bound, waits (on the host) until a block's end event is free.
    fn wait_for_room(&mut self) -> Result<(), EngineError> {
        if self.ahead.free.is_empty() {
            if let Some(e) = self.ahead.in_flight.pop_front() {
                self.engine.compute.platform().event_synchronize(e)?;
                self.ahead.free.push(e);
            }
        }
        Ok(())
    }

    /// With a run-ahead bound, records the end of the block just launched.
    fn mark_block_end(&mut self) -> Result<(), EngineError> {
        if let Some(e) = self.ahead.free.pop() {
            self.engine.compute.platform().record_event(e, self.engine.stream)?;
            self.ahead.in_flight.push_back(e);
        }
        Ok(())
    }

    fn launch(&mut self, phase: Phase, k: &program::KernelItem) -> Result<(), EngineError> {
        let mut weights = Vec::with_capacity(k.storages.len());
        for &s in &k.storages {
            let len = self.engine.storage_len.get(&s).copied().unwrap_or(0);
            if len == 0 {
                weights.push(WeightRange { storage: s, buffer: self.acts.latent, offset: 0, len: 0 });
                continue;
            }
            let placed = self.placed.iter().rev().flatten().find_map(|r| r.locate(s));
            let (buffer, offset) = match placed {
                Some(p) => p,
                None => self.source.locate(s)?,
            };
            weights.push(WeightRange { storage: s, buffer, offset, len });
        }
        let kernel =
            ModuleKernel { label: k.path.clone(), phase, tensors: k.tensors.clone(), weights, activations: self.acts };
        self.engine.compute.launch_module(self.engine.stream, kernel)?;
        self.out.kernels += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::synthetic::SyntheticWeights;
    use super::*;
    use std::sync::Mutex;
    use weightferry::hooks::ModelHook;
    use weightferry::model::HostModel;
    use weightferry::offload::ResidentPlacement;
    use weightferry::pipeline::presets::preset;
    use weightferry::scheduler::{SimConfig, SimPlatform};

    struct Rec(Arc<Mutex<Vec<String>>>);
    impl ModelHook for Rec {
        fn pre_forward(
            &self,
            m: &str,
        ) -> Result<Option<weightferry::hooks::Residency>, weightferry::hooks::HookFailure> {
            self.0.lock().unwrap().push(format!("pre {m}"));
            Ok(None)
        }
        fn post_forward(&self, m: &str) -> Result<(), weightferry::hooks::HookFailure> {
            self.0.lock().unwrap().push(format!("post {m}"));
            Ok(())
        }
    }

    #[test]
    fn hooks_wrap_components_and_blocks_and_skips_are_silent() {
        let desc = Arc::new(preset("flux-tiny").unwrap());
        let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
        let platform: weightferry::scheduler::PlatformRef = sim.clone();
        let model = HostModel::synthetic(platform.clone(), desc.clone(), 0).unwrap();
        let mut engine = Engine::new(Arc::new(compute::SimCompute::new(sim.clone())), &desc).unwrap();
        let up = platform.create_stream("up").unwrap();
        let all: Vec<StorageId> = desc.storages.keys().copied().collect();
        let mut placement = ResidentPlacement::upload(&platform, &model, &all, up).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let hooks = HookRegistry::new();
        for m in ["transformer", "transformer.transformer_blocks.1", "vae", "text_encoder.encoder.block.0"] {
            hooks.register(m, "rec", "test", Arc::new(Rec(log.clone()))).unwrap();
        }
        let seed = (0..100u64).find(|&s| skips_block(s, 1, 1) && !skips_block(s, 2, 1)).unwrap();
        let opts =
            ExecOptions { steps: 3, input_seed: 0, skip_seed: Some(seed), span_epoch: None, max_blocks_ahead: None };
        let out = engine.execute(&placement, &hooks, &opts, &mut |_| {}).unwrap();
        let got = log.lock().unwrap().clone();
        let b1 = ["pre transformer.transformer_blocks.1", "post transformer.transformer_blocks.1"];
        let t = ["pre transformer", "post transformer"];
        let mut want = vec!["pre text_encoder.encoder.block.0", "post text_encoder.encoder.block.0"];
        want.extend([t[0], b1[0], b1[1], t[1]]); // step 0
        want.extend(t); // step 1: block 1 skipped
        want.extend([t[0], b1[0], b1[1], t[1]]); // step 2
        want.extend(["pre vae", "post vae"]);
        assert_eq!(got, want);
        assert!(out.blocks_skipped > 0);
        assert_eq!(out.blocks_run + out.blocks_skipped, 3 * 57 + 24 + 8);
        // The same inputs give the same bits; the skip pattern changes them.
        let again = engine.execute(&placement, &hooks, &opts, &mut |_| {}).unwrap();
        assert_eq!(again.output, out.output);
        let full = ExecOptions { skip_seed: None, ..opts };
        let full_sum = engine.execute(&placement, &hooks, &full, &mut |_| {}).unwrap().checksum;
        assert_ne!(full_sum, out.checksum);
        // Bounding the host's run-ahead changes where the host waits, not a bit of the output.
        for k in [1, 3] {
            let bounded = ExecOptions { max_blocks_ahead: Some(k), ..opts.clone() };
            assert_eq!(engine.execute(&placement, &hooks, &bounded, &mut |_| {}).unwrap().output, out.output);
        }
        assert!(sim.violations().is_empty());
        // One stale byte in one weight of one block (the low mantissa byte of a bf16 bias element) changes the output.
        let blk = desc.module("transformer.single_transformer_blocks.30.linear2").unwrap();
        let bias = blk.tensors.iter().find(|t| t.name == "bias").unwrap();
        let (buf, off) = placement.locate(bias.storage).unwrap();
        let at = off + 2 * (bias.numel() - 1);
        let mut b = [0u8; 1];
        sim.read_device(buf, at, &mut b).unwrap();
        sim.write_device(buf, at, &[b[0] ^ 0x01]).unwrap();
        assert_ne!(engine.execute(&placement, &hooks, &full, &mut |_| {}).unwrap().checksum, full_sum);
        engine.release().unwrap();
        placement.release().unwrap();
    }

    /// Asks the wrapped source and records which storages it was asked for.
    struct Counting<'a>(&'a dyn WeightSource, Mutex<Vec<StorageId>>);
    impl WeightSource for Counting<'_> {
        fn locate(
            &self,
            s: StorageId,
        ) -> Result<(weightferry::scheduler::DeviceBufferId, u64), weightferry::offload::OffloadError> {
            self.1.lock().unwrap().push(s);
            self.0.locate(s)
        }
    }

    #[test]
    fn streamed_weights_are_found_from_pre_forward_without_asking_the_backend() {
        use weightferry::config::OffloadConfig;
        use weightferry::offload::get_offload_backend;
        use weightferry::offload::units::build_unit_plan;
        use weightferry::plan::resolve_offload_plan;
        let desc = Arc::new(preset("flux-tiny").unwrap());
        let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
        let platform: weightferry::scheduler::PlatformRef = sim.clone();
        let mut model = HostModel::synthetic(platform.clone(), desc.clone(), 3).unwrap();
        let mut engine = Engine::new(Arc::new(compute::SimCompute::new(sim.clone())), &desc).unwrap();
        let opts = ExecOptions { steps: 2, input_seed: 1, skip_seed: None, span_epoch: None, max_blocks_ahead: None };
        let up = platform.create_stream("up").unwrap();
        let all: Vec<StorageId> = desc.storages.keys().copied().collect();
        let mut placement = ResidentPlacement::upload(&platform, &model, &all, up).unwrap();
        let resident = engine.execute(&placement, &HookRegistry::new(), &opts, &mut |_| {}).unwrap();
        placement.release().unwrap();
        let config = OffloadConfig::from_json_str(
            r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder", "vae"]}}"#,
        )
        .unwrap();
        let units = build_unit_plan(&desc, &config, &resolve_offload_plan(&desc, &config).unwrap());
        let streamed: std::collections::BTreeSet<StorageId> = units
            .stacks
            .iter()
            .flat_map(|sp| sp.units.iter())
            .flat_map(|u| u.sections.iter().flat_map(|sec| sec.storages.iter().map(|&(s, _)| s)))
            .collect();
        assert!(!streamed.is_empty());
        let hooks = HookRegistry::new();
        let mut b = get_offload_backend(&config, platform.clone(), None).unwrap().unwrap();
        b.enable(&mut model, &hooks, engine.stream).unwrap();
        let counting = Counting(&b, Mutex::new(Vec::new()));
        let out = engine.execute(&counting, &hooks, &opts, &mut |_| {}).unwrap();
        assert_eq!(out.output, resident.output, "offloaded run is bit-exact");
        let asked = counting.1.into_inner().unwrap();
        let again: Vec<_> = asked.iter().filter(|s| streamed.contains(s)).collect();
        assert!(again.is_empty(), "{} streamed storages looked up a second time, first {:?}", again.len(), again[0]);
        assert!(!asked.is_empty(), "fixed placement is still located through the source");
        b.disable(&mut model, &hooks).unwrap();
        engine.release().unwrap();
    }
}
