//! The device-memory planner (`plan::budget`): exact `device_weight_bytes` for each strategy on a hand-sized
//! pipeline, the budget-driven choice of resident heads and prefetch depths, the budget error and its stated
//! minimum, and `fit_stack` on small hand-made block lists.
//!
//! Every tensor of the test pipeline is one bf16 storage whose size is a multiple of [`U`] (256 bytes, the device
//! packing alignment), so every expected number can be worked out by hand: the DiT's non-block state is 5 U, the
//! text encoder 30 U, the VAE 35 U, and the blocks are given per test.

use weightferry::config::{OffloadConfig, Strategy};
use weightferry::pipeline::builder::{ModuleBuilder, PipelineBuilder};
use weightferry::pipeline::{DType, OffloadPlanDecl, PipelineDesc};
use weightferry::plan::budget::fit_stack;
use weightferry::plan::{resolve_offload_plan, ResolvedPlan};

/// Size unit of the test pipelines (bytes).
const U: u64 = 256;
/// Non-block DiT bytes.
const EMBED: u64 = 5 * U;
/// Text encoder bytes.
const TE: u64 = 30 * U;
/// VAE bytes.
const VAE: u64 = 35 * U;
/// Bytes that stay on the device for the DiT-only layer plans: DiT non-block state, unselected encoder and VAE.
const FIXED: u64 = EMBED + TE + VAE;

/// A pipeline whose DiT blocks weigh `units` × [`U`] bytes each, every block a single bf16 parameter.
fn pipeline(class: &str, units: &[u64]) -> PipelineDesc {
    let sizes = units.to_vec();
    PipelineBuilder::new(class)
        .module("transformer", "BudgetDiT", |m| {
            m.param("embed", DType::Bf16, &[EMBED / 2]);
            m.block_list("blocks", sizes.len(), "BudgetBlock", |b, i| {
                b.param("w", DType::Bf16, &[sizes[i] * U / 2]);
            });
        })
        .module("text_encoder", "BudgetEncoder", |m| {
            m.param("w", DType::Bf16, &[TE / 2]);
        })
        .module("vae", "BudgetVae", |m| {
            m.has_lifecycle(true);
            m.param("w", DType::Bf16, &[VAE / 2]);
        })
        .dit("transformer")
        .encoder("text_encoder")
        .vae("vae")
        .offload_plan(OffloadPlanDecl {
            block_attrs: [("transformer".to_string(), vec!["blocks".to_string()])].into(),
            on_demand_component_paths: vec!["vae".to_string()],
            resident_dit_paths: vec!["transformer".to_string()],
            ..OffloadPlanDecl::default()
        })
        .build()
        .expect("valid test pipeline")
}

/// Five blocks of 4 U.
fn uniform() -> PipelineDesc {
    pipeline("UniformBudgetPipeline", &[4; 5])
}

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("config {json} rejected: {e}"))
}

