//! `weightferry plan`: resolves the offload plan of a pipeline under a config and prints it (text, or one JSON
//! object with `--json`); with `--checkpoint`, of the pipeline derived from a safetensors checkpoint. Nothing is
//! allocated or run.

use super::{emit, load_checkpoint, load_config, load_pipeline, CliError, LoadedPipeline, PlanArgs, DEFAULT_PRESET};
use crate::report::PlanReport;

/// Runs `weightferry plan`; returns the exit code.
pub fn plan(a: &PlanArgs) -> Result<i32, CliError> {
    let pipeline = match &a.checkpoint {
        Some(path) => {
            LoadedPipeline { name: path.display().to_string(), desc: load_checkpoint(path, &a.component)?.derived.desc }
        }
        None => load_pipeline(a.pipeline.as_deref().or(a.preset.as_deref()).unwrap_or(DEFAULT_PRESET))?,
    };
    let config = load_config(a.config.as_deref(), &pipeline.desc)?;
    let report = PlanReport::resolve(&pipeline.name, &pipeline.desc, &config)
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
