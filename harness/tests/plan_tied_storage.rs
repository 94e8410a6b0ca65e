//! The plan counts each storage once: a DiT attribute tied to a weight of a text-encoder *block* is counted where
//! the backend places that storage (in the encoder's ring when the encoder streams layerwise, in the fixed placement
//! when it is not offloaded), never a second time as always-resident DiT state. A `device_budget` exactly at the real
//! need is accepted and one byte less is refused with the planner's exact error; the plan's bound equals what the
//! backend's own layouts allocate, and a simulated run stays within it.
//!
//! The pipeline is written in the pipeline JSON format. Every tensor is one bf16 storage whose size is a multiple of
//! [`U`] (256 bytes, the device packing alignment), so every figure is a sum of whole units:
//!
//! | storage | owner | size |
//! | --- | --- | --- |
//! | `transformer.embed` | DiT non-block state | 5 U |
//! | `transformer.blocks.{0..3}.w` | DiT blocks | 4 × 4 U |
//! | `transformer.txt_proj.weight` | DiT attribute, `tied_to` `text_encoder.blocks.0.w` | (0: no storage of its own) |
//! | `text_encoder.norm` | encoder non-block state | 2 U |
//! | `text_encoder.blocks.{0..2}.w` | encoder blocks | 3 × 6 U |
//!
//! All weights: 5 + 16 + 2 + 18 = 41 U.

use weightferry::config::{OffloadConfig, Strategy};
use weightferry::offload::layout::UnitLayout;
use weightferry::offload::units::build_unit_plan;
use weightferry::pipeline::json::load_pipeline_json;
use weightferry::pipeline::PipelineDesc;
use weightferry::plan::{resolve_offload_plan, ResolvedPlan};
use weightferry_harness::drivers::run::{run, RunSpec};

/// Size unit (bytes): the device packing alignment.
const U: u64 = 256;

/// The test pipeline: bf16 rows of 128 elements are one unit each.
const PIPELINE: &str = r#"{
  "format": "weightferry-pipeline/1",
  "class": "TiedEncoderPipeline",
  "modules": {
    "transformer": {"class": "TiedDiT", "tensors": {"embed": {"dtype": "bf16", "shape": [5, 128]}}, "children": {
      "blocks": {"repeat": 4, "block": {"class": "TiedDiTBlock", "tensors": {"w": {"dtype": "bf16", "shape": [4, 128]}}}},
      "txt_proj": {"class": "Linear", "tensors": {
        "weight": {"dtype": "bf16", "shape": [6, 128], "tied_to": "text_encoder.blocks.0.w"}}}
    }},
    "text_encoder": {"class": "TiedTextEncoder", "tensors": {"norm": {"dtype": "bf16", "shape": [2, 128]}}, "children": {
      "blocks": {"repeat": 3, "block": {"class": "TiedEncoderBlock", "tensors": {"w": {"dtype": "bf16", "shape": [6, 128]}}}}
    }}
  },
  "components": {"dit": ["transformer"], "encoders": ["text_encoder"]},
  "offload_plan": {"block_attrs": {"transformer": ["blocks"]}, "encoder_block_attrs": {"text_encoder": ["blocks"]}}
}"#;

fn pipeline() -> PipelineDesc {
    load_pipeline_json(PIPELINE).expect("valid pipeline")
}

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("config {json} rejected: {e}"))
}

/// Layer mode over the DiT (and the text encoder when `with_encoder`), every stack at prefetch depth 1, with an
/// optional `device_budget`.
fn layer(with_encoder: bool, budget: Option<u64>) -> OffloadConfig {
    let budget = budget.map(|b| format!(r#", "device_budget": {b}"#)).unwrap_or_default();
    let (components, encoder) = if with_encoder {
        (r#""dit", "text_encoder""#, r#", "text_encoder": {"prefetch_depth": 1}"#)
    } else {
        (r#""dit""#, "")
    };
    cfg(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": [{components}], "layer_options": {{
            "dit": {{"prefetch_depth": 1}}{encoder}}}{budget}}}}}"#
    ))
}

fn ok(c: &OffloadConfig) -> ResolvedPlan {
    resolve_offload_plan(&pipeline(), c).unwrap_or_else(|e| panic!("expected a plan, got: {e}"))
}

fn err(c: &OffloadConfig) -> String {
    match resolve_offload_plan(&pipeline(), c) {
        Ok(plan) => panic!("expected an error, got {:#?}", plan.budget),
        Err(e) => e.to_string(),
    }
}

/// (always resident, resident heads, slots, on-demand peak, total).
fn parts(plan: &ResolvedPlan) -> (u64, u64, u64, u64, u64) {
    let b = &plan.budget;
    (b.always_resident_bytes, b.resident_head_bytes, b.slot_bytes, b.on_demand_peak_bytes, b.device_weight_bytes)
}

/// Device bytes the backend's layouts allocate at most for `config`: the packed fixed placement, the resident units
/// and `depth + 1` slots of the largest streamed unit of every stack.
fn layout_bound(config: &OffloadConfig) -> u64 {
    let p = pipeline();
    let plan = resolve_offload_plan(&p, config).expect("plan");
    let units = build_unit_plan(&p, config, &plan);
    let mut total = UnitLayout::pack(&p, "fixed", &units.fixed).device_bytes;
    for s in &units.stacks {
        let resident = |i: usize| s.resident_mask.as_ref().map_or(i < s.resident_head, |m| m[i]);
        let mut tail = 0u64;
        let mut streamed = 0usize;
        for (i, u) in s.units.iter().enumerate() {
            if resident(i) {
                total += u.device_bytes;
            } else {
                tail = tail.max(u.device_bytes);
                streamed += 1;
            }
        }
        total += (s.depth + 1).min(streamed) as u64 * tail;
    }
    total
}

