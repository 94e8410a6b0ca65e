//! Integration tests of the offload config: legacy flag priority, compact-config rules and conflicts, group
//! derivation, cross-feature guards, key/type errors with exact text, byte sizes, format parity and file loading.

use serde_json::json;
use std::collections::BTreeSet;
use weightferry::config::{
    parse_byte_size, Component, ConfigError, CopySubmission, GroupAxis, OffloadConfig, OffloadGroup, ParallelConfig,
    Strategy, WeightTransfer,
};

fn ok(text: &str) -> OffloadConfig {
    match OffloadConfig::from_json_str(text) {
        Ok(c) => c,
        Err(e) => panic!("expected {text} to be accepted, got: {e}"),
    }
}

fn err(text: &str) -> ConfigError {
    match OffloadConfig::from_json_str(text) {
        Ok(c) => panic!("expected {text} to be rejected, got: {c:?}"),
        Err(e) => e,
    }
}

/// Asserts the exact key and the exact full text (`"{key}: {message}"`).
fn assert_err(text: &str, key: &str, display: &str) {
    let e = err(text);
    assert_eq!(e.key(), key, "key of {text}");
    assert_eq!(e.to_string(), display, "text of {text}");
    assert_eq!(format!("{}: {}", e.key(), e.message()), display);
}

fn set(cs: &[Component]) -> Option<BTreeSet<Component>> {
    Some(cs.iter().copied().collect())
}

const SINGLE: OffloadGroup = OffloadGroup { size: 1, axis: GroupAxis::Single };

// ---------------------------------------------------------------------------------------------------------------
// Legacy flags

#[test]
fn legacy_priority_over_all_flag_combinations() {
    for bits in 0u8..8 {
        let cpu = bits & 1 != 0;
        let layer = bits & 2 != 0;
        let dlo = bits & 4 != 0;
        let text = json!({
            "enable_cpu_offload": cpu,
            "enable_layerwise_offload": layer,
            "enable_distributed_layerwise_offload": dlo,
        })
        .to_string();
        let expected = if dlo {
            Strategy::DistributedLayerWise
        } else if layer {
            Strategy::LayerWise
        } else if cpu {
            Strategy::ModelLevel
        } else {
            Strategy::None
        };
        let c = ok(&text);
        assert_eq!(c.strategy, expected, "flags cpu={cpu} layer={layer} dlo={dlo}");
        assert_eq!(c.components, None);
        assert!(!c.compact);
        assert_eq!(c.offloads(Component::Dit), expected != Strategy::None);
        assert!(!c.offloads(Component::TextEncoder));
        assert!(!c.offloads(Component::Vae));
        let dit_transfer = if dlo { WeightTransfer::Allgather } else { WeightTransfer::RankLocal };
        assert_eq!(c.transfer_for(Component::Dit), dit_transfer);
        assert_eq!(c.transfer_for(Component::TextEncoder), WeightTransfer::RankLocal);
        assert_eq!(c.transfer_for(Component::Vae), WeightTransfer::RankLocal);
        for comp in Component::ALL {
            assert_eq!(c.prefetch_depth(comp), None);
        }
    }
}

#[test]
fn empty_config_is_disabled() {
    assert_eq!(ok("{}"), OffloadConfig::disabled());
    assert_eq!(OffloadConfig::from_toml_str("").unwrap(), OffloadConfig::disabled());
    assert_eq!(ok(r#"{"diffusion_offload_config": null}"#), OffloadConfig::disabled());
}

#[test]
fn disabled_config_still_carries_parallel_and_pin_values() {
    let c = ok(r#"{"pin_cpu_memory": false, "data_parallel_size": 4, "tensor_parallel_size": 2}"#);
    assert_eq!(c.strategy, Strategy::None);
    assert!(!c.pin_memory);
    assert_eq!(c.parallel.data_parallel_size, 4);
    assert_eq!(c.parallel.tensor_parallel_size, 2);
    assert_eq!(c.group, SINGLE);
    assert_eq!(c.device_budget, None);
}

#[test]
fn legacy_dlo_transfer_follows_dlo_use_allgather() {
    let c =
        ok(r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_resident_layers": 3}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(c.transfer_for(Component::Dit), WeightTransfer::RankLocal);
    assert_eq!(c.resident_layers, 3);
    assert_eq!(c.group, SINGLE);

    let c = ok(r#"{"enable_distributed_layerwise_offload": true, "data_parallel_size": 2}"#);
    assert_eq!(c.transfer_for(Component::Dit), WeightTransfer::Allgather);
    assert_eq!(c.resident_layers, 0);
    assert_eq!(c.group, OffloadGroup { size: 2, axis: GroupAxis::DataParallel });
    assert!(c.uses_allgather(Component::Dit));
}

#[test]
fn legacy_resident_layers_with_allgather_is_rejected() {
    assert_err(
        r#"{"enable_distributed_layerwise_offload": true, "dlo_resident_layers": 2}"#,
        "dlo_resident_layers",
        "dlo_resident_layers: resident layers need the DiT weight transfer to be rank-local; set dlo_use_allgather \
         = false, or set dlo_resident_layers = 0",
    );
}

#[test]
fn legacy_dlo_settings_without_dlo_are_tolerated_and_ignored() {
    let c = ok(r#"{"enable_layerwise_offload": true, "dlo_resident_layers": 2, "dlo_use_allgather": true}"#);
    assert_eq!(c.strategy, Strategy::LayerWise);
    assert_eq!(c.resident_layers, 0);
    assert_eq!(c.transfer_for(Component::Dit), WeightTransfer::RankLocal);
    let c = ok(r#"{"dlo_use_allgather": false, "dlo_resident_layers": 5}"#);
    assert_eq!(c.strategy, Strategy::None);
    assert_eq!(c.resident_layers, 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Compact config: strategies and defaults

#[test]
fn compact_module_is_model_level_with_rank_local_defaults() {
    let c = ok(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}"#);
    assert_eq!(c.strategy, Strategy::ModelLevel);
    assert_eq!(c.components, set(&[Component::Dit, Component::TextEncoder, Component::Vae]));
    assert!(c.compact);
    assert!(c.pin_memory);
    assert_eq!(c.resident_layers, 0);
    assert!(!c.keep_dit_resident);
    for comp in Component::ALL {
        assert_eq!(c.transfer_for(comp), WeightTransfer::RankLocal);
        assert_eq!(c.prefetch_depth(comp), None);
    }
}

#[test]
fn compact_layer_strategy_depends_on_transfer_and_resident_layers() {
    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#);
    assert_eq!(c.strategy, Strategy::LayerWise);
    assert_eq!(c.components, set(&[Component::Dit]));
    assert!(c.offloads(Component::Dit));
    assert!(!c.offloads(Component::TextEncoder));

    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"weight_transfer": "rank-local", "prefetch_depth": 4}}}}"#);
    assert_eq!(c.strategy, Strategy::LayerWise);
    assert_eq!(c.prefetch_depth(Component::Dit), Some(4));

    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
        "layer_options": {"text_encoder": {"weight_transfer": "allgather", "prefetch_depth": 2}}}}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(c.transfer_for(Component::TextEncoder), WeightTransfer::Allgather);
    assert_eq!(c.transfer_for(Component::Dit), WeightTransfer::RankLocal);
    assert_eq!(c.prefetch_depth(Component::TextEncoder), Some(2));
    assert_eq!(c.group, SINGLE);

    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"resident_layers": 6}}}}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(c.resident_layers, 6);
    assert_eq!(c.transfer_for(Component::Dit), WeightTransfer::RankLocal);

    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"resident_layers": 0, "weight_transfer": "allgather"}}}}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(c.resident_layers, 0);
}

