//! `weightferry run`: loads the pipeline and config, runs the [`driver`](crate::drivers::run) on the simulated
//! platform (or, when the launch environment has `WORLD_SIZE > 1`, one rank of a distributed run: see
//! [`super::dist_run`]), prints the report (text, or one JSON object with `--json`), writes the trace, and maps
//! the outcome to an exit code (1 when outputs or weights differ or the hazard detector fired). On a terminal it
//! draws progress bars on stderr ([`crate::report::progress`]). With `--checkpoint`, the pipeline is derived from a safetensors
//! checkpoint and both runs compute over its bytes (simulated platform, one process).

use super::{
    check_blockless, emit, load_checkpoint, load_config, load_pipeline, CliError, FaultArg, LoadedPipeline,
    PlatformArg, RunArgs, DEFAULT_PRESET,
};
use crate::drivers::run::{run as drive, CheckpointWeights, RunSpec};
use crate::engine::EngineError;
use crate::report::progress::{RunBars, RunObserver};
use std::io::IsTerminal;
use std::sync::Arc;
use weightferry::dist::allgather_engine::AllGatherEngine;
use weightferry::dist::LaunchEnv;
use weightferry::offload::OffloadError;
use weightferry::scheduler::OrderingFault;
use weightferry::session::SessionError;

/// Maps an engine error to the CLI contract: input problems exit 2, everything else 1.
fn engine_error(e: EngineError) -> CliError {
    match &e {
        EngineError::Invalid(_)
        | EngineError::Offload(OffloadError::Plan(_) | OffloadError::Unsupported(_))
        | EngineError::Session(SessionError::Plan(_) | SessionError::Config(_) | SessionError::Pipeline(_)) => {
            CliError::invalid(e.to_string())
        }
        _ => CliError::failed(format!("run failed: {e}")),
    }
}

/// The scheduler ordering a `--inject-ordering-fault` value asks for.
fn ordering_fault(arg: Option<FaultArg>) -> OrderingFault {
    match arg {
        None => OrderingFault::None,
        Some(FaultArg::SkipReadyWait) => OrderingFault::SkipReadyWait,
        Some(FaultArg::SkipLastUseWait) => OrderingFault::SkipLastUseWait,
    }
}

/// Exit code 1 (with the reason) when the offloaded output or the host weights differ from the resident run.
fn check_outcome(outputs_match: bool, weights_match: bool, offloaded: &str, resident: &str) -> Result<(), CliError> {
    if !outputs_match {
        return Err(CliError::failed(format!(
            "the offloaded output differs from the resident output ({offloaded} vs {resident})"
        )));
    }
    if !weights_match {
        return Err(CliError::failed("the host weights changed during the offloaded run"));
    }
    Ok(())
}

/// The platform check: `--platform cuda` needs a build with the `cuda` feature.
pub fn check_platform(p: PlatformArg) -> Result<(), CliError> {
    match p {
        PlatformArg::Sim => Ok(()),
        PlatformArg::Cuda if cfg!(feature = "cuda") => Ok(()),
        PlatformArg::Cuda => Err(CliError::invalid(
            "--platform cuda: this build has no CUDA support (rebuild with --features cuda); run with --platform sim",
        )),
    }
}

/// `run --platform cuda`: the GPU reference engine, resident vs offloaded.
#[cfg(feature = "cuda")]
fn run_cuda(
    a: &RunArgs,
    name: &str,
    desc: &weightferry::pipeline::PipelineDesc,
    checkpoint: Option<&crate::drivers::run::CheckpointWeights>,
    config: &weightferry::config::OffloadConfig,
) -> Result<i32, CliError> {
    use crate::drivers::gpu::{gpu_run, GpuRunSpec};
    use crate::engine::cuda::default_tokens;
    use crate::engine::cuda::GpuShape;
    let (mut tokens, context_tokens) = default_tokens(name);
    if let Some(t) = a.tokens {
        tokens = t;
    }
    let fault = ordering_fault(a.inject_ordering_fault);
    // The report is always JSON on stdout; bars go to a terminal stderr only.
    let bars = RunBars::for_stderr(false, std::io::stderr().is_terminal());
    let r = gpu_run(GpuRunSpec {
        checkpoint,
        seed: a.seed,
        skip_seed: a.skip_seed,
        ordering_fault: fault,
        slow_copies: fault != OrderingFault::None,
        observer: bars.clone().map(|b| b as Arc<dyn RunObserver>),
        ..GpuRunSpec::new(desc, config, a.steps, GpuShape { tokens, context_tokens })
    });
    if let Some(b) = &bars {
        b.clear();
    }
    let r = r.map_err(|e| match e {
        EngineError::Platform(weightferry::scheduler::PlatformError::Unavailable(m)) => {
            CliError::invalid(format!("--platform cuda: {m}; run with --platform sim"))
        }
        e => engine_error(e),
    })?;
    let text = serde_json::to_string_pretty(&r).map_err(|e| CliError::failed(format!("cannot encode: {e}")))?;
    emit(&format!("{text}\n"));
    check_outcome(r.outputs_match, r.weights_match, &r.offloaded_checksum, &r.resident_checksum)?;
    Ok(0)
}

