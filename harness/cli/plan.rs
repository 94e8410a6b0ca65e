//! `weightferry plan`: resolves the offload plan of a pipeline under a config and prints it (text, or one JSON
//! object with `--json`); with `--checkpoint`, of the pipeline derived from a safetensors checkpoint, whose files are
//! mapped (not read) so the plan predicts what they serve and what the disk tier reads. Nothing is run.

use super::{
    check_blockless, emit, load_checkpoint, load_config, load_pipeline, CliError, LoadedPipeline, PlanArgs,
    DEFAULT_PRESET,
};

/// Runs `weightferry plan`; returns the exit code.
pub fn plan(a: &PlanArgs) -> Result<i32, CliError> {
    let loaded = a.checkpoint.as_deref().map(|p| load_checkpoint(p, &a.component)).transpose()?;
    let pipeline = match (&a.checkpoint, &loaded) {
        (Some(path), Some(l)) => LoadedPipeline { name: path.display().to_string(), desc: l.derived.desc.clone() },
        _ => load_pipeline(a.pipeline.as_deref().or(a.preset.as_deref()).unwrap_or(DEFAULT_PRESET))?,
    };
    let config = load_config(a.config.as_deref(), &pipeline.desc)?;
    if let (Some(path), Some(l)) = (&a.checkpoint, &loaded) {
        check_blockless(path, l, &config)?;
    }
    // With a checkpoint, the model over its mapped files (on the simulated platform: nothing is copied), so the
    // plan says what the files serve and what the disk tier reads.
    let model = match &loaded {
        Some(l) => Some(checkpoint_model(&pipeline.desc, l)?),
        None => None,
    };
    let report = weightferry::offload::predict::plan_report_of(&pipeline.name, &pipeline.desc, &config, model.as_ref())
        .map_err(|e| CliError::invalid(format!("the config cannot be applied to {}: {e}", pipeline.name)))?;
    if a.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| CliError::failed(format!("cannot encode: {e}")))?;
        emit(&format!("{text}\n"));
    } else {
        emit(&report.to_string());
    }
    Ok(0)
}

/// The model of `loaded`'s checkpoint over its mapped files, on a simulated platform of its own.
fn checkpoint_model(
    desc: &weightferry::pipeline::PipelineDesc,
    loaded: &super::LoadedCheckpoint,
) -> Result<weightferry::model::HostModel, CliError> {
    use weightferry::scheduler::{PlatformRef, SimConfig, SimPlatform};
    let sim = SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() })
        .map_err(|e| CliError::failed(format!("simulated platform: {e}")))?;
    let platform: PlatformRef = std::sync::Arc::new(sim);
    let desc = std::sync::Arc::new(desc.clone());
    weightferry::model::HostModel::from_checkpoint(platform, desc, &loaded.checkpoint, &loaded.derived.component)
        .map_err(|e| CliError::invalid(format!("checkpoint {e}")))
}