/// Layer mode over `components` with an optional DiT `prefetch_depth` and `device_budget`.
fn layer(components: &str, depth: Option<u32>, budget: Option<u64>) -> OffloadConfig {
    let options = match depth {
        Some(d) => format!(r#", "layer_options": {{"dit": {{"prefetch_depth": {d}}}}}"#),
        None => String::new(),
    };
    let budget = budget.map(|b| format!(r#", "device_budget": {b}"#)).unwrap_or_default();
    cfg(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": [{components}]{options}{budget}}}}}"#
    ))
}

fn ok(p: &PipelineDesc, c: &OffloadConfig) -> ResolvedPlan {
    resolve_offload_plan(p, c).unwrap_or_else(|e| panic!("expected a plan, got: {e}"))
}

fn err(p: &PipelineDesc, c: &OffloadConfig) -> String {
    match resolve_offload_plan(p, c) {
        Ok(plan) => panic!("expected an error, got {:#?}", plan.budget),
        Err(e) => e.to_string(),
    }
}

/// (always resident, resident heads, slots, on-demand peak, total).
fn parts(plan: &ResolvedPlan) -> (u64, u64, u64, u64, u64) {
    let b = &plan.budget;
    (b.always_resident_bytes, b.resident_head_bytes, b.slot_bytes, b.on_demand_peak_bytes, b.device_weight_bytes)
}

/// The planner's error for a budget that cannot hold one stack.
fn too_small(budget: u64, fixed: u64, ring: u64, name: &str, depth: u32, others: Option<u64>, need: u64) -> String {
    let others = others.map(|o| format!(" and {o} bytes for the other DiT stacks")).unwrap_or_default();
    format!(
        "diffusion_offload_config.device_budget: {budget} bytes cannot hold the {fixed} bytes of weights that stay \
         on the device plus the smallest ring of {ring} bytes for '{name}' (prefetch depth {depth}){others}; raise \
         device_budget to at least {need} bytes ({})",
        weightferry::plan::bytes::short_bytes(need)
    )
}

#[test]
fn test_pipeline_has_the_intended_sizes() {
    let p = uniform();
    assert_eq!(p.subtree_bytes("transformer"), EMBED + 20 * U);
    assert_eq!(p.subtree_bytes("text_encoder"), TE);
    assert_eq!(p.subtree_bytes("vae"), VAE);
    assert_eq!(p.subtree_bytes("transformer.blocks.3"), 4 * U);
}

// ------------------------------------------------------------------------------------------------------------
// Model level: always-resident components plus the largest phase.

#[test]
fn model_level_is_always_resident_plus_the_largest_phase() {
    let p = uniform();
    let dit = EMBED + 20 * U;
    // The unselected VAE stays; the encoder (30 U) is the largest phase against the DiT (25 U).
    let plan =
        ok(&p, &cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}"#));
    assert_eq!(plan.strategy, Strategy::ModelLevel);
    assert_eq!(parts(&plan), (VAE, 0, 0, TE, VAE + TE));
    assert!(!plan.budget.planner_chose);
    // With the VAE selected too, nothing stays and the VAE is the largest phase.
    let plan = ok(
        &p,
        &cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}"#),
    );
    assert_eq!(parts(&plan), (0, 0, 0, VAE, VAE));
    // Keeping the DiT resident moves it to the always-resident part.
    let plan = ok(
        &p,
        &cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"],
                  "keep_dit_resident": true}}"#),
    );
    assert_eq!(parts(&plan), (VAE + dit, 0, 0, TE, VAE + dit + TE));
    // Legacy model-level: the DiT and encoder swap, the VAE stays.
    let plan = ok(&p, &cfg(r#"{"enable_cpu_offload": true}"#));
    assert_eq!(parts(&plan), (VAE, 0, 0, TE, VAE + TE));
}

#[test]
fn model_level_budget_is_checked() {
    let p = uniform();
    let c = |b: u64| {
        cfg(&format!(
            r#"{{"diffusion_offload_config": {{"mode": "module", "components": ["dit", "text_encoder"],
                 "device_budget": {b}}}}}"#
        ))
    };
    let need = VAE + TE;
    let plan = ok(&p, &c(need));
    assert_eq!(plan.budget.device_weight_bytes, need);
    assert_eq!(plan.budget.budget, Some(need));
    assert_eq!(
        err(&p, &c(need - 1)),
        format!(
            "diffusion_offload_config.device_budget: the plan needs {need} bytes of device memory for weights but \
             the budget is {}; raise device_budget, lower resident_layers or prefetch_depth, or select more \
             components",
            need - 1
        )
    );
}

// ------------------------------------------------------------------------------------------------------------
// Layerwise without a budget: (depth + 1) slots of the largest streamed block.

