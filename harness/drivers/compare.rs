//! Resident, then offloaded, through one engine, compared bit for bit: the sequence every run driver makes.
//!
//! [`compare`] checksums the host weights, runs the resident stage ([`run_resident`]: every storage uploaded once
//! with [`ResidentPlacement`], no hooks), then the offloaded stage through the same [`Engine`] on the backend an
//! [`OffloadedSource`] builds ([`run_offloaded`]: `enable` → execute → `disable`), checksums the host weights again
//! and compares the outputs ([`compare_outputs`]). The two stages are public on their own for the distributed rank
//! runner, which runs them apart (the resident baseline, then the rank's part of a group run).
//!
//! Invariant: once `enable` was called, `disable` is called before [`run_offloaded`] returns — also when `enable`
//! or the execution failed — so host weights are back in their own buffers whatever failed.

use crate::engine::{Engine, EngineError, ExecOptions, ExecOutput, Progress};
use std::fmt;
use std::time::{Duration, Instant};
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::{
    get_offload_backend, BackendReport, OffloadError, ResidentPlacement, StreamingBackend, WeightSource,
};
use weightferry::pipeline::StorageId;
use weightferry_actors::platform::{HostBufferId, PlatformRef, StreamId};
use weightferry_actors::OrderingFault;

/// Name of the stream [`compare`] uploads resident placements on.
pub const UPLOAD_STREAM: &str = "resident-upload";

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

/// The caller's side of [`compare`]: builds the offloaded source and brackets the offloaded stage. A closure
/// `FnMut(&PlatformRef) -> Result<Option<StreamingBackend>, EngineError>` is one that only builds.
pub trait OffloadedSource {
    /// Builds the backend on `platform` (the model's), e.g. with [`single_process_backend`]; `None`: offload is
    /// off, and the offloaded stage runs resident too. Called once, after the resident stage; must touch nothing
    /// (as [`get_offload_backend`] does not): the offloaded stage's measurements start after it.
    fn build(&mut self, platform: &PlatformRef) -> Result<Option<StreamingBackend>, EngineError>;
    /// Options of the offloaded execution (by default the resident execution's).
    fn options(&self, resident: &ExecOptions) -> ExecOptions {
        resident.clone()
    }
    /// Called after [`OffloadedSource::build`], right before the offloaded stage's measurements start.
    fn begin(&mut self) {}
    /// Called right after the offloaded stage ended (after `disable`), also when it failed.
    fn end(&mut self) {}
}

impl<F> OffloadedSource for F
where
    F: FnMut(&PlatformRef) -> Result<Option<StreamingBackend>, EngineError>,
{
    fn build(&mut self, platform: &PlatformRef) -> Result<Option<StreamingBackend>, EngineError> {
        self(platform)
    }
}

/// The backend of a single-process run: [`get_offload_backend`] for `config` without a collective, its block
/// stacks run with `fault` (a test hook: a deliberately broken ordering).
pub fn single_process_backend(
    config: &OffloadConfig,
    platform: &PlatformRef,
    fault: OrderingFault,
) -> Result<Option<StreamingBackend>, EngineError> {
    let mut backend = get_offload_backend(config, platform.clone(), None)?;
    if let Some(b) = backend.as_mut() {
        b.set_ordering_fault(fault);
    }
    Ok(backend)
}

/// Where the offloaded output differs from the resident one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Bytes of the resident output.
    pub resident_len: usize,
    /// Bytes of the offloaded output.
    pub offloaded_len: usize,
    /// Offset of the first differing byte (the shorter length when one output is a prefix of the other).
    pub first_byte: usize,
    /// Differing bytes over the length both outputs have.
    pub differing_bytes: usize,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let common = self.resident_len.min(self.offloaded_len);
        write!(
            f,
            "the offloaded output differs from the resident one in {} of {common} bytes, the first at byte {}",
            self.differing_bytes, self.first_byte
        )?;
        if self.resident_len != self.offloaded_len {
            write!(f, "; it has {} bytes, the resident one {}", self.offloaded_len, self.resident_len)?;
        }
        Ok(())
    }
}

/// Compares two outputs bit for bit: `None` when they are identical.
pub fn compare_outputs(resident: &[u8], offloaded: &[u8]) -> Option<Mismatch> {
    if resident == offloaded {
        return None;
    }
    let pairs = || resident.iter().zip(offloaded);
    let common = resident.len().min(offloaded.len());
    Some(Mismatch {
        resident_len: resident.len(),
        offloaded_len: offloaded.len(),
        first_byte: pairs().position(|(a, b)| a != b).unwrap_or(common),
        differing_bytes: pairs().filter(|(a, b)| a != b).count(),
    })
}