#[test]
fn compact_layer_mode_accepts_vae_as_a_component() {
    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["vae", "dit"]}}"#);
    assert_eq!(c.strategy, Strategy::LayerWise);
    assert_eq!(c.components, set(&[Component::Dit, Component::Vae]));
}

#[test]
fn empty_layer_options_are_allowed_in_module_mode() {
    let c = ok(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit"], "layer_options": {}}}"#);
    assert_eq!(c.strategy, Strategy::ModelLevel);
}

#[test]
fn pin_memory_resolution() {
    // (compact pin_memory fragment, top-level pin_cpu_memory fragment, expected)
    let cases = [
        (r#", "pin_memory": true"#, r#", "pin_cpu_memory": false"#, true),
        (r#", "pin_memory": false"#, r#", "pin_cpu_memory": true"#, false),
        (r#", "pin_memory": null"#, r#", "pin_cpu_memory": false"#, false),
        (r#", "pin_memory": null"#, "", true),
        ("", r#", "pin_cpu_memory": false"#, false),
        ("", "", true),
    ];
    for (compact, top, expected) in cases {
        let text = format!(
            r#"{{"use_hsdp": false{top}, "diffusion_offload_config": {{"mode": "module", "components": ["dit"]{compact}}}}}"#
        );
        assert_eq!(ok(&text).pin_memory, expected, "{text}");
    }
}

#[test]
fn device_budget_is_allowed_in_both_modes() {
    let c = ok(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit"], "device_budget": "24GiB"}}"#);
    assert_eq!(c.device_budget, Some(24 << 30));
    let c = ok(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": 1000}}"#);
    assert_eq!(c.device_budget, Some(1000));
}

#[test]
fn keep_dit_resident_rules() {
    let c = ok(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit"], "keep_dit_resident": true}}"#);
    assert!(c.keep_dit_resident);
    let c =
        ok(r#"{"diffusion_offload_config": {"mode": "module", "components": ["vae"], "keep_dit_resident": false}}"#);
    assert!(!c.keep_dit_resident);
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "keep_dit_resident": true}}"#,
        "diffusion_offload_config.keep_dit_resident",
        "diffusion_offload_config.keep_dit_resident: applies only to mode = \"module\"; remove keep_dit_resident \
         (in layer mode the planner keeps leading blocks resident within device_budget) or set mode = \"module\"",
    );
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "module", "components": ["vae"], "keep_dit_resident": true}}"#,
        "diffusion_offload_config.keep_dit_resident",
        "diffusion_offload_config.keep_dit_resident: the DiT is not offloaded, so there is nothing to keep \
         resident; add \"dit\" to components or remove keep_dit_resident",
    );
}

// ---------------------------------------------------------------------------------------------------------------
// Compact config: rule violations

#[test]
fn module_mode_rejects_layer_options() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "rank-local"}}}}"#,
        "diffusion_offload_config.layer_options",
        "diffusion_offload_config.layer_options: layer options apply only to mode = \"layer\"; remove \
         layer_options or set mode = \"layer\"",
    );
}

#[test]
fn vae_layer_options_are_rejected() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "vae"],
            "layer_options": {"vae": {}}}}"#,
        "diffusion_offload_config.layer_options.vae",
        "diffusion_offload_config.layer_options.vae: the VAE is staged to the device as a whole component and \
         takes no layer options; remove layer_options.vae",
    );
}

#[test]
fn layer_options_for_unselected_component_are_rejected() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}}}"#,
        "diffusion_offload_config.layer_options.text_encoder",
        "diffusion_offload_config.layer_options.text_encoder: text_encoder is not in \
         diffusion_offload_config.components; add \"text_encoder\" to components or remove these options",
    );
}

#[test]
fn text_encoder_resident_layers_are_encoder_resident_layers() {
    // vLLM-Omni parity (issue 18): the text encoder's resident layers keep leading blocks of the encoder stacks the
    // pipeline declares eligible; like the DiT's, they select the distributed strategy.
    let c = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["text_encoder"],
            "layer_options": {"text_encoder": {"resident_layers": 1}}}}"#,
    )
    .unwrap();
    assert_eq!((c.strategy, c.resident_layers, c.encoder_resident_layers), (Strategy::DistributedLayerWise, 0, 1));
}

#[test]
fn resident_layers_need_rank_local() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather", "resident_layers": 2}}}}"#,
        "diffusion_offload_config.layer_options.dit.resident_layers",
        "diffusion_offload_config.layer_options.dit.resident_layers: resident layers need weight_transfer = \
         \"rank-local\"; set diffusion_offload_config.layer_options.dit.weight_transfer = \"rank-local\" or remove \
         resident_layers",
    );
}

#[test]
fn prefetch_depth_range() {
    let base = |d: &str| {
        format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
                "layer_options": {{"dit": {{"prefetch_depth": {d}}}}}}}}}"#
        )
    };
    assert_eq!(ok(&base("64")).prefetch_depth(Component::Dit), Some(64));
    assert_eq!(ok(&base("1")).prefetch_depth(Component::Dit), Some(1));
    let key = "diffusion_offload_config.layer_options.dit.prefetch_depth";
    assert_err(&base("0"), key, &format!("{key}: expected an integer from 1 to 64, found 0"));
    assert_err(&base("65"), key, &format!("{key}: expected an integer from 1 to 64, found 65"));
    assert_err(&base("true"), key, &format!("{key}: expected an integer from 1 to 64, found the boolean true"));
    assert_err(&base("2.0"), key, &format!("{key}: expected an integer from 1 to 64, found the number 2.0"));
}

// ---------------------------------------------------------------------------------------------------------------
// Compact + legacy conflicts

#[test]
fn compact_with_conflicting_legacy_flag_is_rejected() {
    assert_err(
        r#"{"enable_cpu_offload": true,
            "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#,
        "enable_cpu_offload",
        "enable_cpu_offload: this legacy flag selects model-level offload, but diffusion_offload_config selects \
         layerwise offload; remove enable_cpu_offload (diffusion_offload_config alone decides the strategy)",
    );
    assert_err(
        r#"{"enable_layerwise_offload": true,
            "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather"}}}}"#,
        "enable_layerwise_offload",
        "enable_layerwise_offload: this legacy flag selects layerwise offload, but diffusion_offload_config selects \
         distributed layerwise offload; remove enable_layerwise_offload (diffusion_offload_config alone decides \
         the strategy)",
    );
    assert_err(
        r#"{"enable_distributed_layerwise_offload": true,
            "diffusion_offload_config": {"mode": "module", "components": ["dit"]}}"#,
        "enable_distributed_layerwise_offload",
        "enable_distributed_layerwise_offload: this legacy flag selects distributed layerwise offload, but \
         diffusion_offload_config selects model-level offload; remove enable_distributed_layerwise_offload \
         (diffusion_offload_config alone decides the strategy)",
    );
    // Each set flag is checked on its own, even when a higher-priority flag agrees.
    assert_eq!(
        err(r#"{"enable_layerwise_offload": true, "enable_cpu_offload": true,
            "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#)
        .key(),
        "enable_cpu_offload"
    );
}

