//! vLLM-Omni parity (issue 18): every row of docs/vllm-omni.md's "Keys and declarations" table — each vLLM-Omni config
//! key and pipeline declaration, accepted with its meaning, accepted as deprecated with the exact warning, or rejected
//! with the exact message — plus the resolver rules: a pipeline-managed encoder that also streams blocks stays on
//! demand (non-block weights staged between its phases), encoder resident layers (plan, budget and the backend), the
//! VAE selection that needs a declared lifecycle, and blocks claimed twice through tied weights.
//!
//! Every assertion pins exact fields, messages or warnings, so a changed rule fails a test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use weightferry::config::{Component, OffloadConfig, Strategy};
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::units::build_unit_plan;
use weightferry::offload::{get_offload_backend, OffloadError, WeightSource};
use weightferry::pipeline::builder::{ModuleBuilder, PipelineBuilder};
use weightferry::pipeline::json::{load_pipeline_json, to_pipeline_json};
use weightferry::pipeline::{DType, OffloadPlanDecl, PipelineDesc};
use weightferry::plan::budget::{non_block_storages, storages_under};
use weightferry::plan::{resolve_offload_plan, ResolvedPlan};
use weightferry_actors::platform::{Platform, PlatformRef};
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

// ------------------------------------------------------------------------------------------------------------
// Helpers

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("config {json} rejected: {e}"))
}

fn cfg_err(json: &str) -> String {
    match OffloadConfig::from_json_str(json) {
        Ok(c) => panic!("config {json} accepted: {c:?}"),
        Err(e) => e.to_string(),
    }
}

fn ok(p: &PipelineDesc, c: &OffloadConfig) -> ResolvedPlan {
    resolve_offload_plan(p, c).unwrap_or_else(|e| panic!("expected a plan, got error: {e}"))
}

fn err(p: &PipelineDesc, c: &OffloadConfig) -> String {
    match resolve_offload_plan(p, c) {
        Ok(plan) => panic!("expected an error, got a plan: {plan:#?}"),
        Err(e) => e.to_string(),
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn attrs_map(entries: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
    entries.iter().map(|(k, v)| (k.to_string(), strings(v))).collect()
}

/// `count` blocks under `name`, each one `Linear` 8→16 without bias (256 bytes of bf16).
fn block_list(m: &mut ModuleBuilder<'_>, name: &str, count: usize) {
    m.block_list(name, count, "ToyBlock", |b, _| {
        b.linear("fc", DType::Bf16, 8, 16, false);
    });
}

/// One block or leaf: 256 bytes.
const U: u64 = 256;

/// `transformer` (4 blocks and an embedding), `text_encoder` (`vision.blocks` 2, `text_model.layers` 3, a final
/// norm; lifecycle as given), `vae` (with the lifecycle), under `plan`.
fn staged(class: &str, lifecycle: bool, plan: OffloadPlanDecl) -> PipelineDesc {
    PipelineBuilder::new(class)
        .module("transformer", "ToyDiT", |m| {
            m.linear("embed", DType::Bf16, 8, 16, false);
            block_list(m, "blocks", 4);
        })
        .module("text_encoder", "StagedEncoder", |m| {
            m.has_lifecycle(lifecycle);
            m.module("vision", "Vision", |v| block_list(v, "blocks", 2));
            m.module("text_model", "TextModel", |t| block_list(t, "layers", 3));
            m.linear("final_norm", DType::Bf16, 8, 16, false);
        })
        .module("vae", "ToyVAE", |m| {
            m.has_lifecycle(true);
            m.linear("conv", DType::Bf16, 8, 16, false);
        })
        .dit("transformer")
        .encoder("text_encoder")
        .vae("vae")
        .offload_plan(plan)
        .build()
        .unwrap_or_else(|e| panic!("test pipeline invalid: {e}"))
}

/// The staged encoder's plan: both encoder stacks declared, the encoder and the VAE pipeline-managed, the text
/// stack eligible for resident layers.
fn staged_plan() -> OffloadPlanDecl {
    OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        encoder_block_attrs: attrs_map(&[("text_encoder", &["vision.blocks", "text_model.layers"])]),
        on_demand_component_paths: strings(&["text_encoder", "vae"]),
        resident_encoder_block_paths: strings(&["text_encoder.text_model.layers"]),
        ..OffloadPlanDecl::default()
    }
}

fn compact(components: &str, options: &str) -> OffloadConfig {
    cfg(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": [{components}], "layer_options": {options}}}}}"#
    ))
}