/// Refuses a `--trace` path that names the `--config`, `--pipeline` or `--checkpoint` file (under any name).
fn refuse_overwriting_inputs(trace: &std::path::Path, a: &RunArgs) -> Result<(), CliError> {
    let Ok(target) = std::fs::canonicalize(trace) else { return Ok(()) };
    let inputs = [
        ("--config", a.config.clone()),
        ("--pipeline", a.pipeline.as_ref().map(std::path::PathBuf::from)),
        ("--checkpoint", a.checkpoint.clone()),
    ];
    for (flag, path) in inputs {
        if let Some(p) = path {
            if std::fs::canonicalize(&p).is_ok_and(|c| c == target) {
                return Err(CliError::invalid(format!(
                    "--trace {} is the {flag} file; writing the trace would destroy it: choose another trace path",
                    trace.display()
                )));
            }
        }
    }
    Ok(())
}

/// Runs `weightferry run`; returns the exit code.
pub fn run(a: &RunArgs) -> Result<i32, CliError> {
    let env = LaunchEnv::from_env().map_err(|e| CliError::invalid(e.to_string()))?;
    if env.is_distributed() {
        return super::dist_run::run_distributed(a, &env);
    }
    if a.inject_gather_failure.is_some() {
        return Err(CliError::invalid(
            "--inject-gather-failure applies only to a distributed run (WORLD_SIZE > 1, e.g. under weightferry launch)",
        ));
    }
    if a.time_rounds != 1 {
        return Err(CliError::invalid(
            "--time-rounds applies only to a distributed run with --time-steps (WORLD_SIZE > 1, e.g. under \
             weightferry launch); on one GPU, weightferry bench --rounds repeats configurations",
        ));
    }
    if AllGatherEngine::from(a.allgather_engine) != AllGatherEngine::Auto {
        return Err(CliError::invalid(
            "--allgather-engine applies only to a distributed run on --platform cuda (WORLD_SIZE > 1, e.g. under \
             weightferry launch)",
        ));
    }
    if a.time_steps.is_some() {
        return Err(CliError::invalid(
            "--time-steps applies only to a distributed run (WORLD_SIZE > 1, e.g. under weightferry launch); on one \
             GPU, weightferry bench times layerwise offload",
        ));
    }
    check_platform(a.platform)?;
    let loaded = a.checkpoint.as_deref().map(|p| load_checkpoint(p, &a.component)).transpose()?;
    let (pipeline, weights) = match (&a.checkpoint, &loaded) {
        (Some(path), Some(l)) => {
            let name = path.display().to_string();
            let weights =
                CheckpointWeights { checkpoint: l.checkpoint.clone(), component: l.derived.component.clone() };
            (LoadedPipeline { name, desc: l.derived.desc.clone() }, Some(weights))
        }
        _ => (load_pipeline(a.preset.as_deref().or(a.pipeline.as_deref()).unwrap_or(DEFAULT_PRESET))?, None),
    };
    let config = load_config(a.config.as_deref(), &pipeline.desc)?;
    if let (Some(path), Some(l)) = (&a.checkpoint, &loaded) {
        check_blockless(path, l, &config)?;
    }
    #[cfg(feature = "cuda")]
    if a.platform == PlatformArg::Cuda {
        return run_cuda(a, &pipeline.name, &pipeline.desc, weights.as_ref(), &config);
    }
    let mut spec = RunSpec::new(pipeline.name, pipeline.desc, config);
    spec.steps = a.steps;
    spec.seed = a.seed;
    spec.skip_seed = a.skip_seed;
    spec.trace = a.trace.is_some();
    spec.checkpoint = weights;
    let (rate, latency) = super::sim_args::sim_throttles(a)?;
    spec.sim.h2d_bytes_per_sec = rate;
    spec.sim.copy_latency = latency;
    spec.ordering_fault = ordering_fault(a.inject_ordering_fault);
    // Never write the trace over an input file; fail on an unwritable trace path before spending time on the run.
    if let Some(t) = &a.trace {
        refuse_overwriting_inputs(t, a)?;
    }
    let trace_file = match &a.trace {
        Some(p) => Some(
            std::fs::File::create(p)
                .map_err(|e| CliError::invalid(format!("cannot create trace file `{}`: {e}", p.display())))?,
        ),
        None => None,
    };
    // Progress bars on a terminal stderr (never with --json), once the work is expected to last about a second.
    let bars = RunBars::for_stderr(a.json, std::io::stderr().is_terminal());
    spec.observer = bars.clone().map(|b| b as Arc<dyn RunObserver>);
    let outcome = drive(&spec, &mut |_, _| {});
    if let Some(b) = &bars {
        b.clear();
    }
    let outcome = outcome.map_err(engine_error)?;
    // A trace that cannot be written (a full disk, `/dev/full`) must not cost the report: the report is printed,
    // then the error.
    let written = match (&a.trace, &outcome.trace) {
        (Some(path), Some(trace)) => {
            drop(trace_file);
            Some(trace.write_chrome(path).map(|()| path))
        }
        _ => None,
    };
    let r = &outcome.report;
    if a.json {
        let text = serde_json::to_string_pretty(r).map_err(|e| CliError::failed(format!("cannot encode: {e}")))?;
        emit(&format!("{text}\n"));
    } else {
        emit(&format!("{r}\n"));
        if let Some(Ok(path)) = &written {
            emit(&format!("trace written to {}\n", path.display()));
        }
    }
    if let Some(Err(e)) = written {
        return Err(CliError::failed(e.to_string()));
    }
    check_outcome(r.outputs_match, r.weights_match, &r.offloaded_checksum, &r.resident_checksum)?;
    if r.hazard_violations > 0 {
        return Err(CliError::failed(format!(
            "the sim hazard detector recorded {} ordering violations",
            r.hazard_violations
        )));
    }
    Ok(0)
}