#[test]
fn compact_with_agreeing_legacy_flag_is_tolerated() {
    let c =
        ok(r#"{"enable_cpu_offload": true, "diffusion_offload_config": {"mode": "module", "components": ["dit"]}}"#);
    assert_eq!(c.strategy, Strategy::ModelLevel);
    assert_eq!(c.components, set(&[Component::Dit]));
    let c = ok(r#"{"enable_layerwise_offload": true, "enable_cpu_offload": false,
        "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#);
    assert_eq!(c.strategy, Strategy::LayerWise);
    let c = ok(r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": true, "dlo_resident_layers": 0,
        "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"resident_layers": 1}}}}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(c.resident_layers, 1);
}

#[test]
fn compact_with_legacy_dlo_tuning_is_rejected() {
    assert_err(
        r#"{"dlo_use_allgather": false, "diffusion_offload_config": {"mode": "module", "components": ["dit"]}}"#,
        "dlo_use_allgather",
        "dlo_use_allgather: legacy distributed-offload tuning cannot be combined with diffusion_offload_config; \
         remove dlo_use_allgather and set diffusion_offload_config.layer_options.<component>.weight_transfer \
         instead",
    );
    assert_err(
        r#"{"dlo_resident_layers": 1, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#,
        "dlo_resident_layers",
        "dlo_resident_layers: legacy distributed-offload tuning cannot be combined with diffusion_offload_config; \
         remove dlo_resident_layers and set diffusion_offload_config.layer_options.dit.resident_layers instead",
    );
}

// ---------------------------------------------------------------------------------------------------------------
// Group derivation and guards

fn dlo_config(dp: u32, sp: u32, tp: u32, allgather: bool) -> String {
    let transfer = if allgather { "allgather" } else { "rank-local" };
    json!({
        "data_parallel_size": dp,
        "sequence_parallel_size": sp,
        "tensor_parallel_size": tp,
        "diffusion_offload_config": {
            "mode": "layer",
            "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": transfer}},
        },
    })
    .to_string()
}

#[test]
fn group_size_matrix() {
    let matrix = [
        ((1, 1, 1, true), 1, GroupAxis::Single),
        ((2, 1, 1, true), 2, GroupAxis::DataParallel),
        ((1, 4, 1, true), 4, GroupAxis::SequenceParallel),
        ((2, 2, 2, true), 2, GroupAxis::DataParallel),
        ((2, 2, 2, false), 1, GroupAxis::Single),
        ((1, 4, 2, false), 1, GroupAxis::Single),
        ((1, 1, 8, true), 1, GroupAxis::Single),
    ];
    for ((dp, sp, tp, ag), size, axis) in matrix {
        let c = ok(&dlo_config(dp, sp, tp, ag));
        assert_eq!(c.group, OffloadGroup { size, axis }, "(dp, sp, tp, allgather) = ({dp}, {sp}, {tp}, {ag})");
        assert_eq!(c.uses_allgather(Component::Dit), ag && size > 1);
    }
    // The same matrix through the legacy flags.
    for ((dp, sp, tp, ag), size, _) in matrix {
        let text = json!({
            "enable_distributed_layerwise_offload": true,
            "dlo_use_allgather": ag,
            "data_parallel_size": dp,
            "sequence_parallel_size": sp,
            "tensor_parallel_size": tp,
        })
        .to_string();
        assert_eq!(ok(&text).group.size, size, "legacy ({dp}, {sp}, {tp}, {ag})");
    }
}

#[test]
fn group_is_single_for_non_distributed_strategies() {
    let c = ok(r#"{"data_parallel_size": 4, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#);
    assert_eq!(c.group, SINGLE);
    let c = ok(r#"{"data_parallel_size": 4, "enable_layerwise_offload": true}"#);
    assert_eq!(c.group, SINGLE);
}

#[test]
fn weight_shard_group_derivation() {
    let p = |dp, sp, hsdp, shard, rep| ParallelConfig {
        data_parallel_size: dp,
        sequence_parallel_size: sp,
        tensor_parallel_size: 1,
        use_hsdp: hsdp,
        hsdp_shard_size: shard,
        hsdp_replicate_size: rep,
    };
    assert_eq!(p(1, 1, true, 2, 2).weight_shard_group(), OffloadGroup { size: 4, axis: GroupAxis::Hsdp });
    assert_eq!(p(1, 4, true, 1, 1).weight_shard_group(), OffloadGroup { size: 4, axis: GroupAxis::SequenceParallel });
    assert_eq!(p(2, 1, true, -1, 3).weight_shard_group(), OffloadGroup { size: 2, axis: GroupAxis::DataParallel });
    assert_eq!(p(3, 1, false, 2, 2).weight_shard_group(), OffloadGroup { size: 3, axis: GroupAxis::DataParallel });
    assert!(!p(1, 1, true, -1, 1).hsdp_sharded());
    assert!(p(1, 1, true, 1, 1).hsdp_sharded());
}

#[test]
fn hsdp_with_allgather_is_rejected() {
    assert_err(
        r#"{"use_hsdp": true, "hsdp_shard_size": 2, "hsdp_replicate_size": 2,
            "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather"}}}}"#,
        "use_hsdp",
        "use_hsdp: HSDP already shards the weights across ranks, so AllGather offload would shard them twice; set \
         diffusion_offload_config.layer_options.dit.weight_transfer = \"rank-local\" or set use_hsdp = false",
    );
    assert_err(
        r#"{"use_hsdp": true, "hsdp_shard_size": 4, "enable_distributed_layerwise_offload": true}"#,
        "use_hsdp",
        "use_hsdp: HSDP already shards the weights across ranks, so AllGather offload would shard them twice; set \
         dlo_use_allgather = false or set use_hsdp = false",
    );
}

#[test]
fn hsdp_without_allgather_is_accepted_with_group_one() {
    let c = ok(r#"{"use_hsdp": true, "hsdp_shard_size": 2, "hsdp_replicate_size": 2,
        "enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_resident_layers": 2}"#);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    assert_eq!(c.group, SINGLE);
    assert_eq!(c.parallel.hsdp_shard_size, 2);
    let c = ok(r#"{"use_hsdp": true, "hsdp_shard_size": 2,
        "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#);
    assert_eq!(c.group, SINGLE);
}

#[test]
fn hsdp_with_unset_shard_size_is_not_sharded() {
    let c = ok(r#"{"use_hsdp": true, "hsdp_shard_size": -1, "data_parallel_size": 2,
        "enable_distributed_layerwise_offload": true}"#);
    assert_eq!(c.group, OffloadGroup { size: 2, axis: GroupAxis::DataParallel });
    let c = ok(r#"{"use_hsdp": true, "enable_distributed_layerwise_offload": true, "sequence_parallel_size": 2}"#);
    assert_eq!(c.group, OffloadGroup { size: 2, axis: GroupAxis::SequenceParallel });
}

#[test]
fn step_cache_with_allgather_group_is_rejected() {
    assert_err(
        r#"{"data_parallel_size": 2, "cache_backend": "tea_cache",
            "enable_distributed_layerwise_offload": true}"#,
        "cache_backend",
        "cache_backend: the step cache \"tea_cache\" decides per rank which steps to skip, so ranks could skip \
         different weight AllGathers and hang; set cache_backend = \"none\", or set dlo_use_allgather = false",
    );
    assert_err(
        r#"{"sequence_parallel_size": 2, "cache_backend": "cache_dit",
            "diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
            "layer_options": {"dit": {"weight_transfer": "allgather"}, "text_encoder": {"weight_transfer": "allgather"}}}}"#,
        "cache_backend",
        "cache_backend: the step cache \"cache_dit\" decides per rank which steps to skip, so ranks could skip \
         different weight AllGathers and hang; set cache_backend = \"none\", or set \
         diffusion_offload_config.layer_options.dit.weight_transfer and \
         diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\"",
    );
}

