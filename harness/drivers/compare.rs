//! Resident, then offloaded, through one engine, compared bit for bit: the sequence every run driver makes.
//!
//! [`compare`] takes a library [`Session`] over the engine's platform and host model ([`Session::from_model`]),
//! checksums the host weights, runs the resident stage ([`run_resident`]: every storage uploaded once with
//! [`ResidentPlacement`], no hooks), then the offloaded stage through the same [`Engine`] and the session
//! ([`run_offloaded`]: `enable` → execute with the session's hooks → `disable`), checksums the host weights again
//! and compares the outputs ([`compare_outputs`]). An [`OffloadedStage`] brackets the offloaded stage (trace and
//! counters). The two stages are public on their own for the distributed rank runner, which runs them apart (the
//! resident baseline, then the rank's part of a group run).
//!
//! Invariant: once `enable` was called, `disable` is called before [`run_offloaded`] returns — also when `enable`
//! or the execution failed — so host weights are back in their own buffers whatever failed.

use crate::engine::{Engine, EngineError, ExecOptions, ExecOutput, Progress};
use std::fmt;
use std::time::{Duration, Instant};
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::{BackendReport, OffloadError, ResidentPlacement, WeightSource};
use weightferry::pipeline::StorageId;
use weightferry::scheduler::{HostBufferId, StreamId};
use weightferry::session::Session;

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

/// The caller's side of [`compare`]: brackets the offloaded stage. `()` brackets nothing.
pub trait OffloadedStage {
    /// Options of the offloaded execution (by default the resident execution's).
    fn options(&self, resident: &ExecOptions) -> ExecOptions {
        resident.clone()
    }
    /// Called right before the offloaded stage's measurements start.
    fn begin(&mut self) {}
    /// Called right after the offloaded stage ended (after `disable`), also when it failed.
    fn end(&mut self) {}
}

impl OffloadedStage for () {}

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

/// Enables the session (its hooks ordering copies against the engine's compute stream, given at
/// [`Session::from_model`]), runs `exec` on it when that succeeded, then disables it — also when `enable` or `exec`
/// failed. Returns `exec`'s result (or `enable`'s error) and `disable`'s, for the caller to weigh: a distributed rank
/// maps a failed restore to its own errors.
pub fn run_offloaded<T, E: From<OffloadError>>(
    session: &mut Session,
    exec: impl FnOnce(&Session) -> Result<T, E>,
) -> (Result<T, E>, Result<(), OffloadError>) {
    let out = match session.enable_offload() {
        Ok(_) => exec(session),
        Err(e) => Err(e.into()),
    };
    let disabled = session.disable_offload();
    (out, disabled)
}

