//! `weightferry inspect PATH`: opens a safetensors checkpoint, checks it, derives its pipeline and prints what it
//! found (text, or one JSON object with `--json`). Nothing is loaded into buffers.

use super::{emit, load_checkpoint, CliError, InspectArgs};
use crate::report::checkpoint::Summary;

/// Runs `weightferry inspect`; returns the exit code.
pub fn inspect(a: &InspectArgs) -> Result<i32, CliError> {
    let loaded = load_checkpoint(&a.path, &a.component)?;
    let summary = Summary::of(&loaded.checkpoint, &loaded.derived);
    if a.json {
        let text =
            serde_json::to_string_pretty(&summary).map_err(|e| CliError::failed(format!("cannot encode: {e}")))?;
        emit(&format!("{text}\n"));
    } else {
        emit(&summary.to_string());
    }
    Ok(0)
}
