//! Reading what a session is built from out of text: a config ([`ConfigSource`]: JSON or TOML text, or a file
//! read exactly as the CLI's `--config`) and a pipeline description in the JSON format, each failure worded as
//! the CLI words it.

use super::error::{one_line, SessionError};
use crate::config::OffloadConfig;
use crate::pipeline::json::load_pipeline_json;
use crate::pipeline::PipelineDesc;
use std::path::Path;

/// Where a config's text is.
#[derive(Debug, Clone, Copy)]
pub enum ConfigSource<'a> {
    /// JSON text.
    Json(&'a str),
    /// TOML text.
    Toml(&'a str),
    /// A `.json` or `.toml` file.
    File(&'a Path),
}

/// Reads and validates a config ([`SessionError::Config`]: `invalid config: …`).
pub fn load_config(source: ConfigSource<'_>) -> Result<OffloadConfig, SessionError> {
    let parsed = match source {
        ConfigSource::Json(text) => OffloadConfig::from_json_str(text),
        ConfigSource::Toml(text) => OffloadConfig::from_toml_str(text),
        ConfigSource::File(path) => OffloadConfig::from_path(path),
    };
    parsed.map_err(|e| SessionError::Config(one_line(&format!("invalid config: {e}"))))
}

/// Parses and validates a pipeline description in the JSON format; `name` is how errors name the pipeline
/// ([`SessionError::Pipeline`]: `pipeline {name}: …`).
pub fn load_pipeline(pipeline_json: &str, name: &str) -> Result<PipelineDesc, SessionError> {
    load_pipeline_json(pipeline_json).map_err(|e| SessionError::Pipeline(one_line(&format!("pipeline {name}: {e}"))))
}
