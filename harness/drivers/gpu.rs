//! `run --platform cuda`: the GPU reference engine on a real device, fully resident, then offloaded, compared bit
//! for bit (outputs and host weights), with the offloaded run's memory, bytes and hook latency.

use crate::drivers::compare::compare;
use crate::engine::cuda::{CudaCompute, GpuShape};
use crate::engine::synthetic::SyntheticWeights;
use crate::engine::timing::{hook_percentiles_us, ms, stack_h2d_bytes};
use crate::engine::{Engine, EngineError, ExecOptions};
use crate::report::progress::StepWatch;
use serde::Serialize;
use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::model::HostModel;
use weightferry::offload::backend::EnableProgress;
use weightferry::pipeline::PipelineDesc;
use weightferry::platform::cuda::CudaPlatform;
use weightferry::scheduler::PlatformRef;
use weightferry::session::{Session, SessionOptions};

/// The result of a GPU run: resident vs offloaded.
#[derive(Debug, Clone, Serialize)]
pub struct GpuRunReport {
    /// Device name.
    pub device: String,
    /// Strategy.
    pub strategy: String,
    /// Resident output checksum.
    pub resident_checksum: String,
    /// Offloaded output checksum.
    pub offloaded_checksum: String,
    /// Outputs equal bit for bit.
    pub outputs_match: bool,
    /// Host weights equal bit for bit after disable.
    pub weights_match: bool,
    /// Peak device weight memory of the offloaded run.
    pub peak_device_weight_bytes: u64,
    /// The plan's bound.
    pub planned_device_weight_bytes: u64,
    /// Bytes copied host → device by the offloaded run.
    pub h2d_bytes: u64,
    /// Synchronous fetches.
    pub sync_fetches: u64,
    /// Resident wall time, ms.
    pub resident_wall_ms: f64,
    /// Offloaded wall time, ms.
    pub offloaded_wall_ms: f64,
    /// Median hook latency, µs.
    pub hook_latency_p50_us: f64,
    /// 99th percentile hook latency, µs.
    pub hook_latency_p99_us: f64,
}

/// What a GPU run runs: [`GpuRunSpec::new`] gives synthetic weights of seed 0, no skips, the correct ordering,
/// ordinary copies and no observer.
#[derive(Debug, Clone)]
pub struct GpuRunSpec<'a> {
    /// The pipeline.
    pub desc: &'a PipelineDesc,
    /// The checkpoint's bytes instead of synthetic weights.
    pub checkpoint: Option<&'a crate::drivers::run::CheckpointWeights>,
    /// The offload config of the offloaded run.
    pub config: &'a OffloadConfig,
    /// DiT steps.
    pub steps: u32,
    /// Token counts of the GPU engine.
    pub shape: GpuShape,
    /// Seed of the synthetic weights and the inputs.
    pub seed: u64,
    /// Seed of the block-skip pattern (a step cache), if any.
    pub skip_seed: Option<u64>,
    /// Test hook: a deliberately broken ordering (proves the checks can fail).
    pub ordering_fault: weightferry::scheduler::OrderingFault,
    /// Every host → device copy waits behind a dummy one ([`crate::engine::slow::SlowCopies`]).
    pub slow_copies: bool,
    /// Sees `enable` build masters and the DiT steps complete on the device (progress bars).
    pub observer: Option<Arc<dyn crate::report::progress::RunObserver>>,
}

impl<'a> GpuRunSpec<'a> {
    /// `steps` steps of `desc` under `config` at `shape`, with the defaults above.
    pub fn new(desc: &'a PipelineDesc, config: &'a OffloadConfig, steps: u32, shape: GpuShape) -> Self {
        GpuRunSpec {
            desc,
            checkpoint: None,
            config,
            steps,
            shape,
            seed: 0,
            skip_seed: None,
            ordering_fault: weightferry::scheduler::OrderingFault::None,
            slow_copies: false,
            observer: None,
        }
    }
}

/// Runs the spec's pipeline on GPU 0 fully resident, then offloaded under its config through a library session
/// ([`compare`]), and compares outputs and host weights.
pub fn gpu_run(spec: GpuRunSpec<'_>) -> Result<GpuRunReport, EngineError> {
    let GpuRunSpec { desc, checkpoint, config, steps, shape, seed, skip_seed, ordering_fault, slow_copies, observer } =
        spec;
    let cuda = Arc::new(CudaPlatform::new(0)?);
    let platform: PlatformRef =
        if slow_copies { Arc::new(crate::engine::slow::SlowCopies::new(cuda.clone())) } else { cuda.clone() };
    let compute = Arc::new(CudaCompute::new(cuda.clone(), desc, shape)?);
    let model = match checkpoint {
        Some(w) => HostModel::from_checkpoint(platform, Arc::new(desc.clone()), &w.checkpoint, &w.component)
            .map_err(crate::drivers::run::checkpoint_error)?,
        None => HostModel::synthetic(platform, Arc::new(desc.clone()), seed)?,
    };
    let engine = match Engine::new(compute, desc) {
        Ok(engine) => engine,
        Err(e) => {
            model.release();
            return Err(e);
        }
    };
    let enable_progress = observer.clone().map(|o| EnableProgress::new(move |done, total| o.masters(done, total)));
    let options = SessionOptions { ordering_fault, enable_progress, ..SessionOptions::default() };
    let mut session = Session::from_model(model, engine.stream(), config.clone(), options)?;
    let opts = ExecOptions { steps, input_seed: seed, skip_seed, ..ExecOptions::default() };
    let mut watch = StepWatch::new(cuda.clone(), engine.stream(), observer);
    let cmp = compare(&engine, &mut session, &opts, &mut (), &mut |stage, p| watch.observe(stage, p));
    watch.finish();
    let plan = session.plan().clone();
    drop(session);
    let cmp = cmp?;
    let backend = cmp.backend.as_ref();
    let (p50, p99) = hook_percentiles_us(&cmp.offloaded.hook_latencies);
    Ok(GpuRunReport {
        device: cuda.device_name().to_string(),
        strategy: plan.strategy.report_name().to_string(),
        resident_checksum: format!("{:016x}", cmp.resident.checksum),
        offloaded_checksum: format!("{:016x}", cmp.offloaded.checksum),
        outputs_match: cmp.outputs_match(),
        weights_match: cmp.weights_match(),
        peak_device_weight_bytes: cmp.offloaded_peak_bytes,
        planned_device_weight_bytes: plan.budget.device_weight_bytes,
        h2d_bytes: backend.map_or(0, stack_h2d_bytes),
        sync_fetches: backend.map_or(0, |b| b.stacks.iter().map(|s| s.sync_fetches).sum()),
        resident_wall_ms: ms(cmp.resident.wall),
        offloaded_wall_ms: ms(cmp.offloaded_wall),
        hook_latency_p50_us: p50,
        hook_latency_p99_us: p99,
    })
}
