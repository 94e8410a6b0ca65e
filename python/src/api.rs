//! What `weightferry._core` does, without Python: loads a config (JSON or TOML text, or a file read exactly as the
//! CLI's `--config`), loads a pipeline description (the JSON format), resolves the plan report, and maps every
//! failure onto [`CoreError`] with the text the CLI prints after `error: `. [`guarded`] turns a panic into
//! [`CoreError::Internal`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use weightferry::config::OffloadConfig;
use weightferry::plan::json::load_pipeline_json;
use weightferry::plan::report::PlanReport;
use weightferry::plan::PipelineDesc;

/// A failure of an entry point; each variant is raised as the Python exception of the same name (`Internal` as
/// the base `weightferry.Error`). The message is the text the CLI prints after `error: `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A config that cannot be read, parsed or accepted: `invalid config: {key}: {message}`.
    #[error("{0}")]
    Config(String),
    /// An invalid pipeline description: `pipeline {name}: {message}`.
    #[error("{0}")]
    Pipeline(String),
    /// A valid config the pipeline cannot serve: `the config cannot be applied to {name}: {message}`.
    #[error("{0}")]
    Plan(String),
    /// A bug: a caught panic, or a report that cannot be encoded.
    #[error("{0}")]
    Internal(String),
}

/// Collapses a message onto one line, as the CLI does before printing it.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Runs `f`, turning a panic into [`CoreError::Internal`] naming the entry point `entry`.
pub fn guarded<T>(entry: &str, f: impl FnOnce() -> Result<T, CoreError>) -> Result<T, CoreError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        Err(CoreError::Internal(one_line(&format!(
            "internal error in weightferry._core.{entry}: {what}; this is a bug, please report it"
        ))))
    })
}

/// Reads a config: `config_format` `"json"` or `"toml"` (then `config` is the text) or `"file"` (then `config` is
/// the path of a `.json` / `.toml` file, read exactly as the CLI's `--config` reads it).
pub fn load_config(config: &str, config_format: &str) -> Result<OffloadConfig, CoreError> {
    let parsed = match config_format {
        "json" => OffloadConfig::from_json_str(config),
        "toml" => OffloadConfig::from_toml_str(config),
        "file" => OffloadConfig::from_path(Path::new(config)),
        other => {
            return Err(CoreError::Config(format!(
                "unknown config format '{other}'; use \"json\", \"toml\" or \"file\" (a path to a .json or .toml file)"
            )))
        }
    };
    parsed.map_err(|e| CoreError::Config(one_line(&format!("invalid config: {e}"))))
}

/// Parses and validates a pipeline description in the JSON format; `name` is how errors name the pipeline.
pub fn load_pipeline(pipeline_json: &str, name: &str) -> Result<PipelineDesc, CoreError> {
    load_pipeline_json(pipeline_json).map_err(|e| CoreError::Pipeline(one_line(&format!("pipeline {name}: {e}"))))
}

/// Resolves the plan of `pipeline_json` under the config and encodes its report as JSON: the object
/// `weightferry plan --json` prints, with `name` as its `pipeline`.
pub fn plan_json(pipeline_json: &str, config: &str, config_format: &str, name: &str) -> Result<String, CoreError> {
    let desc = load_pipeline(pipeline_json, name)?;
    let config = load_config(config, config_format)?;
    let report = PlanReport::resolve(name, &desc, &config)
        .map_err(|e| CoreError::Plan(one_line(&format!("the config cannot be applied to {name}: {e}"))))?;
    serde_json::to_string(&report).map_err(|e| CoreError::Internal(format!("cannot encode the plan report: {e}")))
}

/// The strategy a valid config selects (`none`, `model`, `layer`, `distributed_layer`).
pub fn config_strategy(config: &str, config_format: &str) -> Result<&'static str, CoreError> {
    load_config(config, config_format).map(|c| c.strategy.report_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIPELINE: &str = r#"{"class": "P", "modules": {"transformer": {"class": "D", "children": {
        "blocks": {"repeat": 2, "block": {"class": "B", "tensors": {"w": {"dtype": "bf16", "shape": [128]}}}}}}},
        "components": {"dit": ["transformer"]}, "class_block_attrs": {"D": ["blocks"]}}"#;

    #[test]
    fn plan_json_is_the_report() {
        let config = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
        let text = plan_json(PIPELINE, config, "json", "p").unwrap();
        let desc = load_pipeline_json(PIPELINE).unwrap();
        let report = PlanReport::resolve("p", &desc, &OffloadConfig::from_json_str(config).unwrap()).unwrap();
        assert_eq!(text, serde_json::to_string(&report).unwrap());
        assert_eq!(report.strategy, "layer");
        assert_eq!(report.total_weight_bytes, 512);
    }

    #[test]
    fn errors_carry_the_cli_prefixes() {
        assert_eq!(
            config_strategy(r#"{"diffusion_offload_config": {"mdoe": "layer"}}"#, "json"),
            Err(CoreError::Config(one_line(&format!(
                "invalid config: {}",
                OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mdoe": "layer"}}"#).unwrap_err()
            ))))
        );
        let Err(CoreError::Pipeline(m)) = load_pipeline("{}", "p") else { panic!("expected a pipeline error") };
        assert!(m.starts_with("pipeline p: class: required key is missing;"), "{m}");
        let dit_only_missing = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["text_encoder"]}}"#;
        let Err(CoreError::Plan(m)) = plan_json(PIPELINE, dit_only_missing, "json", "p") else {
            panic!("expected a plan error")
        };
        assert!(m.starts_with("the config cannot be applied to p: "), "{m}");
        assert_eq!(
            config_strategy("x", "yaml"),
            Err(CoreError::Config(
                "unknown config format 'yaml'; use \"json\", \"toml\" or \"file\" (a path to a .json or .toml file)"
                    .into()
            ))
        );
    }

    #[test]
    fn toml_and_json_configs_agree() {
        let toml = "[diffusion_offload_config]\nmode = \"module\"\ncomponents = [\"dit\"]\n";
        assert_eq!(config_strategy(toml, "toml"), Ok("model"));
        assert_eq!(config_strategy("{}", "json"), Ok("none"));
    }

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let r: Result<(), CoreError> = guarded("probe", || panic!("boom\n  here"));
        assert_eq!(
            r,
            Err(CoreError::Internal(
                "internal error in weightferry._core.probe: boom here; this is a bug, please report it".into()
            ))
        );
        let r: Result<(), CoreError> = guarded("probe", || std::panic::panic_any(7_u8));
        assert_eq!(
            r,
            Err(CoreError::Internal(
                "internal error in weightferry._core.probe: a panic without a message; this is a bug, please report it"
                    .into()
            ))
        );
    }
}