/// What [`compare`] measured.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// The resident execution.
    pub resident: ExecOutput,
    /// Device bytes of the resident placement.
    pub resident_weight_bytes: u64,
    /// The offloaded execution (resident again when offload is off or had nothing to offload).
    pub offloaded: ExecOutput,
    /// The backend's report after the offloaded execution, before `disable`; `None` when that execution did not
    /// run through an enabled backend.
    pub backend: Option<BackendReport>,
    /// The unit each of the backend's host masters held (names a trace's copies); empty without a backend.
    pub master_units: Vec<(HostBufferId, String)>,
    /// Wall time of the offloaded stage (`enable` → execute → `disable`).
    pub offloaded_wall: Duration,
    /// Peak device memory of the offloaded stage above what was in use when it began (the engine's activations
    /// and workspace): its weight memory.
    pub offloaded_peak_bytes: u64,
    /// Where the outputs differ; `None`: bit-identical.
    pub mismatch: Option<Mismatch>,
    /// The model's checksum before the resident stage and after the offloaded one.
    pub weights_checksums: (u64, u64),
}

impl Comparison {
    /// The outputs are bit-identical.
    pub fn outputs_match(&self) -> bool {
        self.mismatch.is_none()
    }
    /// The host weights are bit-identical after the offloaded stage.
    pub fn weights_match(&self) -> bool {
        self.weights_checksums.0 == self.weights_checksums.1
    }
}

/// Runs `exec` with every storage of `model` uploaded (on `upload`, a stream of the model's platform) into one
/// device buffer and an empty hook registry; releases the placement afterwards, also when `exec` failed (a
/// release failure is reported first). Returns `exec`'s result and the placement's device bytes.
pub fn run_resident<T>(
    model: &HostModel,
    upload: StreamId,
    exec: impl FnOnce(&ResidentPlacement, &HookRegistry) -> Result<T, EngineError>,
) -> Result<(T, u64), EngineError> {
    let all: Vec<StorageId> = model.desc().storages.keys().copied().collect();
    let mut placement = ResidentPlacement::upload(model.platform(), model, &all, upload)?;
    let bytes = placement.bytes();
    let out = exec(&placement, &HookRegistry::new());
    placement.release()?;
    Ok((out?, bytes))
}

/// Enables `backend` on `model` with `hooks` and the engine's `compute` stream, runs `exec` on it when that
/// succeeded, then disables it — also when `enable` or `exec` failed. Returns `exec`'s result (or `enable`'s
/// error) and `disable`'s, for the caller to weigh: a distributed rank maps a failed restore to its own errors.
pub fn run_offloaded<T, E: From<OffloadError>>(
    backend: &mut StreamingBackend,
    model: &mut HostModel,
    hooks: &HookRegistry,
    compute: StreamId,
    exec: impl FnOnce(&StreamingBackend, &HostModel) -> Result<T, E>,
) -> (Result<T, E>, Result<(), OffloadError>) {
    let out = match backend.enable(model, hooks, compute) {
        Ok(()) => exec(backend, model),
        Err(e) => Err(e.into()),
    };
    let disabled = backend.disable(model, hooks);
    (out, disabled)
}

