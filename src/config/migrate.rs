//! vLLM-Omni's offload keys that have no native spelling here: read, type-checked and given one meaning each —
//! the same behaviour, deprecated with a warning that names the compact key it maps to, or rejected with a
//! message that names the replacement. docs/vllm-omni.md's "Keys and declarations" table lists every row.
//!
//! Invariant: nothing here changes what a config made only of native keys means; every key is read before the
//! strategy is resolved, so a rejected key fails before anything else is decided.

use super::walk::{describe, quote, suggest, type_error, Table};
use super::{Component, ConfigError};
use serde_json::Value;
use std::collections::BTreeSet;

/// The vLLM-Omni keys read here (top level), in the order they are read.
pub(crate) const MIGRATED_KEYS: &[&str] = &[
    "layerwise_num_gpu_layers",
    "layerwise_offload_components",
    "dlo_offload_components",
    "dlo_encoder_resident_layers",
    "host_weight_runtime_mode",
    "host_weight_runtime_root",
    "host_weight_runtime_required",
    "host_weight_runtime_wait_timeout_s",
    "dlo_host_registration_limit_gib",
    "dlo_chunk_size_mb",
    "dlo_pin_budget_gb",
    "dlo_pin_failure_policy",
    "dlo_transport_backend",
];

/// `host_weight_runtime_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostWeightRuntime {
    /// `"disabled"` (the default): the loaded weights become the host masters.
    Disabled,
    /// `"preferred"`: use the runtime when it is available, else the loaded weights.
    Preferred,
    /// `"required"`: fail when the runtime is unavailable.
    Required,
}

/// The vLLM-Omni keys of one config, validated on their own.
#[derive(Debug, Clone)]
pub(crate) struct Migrated {
    /// `layerwise_offload_components`: the selected families, and the list as the file gave it.
    pub layerwise_components: Option<BTreeSet<Component>>,
    /// `dlo_encoder_resident_layers`.
    pub encoder_resident_layers: u32,
    /// `host_weight_runtime_mode`.
    pub host_weight_runtime: HostWeightRuntime,
    /// `dlo_host_registration_limit_gib` is above zero.
    pub registration_limit: bool,
    /// `dlo_chunk_size_mb`.
    pub chunk_size_mb: Option<u32>,
}

/// The compact key `layerwise_offload_components` maps to.
const COMPONENTS_KEY: &str = "diffusion_offload_config.components";

impl Migrated {
    pub(crate) fn read(top: &Table<'_>) -> Result<Self, ConfigError> {
        if top.get("layerwise_num_gpu_layers").is_some() {
            return Err(ConfigError::invalid(
                "layerwise_num_gpu_layers",
                "vLLM-Omni removed this key (its layerwise offload keeps one block on the device while the next \
                 prefetches); keep leading DiT blocks on the device with \
                 diffusion_offload_config.layer_options.dit.resident_layers and choose how far blocks prefetch with \
                 diffusion_offload_config.layer_options.dit.prefetch_depth",
            ));
        }
        let layerwise_components = read_layerwise_components(top)?;
        read_dlo_offload_components(top)?;
        let encoder_resident_layers = top.opt_u32("dlo_encoder_resident_layers", 0, u32::MAX)?.unwrap_or(0);
        let host_weight_runtime = read_host_weight_runtime(top)?;
        let registration_limit = read_registration_limit(top)?;
        let chunk_size_mb = top.opt_u32("dlo_chunk_size_mb", 1, u32::MAX)?;
        read_pin_budget(top)?;
        read_pin_failure_policy(top)?;
        read_transport_backend(top)?;
        Ok(Migrated {
            layerwise_components,
            encoder_resident_layers,
            host_weight_runtime,
            registration_limit,
            chunk_size_mb,
        })
    }

