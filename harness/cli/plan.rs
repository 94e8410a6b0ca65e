//! `weightferry plan`: resolves the offload plan of a pipeline under a config and prints it (text, or one JSON
//! object with `--json`); with `--checkpoint`, of the pipeline derived from a safetensors checkpoint. Nothing is
//! allocated or run.

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
    let report = weightferry::offload::predict::plan_report(&pipeline.name, &pipeline.desc, &config)
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