/// Compact layer mode over the DiT and the text encoder with `n` resident encoder layers.
fn encoder_resident(n: u32) -> OffloadConfig {
    compact(r#""dit", "text_encoder""#, &format!(r#"{{"text_encoder": {{"resident_layers": {n}}}}}"#))
}

// ------------------------------------------------------------------------------------------------------------
// Config keys: layerwise_offload_components

#[test]
fn layerwise_offload_components_is_deprecated_and_maps_to_components() {
    let c = cfg(r#"{"enable_layerwise_offload": true, "layerwise_offload_components": ["dit", "text_encoder"]}"#);
    assert_eq!(c.strategy, Strategy::LayerWise);
    assert_eq!(c.components, Some(BTreeSet::from([Component::Dit, Component::TextEncoder])));
    assert!(!c.compact);
    assert_eq!(
        c.warnings,
        vec!["layerwise_offload_components is deprecated: it maps to diffusion_offload_config.components = [\"dit\", \
              \"text_encoder\"] (with mode = \"layer\")"
            .to_string()]
    );
    // The comma-separated form of the CLI flag, with spaces after the commas.
    let c = cfg(r#"{"enable_layerwise_offload": true, "layerwise_offload_components": "text_encoder, vae"}"#);
    assert_eq!(c.components, Some(BTreeSet::from([Component::TextEncoder, Component::Vae])));
    // The warning reaches the plan's warnings.
    let p = staged("DeprecatedSelectionPipeline", true, staged_plan());
    let plan = ok(&p, &c);
    assert_eq!(plan.warnings[0], c.warnings[0]);
    assert!(!plan.dits[0].selected, "the DiT is left out of the selection");
}

#[test]
fn layerwise_offload_components_rejections_name_the_fix() {
    assert_eq!(
        cfg_err(r#"{"enable_layerwise_offload": true, "layerwise_offload_components": ["dit", "text_encodr"]}"#),
        "layerwise_offload_components[1]: unknown component \"text_encodr\" (did you mean \"text_encoder\"?); choose \
         from dit, text_encoder, vae"
    );
    assert_eq!(
        cfg_err(r#"{"enable_layerwise_offload": true, "layerwise_offload_components": ""}"#),
        "layerwise_offload_components: the list is empty; name at least one of dit, text_encoder, vae (or remove the \
         key)"
    );
    assert_eq!(
        cfg_err(r#"{"enable_layerwise_offload": true, "layerwise_offload_components": ["dit", "dit"]}"#),
        "layerwise_offload_components[1]: \"dit\" is listed twice; list each component once"
    );
    assert_eq!(
        cfg_err(r#"{"enable_layerwise_offload": true, "layerwise_offload_components": {"dit": true}}"#),
        "layerwise_offload_components: expected a list of component names such as [\"dit\", \"text_encoder\"] or a \
         comma-separated string, found an object"
    );
    assert_eq!(
        cfg_err(r#"{"layerwise_offload_components": ["dit"]}"#),
        "layerwise_offload_components: selects components for layerwise offload, but no layerwise offload flag is \
         set; set enable_layerwise_offload = true, or use diffusion_offload_config with mode = \"layer\" and components"
    );
    assert_eq!(
        cfg_err(r#"{"enable_cpu_offload": true, "layerwise_offload_components": ["dit"]}"#),
        "layerwise_offload_components: selects components for layerwise offload, but enable_cpu_offload selects \
         model-level offload; set enable_layerwise_offload = true, or use diffusion_offload_config with mode = \
         \"layer\" and components"
    );
    assert_eq!(
        cfg_err(
            r#"{"layerwise_offload_components": ["dit"],
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#
        ),
        "layerwise_offload_components: cannot be combined with diffusion_offload_config; remove \
         layerwise_offload_components and list the components in diffusion_offload_config.components"
    );
}

// ------------------------------------------------------------------------------------------------------------
// Config keys: dlo_offload_components

#[test]
fn dlo_offload_components_empty_keeps_the_default_and_any_switch_is_rejected() {
    for empty in ["{}", "null"] {
        let c = cfg(&format!(r#"{{"enable_distributed_layerwise_offload": true, "dlo_offload_components": {empty}}}"#));
        assert_eq!(c, cfg(r#"{"enable_distributed_layerwise_offload": true}"#), "{empty}");
    }
    assert_eq!(
        cfg_err(r#"{"enable_distributed_layerwise_offload": true, "dlo_offload_components": {"text_encoder": false}}"#),
        "dlo_offload_components: per-module distributed-offload switches are not supported; choose the offloaded \
         component families with diffusion_offload_config.components (mode = \"layer\"): a family left out stays on \
         the device"
    );
    assert_eq!(
        cfg_err(r#"{"dlo_offload_components": ["text_encoder"]}"#),
        "dlo_offload_components: expected an object mapping component names to true or false (or null), found a list"
    );
    assert_eq!(
        cfg_err(r#"{"dlo_offload_components": {"text_encoder": 0}}"#),
        "dlo_offload_components.text_encoder: expected true or false, found the integer 0"
    );
    assert_eq!(
        cfg_err(r#"{"dlo_offload_components": {"": true}}"#),
        "dlo_offload_components.\"\": component names must be non-empty; remove the empty key"
    );
}

// ------------------------------------------------------------------------------------------------------------
// Config keys: dlo_encoder_resident_layers and layer_options.text_encoder.resident_layers

#[test]
fn dlo_encoder_resident_layers_keeps_its_meaning_under_rank_local_dlo() {
    let c = cfg(
        r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_encoder_resident_layers": 2}"#,
    );
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!((c.resident_layers, c.encoder_resident_layers), (0, 2));
    assert!(c.warnings.is_empty());
    // Zero is the default and needs nothing.
    assert_eq!(cfg(r#"{"dlo_encoder_resident_layers": 0}"#), cfg("{}"));
}

#[test]
fn dlo_encoder_resident_layers_rejections_name_the_fix() {
    assert_eq!(
        cfg_err(r#"{"enable_layerwise_offload": true, "dlo_encoder_resident_layers": 1}"#),
        "dlo_encoder_resident_layers: resident encoder layers require distributed layerwise offload; set \
         enable_distributed_layerwise_offload = true, or use \
         diffusion_offload_config.layer_options.text_encoder.resident_layers"
    );
    assert_eq!(
        cfg_err(r#"{"enable_distributed_layerwise_offload": true, "dlo_encoder_resident_layers": 1}"#),
        "dlo_encoder_resident_layers: resident encoder layers keep the rank-local weights the loader produced; set \
         dlo_use_allgather = false, or set dlo_encoder_resident_layers = 0"
    );
    assert_eq!(
        cfg_err(r#"{"dlo_encoder_resident_layers": -1}"#),
        "dlo_encoder_resident_layers: expected an integer >= 0, found -1"
    );
    assert_eq!(
        cfg_err(
            r#"{"dlo_encoder_resident_layers": 2,
                "diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}"#
        ),
        "dlo_encoder_resident_layers: legacy distributed-offload tuning cannot be combined with \
         diffusion_offload_config; remove dlo_encoder_resident_layers and set \
         diffusion_offload_config.layer_options.text_encoder.resident_layers instead"
    );
}

#[test]
fn compact_text_encoder_resident_layers_select_the_distributed_strategy() {
    let c = encoder_resident(2);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!((c.resident_layers, c.encoder_resident_layers), (0, 2));
    assert_eq!(encoder_resident(0).strategy, Strategy::LayerWise);
    assert_eq!(
        cfg_err(
            r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
                "layer_options": {"text_encoder": {"resident_layers": 1, "weight_transfer": "allgather"}}}}"#
        ),
        "diffusion_offload_config.layer_options.text_encoder.resident_layers: resident layers need weight_transfer = \
         \"rank-local\"; set diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\" or \
         remove resident_layers"
    );
}

// ------------------------------------------------------------------------------------------------------------
// Config keys: the Host Weight Runtime

#[test]
fn host_weight_runtime_disabled_is_the_default_and_preferred_falls_back_with_a_warning() {
    assert_eq!(cfg(r#"{"host_weight_runtime_mode": "disabled", "host_weight_runtime_root": null}"#), cfg("{}"));
    let c = cfg(r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false,
            "host_weight_runtime_mode": "preferred", "host_weight_runtime_root": "/var/cache/hwr"}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(
        c.warnings,
        vec!["host_weight_runtime_mode = \"preferred\": weightferry has no Host Weight Runtime, so host masters are \
              built from the loaded weights (vLLM-Omni's fallback when the runtime is unavailable); set \
              host_weight_runtime_mode = \"disabled\" to silence this"
            .to_string()]
    );
}

#[test]
fn host_weight_runtime_rejections_name_the_fix() {
    assert_eq!(
        cfg_err(r#"{"host_weight_runtime_mode": "required", "host_weight_runtime_root": "/hwr"}"#),
        "host_weight_runtime_mode: weightferry has no Host Weight Runtime, so \"required\" cannot be met; set \
         host_weight_runtime_mode = \"disabled\" (host masters are built from the loaded weights)"
    );
    assert_eq!(
        cfg_err(r#"{"host_weight_runtime_mode": "preferred"}"#),
        "host_weight_runtime_root: required when host_weight_runtime_mode = \"preferred\"; give the node-local store \
         directory, or set host_weight_runtime_mode = \"disabled\""
    );
    assert_eq!(
        cfg_err(r#"{"host_weight_runtime_mode": "automatic"}"#),
        "host_weight_runtime_mode: unknown host weight runtime mode \"automatic\"; choose \"disabled\", \"preferred\" \
         or \"required\""
    );
    assert_eq!(
        cfg_err(r#"{"host_weight_runtime_root": 3}"#),
        "host_weight_runtime_root: expected a directory path (or null), found the integer 3"
    );
    assert_eq!(
        cfg_err(
            r#"{"host_weight_runtime_mode": "preferred", "host_weight_runtime_root": "/hwr",
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#
        ),
        "host_weight_runtime_mode: the Host Weight Runtime cannot be combined with diffusion_offload_config; set \
         host_weight_runtime_mode = \"disabled\" (or remove it)"
    );
}

#[test]
fn host_weight_runtime_required_and_wait_timeout_are_accepted_when_they_change_nothing() {
    let base = cfg("{}");
    assert_eq!(cfg(r#"{"host_weight_runtime_required": false, "host_weight_runtime_wait_timeout_s": 17.5}"#), base);
    assert_eq!(cfg(r#"{"host_weight_runtime_wait_timeout_s": null}"#), base);
    assert_eq!(
        cfg_err(r#"{"host_weight_runtime_required": true}"#),
        "host_weight_runtime_required: weightferry has no Host Weight Runtime, so it cannot be required; set \
         host_weight_runtime_required = false (or remove it)"
    );
    for bad in ["0", "-1.0"] {
        assert_eq!(
            cfg_err(&format!(r#"{{"host_weight_runtime_wait_timeout_s": {bad}}}"#)),
            format!(
                "host_weight_runtime_wait_timeout_s: must be finite and positive, found {bad}; it has no effect here \
                 (no Host Weight Runtime)"
            )
        );
    }
    assert_eq!(
        cfg_err(r#"{"host_weight_runtime_wait_timeout_s": "2m"}"#),
        "host_weight_runtime_wait_timeout_s: expected a number of seconds, found the string \"2m\""
    );
    for old in ["read_only", "read_write"] {
        assert_eq!(
            cfg_err(&format!(r#"{{"host_weight_runtime_mode": "{old}", "host_weight_runtime_root": "/hwr"}}"#)),
            format!(
                "host_weight_runtime_mode: \"{old}\" is an earlier generation's mode (vLLM-Omni now takes \
                 \"disabled\", \"preferred\" or \"required\"); weightferry has no Host Weight Runtime: set \
                 host_weight_runtime_mode = \"disabled\" (host masters are built from the loaded weights)"
            )
        );
    }
}

#[test]
fn dlo_host_registration_limit_has_no_effect_and_conflicts_with_the_compact_config() {
    assert_eq!(cfg(r#"{"dlo_host_registration_limit_gib": 0}"#), cfg("{}"));
    let c = cfg(r#"{"enable_distributed_layerwise_offload": true, "dlo_host_registration_limit_gib": 80}"#);
    assert_eq!(
        c.warnings,
        vec!["dlo_host_registration_limit_gib has no effect: it limits Host Weight Runtime registrations, which \
              weightferry never makes; remove it"
            .to_string()]
    );
    assert_eq!(
        cfg_err(r#"{"dlo_host_registration_limit_gib": -1.5}"#),
        "dlo_host_registration_limit_gib: expected a number >= 0 (0 = no ceiling), found -1.5"
    );
    assert_eq!(
        cfg_err(
            r#"{"dlo_host_registration_limit_gib": 0.5,
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#
        ),
        "dlo_host_registration_limit_gib: legacy distributed-offload tuning cannot be combined with \
         diffusion_offload_config; remove dlo_host_registration_limit_gib (it limits Host Weight Runtime \
         registrations, which weightferry never makes)"
    );
}

// ------------------------------------------------------------------------------------------------------------
// Config keys: chunked transport and pinning

#[test]
fn dlo_chunk_size_mb_is_deprecated_and_maps_to_allgather_chunk_size() {
    let c = cfg(r#"{"enable_distributed_layerwise_offload": true, "data_parallel_size": 2, "dlo_chunk_size_mb": 32}"#);
    assert_eq!(c.allgather_chunk_bytes(Component::Dit), Some(32 * 1024 * 1024));
    assert_eq!(
        c.warnings,
        vec!["dlo_chunk_size_mb is deprecated: it maps to \
              diffusion_offload_config.layer_options.dit.allgather_chunk_size = \"32MiB\""
            .to_string()]
    );
    let c =
        cfg(r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_chunk_size_mb": 64}"#);
    assert_eq!(c.allgather_chunk_bytes(Component::Dit), None);
    assert_eq!(
        c.warnings,
        vec!["dlo_chunk_size_mb has no effect without DiT AllGather transfer (it maps to \
              diffusion_offload_config.layer_options.dit.allgather_chunk_size = \"64MiB\")"
            .to_string()]
    );
    assert_eq!(cfg_err(r#"{"dlo_chunk_size_mb": 0}"#), "dlo_chunk_size_mb: expected an integer >= 1, found 0");
    assert_eq!(
        cfg_err(r#"{"dlo_chunk_size_mb": 64, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#),
        "dlo_chunk_size_mb: legacy distributed-offload tuning cannot be combined with diffusion_offload_config; \
         remove dlo_chunk_size_mb and set diffusion_offload_config.layer_options.dit.allgather_chunk_size instead"
    );
}

#[test]
fn pin_budget_pin_failure_policy_and_transport_backend() {
    assert_eq!(
        cfg(r#"{"dlo_pin_budget_gb": null, "dlo_pin_failure_policy": "fail", "dlo_transport_backend": "auto"}"#),
        cfg("{}")
    );
    assert_eq!(
        cfg_err(r#"{"dlo_pin_budget_gb": 64}"#),
        "dlo_pin_budget_gb: weightferry has no pinned-memory budget (every host master is pinned, or none is); remove \
         dlo_pin_budget_gb, and set pin_cpu_memory = false (diffusion_offload_config.pin_memory = false) for pageable \
         host masters"
    );
    assert_eq!(
        cfg_err(r#"{"dlo_pin_failure_policy": "whole_block_fallback"}"#),
        "dlo_pin_failure_policy: weightferry does not fall back to pageable blocks when pinning fails (enable fails \
         instead); remove dlo_pin_failure_policy, or set pin_cpu_memory = false (diffusion_offload_config.pin_memory \
         = false) for pageable host masters throughout"
    );
    assert_eq!(
        cfg_err(r#"{"dlo_pin_failure_policy": "retry"}"#),
        "dlo_pin_failure_policy: unknown pin failure policy \"retry\"; choose \"fail\" or \"whole_block_fallback\""
    );
    for backend in ["reference", "group_scatter_ag"] {
        assert_eq!(
            cfg_err(&format!(r#"{{"dlo_transport_backend": "{backend}"}}"#)),
            format!(
                "dlo_transport_backend: weightferry has one AllGather transport, so \"{backend}\" cannot be chosen; \
                 remove dlo_transport_backend (or set \"auto\") and tune it with \
                 diffusion_offload_config.layer_options.dit.allgather_chunk_size"
            )
        );
    }
    assert_eq!(
        cfg_err(r#"{"dlo_transport_backend": "nccl"}"#),
        "dlo_transport_backend: unknown transport backend \"nccl\"; choose \"auto\", \"reference\" or \
         \"group_scatter_ag\""
    );
}

#[test]
fn removed_layerwise_num_gpu_layers_names_its_replacement() {
    assert_eq!(
        cfg_err(r#"{"enable_layerwise_offload": true, "layerwise_num_gpu_layers": 2}"#),
        "layerwise_num_gpu_layers: vLLM-Omni removed this key (its layerwise offload keeps one block on the device \
         while the next prefetches); keep leading DiT blocks on the device with \
         diffusion_offload_config.layer_options.dit.resident_layers and choose how far blocks prefetch with \
         diffusion_offload_config.layer_options.dit.prefetch_depth"
    );
}

#[test]
fn unknown_keys_still_list_only_the_native_vocabulary() {
    let e = cfg_err(r#"{"host_weight_runtime_moed": "disabled"}"#);
    assert!(
        e.starts_with("host_weight_runtime_moed: unknown top-level key; valid keys are: enable_cpu_offload,"),
        "{e}"
    );
    assert!(!e.contains("dlo_chunk_size_mb"), "{e}");
}

// ------------------------------------------------------------------------------------------------------------
// Pipeline declarations: JSON

const JSON_HEAD: &str = r#"{"class": "P", "modules": {
    "transformer": {"class": "D", "children": {"blocks": {"repeat": 3, "block": {"class": "B", "tensors": {
        "w": {"dtype": "bf16", "shape": [8, 16]}}}}}}},
    "components": {"dit": ["transformer"]},"#;

#[test]
fn new_offload_plan_keys_parse_and_round_trip() {
    let text = format!(
        r#"{JSON_HEAD} "offload_plan": {{"block_attrs": {{"transformer": ["blocks"]}},
            "resident_encoder_block_paths": ["text_encoder.text.layers"],
            "layerwise_resident_layers": {{"transformer": 2}}}}}}"#
    );
    let p = load_pipeline_json(&text).unwrap_or_else(|e| panic!("{e}"));
    let plan = p.offload_plan.clone().unwrap();
    assert_eq!(plan.resident_encoder_block_paths, strings(&["text_encoder.text.layers"]));
    assert_eq!(plan.layerwise_resident_layers, BTreeMap::from([("transformer".to_string(), 2)]));
    let again = load_pipeline_json(&to_pipeline_json(&p)).unwrap();
    assert_eq!(again, p);
}

#[test]
fn host_resident_encoder_tables_are_refused_with_the_replacement() {
    let text = format!(
        r#"{JSON_HEAD} "offload_plan": {{"encoder_host_resident_table_attrs": {{"text_encoder": ["shared"]}}}}}}"#
    );
    assert_eq!(
        load_pipeline_json(&text).unwrap_err().to_string(),
        "offload_plan.encoder_host_resident_table_attrs: host-resident encoder tables are not supported (every weight \
         the engine reads is on the device when it runs); remove the declaration: the table then stays on the device \
         with the encoder's non-block weights, or streams with its block if it lies inside one"
    );
    let text = format!(r#"{JSON_HEAD} "offload_plan": {{"layerwise_resident_layers": {{"transformer": -1}}}}}}"#);
    assert_eq!(
        load_pipeline_json(&text).unwrap_err().to_string(),
        "offload_plan.layerwise_resident_layers.transformer: expected a non-negative integer that fits in 64 bits"
    );
}

// ------------------------------------------------------------------------------------------------------------
// Pipeline declarations: layerwise_resident_layers (deprecated)

fn dit_only(heads: &[(&str, u32)]) -> PipelineDesc {
    staged(
        "DeclaredHeadPipeline",
        true,
        OffloadPlanDecl {
            block_attrs: attrs_map(&[("transformer", &["blocks"])]),
            resident_dit_paths: strings(&["transformer"]),
            layerwise_resident_layers: heads.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
            ..OffloadPlanDecl::default()
        },
    )
}

#[test]
fn layerwise_resident_layers_declaration_is_deprecated_and_keeps_the_head() {
    let p = dit_only(&[("transformer", 2)]);
    let c = compact(r#""dit""#, "{}");
    let plan = ok(&p, &c);
    assert_eq!(plan.strategy, Strategy::LayerWise);
    let s = &plan.dits[0].stacks[0];
    assert_eq!((s.resident_head, s.resident_mask.clone()), (2, None));
    assert_eq!(s.streaming(), strings(&["transformer.blocks.2", "transformer.blocks.3"]));
    assert_eq!(
        plan.warnings,
        vec!["offload_plan.layerwise_resident_layers is deprecated: it maps to \
              diffusion_offload_config.layer_options.dit.resident_layers = 2 (with 'transformer' in \
              offload_plan.resident_dit_paths)"
            .to_string()]
    );
    assert_eq!(plan.budget.resident_head_bytes, 2 * U);

    // The config's own resident layers win.
    let plan = ok(&p, &compact(r#""dit""#, r#"{"dit": {"resident_layers": 1}}"#));
    assert_eq!(plan.dits[0].stacks[0].resident_head, 1);
    assert_eq!(
        plan.warnings,
        vec!["offload_plan.layerwise_resident_layers['transformer'] = 2 is ignored: the config's resident layers (1) \
              decide"
            .to_string()]
    );
    // So does the device-budget planner.
    let budget = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                          "device_budget": 100000}}"#);
    let plan = ok(&p, &budget);
    assert!(plan.budget.planner_chose);
    assert_eq!(
        plan.warnings,
        vec!["offload_plan.layerwise_resident_layers['transformer'] = 2 is ignored: with device_budget the planner \
              chooses the resident blocks"
            .to_string()]
    );
}

#[test]
fn layerwise_resident_layers_declaration_errors() {
    let p = dit_only(&[("transformer", 3)]);
    assert_eq!(
        err(&p, &compact(r#""dit""#, "{}")),
        "DiT 'transformer' has 4 blocks: layerwise_resident_layers=3 leaves only one streaming block; choose a \
         resident count that leaves zero or at least two (e.g. 4 or 2)"
    );
    // The compatibility topology keeps the last block resident instead.
    let plan = ok(&p, &cfg(r#"{"enable_layerwise_offload": true}"#));
    assert_eq!(plan.dits[0].stacks[0].resident_head, 4);
    let p = dit_only(&[("transformer_2", 1)]);
    assert_eq!(
        err(&p, &compact(r#""dit""#, "{}")),
        "offload_plan.layerwise_resident_layers names 'transformer_2', which is not a discovered DiT; fix the path or \
         remove the entry"
    );
}

// ------------------------------------------------------------------------------------------------------------
// Rule 1: a pipeline-managed encoder that also streams blocks stays on demand

#[test]
fn staged_encoder_with_stacks_stays_on_demand() {
    let p = staged("StagedStacksParityPipeline", true, staged_plan());
    // The compact selection leaves the VAE on the device; the compatibility topology stages it too.
    for (c, always) in
        [(compact(r#""dit", "text_encoder""#, "{}"), 2 * U), (cfg(r#"{"enable_layerwise_offload": true}"#), U)]
    {
        let plan = ok(&p, &c);
        let e = &plan.encoders[0];
        assert!(e.selected && e.on_demand, "{:?}", c.components);
        assert_eq!(e.stacks.len(), 2);
        // The staged part is the encoder less its blocks: the final norm only.
        let norm = p.tensor("text_encoder.final_norm.weight").unwrap().storage;
        assert_eq!(non_block_storages(&p, e), BTreeSet::from([norm]));
        // Counted as an on-demand phase (the VAE and the encoder's non-block weights are one U each), not as
        // always-resident weights: the DiT's embedding stays (and the VAE when it is not staged).
        assert_eq!(plan.budget.always_resident_bytes, always);
        assert_eq!(plan.budget.on_demand_peak_bytes, U);
        // The backend stages exactly that, and streams the blocks in their own rings.
        let units = build_unit_plan(&p, &c, &plan);
        assert!(!units.fixed.contains(&norm));
        let staged = units.stacks.iter().find(|s| s.name == "on-demand").expect("an on-demand stack");
        let enc = staged.units.iter().find(|u| u.path == "text_encoder").expect("the encoder is staged");
        assert_eq!(enc.storages().collect::<BTreeSet<_>>(), BTreeSet::from([norm]));
        let names: Vec<&str> = units.stacks.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            vec!["transformer[blocks]", "text_encoder[vision.blocks]", "text_encoder[text_model.layers]", "on-demand"]
        );
    }
}

#[test]
fn staged_encoder_weights_are_off_the_device_between_its_phases() {
    let p = Arc::new(staged("StagedStacksRunPipeline", true, staged_plan()));
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let mut model = HostModel::synthetic(platform.clone(), p.clone(), 3).unwrap();
    let checksum = model.checksum().unwrap();
    let hooks = HookRegistry::new();
    let c = compact(r#""dit", "text_encoder", "vae""#, "{}");
    let mut b = get_offload_backend(&c, platform.clone(), None).unwrap().unwrap();
    b.enable(&mut model, &hooks, compute).unwrap();
    let norm = p.tensor("text_encoder.final_norm.weight").unwrap().storage;
    let vae = p.tensor("vae.conv.weight").unwrap().storage;
    let not_here = |s| matches!(b.locate(s), Err(OffloadError::NotResident { .. }));
    assert!(not_here(norm), "parked before the encoder's phase");
    for pass in 0..2 {
        hooks.pre_forward("text_encoder").unwrap();
        assert!(b.locate(norm).is_ok(), "pass {pass}: on the device during its phase");
        for path in ["text_encoder.vision.blocks.0", "text_encoder.vision.blocks.1"] {
            hooks.pre_forward(path).unwrap();
            assert!(b.locate(p.tensor(&format!("{path}.fc.weight")).unwrap().storage).is_ok());
            hooks.post_forward(path).unwrap();
        }
        hooks.post_forward("text_encoder").unwrap();
        // The VAE's phase takes the staged slot: the encoder's non-block weights are off the device.
        hooks.pre_forward("vae").unwrap();
        assert!(b.locate(vae).is_ok());
        assert!(not_here(norm), "pass {pass}: parked while the VAE runs");
        hooks.post_forward("vae").unwrap();
    }
    b.disable(&mut model, &hooks).unwrap();
    assert_eq!(model.checksum().unwrap(), checksum, "host weights unchanged");
    assert_eq!(sim.device_memory().in_use, 0);
}

// ------------------------------------------------------------------------------------------------------------
// Encoder resident layers

#[test]
fn encoder_resident_layers_keep_the_head_of_each_eligible_stack() {
    let p = staged("EncoderResidentPipeline", true, staged_plan());
    let plan = ok(&p, &encoder_resident(2));
    assert_eq!(plan.strategy, Strategy::DistributedLayerWise);
    let e = &plan.encoders[0];
    assert!(e.on_demand);
    // Only the declared stack keeps a head; the vision stack streams whole.
    assert_eq!((e.stacks[0].name.as_str(), e.stacks[0].resident_head), ("text_encoder[vision.blocks]", 0));
    assert_eq!((e.stacks[1].name.as_str(), e.stacks[1].resident_head), ("text_encoder[text_model.layers]", 2));
    assert_eq!(e.stacks[1].streaming(), strings(&["text_encoder.text_model.layers.2"]));
    // The planner counts them: two resident blocks; slots: DiT 3 (depth 2 of 4 blocks), vision 2, text 1; the DiT's
    // embedding and the unselected VAE stay; the encoder's final norm is its on-demand phase.
    assert_eq!(plan.budget.always_resident_bytes, 2 * U);
    assert_eq!(plan.budget.resident_head_bytes, 2 * U);
    assert_eq!(plan.budget.slot_bytes, 6 * U);
    assert_eq!(plan.budget.on_demand_peak_bytes, U);
    assert_eq!(plan.budget.device_weight_bytes, 11 * U);
    // The legacy spelling resolves to the same plan (its key named in errors).
    let legacy = cfg(
        r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_encoder_resident_layers": 2}"#,
    );
    assert_eq!(ok(&p, &legacy).encoders[0].stacks[1].resident_head, 2);
    // Every block of the stack may stay.
    let plan = ok(&p, &encoder_resident(3));
    assert_eq!(plan.encoders[0].stacks[1].streaming(), Vec::<String>::new());
    assert_eq!(plan.encoders[0].stacks[1].slot_bytes(), 0);
}

#[test]
fn the_device_budget_respects_encoder_resident_layers() {
    let p = staged("EncoderResidentBudgetPipeline", true, staged_plan());
    let need = ok(&p, &encoder_resident(2)).budget.device_weight_bytes;
    let with_budget = |b: u64| {
        OffloadConfig::from_json_str(&format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit", "text_encoder"],
                "device_budget": {b}, "layer_options": {{"text_encoder": {{"resident_layers": 2}}}}}}}}"#
        ))
        .unwrap()
    };
    assert_eq!(ok(&p, &with_budget(need)).budget.device_weight_bytes, need);
    assert_eq!(
        err(&p, &with_budget(need - 1)),
        format!(
            "diffusion_offload_config.device_budget: the plan needs {need} bytes of device memory for weights but the \
             budget is {}; raise device_budget, lower resident_layers or prefetch_depth, or select more components",
            need - 1
        )
    );
}

#[test]
fn encoder_resident_layers_fail_before_anything_is_placed() {
    let key = "diffusion_offload_config.layer_options.text_encoder.resident_layers";
    let mut no_paths = staged_plan();
    no_paths.resident_encoder_block_paths.clear();
    assert_eq!(
        err(&staged("NoResidentPaths", true, no_paths), &encoder_resident(1)),
        format!(
            "{key} = 1: pipeline NoResidentPaths declares no offload_plan.resident_encoder_block_paths, so no encoder \
             stack may keep resident layers; declare the eligible encoder block lists there or set {key} = 0"
        )
    );
    let mut undeclared = staged_plan();
    undeclared.encoder_block_attrs = attrs_map(&[("text_encoder", &["vision.blocks"])]);
    assert_eq!(
        err(&staged("UndeclaredStack", true, undeclared), &encoder_resident(1)),
        "offload_plan.resident_encoder_block_paths names 'text_encoder.text_model.layers', which must also be declared \
         as an encoder block list in offload_plan.encoder_block_attrs; declare it there or remove it"
    );
    let mut missing = staged_plan();
    missing.encoder_block_attrs.insert("text_encoder_2".into(), strings(&["layers"]));
    missing.resident_encoder_block_paths = strings(&["text_encoder_2.layers"]);
    assert_eq!(
        err(&staged("MissingEncoder", true, missing), &encoder_resident(1)),
        "offload_plan.resident_encoder_block_paths names 'text_encoder_2.layers', but its encoder 'text_encoder_2' \
         was not discovered; declare 'text_encoder_2' in components.encoders or remove the path"
    );
    let mut not_staged = staged_plan();
    not_staged.on_demand_component_paths = strings(&["vae"]);
    assert_eq!(
        err(&staged("NotStaged", true, not_staged), &encoder_resident(1)),
        format!(
            "Encoder 'text_encoder' keeps resident layers ({key} = 1) only under pipeline-managed stage ownership: \
             list it in offload_plan.on_demand_component_paths (with load_to_device / offload_to_cpu), or remove \
             'text_encoder.text_model.layers' from offload_plan.resident_encoder_block_paths"
        )
    );
    assert_eq!(
        err(&staged("NoLifecycle", false, staged_plan()), &encoder_resident(1)),
        "On-demand component 'text_encoder' must implement load_to_device() and offload_to_cpu() (has_lifecycle) or \
         be removed from offload_plan.on_demand_component_paths"
    );
    assert_eq!(
        err(&staged("TooMany", true, staged_plan()), &encoder_resident(4)),
        format!("{key} = 4 exceeds the 3 blocks of encoder stack 'text_encoder.text_model.layers'; choose at most 3")
    );
    let legacy = cfg(
        r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_encoder_resident_layers": 5}"#,
    );
    assert_eq!(
        err(&staged("TooManyLegacy", true, staged_plan()), &legacy),
        "dlo_encoder_resident_layers = 5 exceeds the 3 blocks of encoder stack 'text_encoder.text_model.layers'; \
         choose at most 3"
    );
}

#[test]
fn encoder_resident_layers_stay_on_the_device_in_the_backend() {
    let p = Arc::new(staged("EncoderResidentRunPipeline", true, staged_plan()));
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let mut model = HostModel::synthetic(platform.clone(), p.clone(), 5).unwrap();
    let checksum = model.checksum().unwrap();
    let hooks = HookRegistry::new();
    let c = encoder_resident(2);
    let mut b = get_offload_backend(&c, platform.clone(), None).unwrap().unwrap();
    b.enable(&mut model, &hooks, compute).unwrap();
    let storage = |path: &str| p.tensor(path).unwrap().storage;
    let head =
        [storage("text_encoder.text_model.layers.0.fc.weight"), storage("text_encoder.text_model.layers.1.fc.weight")];
    let tail = storage("text_encoder.text_model.layers.2.fc.weight");
    let at_enable: Vec<_> = head.iter().map(|&s| b.locate(s).expect("resident from enable")).collect();
    assert!(matches!(b.locate(tail), Err(OffloadError::NotResident { .. })));
    for _ in 0..2 {
        hooks.pre_forward("text_encoder").unwrap();
        for i in 0..3 {
            let path = format!("text_encoder.text_model.layers.{i}");
            hooks.pre_forward(&path).unwrap();
            assert!(b.locate(storage(&format!("{path}.fc.weight"))).is_ok(), "{path}");
            hooks.post_forward(&path).unwrap();
        }
        hooks.post_forward("text_encoder").unwrap();
        let now: Vec<_> = head.iter().map(|&s| b.locate(s).unwrap()).collect();
        assert_eq!(now, at_enable, "resident blocks never move");
    }
    b.disable(&mut model, &hooks).unwrap();
    assert_eq!(model.checksum().unwrap(), checksum);
    assert_eq!(sim.device_memory().in_use, 0);
}

// ------------------------------------------------------------------------------------------------------------
// Rule 2: selecting the VAE needs a declared lifecycle

#[test]
fn vae_selection_needs_the_declared_lifecycle() {
    let with = staged("DeclaredVaePipeline", true, staged_plan());
    let plan = ok(&with, &compact(r#""dit", "vae""#, "{}"));
    assert!(plan.vaes[0].selected && plan.vaes[0].on_demand);
    let mut undeclared = staged_plan();
    undeclared.on_demand_component_paths = strings(&["text_encoder"]);
    let without = staged("UndeclaredVaePipeline", true, undeclared);
    let c = compact(r#""dit", "vae""#, "{}");
    assert_eq!(
        err(&without, &c),
        "Selected VAE 'vae' requires a pipeline-managed lifecycle: the pipeline's offload plan must list it in \
         offload_plan.on_demand_component_paths (and the module must implement load_to_device / offload_to_cpu); \
         declare it there or remove \"vae\" from diffusion_offload_config.components"
    );
    // Failing before anything is placed: the backend's enable touches nothing.
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let desc = Arc::new(without);
    let mut model = HostModel::synthetic(platform.clone(), desc, 1).unwrap();
    let hooks = HookRegistry::new();
    let mut b = get_offload_backend(&c, platform.clone(), None).unwrap().unwrap();
    assert!(b.enable(&mut model, &hooks, compute).is_err());
    assert!(hooks.hook_names().is_empty());
    assert_eq!(sim.device_memory().in_use, 0);
    // Module mode swaps the VAE with the other stages and needs no lifecycle.
    let plan = ok(
        &desc_of(&model),
        &cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit",
        "text_encoder", "vae"]}}"#),
    );
    assert!(plan.vaes[0].selected);
}

fn desc_of(model: &HostModel) -> PipelineDesc {
    model.desc().as_ref().clone()
}

// ------------------------------------------------------------------------------------------------------------
// Rule 4: the same blocks claimed twice through tied weights

/// Two DiTs of three blocks (`blocks.i.fc.weight` and `.bias` each); the tensors of `transformer_2` named in `tie`
/// (relative to the DiT) are tied to the same tensor of `transformer`.
fn two_dits(tie: &[&str]) -> PipelineDesc {
    let tensor = |dit: &str, i: usize, t: &str, shape: &str| {
        let rel = format!("blocks.{i}.fc.{t}");
        if dit == "transformer_2" && tie.contains(&rel.as_str()) {
            format!(r#""{t}": {{"dtype": "bf16", "shape": {shape}, "tied_to": "transformer.{rel}"}}"#)
        } else {
            format!(r#""{t}": {{"dtype": "bf16", "shape": {shape}}}"#)
        }
    };
    let dit = |name: &str| {
        let blocks: Vec<String> = (0..3)
            .map(|i| {
                format!(
                    r#""{i}": {{"class": "B", "children": {{"fc": {{"class": "Linear", "tensors": {{{}, {}}}}}}}}}"#,
                    tensor(name, i, "weight", "[16, 8]"),
                    tensor(name, i, "bias", "[16]")
                )
            })
            .collect();
        format!(
            r#""{name}": {{"class": "D", "tensors": {{"embed": {{"dtype": "bf16", "shape": [8]}}}},
                "children": {{"blocks": {{"class": "ModuleList", "children": {{{}}}}}}}}}"#,
            blocks.join(", ")
        )
    };
    let text = format!(
        r#"{{"class": "TwoDitPipeline", "modules": {{{}, {}}},
            "components": {{"dit": ["transformer", "transformer_2"]}},
            "offload_plan": {{"block_attrs": {{"transformer": ["blocks"], "transformer_2": ["blocks"]}}}}}}"#,
        dit("transformer"),
        dit("transformer_2")
    );
    load_pipeline_json(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

#[test]
fn tied_blocks_across_two_dits_are_rejected() {
    let all: Vec<String> =
        (0..3).flat_map(|i| [format!("blocks.{i}.fc.weight"), format!("blocks.{i}.fc.bias")]).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let p = two_dits(&all);
    let expected = "Offload block 'transformer_2.blocks.0' (of 'transformer_2') views exactly the weights of block \
                    'transformer.blocks.0' (of 'transformer'): the same block is claimed twice through tied weights; \
                    declare one owner for each block list";
    for c in [compact(r#""dit""#, "{}"), cfg(r#"{"enable_layerwise_offload": true}"#)] {
        assert_eq!(err(&p, &c), expected);
    }
    // Before anything is placed.
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(p), 1).unwrap();
    let hooks = HookRegistry::new();
    let mut b = get_offload_backend(&compact(r#""dit""#, "{}"), platform.clone(), None).unwrap().unwrap();
    let e = b.enable(&mut model, &hooks, compute).unwrap_err().to_string();
    assert!(e.contains(expected), "{e}");
    assert!(hooks.hook_names().is_empty());
    assert_eq!(sim.device_memory().in_use, 0);
}

#[test]
fn a_partly_tied_block_is_not_the_same_block() {
    // Only one weight of one block is tied: the blocks differ, the shared storage is pinned to the fixed placement.
    let p = two_dits(&["blocks.1.fc.weight"]);
    let plan = ok(&p, &compact(r#""dit""#, "{}"));
    assert!(plan.dits.iter().all(|d| d.selected));
    let shared = p.tensor("transformer.blocks.1.fc.weight").unwrap().storage;
    let units = build_unit_plan(&p, &compact(r#""dit""#, "{}"), &plan);
    assert!(units.fixed.contains(&shared));
    assert_eq!(storages_under(&p, "transformer_2.blocks.1").len(), 2);
}