    /// Rejects the vLLM-Omni keys that contradict the compact config (the compact config alone decides what they
    /// would have decided).
    pub(crate) fn check_against_compact(&self) -> Result<(), ConfigError> {
        if self.layerwise_components.is_some() {
            return Err(ConfigError::invalid(
                "layerwise_offload_components",
                format!(
                    "cannot be combined with diffusion_offload_config; remove layerwise_offload_components and list \
                     the components in {COMPONENTS_KEY}"
                ),
            ));
        }
        if self.encoder_resident_layers != 0 {
            return Err(ConfigError::invalid(
                "dlo_encoder_resident_layers",
                "legacy distributed-offload tuning cannot be combined with diffusion_offload_config; remove \
                 dlo_encoder_resident_layers and set diffusion_offload_config.layer_options.text_encoder.resident_layers \
                 instead",
            ));
        }
        if self.host_weight_runtime != HostWeightRuntime::Disabled {
            return Err(ConfigError::invalid(
                "host_weight_runtime_mode",
                "the Host Weight Runtime cannot be combined with diffusion_offload_config; set \
                 host_weight_runtime_mode = \"disabled\" (or remove it)",
            ));
        }
        if self.registration_limit {
            return Err(ConfigError::invalid(
                "dlo_host_registration_limit_gib",
                "legacy distributed-offload tuning cannot be combined with diffusion_offload_config; remove \
                 dlo_host_registration_limit_gib (it limits Host Weight Runtime registrations, which weightferry \
                 never makes)",
            ));
        }
        if self.chunk_size_mb.is_some() {
            return Err(ConfigError::invalid(
                "dlo_chunk_size_mb",
                "legacy distributed-offload tuning cannot be combined with diffusion_offload_config; remove \
                 dlo_chunk_size_mb and set diffusion_offload_config.layer_options.dit.allgather_chunk_size instead",
            ));
        }
        Ok(())
    }
}

fn component_names() -> String {
    Component::ALL.map(Component::name).join(", ")
}

fn read_layerwise_components(top: &Table<'_>) -> Result<Option<BTreeSet<Component>>, ConfigError> {
    let key = "layerwise_offload_components";
    let expected = "a list of component names such as [\"dit\", \"text_encoder\"] or a comma-separated string";
    let names: Vec<(String, String)> = match top.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => {
            s.split(',').enumerate().map(|(i, n)| (format!("{key}[{i}]"), n.trim().to_string())).collect()
        }
        Some(Value::Array(items)) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let at = format!("{key}[{i}]");
                match item {
                    Value::String(s) => out.push((at, s.clone())),
                    other => return Err(type_error(&at, "a component name (dit, text_encoder or vae)", other)),
                }
            }
            out
        }
        Some(other) => return Err(type_error(key, expected, other)),
    };
    if names.iter().all(|(_, n)| n.is_empty()) {
        return Err(ConfigError::invalid(
            key,
            format!("the list is empty; name at least one of {} (or remove the key)", component_names()),
        ));
    }
    let mut set = BTreeSet::new();
    for (at, name) in &names {
        let Some(c) = Component::ALL.into_iter().find(|c| c.name() == name) else {
            let hint = match suggest(name, &Component::ALL.map(Component::name)) {
                Some(s) => format!(" (did you mean \"{s}\"?)"),
                None => String::new(),
            };
            return Err(ConfigError::invalid(
                at.as_str(),
                format!("unknown component {}{hint}; choose from {}", quote(name), component_names()),
            ));
        };
        if !set.insert(c) {
            return Err(ConfigError::invalid(
                at.as_str(),
                format!("{} is listed twice; list each component once", quote(name)),
            ));
        }
    }
    Ok(Some(set))
}

fn read_dlo_offload_components(top: &Table<'_>) -> Result<(), ConfigError> {
    let key = "dlo_offload_components";
    let entries = match top.get(key) {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(type_error(key, "an object mapping component names to true or false (or null)", other))
        }
    };
    for (name, value) in entries {
        let at = super::walk::join(key, name);
        if name.is_empty() {
            return Err(ConfigError::invalid(at, "component names must be non-empty; remove the empty key"));
        }
        if !value.is_boolean() {
            return Err(type_error(&at, "true or false", value));
        }
    }
    if entries.is_empty() {
        // vLLM-Omni: an empty policy keeps the default behaviour.
        return Ok(());
    }
    Err(ConfigError::invalid(
        key,
        format!(
            "per-module distributed-offload switches are not supported; choose the offloaded component families with \
             {COMPONENTS_KEY} (mode = \"layer\"): a family left out stays on the device"
        ),
    ))
}