#[test]
fn layerwise_without_budget_counts_depth_plus_one_slots() {
    let p = uniform();
    // Default depth 2: three slots of 4 U.
    let plan = ok(&p, &layer(r#""dit""#, None, None));
    assert_eq!(plan.strategy, Strategy::LayerWise);
    assert_eq!(plan.dits[0].stacks[0].prefetch_depth, 2);
    assert_eq!(parts(&plan), (FIXED, 0, 12 * U, 0, FIXED + 12 * U));
    for (depth, slots) in [(1, 2), (3, 4), (4, 5), (9, 5)] {
        let plan = ok(&p, &layer(r#""dit""#, Some(depth), None));
        let s = &plan.dits[0].stacks[0];
        assert_eq!(s.prefetch_depth, depth);
        assert_eq!(s.slot_count(), slots, "depth {depth}");
        assert_eq!(plan.budget.device_weight_bytes, FIXED + 4 * U * slots as u64, "depth {depth}");
        assert!(!plan.budget.planner_chose);
    }
}

#[test]
fn layerwise_slots_use_the_largest_streamed_block() {
    let p = pipeline("UnevenBudgetPipeline", &[4, 3, 6, 2, 1]);
    let plan = ok(&p, &layer(r#""dit""#, None, None));
    assert_eq!(plan.dits[0].stacks[0].block_bytes, vec![4 * U, 3 * U, 6 * U, 2 * U, U]);
    assert_eq!(parts(&plan), (FIXED, 0, 18 * U, 0, FIXED + 18 * U));
}

#[test]
fn layerwise_staged_vae_counts_as_its_own_phase() {
    let p = uniform();
    let plan = ok(&p, &layer(r#""dit", "vae""#, None, None));
    assert!(plan.vaes[0].on_demand);
    assert_eq!(parts(&plan), (EMBED + TE, 0, 12 * U, VAE, EMBED + TE + 12 * U + VAE));
}

#[test]
fn resident_layers_count_the_head_and_fewer_slots() {
    let p = uniform();
    let c = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                    "layer_options": {"dit": {"resident_layers": 2, "prefetch_depth": 3}}}}"#);
    let plan = ok(&p, &c);
    assert_eq!(plan.strategy, Strategy::DistributedLayerWise);
    // Two resident (8 U), three streaming with depth 3: min(4, 3) = 3 slots of 4 U.
    assert_eq!(parts(&plan), (FIXED, 8 * U, 12 * U, 0, FIXED + 20 * U));
}

// ------------------------------------------------------------------------------------------------------------
// Layerwise with a budget: the planner chooses.

#[test]
fn budget_planner_fills_the_room_and_never_predicts_worse_than_a_resident_head() {
    use weightferry::plan::budget::{fit_stack, resident_set_cost, simulate_pass, ASSUMED_COMPUTE_RATIO};
    let p = uniform();
    for room in [12 * U, 16 * U, 17 * U, 20 * U - 1] {
        let plan = ok(&p, &layer(r#""dit""#, None, Some(FIXED + room)));
        let s = &plan.dits[0].stacks[0];
        let flags = s.resident_flags();
        assert_eq!(flags.iter().filter(|r| **r).count(), s.resident_head, "room {room}");
        let used = resident_set_cost(&s.block_bytes, &flags, s.prefetch_depth, false);
        assert_eq!(plan.budget.device_weight_bytes, FIXED + used, "room {room}");
        assert!(plan.budget.device_weight_bytes <= FIXED + room, "room {room}");
        assert!(plan.budget.planner_chose);
        // Under the planner's own timing model, its layout is at least as fast as keeping a leading head.
        let (head, k) = fit_stack(&s.block_bytes, None, room).expect("a head split fits");
        let head_flags: Vec<bool> = (0..5).map(|i| i < head).collect();
        let chosen = simulate_pass(&s.block_bytes, &flags, s.prefetch_depth, false, ASSUMED_COMPUTE_RATIO);
        let packed = simulate_pass(&s.block_bytes, &head_flags, k, false, ASSUMED_COMPUTE_RATIO);
        assert!(chosen <= packed + 1e-6, "room {room}: chosen {chosen} vs head {packed}");
        assert!(plan.budget.notes[0].contains("layout "), "{:?}", plan.budget.notes);
    }
    // Room for every block: everything stays resident, nothing streams.
    let plan = ok(&p, &layer(r#""dit""#, None, Some(FIXED + 20 * U)));
    assert_eq!(plan.dits[0].stacks[0].resident_flags(), vec![true; 5]);
    assert_eq!(plan.budget.device_weight_bytes, FIXED + 20 * U);
    // Only depth 1 with nothing resident fits in 10 U.
    let plan = ok(&p, &layer(r#""dit""#, None, Some(FIXED + 10 * U)));
    let s = &plan.dits[0].stacks[0];
    assert_eq!((s.resident_head, s.prefetch_depth), (0, 1));
    assert_eq!(plan.budget.device_weight_bytes, FIXED + 8 * U);
    // Depth 3 needs four slots: the minimum is FIXED + 16 U, not two slots' worth.
    let need = FIXED + 16 * U;
    assert_eq!(
        err(&p, &layer(r#""dit""#, Some(3), Some(need - 1))),
        too_small(need - 1, FIXED, 16 * U, "transformer[blocks]", 3, None, need)
    );
    assert_eq!(ok(&p, &layer(r#""dit""#, Some(3), Some(need))).budget.device_weight_bytes, need);
}

#[test]
fn the_planner_spreads_resident_blocks_between_streamed_ones() {
    use weightferry::plan::budget::{plan_spread, Ring};
    let user = |k| Ring { depth: Some(k), static_slots: false };
    // Ten equal blocks, room for five resident plus two slots: a compute-heavy model (ratio 2) wants every streamed
    // block between resident ones, not a resident head followed by a streamed tail.
    let blocks = vec![10u64; 10];
    let c = plan_spread(&blocks, user(1), 70, 2.0).expect("fits");
    assert_eq!(c.depth, 1);
    assert_eq!(c.resident.iter().filter(|r| **r).count(), 5);
    for w in c.resident.windows(2) {
        assert!(w[0] || w[1], "two streamed blocks in a row: {:?}", c.resident);
    }
    // With a tiny budget nothing can be resident.
    let c = plan_spread(&blocks, Ring::default(), 20, 0.5).expect("two slots fit");
    assert_eq!((c.resident, c.depth), (vec![false; 10], 1));
    assert!(plan_spread(&blocks, Ring::default(), 19, 0.5).is_none());
}

#[test]
fn a_static_ring_is_costed_with_its_divisor_slot_count() {
    use weightferry::plan::budget::{plan_spread, resident_set_cost, simulate_pass, Ring};
    let blocks = vec![10u64; 10];
    let none = vec![false; 10];
    // Depth 2 over ten streamed blocks: 3 slots, or 5 when static (the smallest divisor of 10 from 3).
    assert_eq!(resident_set_cost(&blocks, &none, 2, false), 30);
    assert_eq!(resident_set_cost(&blocks, &none, 2, true), 50);
    // Nine streamed (one resident): 3 slots either way, plus the resident block.
    let mut one = none.clone();
    one[0] = true;
    assert_eq!(resident_set_cost(&blocks, &one, 2, true), 40);
    // The static ring's extra slots do not prefetch further than the depth: a copy-bound stack (ratio 0.5) steps
    // no faster with them.
    let plain = simulate_pass(&blocks, &none, 2, false, 0.5);
    let stat = simulate_pass(&blocks, &none, 2, true, 0.5);
    assert!((plain - 100.0).abs() < 1e-9 && (stat - 100.0).abs() < 1e-9, "{plain} {stat}");
    // A budget of 40 holds a static depth-2 ring only over a streamed count whose divisor fits: the planner keeps
    // one block resident (9 streamed, 3 slots), never the 5 slots of 10 streamed.
    let ring = Ring { depth: Some(2), static_slots: true };
    let c = plan_spread(&blocks, ring, 40, 0.5).expect("a resident block and 3 slots fit");
    let streamed = c.resident.iter().filter(|r| !**r).count();
    assert_eq!((c.depth, c.bytes), (2, 40));
    assert!(streamed % 3 == 0 && streamed > 0, "{:?}", c.resident);
    assert!(plan_spread(&blocks, ring, 29, 0.5).is_none(), "no static depth-2 ring fits in 29");
}

/// Two DiTs of four 4 U blocks each, no other components.
fn two_dits() -> PipelineDesc {
    let dit = |m: &mut ModuleBuilder<'_>| {
        m.block_list("blocks", 4, "BudgetBlock", |b, _| {
            b.param("w", DType::Bf16, &[2 * U]);
        });
    };
    PipelineBuilder::new("TwoDitBudgetPipeline")
        .module("transformer", "BudgetDiT", dit)
        .module("transformer_2", "BudgetDiT", dit)
        .dit("transformer")
        .dit("transformer_2")
        .class_block_attrs("BudgetDiT", &["blocks"])
        .build()
        .expect("valid")
}

#[test]
fn budget_is_shared_so_every_dit_stack_fits() {
    let p = two_dits();
    // 20 U: depth 2 for the first (12 U) leaves exactly depth 1 for the second (8 U). Greedily holding the whole
    // first stack (16 U) would leave 4 U, not enough for the second.
    let plan = ok(&p, &layer(r#""dit""#, None, Some(20 * U)));
    assert!(plan.budget.device_weight_bytes <= 20 * U);
    for d in &plan.dits {
        let s = &d.stacks[0];
        assert!(s.slot_count() >= 2 || s.resident_head == 4, "{s:?}");
    }
    // The stated minimum covers both stacks: two slots each.
    assert_eq!(
        err(&p, &layer(r#""dit""#, None, Some(16 * U - 1))),
        too_small(16 * U - 1, 0, 8 * U, "transformer[blocks]", 1, Some(8 * U), 16 * U)
    );
    assert_eq!(ok(&p, &layer(r#""dit""#, None, Some(16 * U))).budget.device_weight_bytes, 16 * U);
}

#[test]
fn distributed_strategy_keeps_its_layout_and_checks_the_budget() {
    let p = uniform();
    let c = |b: u64| {
        cfg(&format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "device_budget": {b},
                 "layer_options": {{"dit": {{"resident_layers": 2}}}}}}}}"#
        ))
    };
    // 2 resident (8 U) + min(3, 3) slots of 4 U (12 U).
    let need = FIXED + 20 * U;
    let plan = ok(&p, &c(need));
    assert!(!plan.budget.planner_chose);
    assert_eq!(plan.dits[0].stacks[0].resident_head, 2);
    assert_eq!(plan.budget.device_weight_bytes, need);
    assert_eq!(
        err(&p, &c(need - 1)),
        format!(
            "diffusion_offload_config.device_budget: the plan needs {need} bytes of device memory for weights but \
             the budget is {}; raise device_budget, lower resident_layers or prefetch_depth, or select more \
             components",
            need - 1
        )
    );
}

// ------------------------------------------------------------------------------------------------------------
// fit_stack

#[test]
fn fit_stack_prefers_depth_two_then_falls_back_to_one() {
    let b = [10, 10, 10, 10];
    // Depth 2 costs by resident count: 30, 40, 40, 40, 40.
    assert_eq!(fit_stack(&b, None, 30), Some((0, 2)));
    assert_eq!(fit_stack(&b, None, 39), Some((0, 2)));
    assert_eq!(fit_stack(&b, None, 40), Some((4, 2)));
    assert_eq!(fit_stack(&b, None, 1000), Some((4, 2)));
    // Depth 1 costs: 20, 30, 30, 30, 30.
    assert_eq!(fit_stack(&b, None, 29), Some((0, 1)));
    assert_eq!(fit_stack(&b, None, 20), Some((0, 1)));
    assert_eq!(fit_stack(&b, None, 19), None);
}

#[test]
fn fit_stack_respects_the_user_depth() {
    let b = [10, 10, 10, 10, 10, 10];
    // Depth 3: four slots (40) with nothing resident; r resident: 10r + min(4, 6 - r) x 10.
    assert_eq!(fit_stack(&b, Some(3), 39), None);
    assert_eq!(fit_stack(&b, Some(3), 40), Some((0, 3)));
    assert_eq!(fit_stack(&b, Some(3), 50), Some((1, 3)));
    assert_eq!(fit_stack(&b, Some(3), 60), Some((6, 3)));
    // Depth 1 is never raised to 2, however much room there is.
    assert_eq!(fit_stack(&b, Some(1), 25), Some((0, 1)));
    assert_eq!(fit_stack(&b, Some(1), 10_000), Some((6, 1)));
}

#[test]
fn fit_stack_scans_every_split_because_a_big_head_shrinks_the_tail() {
    // Depth 1 costs by resident count: 20, 21, 13, 13, 13 (the 10-byte block is the tail maximum until resident).
    let b = [1, 10, 1, 1];
    assert_eq!(fit_stack(&b, Some(1), 20), Some((4, 1)));
    assert_eq!(fit_stack(&b, Some(1), 13), Some((4, 1)));
    assert_eq!(fit_stack(&b, Some(1), 12), None);
    // A big first block: 20, 12, 13, 13, 13. Only the resident big block fits in 12.
    let b = [10, 1, 1, 1];
    assert_eq!(fit_stack(&b, Some(1), 12), Some((1, 1)));
    assert_eq!(fit_stack(&b, Some(1), 11), None);
    assert_eq!(fit_stack(&b, Some(1), 13), Some((4, 1)));
}

#[test]
fn fit_stack_edge_cases() {
    assert_eq!(fit_stack(&[], None, 0), Some((0, 2)));
    assert_eq!(fit_stack(&[7], None, 7), Some((1, 2)));
    assert_eq!(fit_stack(&[7], None, 6), None);
    // Sizes near the top of u64 must not overflow.
    assert_eq!(fit_stack(&[u64::MAX / 2, u64::MAX / 2], None, u64::MAX), Some((2, 2)));
    assert_eq!(fit_stack(&[u64::MAX / 2, u64::MAX / 2, 1], Some(2), u64::MAX - 10), None);
}

#[test]
fn a_static_ring_under_a_device_budget_fits_its_divisor_slots() {
    // Ten blocks of 4 U, depth 2: a static ring over all ten takes 5 slots (20 U); over nine (one resident), 3.
    let p = pipeline("StaticBudgetPipeline", &[4; 10]);
    let config = |budget: u64| {
        cfg(&format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "device_budget": {budget},
                "layer_options": {{"dit": {{"prefetch_depth": 2, "static_slots": true}}}}}}}}"#
        ))
    };
    for room in [16 * U, 20 * U, 24 * U, 40 * U] {
        let plan = ok(&p, &config(FIXED + room));
        let s = &plan.dits[0].stacks[0];
        assert!(s.static_slots && s.prefetch_depth == 2, "room {room}");
        let streamed = s.resident_flags().iter().filter(|r| !**r).count();
        assert_eq!(s.slot_count(), weightferry_actors::block_stack::slot_count(streamed, 2, true), "room {room}");
        assert!(streamed == 0 || streamed % s.slot_count() == 0, "room {room}: the schedule repeats");
        assert!(plan.budget.device_weight_bytes <= FIXED + room, "room {room}");
        assert_eq!(plan.budget.device_weight_bytes, FIXED + s.resident_bytes() + s.slot_bytes(), "room {room}");
    }
    // The smallest static ring at depth 2: 3 slots over 9 (or 6, or 3) streamed blocks, with the rest resident;
    // 12 U + the resident blocks. Below every such layout the budget is refused by name.
    let e = err(&p, &config(FIXED + 12 * U - 1));
    assert!(e.starts_with("diffusion_offload_config.device_budget: "), "{e}");
}