/// Runs `engine` on the session's host model fully resident, then offloaded through the session, and compares:
/// outputs bit for bit, host weights by checksum before and after. `progress` sees every component (and DiT step)
/// of both executions start. When the config disables offload, or `enable` finds nothing to offload, the offloaded
/// execution runs resident as well. Fails on any failure of either stage; a mismatch is no failure
/// ([`Comparison::mismatch`]).
pub fn compare(
    engine: &Engine,
    session: &mut Session,
    opts: &ExecOptions,
    stage: &mut dyn OffloadedStage,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<Comparison, EngineError> {
    let platform = session.model().platform().clone();
    let before = session.model().checksum()?;
    let upload = platform.create_stream(UPLOAD_STREAM)?;
    let (resident, resident_weight_bytes) = run_resident(session.model(), upload, |p, hooks| {
        execute(engine, p, hooks, opts, RunStage::Resident, progress)
    })?;
    let off_opts = stage.options(opts);
    stage.begin();
    platform.reset_peak();
    let base = platform.device_memory().in_use;
    let t0 = Instant::now();
    let offloaded = offloaded_stage(engine, session, upload, &off_opts, progress);
    let offloaded_wall = t0.elapsed();
    let offloaded_peak_bytes = platform.device_memory().peak.saturating_sub(base);
    stage.end();
    let (offloaded, backend, master_units) = offloaded?;
    let after = session.model().checksum()?;
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
type StageOutput = (ExecOutput, Option<BackendReport>, Vec<(HostBufferId, String)>);

/// The offloaded execution and, when it ran through an enabled backend, the backend's report.
fn offloaded_stage(
    engine: &Engine,
    session: &mut Session,
    upload: StreamId,
    opts: &ExecOptions,
    progress: &mut dyn FnMut(RunStage, Progress<'_>),
) -> Result<StageOutput, EngineError> {
    let (out, disabled) = run_offloaded(session, |session| {
        let Some(b) = session.backend().filter(|b| b.is_enabled()) else {
            // Offload is off, or the plan had nothing to offload: the pipeline runs resident.
            let (out, _) = resident_again(engine, session.model(), upload, opts, progress)?;
            return Ok::<_, EngineError>((out, None, Vec::new()));
        };
        let out = execute(engine, b, session.hooks(), opts, RunStage::Offloaded, progress)?;
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
    use weightferry::config::OffloadConfig;
    use weightferry::pipeline::presets::preset;
    use weightferry::pipeline::PipelineDesc;
    use weightferry::scheduler::Platform;
    use weightferry::scheduler::{SimConfig, SimPlatform};
    use weightferry::session::SessionOptions;

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

    /// A simulated device, a session over a synthetic model of `desc` under `config`, and an engine.
    struct Fixture {
        sim: Arc<SimPlatform>,
        session: Session,
        engine: Engine,
    }

    impl Fixture {
        fn new(desc: &PipelineDesc, seed: u64, config: OffloadConfig) -> Fixture {
            let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
            let model = HostModel::synthetic(sim.clone(), Arc::new(desc.clone()), seed).unwrap();
            let engine = Engine::new(Arc::new(SimCompute::new(sim.clone())), desc).unwrap();
            let session = Session::from_model(model, engine.stream(), config, SessionOptions::default()).unwrap();
            Fixture { sim, session, engine }
        }
        /// Releases everything; the device then holds nothing, and saw no hazard.
        fn finish(self) {
            let Fixture { sim, session, mut engine } = self;
            engine.release().unwrap();
            drop(session);
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
    fn the_offloaded_stage_runs_through_the_session_and_matches_the_resident_one() {
        use crate::engine::math::Phase;
        let desc = preset("flux-tiny").unwrap();
        let mut f = Fixture::new(&desc, 3, layer_config());
        let opts = ExecOptions { steps: 2, input_seed: 3, ..ExecOptions::default() };
        let mut stages = Vec::new();
        let cmp = compare(&f.engine, &mut f.session, &opts, &mut (), &mut |s, p| {
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
    fn with_offload_disabled_the_offloaded_stage_runs_resident() {
        let mut f = Fixture::new(&preset("flux-tiny").unwrap(), 0, OffloadConfig::disabled());
        assert!(f.session.backend().is_none());
        let opts = ExecOptions { steps: 1, ..ExecOptions::default() };
        let cmp = compare(&f.engine, &mut f.session, &opts, &mut (), &mut |_, _| {}).unwrap();
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
        let mut f = Fixture::new(&desc, 0, config);
        assert!(f.session.backend().is_some());
        let opts = ExecOptions { steps: 1, ..ExecOptions::default() };
        let cmp = compare(&f.engine, &mut f.session, &opts, &mut (), &mut |_, _| {}).unwrap();
        assert!(cmp.outputs_match() && cmp.weights_match());
        assert!(cmp.backend.is_none(), "{:?}", cmp.backend);
        assert_eq!(cmp.offloaded_peak_bytes, cmp.resident_weight_bytes);
        assert_eq!(cmp.resident.kernels, cmp.offloaded.kernels);
        f.finish();
    }

    #[test]
    fn the_session_is_disabled_when_the_execution_fails() {
        let mut f = Fixture::new(&preset("flux-tiny").unwrap(), 0, layer_config());
        let before = f.session.model().checksum().unwrap();
        let (out, disabled) = run_offloaded(&mut f.session, |s| {
            assert!(s.is_enabled());
            Err::<(), _>(EngineError::Failed("boom".into()))
        });
        assert_eq!(out, Err(EngineError::Failed("boom".into())));
        assert_eq!(disabled, Ok(()));
        assert!(!f.session.is_enabled());
        assert_eq!(f.session.model().checksum().unwrap(), before);
        f.finish();
    }
}