/// Runs `engine` on `model` fully resident, then offloaded on the backend `source` builds, and compares: outputs
/// bit for bit, host weights by checksum before and after. `progress` sees every component (and DiT step) of both
/// executions start. Without a backend, or when `enable` finds nothing to offload, the offloaded execution runs
/// resident as well. Fails on any failure of either stage; a mismatch is no failure ([`Comparison::mismatch`]).
pub fn compare(
    engine: &Engine,
    model: &mut HostModel,
    opts: &ExecOptions,
    source: &mut dyn OffloadedSource,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<Comparison, EngineError> {
    let platform = model.platform().clone();
    let before = model.checksum()?;
    let upload = platform.create_stream(UPLOAD_STREAM)?;
    let (resident, resident_weight_bytes) =
        run_resident(model, upload, |p, hooks| execute(engine, p, hooks, opts, RunStage::Resident, progress))?;
    let mut backend = source.build(&platform)?;
    let off_opts = source.options(opts);
    source.begin();
    platform.reset_peak();
    let base = platform.device_memory().in_use;
    let t0 = Instant::now();
    let offloaded = offloaded_stage(engine, model, backend.as_mut(), upload, &off_opts, progress);
    let offloaded_wall = t0.elapsed();
    let offloaded_peak_bytes = platform.device_memory().peak.saturating_sub(base);
    source.end();
    let (offloaded, backend, master_units) = offloaded?;
    let after = model.checksum()?;
    Ok(Comparison {
        mismatch: compare_outputs(&resident.output, &offloaded.output),
        resident,
        resident_weight_bytes,
        offloaded,
        backend,
        master_units,
        offloaded_wall,
        offloaded_peak_bytes,
        weights_checksums: (before, after),
    })
}

/// One execution of `stage`, its progress tagged with the stage.
fn execute(
    engine: &Engine,
    source: &dyn WeightSource,
    hooks: &HookRegistry,
    opts: &ExecOptions,
    stage: RunStage,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<ExecOutput, EngineError> {
    engine.execute(source, hooks, opts, &mut |p| progress(stage, p))
}

/// The offloaded execution, and when it ran through an enabled backend, the backend's report and master units.
type OffloadedStage = (ExecOutput, Option<BackendReport>, Vec<(HostBufferId, String)>);

/// The offloaded execution and, when it ran through an enabled backend, the backend's report.
fn offloaded_stage(
    engine: &Engine,
    model: &mut HostModel,
    backend: Option<&mut StreamingBackend>,
    upload: StreamId,
    opts: &ExecOptions,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<OffloadedStage, EngineError> {
    let Some(backend) = backend else {
        let (out, _) = resident_again(engine, model, upload, opts, progress)?;
        return Ok((out, None, Vec::new()));
    };
    let hooks = HookRegistry::new();
    let (out, disabled) = run_offloaded(backend, model, &hooks, engine.stream(), |b, model| {
        if !b.is_enabled() {
            // The plan had nothing to offload: the pipeline runs resident.
            let (out, _) = resident_again(engine, model, upload, opts, progress)?;
            return Ok::<_, EngineError>((out, None, Vec::new()));
        }
        let out = execute(engine, b, &hooks, opts, RunStage::Offloaded, progress)?;
        Ok((out, Some(b.report()), b.master_units()))
    });
    let out = out?;
    disabled?;
    Ok(out)
}

/// The offloaded stage without an enabled backend: resident again.
fn resident_again(
    engine: &Engine,
    model: &HostModel,
    upload: StreamId,
    opts: &ExecOptions,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<(ExecOutput, Option<BackendReport>), EngineError> {
    let (out, _) =
        run_resident(model, upload, |p, hooks| execute(engine, p, hooks, opts, RunStage::Offloaded, progress))?;
    Ok((out, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::compute::SimCompute;
    use crate::engine::synthetic::SyntheticWeights;
    use std::sync::Arc;
    use weightferry::pipeline::presets::preset;
    use weightferry::pipeline::PipelineDesc;
    use weightferry_actors::platform::Platform;
    use weightferry_actors::sim::{SimConfig, SimPlatform};

    #[test]
    fn a_mismatch_names_the_first_differing_byte_and_counts_the_rest() {
        assert_eq!(compare_outputs(&[1, 2, 3], &[1, 2, 3]), None);
        let m = compare_outputs(&[1, 2, 3, 4], &[1, 9, 3, 8]).unwrap();
        assert_eq!(m, Mismatch { resident_len: 4, offloaded_len: 4, first_byte: 1, differing_bytes: 2 });
        assert_eq!(
            m.to_string(),
            "the offloaded output differs from the resident one in 2 of 4 bytes, the first at byte 1"
        );
        let m = compare_outputs(&[1, 2, 3], &[1, 2]).unwrap();
        assert_eq!(m, Mismatch { resident_len: 3, offloaded_len: 2, first_byte: 2, differing_bytes: 0 });
        assert_eq!(
            m.to_string(),
            "the offloaded output differs from the resident one in 0 of 2 bytes, the first at byte 2; it has 2 \
             bytes, the resident one 3"
        );
    }

    /// A simulated device with a synthetic model of `desc` and an engine.
    struct Fixture {
        sim: Arc<SimPlatform>,
        model: HostModel,
        engine: Engine,
    }

    impl Fixture {
        fn new(desc: &PipelineDesc, seed: u64) -> Fixture {
            let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
            let model = HostModel::synthetic(sim.clone(), Arc::new(desc.clone()), seed).unwrap();
            let engine = Engine::new(Arc::new(SimCompute::new(sim.clone())), desc).unwrap();
            Fixture { sim, model, engine }
        }
        fn platform(&self) -> PlatformRef {
            self.sim.clone()
        }
        /// Releases everything; the device then holds nothing, and saw no hazard.
        fn finish(self) {
            let Fixture { sim, model, mut engine } = self;
            engine.release().unwrap();
            model.release();
            assert!(sim.violations().is_empty());
            assert_eq!(sim.device_memory().in_use, 0);
            sim.shutdown();
        }
    }

    fn layer_config() -> OffloadConfig {
        OffloadConfig::from_json_str(
            r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"prefetch_depth": 2}}}}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_offloaded_stage_runs_through_the_backend_and_matches_the_resident_one() {
        use crate::engine::math::Phase;
        let desc = preset("flux-tiny").unwrap();
        let mut f = Fixture::new(&desc, 3);
        let opts = ExecOptions { steps: 2, input_seed: 3, ..ExecOptions::default() };
        let config = layer_config();
        let mut stages = Vec::new();
        let mut off = |p: &PlatformRef| single_process_backend(&config, p, OrderingFault::None);
        let cmp = compare(&f.engine, &mut f.model, &opts, &mut off, &mut |s, p| {
            if stages.last() != Some(&(s, p.phase)) {
                stages.push((s, p.phase));
            }
        })
        .unwrap();
        assert!(cmp.outputs_match() && cmp.weights_match(), "{:?}", cmp.mismatch);
        assert_eq!(cmp.resident.output, cmp.offloaded.output);
        let ids: Vec<StorageId> = desc.storages.keys().copied().collect();
        let all = weightferry::offload::layout::UnitLayout::pack(&desc, "<fixed>", &ids).device_bytes;
        assert_eq!(cmp.resident_weight_bytes, all);
        let report = cmp.backend.as_ref().expect("the layerwise backend ran");
        assert!(report.enabled && !report.stacks.is_empty());
        assert!(cmp.offloaded_peak_bytes > 0 && cmp.offloaded_peak_bytes < all, "{}", cmp.offloaded_peak_bytes);
        assert_eq!(cmp.offloaded.blocks_run, cmp.resident.blocks_run);
        let (r, o) = (RunStage::Resident, RunStage::Offloaded);
        let phases = [Phase::Encoder, Phase::Dit, Phase::Vae];
        let expected: Vec<_> = phases.iter().map(|p| (r, *p)).chain(phases.iter().map(|p| (o, *p))).collect();
        assert_eq!(stages, expected);
        f.finish();
    }

    #[test]
    fn without_a_backend_the_offloaded_stage_runs_resident() {
        let mut f = Fixture::new(&preset("flux-tiny").unwrap(), 0);
        let opts = ExecOptions { steps: 1, ..ExecOptions::default() };
        let mut off = |_: &PlatformRef| Ok(None);
        let cmp = compare(&f.engine, &mut f.model, &opts, &mut off, &mut |_, _| {}).unwrap();
        assert!(cmp.outputs_match() && cmp.weights_match());
        assert!(cmp.backend.is_none());
        assert_eq!(cmp.offloaded_peak_bytes, cmp.resident_weight_bytes);
        f.finish();
    }

    #[test]
    fn with_nothing_to_offload_the_offloaded_stage_runs_resident() {
        use weightferry::pipeline::builder::PipelineBuilder;
        use weightferry::pipeline::DType;
        let desc = PipelineBuilder::new("NoDit")
            .module("text_encoder", "Enc", |m| {
                m.block_list("layers", 2, "ToyBlock", |b, _| {
                    b.linear("fc", DType::Bf16, 8, 16, false);
                });
            })
            .encoder("text_encoder")
            .build()
            .unwrap();
        let config = OffloadConfig::from_json_str(r#"{"enable_layerwise_offload": true}"#).unwrap();
        let mut f = Fixture::new(&desc, 0);
        let opts = ExecOptions { steps: 1, ..ExecOptions::default() };
        let mut built = false;
        let mut off = |p: &PlatformRef| {
            built = true;
            single_process_backend(&config, p, OrderingFault::None)
        };
        let cmp = compare(&f.engine, &mut f.model, &opts, &mut off, &mut |_, _| {}).unwrap();
        assert!(built);
        assert!(cmp.outputs_match() && cmp.weights_match());
        assert!(cmp.backend.is_none(), "{:?}", cmp.backend);
        assert_eq!(cmp.offloaded_peak_bytes, cmp.resident_weight_bytes);
        assert_eq!(cmp.resident.kernels, cmp.offloaded.kernels);
        f.finish();
    }

    #[test]
    fn the_backend_is_disabled_when_the_execution_fails() {
        let mut f = Fixture::new(&preset("flux-tiny").unwrap(), 0);
        let before = f.model.checksum().unwrap();
        let mut backend = single_process_backend(&layer_config(), &f.platform(), OrderingFault::None).unwrap().unwrap();
        let hooks = HookRegistry::new();
        let (out, disabled) = run_offloaded(&mut backend, &mut f.model, &hooks, f.engine.stream(), |b, _| {
            assert!(b.is_enabled());
            Err::<(), _>(EngineError::Failed("boom".into()))
        });
        assert_eq!(out, Err(EngineError::Failed("boom".into())));
        assert_eq!(disabled, Ok(()));
        assert!(!backend.is_enabled());
        assert_eq!(f.model.checksum().unwrap(), before);
        f.finish();
    }
}
