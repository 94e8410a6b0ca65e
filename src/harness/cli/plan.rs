//! `weightferry plan`: resolves the offload plan of a pipeline under a config and prints it (text, or one JSON
//! object with `--json`). Nothing is allocated or run.

use super::{emit, load_config, load_pipeline, CliError, PlanArgs, DEFAULT_PRESET};
use crate::report::PlanReport;

/// Runs `weightferry plan`; returns the exit code.
pub fn plan(a: &PlanArgs) -> Result<i32, CliError> {
    let spec = a.pipeline.as_deref().or(a.preset.as_deref()).unwrap_or(DEFAULT_PRESET);
    let pipeline = load_pipeline(spec)?;
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