#[test]
fn step_cache_is_fine_without_an_allgather_group() {
    for extra in [
        r#""cache_backend": "none", "data_parallel_size": 2, "enable_distributed_layerwise_offload": true"#,
        r#""cache_backend": null, "data_parallel_size": 2, "enable_distributed_layerwise_offload": true"#,
        r#""cache_backend": "tea_cache", "enable_distributed_layerwise_offload": true"#,
        r#""cache_backend": "tea_cache", "data_parallel_size": 2, "enable_distributed_layerwise_offload": true, "dlo_use_allgather": false"#,
        r#""cache_backend": "tea_cache", "data_parallel_size": 2, "enable_layerwise_offload": true"#,
    ] {
        ok(&format!("{{{extra}}}"));
    }
}

#[test]
fn prompt_embed_cache_with_text_encoder_allgather_is_rejected() {
    let text = |dp: u32, cache: bool, te: &str| {
        json!({
            "data_parallel_size": dp,
            "enable_prompt_embed_cache": cache,
            "diffusion_offload_config": {
                "mode": "layer",
                "components": ["dit", "text_encoder"],
                "layer_options": {"text_encoder": {"weight_transfer": te}},
            },
        })
        .to_string()
    };
    assert_err(
        &text(2, true, "allgather"),
        "enable_prompt_embed_cache",
        "enable_prompt_embed_cache: prompt-embedding cache hits are per rank, so ranks could skip different \
         text-encoder AllGathers and hang; set enable_prompt_embed_cache = false, or set \
         diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\"",
    );
    ok(&text(1, true, "allgather"));
    ok(&text(2, false, "allgather"));
    ok(&text(2, true, "rank-local"));
    // The DiT gathering while the text encoder is rank-local is fine with the prompt cache.
    ok(r#"{"data_parallel_size": 2, "enable_prompt_embed_cache": true, "enable_distributed_layerwise_offload": true}"#);
}

// ---------------------------------------------------------------------------------------------------------------
// Unknown keys

#[test]
fn unknown_top_level_key_lists_valid_keys() {
    assert_err(
        r#"{"enable_cpu_ofload": true}"#,
        "enable_cpu_ofload",
        "enable_cpu_ofload: unknown top-level key (did you mean `enable_cpu_offload`?); valid keys are: \
         enable_cpu_offload, enable_layerwise_offload, enable_distributed_layerwise_offload, pin_cpu_memory, \
         dlo_use_allgather, dlo_resident_layers, data_parallel_size, sequence_parallel_size, tensor_parallel_size, \
         use_hsdp, hsdp_shard_size, hsdp_replicate_size, cache_backend, enable_prompt_embed_cache, \
         diffusion_offload_config",
    );
    assert_eq!(err(r#"{"zzz": 1, "a b": 2}"#).key(), "\"a b\"");
}

#[test]
fn unknown_compact_key_lists_valid_keys() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "budget": "1GiB"}}"#,
        "diffusion_offload_config.budget",
        "diffusion_offload_config.budget: unknown diffusion_offload_config key; valid keys are: mode, components, \
         layer_options, pin_memory, host_masters, device_budget, host_budget, keep_dit_resident",
    );
}

#[test]
fn unknown_layer_option_lists_valid_keys() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"prefetch": 2}}}}"#,
        "diffusion_offload_config.layer_options.dit.prefetch",
        "diffusion_offload_config.layer_options.dit.prefetch: unknown layer option (did you mean \
         `prefetch_depth`?); valid keys are: weight_transfer, resident_layers, prefetch_depth, allgather_chunk_size, \
         copy_submission, static_slots",
    );
}

#[test]
fn unknown_layer_options_component_lists_valid_keys() {
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"transformer": {}}}}"#,
        "diffusion_offload_config.layer_options.transformer",
        "diffusion_offload_config.layer_options.transformer: unknown component; valid keys are: dit, text_encoder",
    );
    assert_err(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {" dit ": {}}}}"#,
        "diffusion_offload_config.layer_options.\" dit \"",
        "diffusion_offload_config.layer_options.\" dit \": unknown component (did you mean `dit`?); valid keys \
         are: dit, text_encoder",
    );
}

// ---------------------------------------------------------------------------------------------------------------
// Wrong types and values

#[test]
fn top_level_type_errors() {
    assert_err(
        r#"{"enable_cpu_offload": 1}"#,
        "enable_cpu_offload",
        "enable_cpu_offload: expected true or false, found the integer 1; remove the key to use the default",
    );
    assert_err(
        r#"{"pin_cpu_memory": "yes"}"#,
        "pin_cpu_memory",
        "pin_cpu_memory: expected true or false, found the string \"yes\"; remove the key to use the default",
    );
    assert_err(
        r#"{"dlo_resident_layers": true}"#,
        "dlo_resident_layers",
        "dlo_resident_layers: expected an integer >= 0, found the boolean true",
    );
    assert_err(
        r#"{"dlo_resident_layers": -1}"#,
        "dlo_resident_layers",
        "dlo_resident_layers: expected an integer >= 0, found -1",
    );
    assert_err(
        r#"{"data_parallel_size": 0}"#,
        "data_parallel_size",
        "data_parallel_size: expected an integer >= 1, found 0",
    );
    assert_err(
        r#"{"tensor_parallel_size": 4294967296}"#,
        "tensor_parallel_size",
        "tensor_parallel_size: expected an integer >= 1, found 4294967296",
    );
    assert_err(
        r#"{"sequence_parallel_size": null}"#,
        "sequence_parallel_size",
        "sequence_parallel_size: expected an integer >= 1, found null",
    );
    assert_err(
        r#"{"hsdp_shard_size": 0}"#,
        "hsdp_shard_size",
        "hsdp_shard_size: expected -1 (unset) or an integer >= 1, found 0; use -1 to leave the shard size unset",
    );
    assert_err(
        r#"{"hsdp_shard_size": -2}"#,
        "hsdp_shard_size",
        "hsdp_shard_size: expected -1 (unset) or an integer >= 1, found -2",
    );
    assert_err(
        r#"{"hsdp_replicate_size": 0}"#,
        "hsdp_replicate_size",
        "hsdp_replicate_size: expected an integer >= 1, found 0",
    );
    assert_err(
        r#"{"cache_backend": 3}"#,
        "cache_backend",
        "cache_backend: expected a cache backend name, \"none\" or null, found the integer 3",
    );
    assert_err(
        r#"{"cache_backend": ""}"#,
        "cache_backend",
        "cache_backend: empty backend name; use \"none\" (or remove the key) to run without a step cache",
    );
    assert_err(
        r#"{"diffusion_offload_config": ["dit"]}"#,
        "diffusion_offload_config",
        "diffusion_offload_config: expected an object, found a list",
    );
    assert_err(
        "[1, 2]",
        "<root>",
        "<root>: expected an object of settings at the top level, found a list; write the settings as an object, \
         e.g. {\"enable_cpu_offload\": true}",
    );
}

#[test]
fn hsdp_group_too_large_is_rejected() {
    assert_err(
        r#"{"use_hsdp": true, "hsdp_shard_size": 4294967295, "hsdp_replicate_size": 2}"#,
        "hsdp_shard_size",
        "hsdp_shard_size: hsdp_shard_size x hsdp_replicate_size = 8589934590 ranks is too large; use sizes that \
         match the real cluster",
    );
}

