//! The plan resolver (`resolve_offload_plan`) against hand-made pipelines and the presets: where block lists come
//! from (precedence), what each strategy resolves (topology), resident heads, every validation error and warning,
//! the tied-alias rule for non-block state, and purity.
//!
//! Every assertion pins exact plan fields or the exact error/warning text, so a changed rule fails a test.

use std::collections::BTreeMap;
use weightferry::config::{Component, OffloadConfig, Strategy};
use weightferry::diag::warn_once;
use weightferry::pipeline::builder::{ModuleBuilder, PipelineBuilder};
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::{ComponentDecls, DType, OffloadPlanDecl, PipelineDesc};
use weightferry::plan::budget::{non_block_storages, storages_under};
use weightferry::plan::resolver::{MODEL_SWAP_SKIP_REASON, NO_DIT_SKIP_REASON};
use weightferry::plan::{resolve_offload_plan, ComponentKind, ResolvedComponent, ResolvedPlan};

// ------------------------------------------------------------------------------------------------------------
// Helpers

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("config {json} rejected: {e}"))
}

/// Compact layer mode with the given components and `layer_options` object.
fn layer(components: &[&str], options: &str) -> OffloadConfig {
    let list: Vec<String> = components.iter().map(|c| format!("\"{c}\"")).collect();
    cfg(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": [{}], "layer_options": {options}}}}}"#,
        list.join(", ")
    ))
}

/// Compact module mode with the given components.
fn module_mode(components: &[&str]) -> OffloadConfig {
    let list: Vec<String> = components.iter().map(|c| format!("\"{c}\"")).collect();
    cfg(&format!(r#"{{"diffusion_offload_config": {{"mode": "module", "components": [{}]}}}}"#, list.join(", ")))
}

fn legacy_layerwise() -> OffloadConfig {
    cfg(r#"{"enable_layerwise_offload": true}"#)
}

fn legacy_dlo_rank_local(resident: u32) -> OffloadConfig {
    cfg(&format!(
        r#"{{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_resident_layers": {resident}}}"#
    ))
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

/// Full block paths `prefix.0` … `prefix.(n-1)`.
fn blocks(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}.{i}")).collect()
}

/// Adds `count` blocks under `name`, each one `Linear` 8→16 without bias (256 bytes of bf16,
/// one device-alignment unit, so packed and plain sizes agree).
fn block_list(m: &mut ModuleBuilder<'_>, name: &str, count: usize) {
    m.block_list(name, count, "ToyBlock", |b, _| {
        b.linear("fc", DType::Bf16, 8, 16, false);
    });
}

/// A module holding one `Linear` 8→16 without bias (256 bytes).
fn leaf(m: &mut ModuleBuilder<'_>) {
    m.linear("fc", DType::Bf16, 8, 16, false);
}

/// A DiT of class `class` with an embedding and one block list `blocks` of `n` blocks.
fn toy_dit(m: &mut ModuleBuilder<'_>, n: usize) {
    m.linear("embed", DType::Bf16, 8, 16, false);
    block_list(m, "blocks", n);
}

/// `transformer` (ToyDiT, `n` blocks), `text_encoder` (3 layers, no lifecycle), `vae` (with the lifecycle).
fn toy(class: &str, n: usize) -> PipelineBuilder {
    PipelineBuilder::new(class)
        .module("transformer", "ToyDiT", |m| toy_dit(m, n))
        .module("text_encoder", "ToyTextEncoder", |m| {
            m.linear("embed", DType::Bf16, 8, 16, false);
            block_list(m, "layers", 3);
        })
        .module("vae", "ToyVAE", |m| {
            m.has_lifecycle(true);
            m.linear("conv", DType::Bf16, 8, 16, false);
        })
        .dit("transformer")
        .encoder("text_encoder")
        .vae("vae")
}

/// The plan the toy pipelines use unless a test says otherwise.
fn toy_plan() -> OffloadPlanDecl {
    OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        encoder_block_attrs: attrs_map(&[("text_encoder", &["layers"])]),
        on_demand_component_paths: strings(&["vae"]),
        resident_dit_paths: strings(&["transformer"]),
        ..OffloadPlanDecl::default()
    }
}

fn build(b: PipelineBuilder) -> PipelineDesc {
    b.build().unwrap_or_else(|e| panic!("test pipeline invalid: {e}"))
}

fn flux_tiny() -> PipelineDesc {
    preset("flux-tiny").expect("flux-tiny preset")
}

/// Block paths of flux-tiny's DiT in execution order (19 double, then 38 single).
fn flux_blocks() -> Vec<String> {
    let mut b = blocks("transformer.transformer_blocks", 19);
    b.extend(blocks("transformer.single_transformer_blocks", 38));
    b
}

fn paths(cs: &[ResolvedComponent]) -> Vec<&str> {
    cs.iter().map(|c| c.path.as_str()).collect()
}

// ------------------------------------------------------------------------------------------------------------
// Precedence

/// A DiT class with two block lists, so the chosen declaration is visible in the stack.
fn two_list_dit(class: &str) -> PipelineBuilder {
    PipelineBuilder::new(class)
        .module("transformer", "TwoListDiT", |m| {
            m.linear("embed", DType::Bf16, 8, 16, false);
            block_list(m, "blocks_a", 3);
            block_list(m, "blocks_b", 2);
        })
        .dit("transformer")
}

#[test]
fn plan_block_attrs_win_over_class_declarations() {
    let p = build(
        two_list_dit("PrecedencePipeline")
            .class_block_attrs("TwoListDiT", &["blocks_a"])
            .class_block_attr_singular("TwoListDiT", "blocks_a")
            .offload_plan(OffloadPlanDecl {
                block_attrs: attrs_map(&[("transformer", &["blocks_b"])]),
                ..OffloadPlanDecl::default()
            }),
    );
    let plan = ok(&p, &layer(&["dit"], "{}"));
    assert_eq!(plan.strategy, Strategy::LayerWise);
    assert_eq!(plan.dits.len(), 1);
    let d = &plan.dits[0];
    assert!(d.selected);
    assert_eq!(d.stacks.len(), 1);
    assert_eq!(d.stacks[0].attrs, strings(&["blocks_b"]));
    assert_eq!(d.stacks[0].blocks, blocks("transformer.blocks_b", 2));
    assert_eq!(d.stacks[0].name, "transformer[blocks_b]");
    // The plan was used, so the deprecated singular declaration never warned.
    assert_eq!(plan.warnings, Vec::<String>::new());
}

#[test]
fn class_block_attrs_are_used_without_a_plan_entry() {
    // No offload plan at all.
    let p = build(two_list_dit("ClassAttrsPipeline").class_block_attrs("TwoListDiT", &["blocks_b", "blocks_a"]));
    let plan = ok(&p, &layer(&["dit"], "{}"));
    let s = &plan.dits[0].stacks[0];
    assert_eq!(s.attrs, strings(&["blocks_b", "blocks_a"]));
    let mut expected = blocks("transformer.blocks_b", 2);
    expected.extend(blocks("transformer.blocks_a", 3));
    assert_eq!(s.blocks, expected);
    assert_eq!(s.block_bytes, vec![256; 5]);

    // A plan that declares other things but no block list for this DiT also falls through to the class.
    let p = build(two_list_dit("ClassAttrsPipeline2").class_block_attrs("TwoListDiT", &["blocks_a"]).offload_plan(
        OffloadPlanDecl { block_attrs: attrs_map(&[("elsewhere", &["blocks_b"])]), ..OffloadPlanDecl::default() },
    ));
    let plan = ok(&p, &layer(&["dit"], "{}"));
    assert_eq!(plan.dits[0].stacks[0].blocks, blocks("transformer.blocks_a", 3));
}

#[test]
fn deprecated_singular_class_attr_works_and_warns() {
    let p = build(two_list_dit("SingularPipeline").class_block_attr_singular("TwoListDiT", "blocks_a"));
    let plan = ok(&p, &layer(&["dit"], "{}"));
    assert_eq!(plan.dits[0].stacks[0].attrs, strings(&["blocks_a"]));
    assert_eq!(plan.dits[0].stacks[0].blocks, blocks("transformer.blocks_a", 3));
    assert_eq!(
        plan.warnings,
        strings(&["DiT class TwoListDiT uses the deprecated singular block attribute declaration; declare a list in \
             class_block_attrs"])
    );

    // The list declaration wins over the singular one (and nothing warns).
    let p = build(
        two_list_dit("SingularPipeline2")
            .class_block_attr_singular("TwoListDiT", "blocks_a")
            .class_block_attrs("TwoListDiT", &["blocks_b"]),
    );
    let plan = ok(&p, &layer(&["dit"], "{}"));
    assert_eq!(plan.dits[0].stacks[0].blocks, blocks("transformer.blocks_b", 2));
    assert_eq!(plan.warnings, Vec::<String>::new());
}

#[test]
fn declared_block_list_that_does_not_exist_is_an_error() {
    let p = build(two_list_dit("MissingAttrPipeline").class_block_attrs("TwoListDiT", &["blocks_a", "blocks_c"]));
    assert_eq!(
        err(&p, &layer(&["dit"], "{}")),
        "DiT 'transformer' declares block list 'blocks_c' in class_block_attrs, but 'transformer.blocks_c' has no \
         such attribute; fix the declaration"
    );
    let p = build(two_list_dit("MissingAttrPipeline2").offload_plan(OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["nope"])]),
        ..OffloadPlanDecl::default()
    }));
    assert_eq!(
        err(&p, &legacy_layerwise()),
        "DiT 'transformer' declares block list 'nope' in offload_plan.block_attrs, but 'transformer.nope' has no \
         such attribute; fix the declaration"
    );
}