fn read_host_weight_runtime(top: &Table<'_>) -> Result<HostWeightRuntime, ConfigError> {
    let key = "host_weight_runtime_mode";
    let choices = "\"disabled\", \"preferred\" or \"required\"";
    let mode = match top.get(key) {
        None => HostWeightRuntime::Disabled,
        Some(Value::String(s)) => match s.as_str() {
            "disabled" => HostWeightRuntime::Disabled,
            "preferred" => HostWeightRuntime::Preferred,
            "required" => HostWeightRuntime::Required,
            old @ ("read_only" | "read_write") => {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "{} is an earlier generation's mode (vLLM-Omni now takes {choices}); weightferry has no Host \
                         Weight Runtime: set host_weight_runtime_mode = \"disabled\" (host masters are built from the \
                         loaded weights)",
                        quote(old)
                    ),
                ))
            }
            other => {
                return Err(ConfigError::invalid(
                    key,
                    format!("unknown host weight runtime mode {}; choose {choices}", quote(other)),
                ))
            }
        },
        Some(other) => return Err(type_error(key, choices, other)),
    };
    let root_key = "host_weight_runtime_root";
    let root = match top.get(root_key) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(other) => return Err(type_error(root_key, "a directory path (or null)", other)),
    };
    let required_key = "host_weight_runtime_required";
    if top.opt_bool(required_key)? == Some(true) {
        return Err(ConfigError::invalid(
            required_key,
            "weightferry has no Host Weight Runtime, so it cannot be required; set host_weight_runtime_required = \
             false (or remove it)",
        ));
    }
    let timeout_key = "host_weight_runtime_wait_timeout_s";
    match top.get(timeout_key) {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if n.as_f64().is_some_and(|t| t.is_finite() && t > 0.0) => {}
        Some(Value::Number(n)) => {
            return Err(ConfigError::invalid(
                timeout_key,
                format!("must be finite and positive, found {n}; it has no effect here (no Host Weight Runtime)"),
            ))
        }
        Some(other) => return Err(type_error(timeout_key, "a number of seconds", other)),
    }
    if mode == HostWeightRuntime::Required {
        return Err(ConfigError::invalid(
            key,
            "weightferry has no Host Weight Runtime, so \"required\" cannot be met; set host_weight_runtime_mode = \
             \"disabled\" (host masters are built from the loaded weights)",
        ));
    }
    if mode == HostWeightRuntime::Preferred && root.is_none_or(str::is_empty) {
        return Err(ConfigError::invalid(
            root_key,
            "required when host_weight_runtime_mode = \"preferred\"; give the node-local store directory, or set \
             host_weight_runtime_mode = \"disabled\"",
        ));
    }
    Ok(mode)
}

fn read_registration_limit(top: &Table<'_>) -> Result<bool, ConfigError> {
    let key = "dlo_host_registration_limit_gib";
    match top.get(key) {
        None => Ok(false),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(v) if v >= 0.0 => Ok(v > 0.0),
            _ => Err(ConfigError::invalid(key, format!("expected a number >= 0 (0 = no ceiling), found {n}"))),
        },
        Some(other) => Err(ConfigError::invalid(
            key,
            format!("expected a number >= 0 (0 = no ceiling), found {}", describe(other)),
        )),
    }
}

fn read_pin_budget(top: &Table<'_>) -> Result<(), ConfigError> {
    match top.get("dlo_pin_budget_gb") {
        None | Some(Value::Null) => Ok(()),
        Some(_) => Err(ConfigError::invalid(
            "dlo_pin_budget_gb",
            "weightferry has no pinned-memory budget (every host master is pinned, or none is); remove \
             dlo_pin_budget_gb, and set pin_cpu_memory = false (diffusion_offload_config.pin_memory = false) for \
             pageable host masters",
        )),
    }
}

fn read_pin_failure_policy(top: &Table<'_>) -> Result<(), ConfigError> {
    let key = "dlo_pin_failure_policy";
    match top.get(key) {
        None => Ok(()),
        Some(Value::String(s)) if s == "fail" => Ok(()),
        Some(Value::String(s)) if s == "whole_block_fallback" => Err(ConfigError::invalid(
            key,
            "weightferry does not fall back to pageable blocks when pinning fails (enable fails instead); remove \
             dlo_pin_failure_policy, or set pin_cpu_memory = false (diffusion_offload_config.pin_memory = false) for \
             pageable host masters throughout",
        )),
        Some(Value::String(s)) => Err(ConfigError::invalid(
            key,
            format!("unknown pin failure policy {}; choose \"fail\" or \"whole_block_fallback\"", quote(s)),
        )),
        Some(other) => Err(type_error(key, "\"fail\" or \"whole_block_fallback\"", other)),
    }
}

fn read_transport_backend(top: &Table<'_>) -> Result<(), ConfigError> {
    let key = "dlo_transport_backend";
    match top.get(key) {
        None => Ok(()),
        Some(Value::String(s)) if s == "auto" => Ok(()),
        Some(Value::String(s)) if s == "reference" || s == "group_scatter_ag" => Err(ConfigError::invalid(
            key,
            format!(
                "weightferry has one AllGather transport, so {} cannot be chosen; remove dlo_transport_backend (or set \
                 \"auto\") and tune it with diffusion_offload_config.layer_options.dit.allgather_chunk_size",
                quote(s)
            ),
        )),
        Some(Value::String(s)) => Err(ConfigError::invalid(
            key,
            format!("unknown transport backend {}; choose \"auto\", \"reference\" or \"group_scatter_ag\"", quote(s)),
        )),
        Some(other) => Err(type_error(key, "\"auto\", \"reference\" or \"group_scatter_ag\"", other)),
    }
}