/// A simulated run of `config`: bit-exact and within the plan.
fn run_within_plan(config: &OffloadConfig) -> u64 {
    let mut spec = RunSpec::new("tied-encoder", pipeline(), config.clone());
    spec.steps = 2;
    let r = run(&spec, &mut |_, _| {}).unwrap_or_else(|e| panic!("run: {e}")).report;
    assert!(r.offload_enabled, "{r}");
    assert!(r.outputs_match && r.weights_match, "{r}");
    assert_eq!(r.hazard_violations, 0, "{r}");
    assert!(r.within_plan, "{r}");
    r.peak_device_weight_bytes
}

#[test]
fn the_pipeline_has_the_intended_sizes() {
    let p = pipeline();
    assert_eq!(p.storages.len(), 1 + 4 + 1 + 3, "the tied attribute has no storage of its own");
    assert_eq!(p.subtree_bytes("transformer"), (5 + 16 + 6) * U, "the DiT's subtree sees the tied encoder weight");
    assert_eq!(p.subtree_bytes("text_encoder"), (2 + 18) * U);
    assert_eq!(p.storages.values().map(|s| s.byte_size()).sum::<u64>(), 41 * U);
}

#[test]
fn a_dit_attribute_tied_to_a_streamed_encoder_block_weight_is_counted_once_in_the_encoder_ring() {
    // Fixed: DiT embed 5 U + encoder norm 2 U = 7 U (the tied storage moves with encoder block 0, so it is not DiT
    // state). DiT ring: depth 1 = 2 slots × 4 U = 8 U. Encoder ring: 2 slots × 6 U = 12 U (block 0's slot holds
    // the tied storage). Total 7 + 8 + 12 = 27 U = 6912 bytes (it was 33 U: the tied 6 U again as DiT state).
    let c = layer(true, None);
    let plan = ok(&c);
    assert_eq!(plan.strategy, Strategy::LayerWise);
    assert_eq!(parts(&plan), (7 * U, 0, 20 * U, 0, 27 * U));
    assert_eq!(plan.encoders[0].stacks[0].block_bytes, vec![6 * U; 3]);
    assert_eq!(layout_bound(&c), 27 * U, "the plan is exactly what the backend's layouts allocate");
    assert!(run_within_plan(&c) <= 27 * U);

    // A budget exactly at the real need is accepted: the planner keeps nothing resident (the 8 U left is the DiT's
    // smallest ring) and the bound is the budget.
    let plan = ok(&layer(true, Some(27 * U)));
    assert!(plan.budget.planner_chose);
    assert_eq!(parts(&plan), (7 * U, 0, 20 * U, 0, 27 * U));
    assert_eq!(plan.dits[0].stacks[0].prefetch_depth, 1);
    // One byte less is refused: the 19 U that stay outside the DiT ring (7 U fixed + the encoder's 12 U ring)
    // plus the DiT's smallest ring of 8 U need 27 U.
    assert_eq!(
        err(&layer(true, Some(27 * U - 1))),
        "diffusion_offload_config.device_budget: 6911 bytes cannot hold the 4864 bytes of weights that stay on the \
         device plus the smallest ring of 2048 bytes for 'transformer[blocks]' (prefetch depth 1); raise \
         device_budget to at least 6912 bytes (6.75 KiB)"
    );
}

#[test]
fn a_dit_attribute_tied_to_a_weight_of_an_encoder_that_is_not_offloaded_is_counted_once() {
    // Only the DiT streams. Fixed: DiT embed 5 U + the whole encoder 20 U (norm 2 U + blocks 18 U, the tied storage
    // among them, viewed by the DiT too) = 25 U. DiT ring: 2 slots × 4 U = 8 U. Total 33 U = 8448 bytes (it was
    // 39 U: the tied 6 U once with the encoder and again as DiT state).
    let c = layer(false, None);
    let plan = ok(&c);
    assert!(!plan.encoders[0].selected);
    assert_eq!(parts(&plan), (25 * U, 0, 8 * U, 0, 33 * U));
    assert_eq!(layout_bound(&c), 33 * U, "the plan is exactly what the backend's layouts allocate");
    assert!(run_within_plan(&c) <= 33 * U);

    let plan = ok(&layer(false, Some(33 * U)));
    assert!(plan.budget.planner_chose);
    assert_eq!(parts(&plan), (25 * U, 0, 8 * U, 0, 33 * U));
    assert_eq!(
        err(&layer(false, Some(33 * U - 1))),
        "diffusion_offload_config.device_budget: 8447 bytes cannot hold the 6400 bytes of weights that stay on the \
         device plus the smallest ring of 2048 bytes for 'transformer[blocks]' (prefetch depth 1); raise \
         device_budget to at least 8448 bytes (8.25 KiB)"
    );
}

#[test]
fn the_other_strategies_count_the_tied_storage_once_too() {
    // No offload: every storage once, 41 U (it was 47 U: the DiT's subtree and the encoder's both held the 6 U).
    let plan = ok(&cfg("{}"));
    assert_eq!(plan.strategy, Strategy::None);
    assert_eq!(parts(&plan), (41 * U, 0, 0, 0, 41 * U));
    // Model level: the DiT (27 U with the tied weight) and the encoder (20 U) swap. Both units hold the tied 6 U,
    // so the backend pins it to the fixed placement: fixed 6 U, phases 21 U and 14 U, peak 6 + 21 = 27 U.
    let c = cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}"#);
    let plan = ok(&c);
    assert_eq!(plan.strategy, Strategy::ModelLevel);
    assert_eq!(parts(&plan), (6 * U, 0, 0, 21 * U, 27 * U));
    assert_eq!(layout_bound(&c), 27 * U);
}