/// Encoders at `prompt_model` (no text-encoder leaf name) and `clip_text_encoder` (leaf ends with it).
fn encoder_naming(class: &str, types: &[(&str, &str)]) -> PipelineDesc {
    build(
        PipelineBuilder::new(class)
            .module("transformer", "ToyDiT", |m| toy_dit(m, 2))
            .module("prompt_model", "PromptModel", leaf)
            .module("clip_text_encoder", "Clip", leaf)
            .module("text_encoder_2", "T5", leaf)
            .module("image_encoder", "Siglip", leaf)
            .dit("transformer")
            .encoder("prompt_model")
            .encoder("clip_text_encoder")
            .encoder("text_encoder_2")
            .encoder("image_encoder")
            .offload_plan(OffloadPlanDecl {
                block_attrs: attrs_map(&[("transformer", &["blocks"])]),
                encoder_component_types: types.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ..OffloadPlanDecl::default()
            }),
    )
}

#[test]
fn declared_encoder_type_wins_over_the_leaf_name() {
    let kinds = |p: &PipelineDesc| -> Vec<(String, ComponentKind)> {
        ok(p, &module_mode(&["dit", "text_encoder"])).encoders.iter().map(|e| (e.path.clone(), e.kind)).collect()
    };
    // Leaf-name rule only: starts or ends with `text_encoder`.
    let p = encoder_naming("EncoderNamingPipeline", &[]);
    assert_eq!(
        kinds(&p),
        vec![
            ("prompt_model".to_string(), ComponentKind::Encoder),
            ("clip_text_encoder".to_string(), ComponentKind::TextEncoder),
            ("text_encoder_2".to_string(), ComponentKind::TextEncoder),
            ("image_encoder".to_string(), ComponentKind::Encoder),
        ]
    );
    // The declared type turns `prompt_model` into a text encoder.
    let p = encoder_naming("EncoderNamingPipeline", &[("prompt_model", "text_encoder")]);
    assert_eq!(kinds(&p)[0], ("prompt_model".to_string(), ComponentKind::TextEncoder));
    // Under model-level explicit selection only text encoders are selected.
    let plan = ok(&p, &module_mode(&["dit", "text_encoder"]));
    let selected: Vec<bool> = plan.encoders.iter().map(|e| e.selected).collect();
    assert_eq!(selected, vec![true, true, true, false]);

    // A declared type that contradicts the leaf name is not silently overridden by it: it is rejected.
    let p = encoder_naming("EncoderNamingPipeline", &[("clip_text_encoder", "image_encoder")]);
    assert_eq!(
        err(&p, &module_mode(&["dit", "text_encoder"])),
        "offload_plan.encoder_component_types['clip_text_encoder'] is 'image_encoder'; the only declarable encoder \
         type is 'text_encoder' (remove the entry for other encoders)"
    );
}

