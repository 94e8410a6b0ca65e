//! The inputs of `run`, `plan` and `inspect`: a pipeline (a preset or a pipeline file), a safetensors checkpoint and
//! the pipeline derived from it, and the offload config (or the documented default), each failure as invalid input.

use super::CliError;
use std::path::Path;
use weightferry::config::OffloadConfig;
use weightferry::pipeline::json::load_pipeline_file;
use weightferry::pipeline::presets::{preset, PRESET_NAMES};
use weightferry::pipeline::PipelineDesc;
use weightferry::plan::resolve_offload_plan;

/// The offload config used when `--config` is not given: layerwise streaming of the DiT and the text encoder,
/// prefetch depth chosen by the planner (2), nothing resident. For a pipeline with no usable text encoder the
/// default falls back to the DiT alone.
pub const DEFAULT_CONFIG_JSON: &str =
    r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}"#;

/// The fallback default when the pipeline has no text encoder the layerwise strategy can use.
pub const DEFAULT_DIT_ONLY_CONFIG_JSON: &str =
    r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;

/// The preset `run` and `plan` use when no pipeline is given.
pub const DEFAULT_PRESET: &str = "flux-tiny";

/// An opened checkpoint and the pipeline derived from it.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    /// The checkpoint, mapped.
    pub checkpoint: std::sync::Arc<weightferry::checkpoint::Checkpoint>,
    /// The derived description and its block lists.
    pub derived: weightferry::checkpoint::Derived,
}

/// Opens `path` and derives its one-DiT pipeline with the DiT named `component`; every checkpoint error is
/// invalid input (exit 2), its message naming the file and the tensor.
pub fn load_checkpoint(path: &Path, component: &str) -> Result<LoadedCheckpoint, CliError> {
    use weightferry::checkpoint::{derive_pipeline, Checkpoint, DeriveOptions};
    let checkpoint = Checkpoint::open(path).map_err(|e| CliError::invalid(format!("checkpoint {e}")))?;
    let derived = derive_pipeline(&checkpoint, &DeriveOptions { component: component.to_string() })
        .map_err(|e| CliError::invalid(format!("checkpoint {e}")))?;
    Ok(LoadedCheckpoint { checkpoint: std::sync::Arc::new(checkpoint), derived })
}

/// For a checkpoint without block lists, a config the derived pipeline cannot use is invalid input that says why
/// (the resolver's own advice, to declare block lists, does not apply to a checkpoint).
pub fn check_blockless(path: &Path, loaded: &LoadedCheckpoint, config: &OffloadConfig) -> Result<(), CliError> {
    if !loaded.derived.block_lists.is_empty() {
        return Ok(());
    }
    match resolve_offload_plan(&loaded.derived.desc, config) {
        Ok(_) => Ok(()),
        Err(e) => Err(CliError::invalid(format!(
            "checkpoint {}: no block list found (no top-level `name.N.` keys, e.g. `blocks.0.`), so the one-DiT \
             pipeline derived from it has nothing to stream ({e})",
            path.display()
        ))),
    }
}

/// A loaded pipeline and the name to show for it.
#[derive(Debug, Clone)]
pub struct LoadedPipeline {
    /// Preset name or file path.
    pub name: String,
    /// The description.
    pub desc: PipelineDesc,
}

/// Loads a pipeline from a preset name or a file. A name that is neither a preset nor an existing file is an
/// unknown preset (unless it looks like a path).
pub fn load_pipeline(spec: &str) -> Result<LoadedPipeline, CliError> {
    if let Some(desc) = preset(spec) {
        return Ok(LoadedPipeline { name: spec.to_string(), desc });
    }
    if PRESET_NAMES.contains(&spec) {
        return Err(CliError::failed(format!("preset '{spec}' could not be built")));
    }
    let path = Path::new(spec);
    let looks_like_file = path.exists() || spec.contains('/') || spec.contains('\\') || spec.contains('.');
    if !looks_like_file {
        return Err(CliError::invalid(format!(
            "unknown preset '{spec}'; choose one of {} or pass a pipeline .json file",
            PRESET_NAMES.join(", ")
        )));
    }
    let desc = load_pipeline_file(path).map_err(|e| CliError::invalid(format!("pipeline {spec}: {e}")))?;
    Ok(LoadedPipeline { name: spec.to_string(), desc })
}

/// Loads the config file, or the documented default for `desc` when none is given.
pub fn load_config(path: Option<&Path>, desc: &PipelineDesc) -> Result<OffloadConfig, CliError> {
    match path {
        Some(p) => OffloadConfig::from_path(p).map_err(|e| CliError::invalid(format!("invalid config: {e}"))),
        None => {
            let default = |text: &str| {
                OffloadConfig::from_json_str(text)
                    .map_err(|e| CliError::failed(format!("the built-in default config is invalid: {e}")))
            };
            let full = default(DEFAULT_CONFIG_JSON)?;
            if resolve_offload_plan(desc, &full).is_ok() {
                Ok(full)
            } else {
                default(DEFAULT_DIT_ONLY_CONFIG_JSON)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_configs_parse() {
        let p = preset(DEFAULT_PRESET).unwrap();
        let c = load_config(None, &p).unwrap();
        assert_eq!(c.strategy.report_name(), "layer");
        assert_eq!(c, OffloadConfig::from_json_str(DEFAULT_CONFIG_JSON).unwrap());
        assert!(OffloadConfig::from_json_str(DEFAULT_DIT_ONLY_CONFIG_JSON).is_ok());
    }

    #[test]
    fn unknown_preset_is_invalid_input() {
        let e = load_pipeline("flux-huge").unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.message.starts_with("unknown preset 'flux-huge'; choose one of flux-dev, flux-tiny"), "{e}");
    }
}