fn compact(body: &str) -> String {
    format!(r#"{{"diffusion_offload_config": {{{body}}}}}"#)
}

#[test]
fn mode_errors() {
    let key = "diffusion_offload_config.mode";
    assert_err(
        &compact(r#""components": ["dit"]"#),
        key,
        "diffusion_offload_config.mode: missing; set mode = \"module\" (whole components swap per phase) or \
         \"layer\" (blocks stream through device slots)",
    );
    assert_err(
        &compact(r#""mode": "layerwise", "components": ["dit"]"#),
        key,
        "diffusion_offload_config.mode: unknown mode \"layerwise\" (did you mean \"layer\"?); choose \"module\" or \
         \"layer\"",
    );
    assert_err(
        &compact(r#""mode": "Module", "components": ["dit"]"#),
        key,
        "diffusion_offload_config.mode: unknown mode \"Module\" (did you mean \"module\"?); choose \"module\" or \
         \"layer\"",
    );
    assert_err(
        &compact(r#""mode": "sequential", "components": ["dit"]"#),
        key,
        "diffusion_offload_config.mode: unknown mode \"sequential\"; choose \"module\" or \"layer\"",
    );
    assert_err(
        &compact(r#""mode": true, "components": ["dit"]"#),
        key,
        "diffusion_offload_config.mode: expected \"module\" or \"layer\", found the boolean true",
    );
}

#[test]
fn components_errors() {
    let key = "diffusion_offload_config.components";
    assert_err(
        &compact(r#""mode": "layer""#),
        key,
        "diffusion_offload_config.components: missing; list the components to offload, e.g. [\"dit\"] (choose \
         from: dit, text_encoder, vae)",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": "dit""#),
        key,
        "diffusion_offload_config.components: expected a non-empty list of component names such as [\"dit\", \
         \"text_encoder\"], found the string \"dit\"",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": {"dit": true}"#),
        key,
        "diffusion_offload_config.components: expected a non-empty list of component names such as [\"dit\", \
         \"text_encoder\"], found an object",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": []"#),
        key,
        "diffusion_offload_config.components: the list is empty; name at least one of dit, text_encoder, vae (or \
         remove diffusion_offload_config to disable offload)",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": ["dit", " dit "]"#),
        "diffusion_offload_config.components[1]",
        "diffusion_offload_config.components[1]: unknown component \" dit \" (did you mean \"dit\"?); choose from \
         dit, text_encoder, vae (names are matched exactly)",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": ["image_encoder"]"#),
        "diffusion_offload_config.components[0]",
        "diffusion_offload_config.components[0]: unknown component \"image_encoder\"; choose from dit, \
         text_encoder, vae (names are matched exactly)",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": ["dit", "vae", "dit"]"#),
        "diffusion_offload_config.components[2]",
        "diffusion_offload_config.components[2]: \"dit\" is listed twice; list each component once",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": [1]"#),
        "diffusion_offload_config.components[0]",
        "diffusion_offload_config.components[0]: expected a component name (dit, text_encoder or vae), found the \
         integer 1",
    );
}

#[test]
fn layer_option_value_errors() {
    let with = |opts: &str| compact(&format!(r#""mode": "layer", "components": ["dit"], "layer_options": {opts}"#));
    assert_err(
        &with(r#"{"dit": {"weight_transfer": "rank_local"}}"#),
        "diffusion_offload_config.layer_options.dit.weight_transfer",
        "diffusion_offload_config.layer_options.dit.weight_transfer: unknown weight transfer \"rank_local\" (did \
         you mean \"rank-local\"?); choose \"allgather\" or \"rank-local\"",
    );
    assert_err(
        &with(r#"{"dit": {"weight_transfer": "nccl"}}"#),
        "diffusion_offload_config.layer_options.dit.weight_transfer",
        "diffusion_offload_config.layer_options.dit.weight_transfer: unknown weight transfer \"nccl\"; choose \
         \"allgather\" or \"rank-local\"",
    );
    assert_err(
        &with(r#"{"dit": {"weight_transfer": ["allgather"]}}"#),
        "diffusion_offload_config.layer_options.dit.weight_transfer",
        "diffusion_offload_config.layer_options.dit.weight_transfer: expected \"allgather\" or \"rank-local\", \
         found a list",
    );
    assert_err(
        &with(r#"{"dit": {"resident_layers": false}}"#),
        "diffusion_offload_config.layer_options.dit.resident_layers",
        "diffusion_offload_config.layer_options.dit.resident_layers: expected an integer >= 0, found the boolean \
         false",
    );
    assert_err(
        &with(r#"{"dit": "allgather"}"#),
        "diffusion_offload_config.layer_options.dit",
        "diffusion_offload_config.layer_options.dit: expected an object, found the string \"allgather\"",
    );
    assert_err(
        &with(r#"["dit"]"#),
        "diffusion_offload_config.layer_options",
        "diffusion_offload_config.layer_options: expected an object, found a list",
    );
    assert_err(
        &compact(r#""mode": "layer", "components": ["dit"], "pin_memory": "true""#),
        "diffusion_offload_config.pin_memory",
        "diffusion_offload_config.pin_memory: expected true, false or null, found the string \"true\"; null (or no \
         key) inherits pin_cpu_memory",
    );
    assert_err(
        &compact(r#""mode": "module", "components": ["dit"], "keep_dit_resident": 1"#),
        "diffusion_offload_config.keep_dit_resident",
        "diffusion_offload_config.keep_dit_resident: expected true or false, found the integer 1; remove the key \
         to use the default",
    );
}

// ---------------------------------------------------------------------------------------------------------------
// device_budget

const FORMS: &str = "a positive integer number of bytes such as 8000000000, or a string such as \"24GiB\", \
\"512MiB\", \"1.5GB\" or \"8000000000\" (units B; KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of \
1024)";

#[test]
fn byte_size_forms() {
    let cases: [(&str, u64); 14] = [
        ("24GiB", 24 * (1 << 30)),
        ("512MiB", 512 * (1 << 20)),
        ("1.5GB", 1_500_000_000),
        ("8000000000", 8_000_000_000),
        ("1B", 1),
        ("3KB", 3_000),
        ("2MB", 2_000_000),
        ("2TB", 2_000_000_000_000),
        ("1KiB", 1024),
        ("1TiB", 1 << 40),
        ("1.5GiB", 1_610_612_736),
        ("512 MiB", 512 * (1 << 20)),
        ("0.1KiB", 102),
        ("18446744073709551615", u64::MAX),
    ];
    for (text, bytes) in cases {
        assert_eq!(parse_byte_size(text, "k").unwrap(), bytes, "{text}");
    }
}

#[test]
fn byte_size_rejections() {
    let bad = |text: &str, why: &str| {
        let e = parse_byte_size(text, "device_budget").unwrap_err();
        assert_eq!(e.to_string(), format!("device_budget: {why}; expected {FORMS}"), "{text}");
    };
    bad("-1GB", "\"-1GB\" is negative");
    bad("lots", "\"lots\" is not a byte size");
    bad("", "\"\" is not a byte size");
    bad(" 1GB", "\" 1GB\" is not a byte size");
    bad("1.GB", "\"1.GB\" is not a byte size");
    bad(".5GB", "\".5GB\" is not a byte size");
    bad("1.2.3GB", "\"1.2.3GB\" is not a byte size");
    bad("24gb", "\"24gb\" has an unknown unit \"gb\"");
    bad("24GiB ", "\"24GiB \" has an unknown unit \"GiB \"");
    bad("24  GiB", "\"24  GiB\" has an unknown unit \" GiB\"");
    bad("1.5", "\"1.5\" has a fraction of a byte");
    bad("1.5B", "\"1.5B\" has a fraction of a byte");
    bad("18446744073709551616", "\"18446744073709551616\" is larger than 2^64 - 1 bytes");
    bad("20000000TiB", "\"20000000TiB\" is larger than 2^64 - 1 bytes");
    bad("1000000000000000000000000000", "\"1000000000000000000000000000\" is larger than 2^64 - 1 bytes");
    bad("1.0000000000000000001GB", "\"1.0000000000000000001GB\" has too many decimals");
    assert_eq!(
        parse_byte_size("0GiB", "device_budget").unwrap_err().to_string(),
        "device_budget: \"0GiB\" is zero bytes; give a positive size, or remove the key for no limit"
    );
    assert_eq!(
        parse_byte_size("0.0001KB", "device_budget").unwrap_err().to_string(),
        "device_budget: \"0.0001KB\" is zero bytes; give a positive size, or remove the key for no limit"
    );
}

#[test]
fn allgather_chunk_size_is_read_and_validated() {
    let with = |transfer: &str, v: &str| {
        compact(&format!(
            r#""mode": "layer", "components": ["dit"],
               "layer_options": {{"dit": {{{transfer}"allgather_chunk_size": {v}}}}}"#
        ))
    };
    let ag = r#""weight_transfer": "allgather", "#;
    let c = ok(&with(ag, r#""64MiB""#));
    assert_eq!(c.allgather_chunk_bytes(Component::Dit), Some(64 << 20));
    assert_eq!(c.allgather_chunk_bytes(Component::TextEncoder), None);
    assert_eq!(ok(&with(ag, "1000")).allgather_chunk_bytes(Component::Dit), Some(1000));
    let key = "diffusion_offload_config.layer_options.dit.allgather_chunk_size";
    assert_err(
        &with("", r#""64MiB""#),
        key,
        &format!(
            "{key}: the chunk size applies only to AllGather transfer; set \
             diffusion_offload_config.layer_options.dit.weight_transfer = \"allgather\" or remove allgather_chunk_size"
        ),
    );
    assert_err(
        &with(ag, "0"),
        key,
        &format!(
            "{key}: 0 bytes is no chunk size; give a positive size such as \"64MiB\", or remove the key for one \
             AllGather per section"
        ),
    );
    assert_err(
        &with(ag, r#""0MiB""#),
        key,
        &format!(
            "{key}: \"0MiB\" is zero bytes; give a positive size, or remove the key for one AllGather per section"
        ),
    );
    assert_err(&with(ag, "true"), key, &format!("{key}: expected {FORMS}, found the boolean true"));
    // Without the key: one AllGather per section.
    assert_eq!(ok(&compact(r#""mode": "layer", "components": ["dit"]"#)).allgather_chunk_bytes(Component::Dit), None);
}

#[test]
fn device_budget_value_errors() {
    let key = "diffusion_offload_config.device_budget";
    let with = |v: &str| compact(&format!(r#""mode": "layer", "components": ["dit"], "device_budget": {v}"#));
    assert_err(&with("-5"), key, &format!("{key}: expected {FORMS}, found the integer -5"));
    assert_err(&with("1.5e9"), key, &format!("{key}: expected {FORMS}, found the number 1500000000.0"));
    assert_err(&with("true"), key, &format!("{key}: expected {FORMS}, found the boolean true"));
    assert_err(&with("null"), key, &format!("{key}: expected {FORMS}, found null"));
    assert_err(
        &with("0"),
        key,
        &format!("{key}: 0 bytes leaves no room for weights; give a positive size, or remove the key for no limit"),
    );
    assert_err(&with(r#""-24GiB""#), key, &format!("{key}: \"-24GiB\" is negative; expected {FORMS}"));
    assert_eq!(ok(&with(r#""8000000000""#)).device_budget, Some(8_000_000_000));
    // "auto" is exact: another spelling is a size string that does not parse.
    let e = err(&with(r#""Auto""#));
    assert_eq!(e.key(), key);
}

#[test]
fn device_budget_auto_is_resolved_from_the_free_memory() {
    let mut c = ok(&compact(r#""mode": "layer", "components": ["dit"], "device_budget": "auto""#));
    assert_eq!((c.device_budget, c.device_budget_auto), (None, true));
    // The headroom is the larger of 2 GiB and a tenth of the free memory.
    assert_eq!(OffloadConfig::auto_budget_headroom(10 << 30), 2 << 30);
    assert_eq!(OffloadConfig::auto_budget_headroom(100 << 30), 10 << 30);
    let mut small = c.clone();
    assert_eq!(c.resolve_auto_budget(100 << 30), Some((90 << 30, 10 << 30)));
    assert_eq!((c.device_budget, c.device_budget_auto), (Some(90 << 30), false));
    assert_eq!(c.resolve_auto_budget(100 << 30), None, "resolved once");
    // A device with less free memory than the headroom gets a 1-byte budget: the planner then says what it needs.
    assert_eq!(small.resolve_auto_budget(1 << 30), Some((1, 2 << 30)));
    let mut sized = ok(&compact(r#""mode": "layer", "components": ["dit"], "device_budget": "24GiB""#));
    assert_eq!(sized.resolve_auto_budget(100 << 30), None);
    assert_eq!(sized.device_budget, Some(24 << 30));
}

#[test]
fn host_budget_auto_is_the_available_memory_plus_the_weights_held_less_a_headroom() {
    let mut c = ok(&compact(r#""mode": "layer", "components": ["dit"], "host_budget": "auto""#));
    assert_eq!((c.host_budget, c.host_budget_auto), (None, true));
    let mut small = c.clone();
    // 70 GiB available + 30 GiB of weights held: a tenth of the 100 GiB is the headroom.
    assert_eq!(c.resolve_auto_host_budget(70 << 30, 30 << 30), Some((90 << 30, 10 << 30)));
    assert_eq!((c.host_budget, c.host_budget_auto), (Some(90 << 30), false));
    assert_eq!(c.resolve_auto_host_budget(70 << 30, 30 << 30), None, "resolved once");
    // Under 2 GiB in all: a 1-byte budget, so enable says what the masters need.
    assert_eq!(small.resolve_auto_host_budget(1 << 30, 0), Some((1, 2 << 30)));
    let mut sized = ok(&compact(r#""mode": "layer", "components": ["dit"], "host_budget": "64GiB""#));
    assert_eq!((sized.host_budget, sized.resolve_auto_host_budget(1 << 40, 0)), (Some(64 << 30), None));
}

// ---------------------------------------------------------------------------------------------------------------
// Syntax errors, formats, files

#[test]
fn json_syntax_errors_have_line_and_column() {
    let e = err("{\n  \"enable_cpu_offload\": true,\n}");
    assert_eq!(e.key(), "<file>");
    assert_eq!(e.line_column(), Some((3, 1)));
    assert_eq!(
        e.to_string(),
        "<file>: invalid JSON at line 3, column 1: trailing comma; fix the JSON at that position"
    );
    // Empty text is an empty config, in JSON as in TOML: offload disabled.
    for empty in ["", "   \n"] {
        let c = OffloadConfig::from_json_str(empty).unwrap();
        assert_eq!(c, OffloadConfig::from_toml_str(empty).unwrap());
        assert_eq!(c, OffloadConfig::from_json_str("{}").unwrap());
        assert_eq!(c.strategy, Strategy::None);
    }
    let e = err(r#"{"a": 1} x"#);
    assert_eq!(e.line_column(), Some((1, 10)));
    assert_eq!(
        e.to_string(),
        "<file>: invalid JSON at line 1, column 10: trailing characters; fix the JSON at that position"
    );
}

#[test]
fn json_duplicate_keys_are_rejected() {
    let e = err("{\"enable_cpu_offload\": true,\n \"enable_cpu_offload\": false}");
    assert_eq!(e.key(), "<file>");
    assert_eq!(e.line_column(), Some((2, 21)));
    assert_eq!(
        e.to_string(),
        "<file>: invalid JSON at line 2, column 21: duplicate key \"enable_cpu_offload\"; give each key once; fix \
         the JSON at that position"
    );
}

#[test]
fn toml_syntax_errors_have_line_and_column() {
    let e = OffloadConfig::from_toml_str("enable_cpu_offload = true\nuse_hsdp = = 1\n").unwrap_err();
    assert_eq!(e.key(), "<file>");
    assert_eq!(e.line_column(), Some((2, 12)));
    assert!(e.to_string().starts_with("<file>: invalid TOML at line 2, column 12: "), "{e}");
    assert!(e.to_string().ends_with("; fix the TOML at that position"), "{e}");

    let e = OffloadConfig::from_toml_str("use_hsdp = true\nuse_hsdp = false\n").unwrap_err();
    assert_eq!(e.line_column(), Some((2, 1)));
    assert!(e.to_string().contains("duplicate key"), "{e}");
}

#[test]
fn toml_values_without_a_json_form_are_rejected() {
    let e = OffloadConfig::from_toml_str("data_parallel_size = nan").unwrap_err();
    assert_eq!(e.to_string(), "data_parallel_size: the float NaN is not accepted by any setting; use a finite number");
    let e = OffloadConfig::from_toml_str("[diffusion_offload_config]\nmode = 1979-05-27\n").unwrap_err();
    assert_eq!(
        e.to_string(),
        "diffusion_offload_config.mode: the date/time 1979-05-27 is not accepted by any setting; quote it if a \
         string was meant"
    );
}

const SAME_JSON: &str = r#"{
  "pin_cpu_memory": false,
  "data_parallel_size": 2,
  "sequence_parallel_size": 1,
  "cache_backend": "none",
  "diffusion_offload_config": {
    "mode": "layer",
    "components": ["dit", "text_encoder", "vae"],
    "device_budget": "1.5GB",
    "layer_options": {
      "dit": {"weight_transfer": "allgather", "prefetch_depth": 3},
      "text_encoder": {"weight_transfer": "rank-local"}
    }
  }
}"#;

const SAME_TOML: &str = r#"
pin_cpu_memory = false
data_parallel_size = 2
sequence_parallel_size = 1
cache_backend = "none"

[diffusion_offload_config]
mode = "layer"
components = ["dit", "text_encoder", "vae"]
device_budget = "1.5GB"

[diffusion_offload_config.layer_options.dit]
weight_transfer = "allgather"
prefetch_depth = 3

[diffusion_offload_config.layer_options.text_encoder]
weight_transfer = "rank-local"
"#;

#[test]
fn toml_and_json_give_identical_results() {
    let from_json = ok(SAME_JSON);
    let from_toml = OffloadConfig::from_toml_str(SAME_TOML).unwrap();
    assert_eq!(from_json, from_toml);
    assert_eq!(from_json.strategy, Strategy::DistributedLayerWise);
    assert_eq!(from_json.group, OffloadGroup { size: 2, axis: GroupAxis::DataParallel });
    assert_eq!(from_json.device_budget, Some(1_500_000_000));
    assert!(!from_json.pin_memory);
    assert_eq!(from_json.prefetch_depth(Component::Dit), Some(3));

    // The same error from both formats.
    let bad_json = SAME_JSON.replace("\"rank-local\"", "\"rank_local\"");
    let bad_toml = SAME_TOML.replace("\"rank-local\"", "\"rank_local\"");
    assert_eq!(err(&bad_json), OffloadConfig::from_toml_str(&bad_toml).unwrap_err());
    let bad_json = SAME_JSON.replace("\"prefetch_depth\"", "\"prefetch\"");
    let bad_toml = SAME_TOML.replace("prefetch_depth", "prefetch");
    assert_eq!(err(&bad_json), OffloadConfig::from_toml_str(&bad_toml).unwrap_err());
    assert_eq!(err(&bad_json).key(), "diffusion_offload_config.layer_options.dit.prefetch");
}

#[test]
fn from_value_matches_from_json_str() {
    let value: serde_json::Value = serde_json::from_str(SAME_JSON).unwrap();
    assert_eq!(OffloadConfig::from_value(&value).unwrap(), ok(SAME_JSON));
}

fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("weightferry-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn from_path_by_extension() {
    let json = temp_file("offload.json", SAME_JSON);
    let toml = temp_file("offload.TOML", SAME_TOML);
    assert_eq!(OffloadConfig::from_path(&json).unwrap(), ok(SAME_JSON));
    assert_eq!(OffloadConfig::from_path(&toml).unwrap(), ok(SAME_JSON));

    let yaml = temp_file("offload.yaml", "mode: layer\n");
    let e = OffloadConfig::from_path(&yaml).unwrap_err();
    assert_eq!(e.key(), yaml.display().to_string());
    assert_eq!(e.message(), "unsupported config file extension \".yaml\"; write the config as a .json or .toml file");

    let bare = temp_file("offload", "{}");
    let e = OffloadConfig::from_path(&bare).unwrap_err();
    assert_eq!(
        e.message(),
        "the file name has no extension; name the config file *.json or *.toml so its format is known"
    );
}

#[test]
fn from_path_errors_name_the_file() {
    let missing = std::env::temp_dir().join("weightferry-config-test-missing-dir/none.json");
    let e = OffloadConfig::from_path(&missing).unwrap_err();
    assert!(matches!(e, ConfigError::Io { kind: std::io::ErrorKind::NotFound, .. }), "{e:?}");
    assert_eq!(e.key(), missing.display().to_string());
    assert!(e.message().starts_with("cannot read the config file ("), "{e}");
    assert!(e.message().ends_with("); check that the path exists and is a readable UTF-8 file"), "{e}");

    let broken = temp_file("broken.json", "{\"use_hsdp\": tru}");
    let e = OffloadConfig::from_path(&broken).unwrap_err();
    assert_eq!(e.key(), broken.display().to_string());
    assert_eq!(e.line_column(), Some((1, 17)));

    // Validation errors keep their key path.
    let invalid = temp_file("invalid.toml", "use_hsdp = 1\n");
    let e = OffloadConfig::from_path(&invalid).unwrap_err();
    assert_eq!(e.key(), "use_hsdp");

    // A byte-order mark (as Windows editors write) is dropped; an empty file disables offload in either format.
    let bom = temp_file(
        "bom.json",
        "\u{feff}{\"diffusion_offload_config\": {\"mode\": \"module\", \"components\": [\"dit\"]}}",
    );
    assert_eq!(OffloadConfig::from_path(&bom).unwrap().strategy, Strategy::ModelLevel);
    for name in ["empty.json", "empty.toml"] {
        assert_eq!(OffloadConfig::from_path(&temp_file(name, "")).unwrap().strategy, Strategy::None, "{name}");
    }
    // A path to an endless device is refused at the size cap, at once, not read until memory runs out.
    let link = std::env::temp_dir().join(format!("weightferry-config-zero-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
    let t = std::time::Instant::now();
    let e = OffloadConfig::from_path(&link).unwrap_err();
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(
        e.to_string(),
        format!(
            "{}: the file holds more than 1048576 bytes, the most a config file may have; check the path (it may \
             name a device or a huge file)",
            link.display()
        )
    );
    std::fs::remove_file(&link).unwrap();
}

#[test]
fn static_slots_is_read_per_component_and_must_be_a_boolean() {
    let with = |dit: &str| {
        compact(&format!(
            r#""mode": "layer", "components": ["dit", "text_encoder"], "layer_options": {{"dit": {{{dit}}}}}"#
        ))
    };
    assert!(!ok(&with("")).static_slots(Component::Dit), "off by default");
    let c = ok(&with(r#""static_slots": true, "prefetch_depth": 2"#));
    assert!(c.static_slots(Component::Dit));
    assert!(!c.static_slots(Component::TextEncoder), "per component");
    let key = "diffusion_offload_config.layer_options.dit.static_slots";
    assert_err(
        &with(r#""static_slots": "yes""#),
        key,
        &format!("{key}: expected true or false, found the string \"yes\"; remove the key to use the default"),
    );
    // With a device budget the planner sizes a static ring by its own slot count (tests/budget.rs).
    for budget in [r#""24GiB""#, r#""auto""#] {
        let text = compact(&format!(
            r#""mode": "layer", "components": ["dit"], "device_budget": {budget},
               "layer_options": {{"dit": {{"static_slots": true}}}}"#
        ));
        assert!(ok(&text).static_slots(Component::Dit), "{budget}");
    }
}

#[test]
fn copy_submission_is_read_and_validated() {
    let with = |dit: &str| {
        compact(&format!(
            r#""mode": "layer", "components": ["dit", "text_encoder"], "layer_options": {{"dit": {{{dit}}}}}"#
        ))
    };
    // Default: the copy-stream actor, for every component.
    let c = ok(&with(""));
    assert_eq!(c.copy_submission(Component::Dit), CopySubmission::Actor);
    let c = ok(&with(r#""copy_submission": "hook""#));
    assert_eq!(c.copy_submission(Component::Dit), CopySubmission::Hook);
    assert_eq!(c.copy_submission(Component::TextEncoder), CopySubmission::Actor, "per component");
    assert_eq!(ok(&with(r#""copy_submission": "actor""#)).copy_submission(Component::Dit), CopySubmission::Actor);
    // With resident layers (rank-local, distributed layerwise) it is accepted too.
    let c = ok(&with(r#""copy_submission": "hook", "resident_layers": 2"#));
    assert_eq!(c.copy_submission(Component::Dit), CopySubmission::Hook);
    let key = "diffusion_offload_config.layer_options.dit.copy_submission";
    assert_err(
        &with(r#""copy_submission": "hooks""#),
        key,
        &format!("{key}: unknown copy submission \"hooks\" (did you mean \"hook\"?); choose \"actor\" or \"hook\""),
    );
    assert_err(
        &with(r#""copy_submission": "thread""#),
        key,
        &format!("{key}: unknown copy submission \"thread\"; choose \"actor\" or \"hook\""),
    );
    assert_err(
        &with(r#""copy_submission": 1"#),
        key,
        &format!("{key}: expected \"actor\" or \"hook\", found the integer 1"),
    );
    assert_err(
        &with(r#""weight_transfer": "allgather", "copy_submission": "hook""#),
        key,
        &format!(
            "{key}: copy_submission = \"hook\" applies only to rank-local transfer (AllGather stacks submit through \
             their actors); set diffusion_offload_config.layer_options.dit.weight_transfer = \"rank-local\" or \
             remove copy_submission"
        ),
    );
    // "actor" is what AllGather stacks do anyway.
    ok(&with(r#""weight_transfer": "allgather", "copy_submission": "actor""#));
    // Pageable masters would make the hook wait for the copy stream: refused, naming the key and both fixes.
    let pageable = compact(
        r#""mode": "layer", "components": ["dit", "text_encoder"], "pin_memory": false,
           "layer_options": {"text_encoder": {"copy_submission": "hook"}}"#,
    );
    let te_key = "diffusion_offload_config.layer_options.text_encoder.copy_submission";
    assert_err(
        &pageable,
        te_key,
        &format!(
            "{te_key}: copy_submission = \"hook\" needs pinned host masters (a copy from pageable memory makes the \
             hook wait for the copy stream); set pin_memory = true or use copy_submission = \"actor\""
        ),
    );
    let legacy_unpinned = r#"{"pin_cpu_memory": false, "diffusion_offload_config": {"mode": "layer",
        "components": ["dit"], "layer_options": {"dit": {"copy_submission": "hook"}}}}"#;
    assert_eq!(err(legacy_unpinned).key(), key, "pin_memory defaults to pin_cpu_memory");
    ok(&compact(
        r#""mode": "layer", "components": ["dit"], "pin_memory": false,
           "layer_options": {"dit": {"copy_submission": "actor"}}"#,
    ));
    // TOML spells it the same way.
    let toml = "[diffusion_offload_config]\nmode = \"layer\"\ncomponents = [\"dit\"]\n\
                [diffusion_offload_config.layer_options.dit]\ncopy_submission = \"hook\"\n";
    let c = OffloadConfig::from_toml_str(toml).unwrap();
    assert_eq!(c.copy_submission(Component::Dit), CopySubmission::Hook);
}

/// The typed constructor of the distributed runner's config is exactly what the equivalent file resolves to.
#[test]
fn distributed_dit_equals_the_parsed_config() {
    for (world, depth, chunk) in [(2u32, 3u32, None), (4, 1, Some(4096u64)), (1, 2, None)] {
        let chunk_key = chunk.map_or(String::new(), |c| format!(r#", "allgather_chunk_size": {c}"#));
        let json = format!(
            r#"{{"data_parallel_size": {world}, "diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
                "layer_options": {{"dit": {{"weight_transfer": "allgather", "prefetch_depth": {depth}{chunk_key}}}}}}}}}"#
        );
        let parsed = weightferry::config::OffloadConfig::from_json_str(&json).unwrap();
        assert_eq!(weightferry::config::OffloadConfig::distributed_dit(world, depth, chunk), parsed, "{json}");
    }
}

#[test]
fn host_masters_takes_auto_mapped_or_pinned() {
    use weightferry::config::HostMasters;
    let with = |v: &str| {
        format!(r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "host_masters": {v}}}}}"#)
    };
    let base = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
    assert_eq!(OffloadConfig::from_json_str(base).unwrap().host_masters, HostMasters::Auto);
    for (v, want) in [("auto", HostMasters::Auto), ("mapped", HostMasters::Mapped), ("pinned", HostMasters::Pinned)] {
        assert_eq!(OffloadConfig::from_json_str(&with(&format!("\"{v}\""))).unwrap().host_masters, want);
    }
    assert_err(
        &with("\"mmap\""),
        "diffusion_offload_config.host_masters",
        "diffusion_offload_config.host_masters: unknown value \"mmap\"; choose \"auto\" (mapped where the \
         checkpoint's layout allows, pinned elsewhere), \"mapped\" or \"pinned\"",
    );
    assert_err(
        &with("true"),
        "diffusion_offload_config.host_masters",
        "diffusion_offload_config.host_masters: expected \"auto\", \"mapped\" or \"pinned\", found the boolean true",
    );
}