#[test]
fn component_declarations_win_over_the_attribute_scan() {
    // `transformer`, `text_encoder` and `vae` are fallback names, but the pipeline declares other modules.
    let p = build(
        PipelineBuilder::new("DeclaredPipeline")
            .module("transformer", "Decoy", |m| toy_dit(m, 2))
            .module("backbone", "ToyDiT", |m| toy_dit(m, 3))
            .module("text_encoder", "Decoy", leaf)
            .module("prompt_text_encoder", "Enc", |m| block_list(m, "layers", 2))
            .module("vae", "Decoy", leaf)
            .dit("backbone")
            .encoder("prompt_text_encoder")
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    let plan = ok(&p, &legacy_layerwise());
    assert_eq!(paths(&plan.dits), vec!["backbone"]);
    assert_eq!(paths(&plan.encoders), vec!["prompt_text_encoder"]);
    assert_eq!(paths(&plan.vaes), Vec::<&str>::new());
    assert_eq!(plan.dits[0].stacks[0].blocks, blocks("backbone.blocks", 3));
    assert!(!plan.warnings.iter().any(|w| w.contains("deprecated attribute scan")), "{:?}", plan.warnings);
}

#[test]
fn declared_paths_that_do_not_exist_warn_and_are_skipped() {
    let p = build(toy("MissingDeclPipeline", 3).dit("transformer_2").vae("audio_vae").offload_plan(toy_plan()));
    let plan = ok(&p, &legacy_layerwise());
    assert_eq!(paths(&plan.dits), vec!["transformer"]);
    assert_eq!(paths(&plan.vaes), vec!["vae"]);
    assert_eq!(
        plan.warnings,
        strings(&[
            "declared DiT module 'transformer_2' does not exist in pipeline MissingDeclPipeline; skipping it",
            "declared VAE module 'audio_vae' does not exist in pipeline MissingDeclPipeline; skipping it",
        ])
    );
}

#[test]
fn attribute_scan_warns_in_every_plan_but_logs_once_per_pipeline_class() {
    let class = "ScanOnceProbePipeline";
    let p = build(
        PipelineBuilder::new(class)
            .module("dit", "ToyDiT", |m| toy_dit(m, 2))
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .module("text_encoder", "Enc", leaf)
            .module("vae", "Vae", leaf)
            .module("unrelated", "Other", leaf)
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    assert_eq!(p.components, None);
    let expected = format!(
        "pipeline {class} declares no components; using the deprecated attribute scan (declare `components` in the \
         pipeline description)"
    );
    let first = ok(&p, &legacy_layerwise());
    // The scan order is the fallback name order, not the module order.
    assert_eq!(paths(&first.dits), vec!["transformer", "dit"]);
    assert_eq!(paths(&first.encoders), vec!["text_encoder"]);
    assert_eq!(paths(&first.vaes), vec!["vae"]);
    assert_eq!(first.warnings, vec![expected.clone()]);
    // The log is keyed per pipeline class: it was already emitted, so a second emission is suppressed.
    assert!(!warn_once(&format!("scan:{class}"), "probe"));
    // Resolving again still reports the warning in the plan (the plan is a pure value) and still logs nothing.
    let second = ok(&p, &legacy_layerwise());
    assert_eq!(second, first);
    assert!(!warn_once(&format!("scan:{class}"), "probe"));
    // A class that never went through the scan has not been logged.
    assert!(warn_once("scan:ScanOnceProbeNeverResolved", "probe"));
}

// ------------------------------------------------------------------------------------------------------------
// Topology

/// An encoder with two block lists (`vision.blocks`, 2; `text_model.layers`, 3) and a final norm.
fn staged_encoder(class: &str, lifecycle: bool, plan: OffloadPlanDecl) -> PipelineDesc {
    build(
        PipelineBuilder::new(class)
            .module("transformer", "ToyDiT", |m| toy_dit(m, 4))
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
            .offload_plan(plan),
    )
}

#[test]
fn encoder_plan_resolves_one_stack_per_declared_block_path() {
    let plan_decl = OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        encoder_block_attrs: attrs_map(&[("text_encoder", &["vision.blocks", "text_model.layers"])]),
        ..OffloadPlanDecl::default()
    };
    let p = staged_encoder("EncoderStacksPipeline", false, plan_decl);
    let plan = ok(&p, &layer(&["dit", "text_encoder"], r#"{"text_encoder": {"prefetch_depth": 1}}"#));
    let e = &plan.encoders[0];
    assert_eq!(e.kind, ComponentKind::TextEncoder);
    assert!(e.selected);
    assert!(!e.on_demand);
    assert_eq!(e.stacks.len(), 2);
    assert_eq!(e.stacks[0].name, "text_encoder[vision.blocks]");
    assert_eq!(e.stacks[0].attrs, strings(&["vision.blocks"]));
    assert_eq!(e.stacks[0].blocks, blocks("text_encoder.vision.blocks", 2));
    assert_eq!(e.stacks[1].name, "text_encoder[text_model.layers]");
    assert_eq!(e.stacks[1].blocks, blocks("text_encoder.text_model.layers", 3));
    assert!(e.stacks.iter().all(|s| s.resident_head == 0 && s.prefetch_depth == 1));
    // The DiT keeps the default depth.
    assert_eq!(plan.dits[0].stacks[0].prefetch_depth, 2);
    assert_eq!(plan.dits[0].stacks[0].blocks, blocks("transformer.blocks", 4));
}

#[test]
fn on_demand_encoder_with_declared_stacks_streams_them() {
    let plan_decl = OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        encoder_block_attrs: attrs_map(&[("text_encoder", &["vision.blocks", "text_model.layers"])]),
        on_demand_component_paths: strings(&["text_encoder", "vae"]),
        ..OffloadPlanDecl::default()
    };
    let p = staged_encoder("StagedStacksPipeline", true, plan_decl);
    let plan = ok(&p, &layer(&["dit", "text_encoder"], "{}"));
    let e = &plan.encoders[0];
    assert_eq!(e.stacks.len(), 2);
    assert!(e.selected);
    // vLLM-Omni parity (issue 18): a pipeline-managed encoder stays on demand while its blocks stream; only its
    // non-block weights are staged.
    assert!(e.on_demand, "a pipeline-managed encoder with stacks stays on demand");
}

#[test]
fn on_demand_only_plan_resolves_without_stacks() {
    let plan_decl = OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        on_demand_component_paths: strings(&["text_encoder"]),
        ..OffloadPlanDecl::default()
    };
    let p = staged_encoder("OnDemandOnlyPipeline", true, plan_decl);
    let plan = ok(&p, &layer(&["text_encoder"], "{}"));
    let e = &plan.encoders[0];
    assert!(e.selected);
    assert!(e.on_demand);
    assert_eq!(e.stacks, vec![]);
    // The DiT is not selected, so it has no stacks and stays resident.
    assert!(!plan.dits[0].selected);
    assert_eq!(plan.dits[0].stacks, vec![]);
    // The VAE is not in the on-demand list here, and not selected.
    assert!(!plan.vaes[0].selected && !plan.vaes[0].on_demand);
    assert_eq!(plan.skip_reason, None);
}

#[test]
fn model_level_resolves_selection_without_stacks_or_staging() {
    let p = flux_tiny();
    let plan = ok(&p, &module_mode(&["dit", "text_encoder"]));
    assert_eq!(plan.strategy, Strategy::ModelLevel);
    let summary: Vec<(&str, ComponentKind, bool, bool, usize)> =
        plan.components().map(|c| (c.path.as_str(), c.kind, c.selected, c.on_demand, c.stacks.len())).collect();
    assert_eq!(
        summary,
        vec![
            ("transformer", ComponentKind::Dit, true, false, 0),
            ("text_encoder", ComponentKind::TextEncoder, true, false, 0),
            // flux-tiny lists the VAE as on-demand; model-level leaves staging to the pipeline.
            ("vae", ComponentKind::Vae, false, false, 0),
        ]
    );
    assert!(plan.dits[0].children.is_empty());
    assert_eq!(plan.skip_reason, None);

    // Legacy model-level selects every encoder and the DiT, never the VAE.
    let plan = ok(&p, &cfg(r#"{"enable_cpu_offload": true}"#));
    let sel: Vec<bool> = plan.components().map(|c| c.selected).collect();
    assert_eq!(sel, vec![true, true, false]);
    assert!(plan.components().all(|c| c.stacks.is_empty() && !c.on_demand));
}

#[test]
fn compatibility_topology_keeps_the_legacy_staged_vae() {
    let p = flux_tiny();
    for c in [legacy_layerwise(), legacy_dlo_rank_local(0)] {
        let plan = ok(&p, &c);
        let v = &plan.vaes[0];
        assert_eq!(v.path, "vae");
        assert!(v.selected, "{:?}", c.strategy);
        assert!(v.on_demand);
        assert_eq!(v.stacks, vec![]);
    }
}

#[test]
fn legacy_staged_vae_without_lifecycle_is_rejected() {
    let p = build(
        PipelineBuilder::new("NoLifecycleVaePipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .module("vae", "PlainVae", leaf)
            .dit("transformer")
            .vae("vae")
            .offload_plan(OffloadPlanDecl {
                block_attrs: attrs_map(&[("transformer", &["blocks"])]),
                on_demand_component_paths: strings(&["vae"]),
                ..OffloadPlanDecl::default()
            }),
    );
    assert_eq!(
        err(&p, &legacy_layerwise()),
        "On-demand component 'vae' must implement load_to_device() and offload_to_cpu() (has_lifecycle) or be removed \
         from offload_plan.on_demand_component_paths"
    );
}

#[test]
fn explicit_vae_selection_uses_the_declared_lifecycle() {
    let p = flux_tiny();
    let plan = ok(&p, &layer(&["dit", "vae"], "{}"));
    assert!(plan.vaes[0].selected);
    assert!(plan.vaes[0].on_demand);
    assert_eq!(plan.vaes[0].stacks, vec![]);
    // The text encoder is not selected: no stacks even though the plan declares them.
    assert!(!plan.encoders[0].selected);
    assert_eq!(plan.encoders[0].stacks, vec![]);
}

#[test]
fn explicit_vae_selection_requires_its_lifecycle() {
    let p = build(
        PipelineBuilder::new("PlainVaePipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .module("vae", "PlainVae", leaf)
            .dit("transformer")
            .vae("vae")
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    // Not listed among the pipeline's on-demand components (vLLM-Omni parity, issue 18): the lifecycle is not
    // declared.
    assert_eq!(
        err(&p, &layer(&["dit", "vae"], "{}")),
        "Selected VAE 'vae' requires a pipeline-managed lifecycle: the pipeline's offload plan must list it in \
         offload_plan.on_demand_component_paths (and the module must implement load_to_device / offload_to_cpu); \
         declare it there or remove \"vae\" from diffusion_offload_config.components"
    );
    // Listed, but the module has no lifecycle.
    let p = build(
        PipelineBuilder::new("PlainVaePipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .module("vae", "PlainVae", leaf)
            .dit("transformer")
            .vae("vae")
            .offload_plan(OffloadPlanDecl {
                block_attrs: attrs_map(&[("transformer", &["blocks"])]),
                on_demand_component_paths: strings(&["vae"]),
                ..OffloadPlanDecl::default()
            }),
    );
    assert_eq!(
        err(&p, &layer(&["dit", "vae"], "{}")),
        "Selected VAE 'vae' requires a pipeline-managed lifecycle (load_to_device / offload_to_cpu); remove \"vae\" \
         from diffusion_offload_config.components or declare the lifecycle"
    );
}

#[test]
fn explicit_vae_selection_without_a_vae_is_an_error() {
    let p = build(
        PipelineBuilder::new("VaelessPipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .dit("transformer")
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    let expected = "No VAE modules found for selected vae offload in pipeline VaelessPipeline; declare one in \
                    `components.vaes` or remove \"vae\" from diffusion_offload_config.components";
    assert_eq!(err(&p, &layer(&["dit", "vae"], "{}")), expected);
    assert_eq!(err(&p, &module_mode(&["vae"])), expected);
}

#[test]
fn unselected_vae_stays_resident_even_when_stageable() {
    let p = flux_tiny();
    for c in [layer(&["dit"], "{}"), layer(&["dit", "text_encoder"], "{}")] {
        let plan = ok(&p, &c);
        assert!(!plan.vaes[0].selected);
        assert!(!plan.vaes[0].on_demand);
    }
}

// ------------------------------------------------------------------------------------------------------------
// Resident layers

fn resident(n: u32) -> OffloadConfig {
    layer(&["dit"], &format!(r#"{{"dit": {{"resident_layers": {n}, "weight_transfer": "rank-local"}}}}"#))
}

#[test]
fn resident_head_splits_the_declared_dit() {
    let p = flux_tiny();
    let c = resident(3);
    assert_eq!(c.strategy, Strategy::DistributedLayerWise);
    let plan = ok(&p, &c);
    let s = &plan.dits[0].stacks[0];
    let all = flux_blocks();
    assert_eq!(s.blocks, all);
    assert_eq!(s.resident_head, 3);
    assert_eq!(s.resident(), &all[..3]);
    assert_eq!(s.streaming(), &all[3..]);
    assert_eq!(s.streaming().len(), 54);
    assert_eq!(s.attrs, strings(&["transformer_blocks", "single_transformer_blocks"]));
    assert_eq!(plan.warnings, Vec::<String>::new());
}

#[test]
fn resident_count_beyond_the_stack_keeps_every_block() {
    let p = flux_tiny();
    for n in [57, 58, 1000] {
        let plan = ok(&p, &resident(n));
        let s = &plan.dits[0].stacks[0];
        assert_eq!(s.resident_head, 57, "resident_layers={n}");
        assert_eq!(s.resident().len(), 57);
        assert!(s.streaming().is_empty());
        assert_eq!(s.slot_count(), 0);
        assert_eq!(s.slot_bytes(), 0);
    }
}

#[test]
fn resident_split_leaving_one_streaming_block_is_rejected_when_explicit() {
    let p = flux_tiny();
    assert_eq!(
        err(&p, &resident(56)),
        "DiT 'transformer' has 57 blocks: resident_layers=56 leaves only one streaming block; choose a resident count \
         that leaves zero or at least two (e.g. 57 or 55)"
    );
    // One fewer resident leaves two streaming blocks: accepted.
    let plan = ok(&p, &resident(55));
    assert_eq!(plan.dits[0].stacks[0].streaming(), &flux_blocks()[55..]);
}

#[test]
fn legacy_single_streaming_block_stays_resident_with_a_warning() {
    let p = flux_tiny();
    let plan = ok(&p, &legacy_dlo_rank_local(56));
    assert_eq!(plan.strategy, Strategy::DistributedLayerWise);
    let s = &plan.dits[0].stacks[0];
    assert_eq!(s.resident_head, 57);
    assert!(s.streaming().is_empty());
    assert_eq!(
        plan.warnings,
        strings(&[
            "#Streaming target layers (blocks) of 'transformer' <= 1 after resident_layers=56. Keeping the final \
             block resident"
        ])
    );
}

#[test]
fn resident_layers_need_a_declared_resident_dit_path() {
    let mut plan_decl = toy_plan();
    plan_decl.resident_dit_paths.clear();
    let p = build(toy("NoResidentPathPipeline", 6).offload_plan(plan_decl));
    assert_eq!(
        err(&p, &resident(2)),
        "diffusion_offload_config.layer_options.dit.resident_layers: DiT 'transformer' is not listed in the \
         pipeline's offload_plan.resident_dit_paths, so it cannot keep resident layers; add it there or set \
         resident_layers = 0"
    );
    let plan = ok(&p, &legacy_dlo_rank_local(2));
    let s = &plan.dits[0].stacks[0];
    assert_eq!(s.resident_head, 0);
    assert_eq!(s.streaming(), &blocks("transformer.blocks", 6)[..]);
    assert_eq!(
        plan.warnings,
        strings(&[
            "dlo_resident_layers=2 requested but DiT 'transformer' is not in offload_plan.resident_dit_paths; all \
             blocks will be streamed"
        ])
    );
}

// ------------------------------------------------------------------------------------------------------------
// Validation

#[test]
fn selected_dit_requires_a_discovered_module() {
    let p = build(
        PipelineBuilder::new("NoDitPipeline")
            .module("text_encoder", "Enc", |m| block_list(m, "layers", 2))
            .encoder("text_encoder"),
    );
    let expected = "No DiT/transformer modules found for selected DiT offload in pipeline NoDitPipeline; declare the \
                    DiT in `components.dit` or remove \"dit\" from diffusion_offload_config.components";
    assert_eq!(err(&p, &layer(&["dit"], "{}")), expected);
    assert_eq!(err(&p, &resident(2)), expected);
    assert_eq!(err(&p, &module_mode(&["dit", "text_encoder"])), expected);
}

#[test]
fn missing_dit_under_the_compatibility_topology_skips() {
    let p = build(
        PipelineBuilder::new("NoDitLegacyPipeline")
            .module("text_encoder", "Enc", |m| block_list(m, "layers", 2))
            .encoder("text_encoder"),
    );
    let plan = ok(&p, &legacy_layerwise());
    assert_eq!(plan.skip_reason.as_deref(), Some(NO_DIT_SKIP_REASON));
    assert_eq!(NO_DIT_SKIP_REASON, "No DiT/transformer modules found for selected DiT layerwise offload");
    assert_eq!(plan.warnings, vec![NO_DIT_SKIP_REASON.to_string()]);
    // The distributed strategy keeps preparing its other components: no skip reason.
    let plan = ok(&p, &legacy_dlo_rank_local(0));
    assert_eq!(plan.skip_reason, None);
    // A DiT that exists (even if it has no blocks) is not "missing".
    let p = build(toy("BlocklessLegacyPipeline", 3));
    let plan = ok(&p, &legacy_layerwise());
    assert_eq!(plan.skip_reason, None);
    assert!(!plan.dits[0].selected);
    assert_eq!(plan.warnings, strings(&["Target layers (blocks) not found. Skipping offloading on 'transformer'"]));
}

#[test]
fn explicit_dit_without_blocks_is_an_error() {
    let p = build(toy("BlocklessPipeline", 3));
    assert_eq!(
        err(&p, &layer(&["dit"], "{}")),
        "Selected DiT 'transformer' has no streamable layerwise-offload blocks; declare its block lists in \
         offload_plan.block_attrs"
    );
}

#[test]
fn explicit_model_level_without_a_pair_is_one_skip() {
    let no_encoder = build(
        PipelineBuilder::new("DitOnlyPipeline").module("transformer", "ToyDiT", |m| toy_dit(m, 2)).dit("transformer"),
    );
    // Selecting a stage the pipeline lacks is refused by the selection checks.
    assert!(err(&no_encoder, &module_mode(&["dit", "text_encoder"])).starts_with("No text encoder modules found"));
    let no_dit =
        build(PipelineBuilder::new("EncoderOnlyPipeline").module("text_encoder", "Enc", leaf).encoder("text_encoder"));
    assert!(err(&no_dit, &module_mode(&["dit", "text_encoder"])).starts_with("No DiT"));
    // A lone stage selected is the same skip, with the same note, whether the pipeline has the other stage or not.
    for (p, lone) in [(&no_encoder, "dit"), (&no_dit, "text_encoder")] {
        let plan = ok(p, &module_mode(&[lone]));
        assert_eq!(plan.skip_reason.as_deref(), Some(MODEL_SWAP_SKIP_REASON), "{lone}");
        assert_eq!(plan.warnings, strings(&[MODEL_SWAP_SKIP_REASON]), "{lone}");
    }
    // The compatibility topology only warns.
    let plan = ok(&no_encoder, &cfg(r#"{"enable_cpu_offload": true}"#));
    assert_eq!(
        plan.warnings,
        strings(&["No encoder modules found; model-level offload keeps the DiT resident and is not enabled"])
    );
    let plan = ok(&no_dit, &cfg(r#"{"enable_cpu_offload": true}"#));
    assert_eq!(plan.warnings, strings(&["No DiT/transformer modules found; model-level offload will not be enabled"]));
}

#[test]
fn selected_text_encoder_requires_a_matching_module() {
    let p = build(
        PipelineBuilder::new("ImageEncoderPipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .module("image_encoder", "Siglip", |m| block_list(m, "layers", 2))
            .dit("transformer")
            .encoder("image_encoder")
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    let expected = "No text encoder modules found for selected text_encoder offload in pipeline ImageEncoderPipeline; \
                    declare one in `components.encoders` or remove \"text_encoder\" from \
                    diffusion_offload_config.components";
    assert_eq!(err(&p, &layer(&["dit", "text_encoder"], "{}")), expected);
    assert_eq!(err(&p, &module_mode(&["dit", "text_encoder"])), expected);
    // Selecting only the DiT leaves the image encoder alone.
    let plan = ok(&p, &layer(&["dit"], "{}"));
    assert_eq!(plan.encoders[0].kind, ComponentKind::Encoder);
    assert!(!plan.encoders[0].selected);
}

#[test]
fn selected_encoder_needs_a_streamable_or_on_demand_plan() {
    let mut plan_decl = toy_plan();
    plan_decl.encoder_block_attrs.clear();
    let p = build(toy("UnplannedEncoderPipeline", 3).offload_plan(plan_decl));
    assert_eq!(
        err(&p, &layer(&["text_encoder"], "{}")),
        "Selected text encoder 'text_encoder' requires a model-declared streamable (offload_plan.encoder_block_attrs) \
         or on-demand (offload_plan.on_demand_component_paths) plan"
    );
}

#[test]
fn explicit_encoder_block_paths_must_exist_and_be_streamable() {
    let plan_with = |attrs: &[&str]| OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        encoder_block_attrs: attrs_map(&[("text_encoder", attrs)]),
        ..OffloadPlanDecl::default()
    };
    let p = build(toy("BadEncoderPathPipeline", 3).offload_plan(plan_with(&["layers", "missing"])));
    assert_eq!(
        err(&p, &layer(&["text_encoder"], "{}")),
        "Encoder block path 'text_encoder.missing' does not exist; fix offload_plan.encoder_block_attrs"
    );
    // Under the compatibility topology the same problem warns, and the good path still streams.
    let plan = ok(&p, &legacy_layerwise());
    assert_eq!(plan.encoders[0].stacks.len(), 1);
    assert_eq!(plan.encoders[0].stacks[0].blocks, blocks("text_encoder.layers", 3));
    assert_eq!(
        plan.warnings,
        strings(&["Encoder block path 'text_encoder.missing' does not exist; fix offload_plan.encoder_block_attrs"])
    );

    let p = build(toy("BadEncoderListPipeline", 3).offload_plan(plan_with(&["embed"])));
    assert_eq!(
        err(&p, &layer(&["text_encoder"], "{}")),
        "Encoder block path 'text_encoder.embed' is not a streamable block list (a list of more than one block)"
    );
}

#[test]
fn on_demand_component_without_lifecycle_is_rejected() {
    let plan_decl = OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        on_demand_component_paths: strings(&["text_encoder"]),
        ..OffloadPlanDecl::default()
    };
    let p = staged_encoder("LifecyclelessPipeline", false, plan_decl);
    let expected = "On-demand component 'text_encoder' must implement load_to_device() and offload_to_cpu() \
                    (has_lifecycle) or be removed from offload_plan.on_demand_component_paths";
    assert_eq!(err(&p, &layer(&["text_encoder"], "{}")), expected);
    // Also under the compatibility topology: a wrong declaration is never silently staged.
    assert_eq!(err(&p, &legacy_layerwise()), expected);
}

#[test]
fn single_block_dit_is_rejected_explicitly_and_skipped_under_legacy() {
    let p = build(toy("SingleBlockPipeline", 1).offload_plan(toy_plan()));
    let expected = "Selected DiT 'transformer' requires at least two streamable layerwise-offload blocks (found one)";
    assert_eq!(err(&p, &layer(&["dit"], "{}")), expected);
    // The distributed strategy without resident layers rejects it as well.
    assert_eq!(err(&p, &layer(&["dit"], r#"{"dit": {"weight_transfer": "allgather"}}"#)), expected);

    let plan = ok(&p, &legacy_layerwise());
    assert!(!plan.dits[0].selected);
    assert_eq!(plan.dits[0].stacks, vec![]);
    assert_eq!(plan.skip_reason, None);
    assert_eq!(plan.warnings, strings(&["Target layers (blocks) of 'transformer' <= 1. Skipping offloading"]));
    // The rest of the legacy plan still resolves: the encoder streams, the VAE is staged.
    assert_eq!(plan.encoders[0].stacks[0].blocks, blocks("text_encoder.layers", 3));
    assert!(plan.vaes[0].on_demand);
}

#[test]
fn single_block_dit_with_undeclared_residency_is_not_streamed_as_a_one_block_ring() {
    // Legacy distributed offload asks for resident layers, but the DiT is not in resident_dit_paths, so nothing is
    // resident; its single block must not become a ring of one block.
    let mut plan_decl = toy_plan();
    plan_decl.resident_dit_paths.clear();
    let p = build(toy("SingleBlockUndeclaredPipeline", 1).offload_plan(plan_decl));
    let plan = ok(&p, &legacy_dlo_rank_local(1));
    assert!(!plan.dits[0].selected);
    assert_eq!(plan.dits[0].stacks, vec![]);
    assert_eq!(
        plan.warnings,
        strings(&[
            "dlo_resident_layers=1 requested but DiT 'transformer' is not in offload_plan.resident_dit_paths; all \
             blocks will be streamed",
            "Selected DiT 'transformer' requires at least two streamable layerwise-offload blocks (found one)",
        ])
    );
    // Declared, the single block is simply resident.
    let p = build(toy("SingleBlockDeclaredPipeline", 1).offload_plan(toy_plan()));
    for c in [legacy_dlo_rank_local(1), resident(1), resident(3)] {
        let plan = ok(&p, &c);
        assert_eq!(plan.dits[0].stacks[0].resident_head, 1);
        assert!(plan.dits[0].stacks[0].streaming().is_empty());
    }
}

fn allgather_encoder_config() -> OffloadConfig {
    cfg(r#"{"data_parallel_size": 2, "diffusion_offload_config": {"mode": "layer",
          "components": ["dit", "text_encoder"],
          "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}}}"#)
}

#[test]
fn encoder_allgather_requires_declared_replication() {
    let c = allgather_encoder_config();
    assert_eq!(c.group.size, 2);
    assert!(c.uses_allgather(Component::TextEncoder));
    // The encoder's block path is also broken: the replication check runs first, before any block discovery.
    let mut plan_decl = toy_plan();
    plan_decl.encoder_block_attrs = attrs_map(&[("text_encoder", &["nope"])]);
    let p = build(toy("AllGatherEncoderPipeline", 3).offload_plan(plan_decl.clone()));
    assert_eq!(
        err(&p, &c),
        "Text encoder 'text_encoder' cannot use AllGather across the offload group of 2 ranks: its weights are not \
         declared replicated (offload_plan.encoder_dlo_weight_replication). Set \
         diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\""
    );
    // Declared replication passes that check; the strict group then rejects the broken path.
    plan_decl.encoder_dlo_weight_replication = strings(&["text_encoder"]);
    let p = build(toy("AllGatherEncoderPipeline", 3).offload_plan(plan_decl));
    assert_eq!(
        err(&p, &c),
        "Encoder block path 'text_encoder.nope' does not exist; fix offload_plan.encoder_block_attrs"
    );
    // With a good path and replication the plan resolves.
    let mut plan_decl = toy_plan();
    plan_decl.encoder_dlo_weight_replication = strings(&["text_encoder"]);
    let p = build(toy("AllGatherEncoderPipeline", 3).offload_plan(plan_decl));
    let plan = ok(&p, &c);
    assert_eq!(plan.strategy, Strategy::DistributedLayerWise);
    assert_eq!(plan.encoders[0].stacks[0].blocks, blocks("text_encoder.layers", 3));
}

#[test]
fn on_demand_encoder_cannot_allgather_without_stacks() {
    let plan_decl = OffloadPlanDecl {
        block_attrs: attrs_map(&[("transformer", &["blocks"])]),
        on_demand_component_paths: strings(&["text_encoder"]),
        encoder_dlo_weight_replication: strings(&["text_encoder"]),
        ..OffloadPlanDecl::default()
    };
    let p = staged_encoder("OnDemandAllGatherPipeline", true, plan_decl);
    assert_eq!(
        err(&p, &allgather_encoder_config()),
        "On-demand text encoder 'text_encoder' has no streamable block stacks, so it cannot use AllGather transfer; \
         set diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\""
    );
}

#[test]
fn two_dits_cannot_own_the_same_blocks() {
    let p = build(
        PipelineBuilder::new("SharedBlocksPipeline")
            .module("transformer", "OuterDiT", |m| {
                m.linear("embed", DType::Bf16, 8, 16, false);
                m.module("core", "InnerDiT", |c| block_list(c, "blocks", 3));
            })
            .dit("transformer")
            .dit("transformer.core")
            .offload_plan(OffloadPlanDecl {
                block_attrs: attrs_map(&[("transformer", &["core.blocks"]), ("transformer.core", &["blocks"])]),
                ..OffloadPlanDecl::default()
            }),
    );
    let expected =
        "Offload block 'transformer.core.blocks.0' is claimed by both 'transformer' and 'transformer.core'; \
                    declare one owner for each block list";
    assert_eq!(err(&p, &layer(&["dit"], "{}")), expected);
    assert_eq!(err(&p, &legacy_layerwise()), expected);
}

#[test]
fn encoder_and_dit_cannot_own_the_same_blocks() {
    let p = build(
        PipelineBuilder::new("SharedEncoderBlocksPipeline")
            .module("transformer", "ToyDiT", |m| {
                toy_dit(m, 2);
                m.module("text_encoder", "Enc", |e| block_list(e, "layers", 2));
            })
            .dit("transformer")
            .encoder("transformer.text_encoder")
            .offload_plan(OffloadPlanDecl {
                block_attrs: attrs_map(&[("transformer", &["blocks", "text_encoder.layers"])]),
                encoder_block_attrs: attrs_map(&[("transformer.text_encoder", &["layers"])]),
                ..OffloadPlanDecl::default()
            }),
    );
    assert_eq!(
        err(&p, &layer(&["dit", "text_encoder"], "{}")),
        "Offload block 'transformer.text_encoder.layers.0' is claimed by both 'transformer' and \
         'transformer.text_encoder'; declare one owner for each block list"
    );
}

#[test]
fn legacy_selection_keeps_unstreamable_components() {
    let p = build(
        PipelineBuilder::new("LegacyUnplannedPipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 4))
            .module("text_encoder", "Enc", leaf)
            .module("image_encoder", "Siglip", |m| block_list(m, "layers", 2))
            .module("vae", "PlainVae", leaf)
            .components(ComponentDecls {
                dit: strings(&["transformer"]),
                encoders: strings(&["text_encoder", "image_encoder"]),
                vaes: strings(&["vae"]),
                resident: vec![],
                auxiliary: vec![],
            })
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    let plan = ok(&p, &legacy_layerwise());
    let summary: Vec<(&str, bool, bool, usize)> =
        plan.components().map(|c| (c.path.as_str(), c.selected, c.on_demand, c.stacks.len())).collect();
    assert_eq!(
        summary,
        vec![
            ("transformer", true, false, 1),
            ("text_encoder", false, false, 0),
            ("image_encoder", false, false, 0),
            ("vae", false, false, 0),
        ]
    );
    assert_eq!(plan.warnings, Vec::<String>::new());
    // The same pipeline with an explicit text-encoder selection is an error.
    assert_eq!(
        err(&p, &layer(&["dit", "text_encoder"], "{}")),
        "Selected text encoder 'text_encoder' requires a model-declared streamable (offload_plan.encoder_block_attrs) \
         or on-demand (offload_plan.on_demand_component_paths) plan"
    );
}

#[test]
fn residents_and_auxiliaries_are_never_selected() {
    let p = build(
        PipelineBuilder::new("ResidentPipeline")
            .module("transformer", "ToyDiT", |m| toy_dit(m, 3))
            .module("text_encoder", "Enc", |m| block_list(m, "layers", 2))
            .module("scheduler_net", "Net", leaf)
            .module("safety", "Checker", leaf)
            .components(ComponentDecls {
                dit: strings(&["transformer"]),
                encoders: strings(&["text_encoder"]),
                vaes: vec![],
                resident: strings(&["scheduler_net"]),
                auxiliary: strings(&["safety"]),
            })
            .class_block_attrs("ToyDiT", &["blocks"]),
    );
    for c in [layer(&["dit"], "{}"), module_mode(&["dit", "text_encoder"]), legacy_layerwise()] {
        let plan = ok(&p, &c);
        let r: Vec<(&str, ComponentKind, bool)> =
            plan.residents.iter().map(|r| (r.path.as_str(), r.kind, r.selected)).collect();
        assert_eq!(
            r,
            vec![("scheduler_net", ComponentKind::Resident, false), ("safety", ComponentKind::Auxiliary, false)]
        );
    }
}

#[test]
fn disabled_config_selects_nothing() {
    for p in [flux_tiny(), build(toy("DisabledPipeline", 4).offload_plan(toy_plan()))] {
        let plan = ok(&p, &OffloadConfig::disabled());
        assert_eq!(plan.strategy, Strategy::None);
        assert!(plan.components().all(|c| !c.selected && c.stacks.is_empty() && !c.on_demand));
        assert_eq!(plan.skip_reason, None);
        let b = &plan.budget;
        assert_eq!((b.resident_head_bytes, b.slot_bytes, b.on_demand_peak_bytes), (0, 0, 0));
        assert_eq!(b.device_weight_bytes, b.always_resident_bytes);
        assert!(b.device_weight_bytes >= p.subtree_bytes(""));
    }
    // Every storage of the toy pipeline is one alignment unit, so the whole pipeline is exactly resident.
    let p = build(toy("DisabledPipeline", 4).offload_plan(toy_plan()));
    assert_eq!(p.subtree_bytes(""), 10 * 256);
    assert_eq!(ok(&p, &OffloadConfig::disabled()).budget.device_weight_bytes, 10 * 256);
}

// ------------------------------------------------------------------------------------------------------------
// Tied aliases

#[test]
fn alias_of_a_block_weight_stays_with_the_ring() {
    let p = flux_tiny();
    let alias = p.tensor("transformer.proj_alias.weight").expect("alias").storage;
    let target = p.tensor("transformer.single_transformer_blocks.0.linear2.weight").expect("target").storage;
    assert_eq!(alias, target);
    let plan = ok(&p, &layer(&["dit"], "{}"));
    let dit = &plan.dits[0];
    let non_block = non_block_storages(&p, dit);
    assert!(!non_block.contains(&alias));
    assert!(storages_under(&p, "transformer.single_transformer_blocks.0").contains(&alias));
    // Ordinary non-block state is kept on the device.
    for t in ["transformer.x_embedder.weight", "transformer.proj_out.weight", "transformer.pos_embed.freqs"] {
        assert!(non_block.contains(&p.tensor(t).expect(t).storage), "{t}");
    }
    // Exactly: every storage under the DiT minus the blocks' storages.
    let mut expected = storages_under(&p, "transformer");
    for b in flux_blocks() {
        for s in storages_under(&p, &b) {
            expected.remove(&s);
        }
    }
    assert_eq!(non_block, expected);
}

// ------------------------------------------------------------------------------------------------------------
// Purity

#[test]
fn resolution_is_repeatable_and_leaves_its_inputs_untouched() {
    let configs = [
        OffloadConfig::disabled(),
        module_mode(&["dit", "text_encoder"]),
        layer(&["dit", "text_encoder", "vae"], r#"{"dit": {"prefetch_depth": 3}}"#),
        resident(5),
        resident(56),
        legacy_layerwise(),
        legacy_dlo_rank_local(4),
        allgather_encoder_config(),
        cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": "1MiB"}}"#),
    ];
    for name in ["flux-tiny", "wan-tiny", "qwen-tiny"] {
        let p = preset(name).expect(name);
        for c in &configs {
            let (p0, c0) = (p.clone(), c.clone());
            let first = resolve_offload_plan(&p, c);
            let second = resolve_offload_plan(&p, c);
            assert_eq!(first, second, "{name} {c:?}");
            assert_eq!(p, p0);
            assert_eq!(*c, c0);
        }
    }
}

/// The format's largest block lists plan in linear time: 65 536 repeated and 100 000 explicit blocks, with the
/// budget planner choosing residency. (A guard against quadratic lookups, not a timing figure: the quadratic
/// versions took 20 s and 67 s in a release build; these bounds are loose for a debug build on a busy machine.)
#[test]
fn the_largest_block_lists_plan_in_linear_time() {
    use weightferry::pipeline::json::load_pipeline_json;
    let config = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": "300KiB"}}"#,
    )
    .unwrap();
    let tail =
        r#"}}}, "components": {"dit": ["transformer"]}, "offload_plan": {"block_attrs": {"transformer": ["blocks"]}}}"#;
    let repeated = format!(
        r#"{{"class": "P", "modules": {{"transformer": {{"class": "T", "children": {{"blocks": {{"repeat": 65536,
            "block": {{"class": "B", "tensors": {{"w": {{"dtype": "bf16", "shape": [4]}}}}}}}}{tail}"#
    );
    let children: Vec<String> = (0..100_000)
        .map(|i| format!(r#""{i}": {{"class": "B", "tensors": {{"w": {{"dtype": "bf16", "shape": [4]}}}}}}"#))
        .collect();
    let explicit = format!(
        r#"{{"class": "P", "modules": {{"transformer": {{"class": "T", "children": {{"blocks": {{"class": "ModuleList",
            "children": {{{}}}}}{tail}"#,
        children.join(",")
    );
    for (text, blocks) in [(repeated, 65_536usize), (explicit, 100_000)] {
        let t = std::time::Instant::now();
        let desc = load_pipeline_json(&text).unwrap();
        let plan = resolve_offload_plan(&desc, &config).unwrap();
        let stack = &plan.dits[0].stacks[0];
        assert_eq!(stack.blocks.len(), blocks);
        assert_eq!(stack.resident().len(), 1198, "300 KiB holds 1198 resident 256-byte blocks beside 2 slots");
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "{blocks} blocks took {:?}", t.elapsed());
    }
}

#[test]
fn an_auto_budget_is_refused_until_a_device_resolved_it() {
    let p = preset("flux-tiny").unwrap();
    let mut c =
        cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": "auto"}}"#);
    let e = resolve_offload_plan(&p, &c).unwrap_err();
    assert_eq!(e.to_string(), weightferry::plan::resolver::AUTO_BUDGET_UNRESOLVED);
    assert!(e
        .to_string()
        .starts_with("diffusion_offload_config.device_budget = \"auto\" is resolved from the device's"));
    c.resolve_auto_budget(64 << 30);
    let plan = resolve_offload_plan(&p, &c).unwrap();
    assert_eq!(plan.strategy, Strategy::LayerWise);
}
