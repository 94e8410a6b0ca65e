//! Property tests of the plan resolver: random builder pipelines (module trees with block lists, ties, lifecycle
//! flags, declarations that may name paths that do not exist) crossed with random configs (built as JSON and
//! parsed; configs the parser rejects are skipped). The resolver must never panic, must be deterministic and leave
//! its inputs untouched, and every plan it returns must satisfy the structural invariants checked in
//! [`check_plan`].

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use weightferry::config::{Component, OffloadConfig, Strategy as OffloadStrategy};
use weightferry::pipeline::builder::{ModuleBuilder, PipelineBuilder};
use weightferry::pipeline::presets::{preset, PRESET_NAMES};
use weightferry::pipeline::{ComponentDecls, DType, ModuleNode, OffloadPlanDecl, PipelineDesc};
use weightferry::plan::resolver::{MODEL_SWAP_SKIP_REASON, NO_DIT_SKIP_REASON};
use weightferry::plan::{resolve_offload_plan, ComponentKind, PlanError, ResolvedComponent, ResolvedPlan};

// ------------------------------------------------------------------------------------------------------------
// Random pipelines

const PIPELINE_CLASSES: &[&str] = &["PropPipelineA", "PropPipelineB"];
const TOP_NAMES: &[&str] = &[
    "transformer",
    "transformer_2",
    "dit",
    "text_encoder",
    "text_encoder_2",
    "image_encoder",
    "vae",
    "backbone",
    "prompt_model",
    "misc",
];
const CHILD_NAMES: &[&str] = &["core", "encoder", "model", "refiner", "vision", "text_model", "head"];
const LIST_NAMES: &[&str] = &["blocks", "layers", "transformer_blocks", "single_blocks", "h"];
/// Includes the block-list classes, so a plain module can look like an (empty) block list.
const CLASSES: &[&str] = &["PropDiT", "PropEncoder", "PropVae", "PropCore", "ModuleList", "Sequential"];
/// Relative attribute paths used in declarations: real list names, nested ones, and nonsense.
const ATTRS: &[&str] = &[
    "blocks",
    "layers",
    "transformer_blocks",
    "single_blocks",
    "h",
    "core.blocks",
    "encoder.layers",
    "model.layers",
    "core",
    "p0",
    "nope",
];
/// Declared paths that usually do not exist.
const NONSENSE_PATHS: &[&str] = &["nope", "transformer.nope", "vae.blocks.0.w", "text_encoder.layers.99", "misc.p0"];
const ENCODER_TYPES: &[&str] = &["text_encoder", "encoder", "image"];

#[derive(Debug, Clone)]
struct ModSpec {
    class: usize,
    lifecycle: bool,
    /// Element counts of bf16 parameters `p0`, `p1`, ….
    params: Vec<u64>,
    /// Block lists: name index, then each block's parameter element count.
    lists: Vec<(usize, Vec<u64>)>,
    /// Nested modules: name index and spec.
    children: Vec<(usize, ModSpec)>,
    /// Tie an `alias` parameter to the first block of the list with this index, if it exists.
    tie: Option<usize>,
}

fn size() -> impl Strategy<Value = u64> + Clone {
    // Mostly small; sometimes huge, to exercise saturating byte arithmetic (2^61 bf16 elements = 2^62 bytes).
    prop_oneof![12 => 1u64..300, 1 => Just(1u64 << 61)]
}

fn mod_spec() -> impl Strategy<Value = ModSpec> {
    let params = prop::collection::vec(size(), 0..3);
    let lists = prop::collection::vec((0..LIST_NAMES.len(), prop::collection::vec(size(), 0..5)), 0..3);
    let leaf = (0..CLASSES.len(), any::<bool>(), params.clone(), lists.clone(), prop::option::of(0usize..3)).prop_map(
        |(class, lifecycle, params, lists, tie)| ModSpec { class, lifecycle, params, lists, children: Vec::new(), tie },
    );
    leaf.prop_recursive(2, 12, 3, move |inner| {
        (
            0..CLASSES.len(),
            any::<bool>(),
            params.clone(),
            lists.clone(),
            prop::collection::vec((0..CHILD_NAMES.len(), inner), 0..3),
            prop::option::of(0usize..3),
        )
            .prop_map(|(class, lifecycle, params, lists, children, tie)| ModSpec {
                class,
                lifecycle,
                params,
                lists,
                children,
                tie,
            })
    })
}

fn fill(m: &mut ModuleBuilder<'_>, spec: &ModSpec) {
    m.has_lifecycle(spec.lifecycle);
    for (i, &n) in spec.params.iter().enumerate() {
        m.param(&format!("p{i}"), DType::Bf16, &[n]);
    }
    let mut used = BTreeSet::new();
    let mut lists = Vec::new();
    for (name, sizes) in &spec.lists {
        let name = LIST_NAMES[*name];
        if !used.insert(name) {
            continue;
        }
        m.block_list(name, sizes.len(), "PropBlock", |b, i| {
            b.param("w", DType::Bf16, &[sizes[i]]);
        });
        lists.push((name, sizes.len()));
    }
    for (name, child) in &spec.children {
        let name = CHILD_NAMES[*name];
        if !used.insert(name) {
            continue;
        }
        m.module(name, CLASSES[child.class], |c| fill(c, child));
    }
    if let Some((list, _)) = spec.tie.and_then(|t| lists.get(t)).filter(|(_, n)| *n > 0) {
        m.tie("alias", &format!("{list}.0.w"));
    }
}

#[derive(Debug, Clone)]
struct PlanSpec {
    block_attrs: Vec<(usize, Vec<usize>)>,
    encoder_block_attrs: Vec<(usize, Vec<usize>)>,
    on_demand: Vec<usize>,
    resident_dit_paths: Vec<usize>,
    replication: Vec<usize>,
    offload_submodules: Vec<(usize, usize, usize)>,
    encoder_types: Vec<(usize, usize)>,
}

#[derive(Debug, Clone)]
struct DeclSpec {
    /// dit, encoders, vaes, resident, auxiliary (indices into the path pool), or `None` for the attribute scan.
    components: Option<[Vec<usize>; 5]>,
    plan: Option<PlanSpec>,
    class_attrs: Vec<(usize, Vec<usize>)>,
    singular: Vec<(usize, usize)>,
}

#[derive(Debug, Clone)]
struct PipelineSpec {
    class: usize,
    modules: Vec<(usize, ModSpec)>,
    decls: DeclSpec,
}

/// An index into a pool (taken modulo its length), biased to the front, where the likeliest-useful entries are.
fn idx() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![3 => 0usize..5, 1 => 0usize..64]
}

fn idxs(max: usize) -> impl Strategy<Value = Vec<usize>> + Clone {
    prop::collection::vec(idx(), 0..max)
}

fn decl_spec() -> impl Strategy<Value = DeclSpec> {
    let attr_list = prop::collection::vec(idx(), 1..3);
    let path_attrs = prop::collection::vec((idx(), attr_list.clone()), 0..3);
    let plan = (
        path_attrs.clone(),
        path_attrs.clone(),
        idxs(3),
        idxs(3),
        idxs(3),
        prop::collection::vec((idx(), idx(), idx()), 0..3),
        prop::collection::vec((idx(), idx()), 0..3),
    )
        .prop_map(|(block_attrs, encoder_block_attrs, on_demand, resident_dit_paths, replication, subs, types)| {
            PlanSpec {
                block_attrs,
                encoder_block_attrs,
                on_demand,
                resident_dit_paths,
                replication,
                offload_submodules: subs,
                encoder_types: types,
            }
        });
    let components = prop::option::of([idxs(3), idxs(3), idxs(3), idxs(2), idxs(2)]);
    (components, prop::option::of(plan), prop::collection::vec((idx(), attr_list), 0..3), idxs(2)).prop_map(
        |(components, plan, class_attrs, singular)| DeclSpec {
            components,
            plan,
            class_attrs,
            singular: singular.into_iter().map(|i| (i, i / 3)).collect(),
        },
    )
}

/// A pipeline shaped like the real ones: `transformer` (at least one block list), `text_encoder` and `vae`, in that
/// order, so declaration indices 0, 1, 2 name them and small attribute indices name block lists that exist. Most
/// such pipelines resolve, which exercises the invariants of plans with stacks, residents and budgets.
fn coherent_spec() -> impl Strategy<Value = PipelineSpec> {
    let near = || prop_oneof![8 => 0usize..3, 1 => 0usize..64];
    let dit_lists = prop::collection::vec((0..LIST_NAMES.len(), prop::collection::vec(size(), 1..5)), 1..3);
    let dit = (mod_spec(), dit_lists).prop_map(|(mut m, lists)| {
        m.lists = lists;
        m
    });
    let attrs = prop::collection::vec(prop_oneof![6 => Just(0usize), 2 => 0usize..2, 1 => 0usize..64], 1..3);
    let plan = (
        attrs.clone(),
        prop::option::of(near()),
        prop::collection::vec(1usize..3, 0..2),
        prop::bool::weighted(0.8),
        any::<bool>(),
        prop::collection::vec((Just(0usize), idx(), near()), 0..2),
    )
        .prop_map(|(mut dit_attrs, enc_attr, on_demand, resident, replicated, subs)| PlanSpec {
            block_attrs: vec![(0, {
                let mut seen = BTreeSet::new();
                dit_attrs.retain(|a| seen.insert(*a));
                dit_attrs
            })],
            encoder_block_attrs: enc_attr.map(|a| vec![(1, vec![a])]).unwrap_or_default(),
            on_demand,
            resident_dit_paths: if resident { vec![0] } else { vec![] },
            replication: if replicated { vec![1] } else { vec![] },
            offload_submodules: subs,
            encoder_types: vec![],
        });
    let declared = Just([vec![0], vec![1], vec![2], vec![], vec![]]);
    let decls = (
        prop::option::weighted(0.8, declared),
        prop::option::weighted(0.9, plan),
        prop::option::weighted(0.1, (idx(), attrs)),
    )
        .prop_map(|(components, plan, class_attrs)| DeclSpec {
            components,
            plan,
            class_attrs: class_attrs.into_iter().collect(),
            singular: vec![],
        });
    (0..PIPELINE_CLASSES.len(), dit, mod_spec(), mod_spec(), decls).prop_map(|(class, dit, enc, vae, decls)| {
        PipelineSpec { class, modules: vec![(0, dit), (3, enc), (6, vae)], decls }
    })
}

fn pipeline_spec() -> impl Strategy<Value = PipelineSpec> {
    (0..PIPELINE_CLASSES.len(), prop::collection::vec((0..TOP_NAMES.len(), mod_spec()), 0..5), decl_spec())
        .prop_map(|(class, modules, decls)| PipelineSpec { class, modules, decls })
}

fn tree_builder(spec: &PipelineSpec) -> PipelineBuilder {
    let mut b = PipelineBuilder::new(PIPELINE_CLASSES[spec.class]);
    let mut used = BTreeSet::new();
    for (name, m) in &spec.modules {
        let name = TOP_NAMES[*name];
        if used.insert(name) {
            b = b.module(name, CLASSES[m.class], |mb| fill(mb, m));
        }
    }
    b
}

fn module_paths(prefix: &str, m: &ModuleNode, out: &mut Vec<String>) {
    for (name, c) in &m.children {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        out.push(path.clone());
        module_paths(&path, c, out);
    }
}

/// Paths of the non-empty block lists in the tree.
fn block_list_paths(prefix: &str, m: &ModuleNode, out: &mut Vec<String>) {
    for (name, c) in &m.children {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        if c.is_block_list() && !c.children.is_empty() {
            out.push(path.clone());
        }
        block_list_paths(&path, c, out);
    }
}

/// Builds the random pipeline: the tree first (to learn its paths), then again with declarations drawn from those
/// paths and from nonsense ones. `None` when the builder rejects it (e.g. a byte total beyond u64).
fn build_pipeline(spec: &PipelineSpec) -> Option<PipelineDesc> {
    let bare = tree_builder(spec).build().ok()?;
    // Top-level modules first, then every nested module path (blocks included), then nonsense.
    let mut nested_paths = Vec::new();
    module_paths("", &bare.root, &mut nested_paths);
    let (mut pool, rest): (Vec<String>, Vec<String>) = nested_paths.into_iter().partition(|p| !p.contains('.'));
    pool.extend(rest);
    pool.extend(NONSENSE_PATHS.iter().map(|s| s.to_string()));
    // Attributes: the block lists that exist (relative to their top-level module and to their parent) first.
    let mut attrs: Vec<String> = Vec::new();
    let mut lists = Vec::new();
    block_list_paths("", &bare.root, &mut lists);
    for l in &lists {
        let candidates = [l.split_once('.').map(|(_, r)| r), l.rsplit_once('.').map(|(_, r)| r)];
        for a in candidates.into_iter().flatten() {
            if !attrs.iter().any(|x| x == a) {
                attrs.push(a.to_string());
            }
        }
    }
    attrs.extend(ATTRS.iter().map(|s| s.to_string()));
    let path = |i: &usize| pool[*i % pool.len()].clone();
    let attr = |i: &usize| attrs[*i % attrs.len()].clone();
    let class = |i: &usize| CLASSES[*i % CLASSES.len()];
    let d = &spec.decls;
    let mut b = tree_builder(spec);
    if let Some([dit, enc, vae, res, aux]) = &d.components {
        b = b.components(ComponentDecls {
            dit: dit.iter().map(path).collect(),
            encoders: enc.iter().map(path).collect(),
            vaes: vae.iter().map(path).collect(),
            resident: res.iter().map(path).collect(),
            auxiliary: aux.iter().map(path).collect(),
        });
    }
    if let Some(ps) = &d.plan {
        let attrs_map = |entries: &[(usize, Vec<usize>)]| -> BTreeMap<String, Vec<String>> {
            entries.iter().map(|(p, a)| (path(p), a.iter().map(attr).collect())).collect()
        };
        let mut subs: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for (p, child, a) in &ps.offload_submodules {
            subs.entry(path(p)).or_default().insert(CHILD_NAMES[child % CHILD_NAMES.len()].to_string(), attr(a));
        }
        b = b.offload_plan(OffloadPlanDecl {
            block_attrs: attrs_map(&ps.block_attrs),
            encoder_block_attrs: attrs_map(&ps.encoder_block_attrs),
            on_demand_component_paths: ps.on_demand.iter().map(path).collect(),
            resident_dit_paths: ps.resident_dit_paths.iter().map(path).collect(),
            encoder_dlo_weight_replication: ps.replication.iter().map(path).collect(),
            offload_submodules: subs,
            encoder_component_types: ps
                .encoder_types
                .iter()
                .map(|(p, t)| (path(p), ENCODER_TYPES[t % ENCODER_TYPES.len()].to_string()))
                .collect(),
            ..OffloadPlanDecl::default()
        });
    }
    for (c, attrs) in &d.class_attrs {
        let attrs: Vec<String> = attrs.iter().map(attr).collect();
        let refs: Vec<&str> = attrs.iter().map(String::as_str).collect();
        b = b.class_block_attrs(class(c), &refs);
    }
    for (c, a) in &d.singular {
        b = b.class_block_attr_singular(class(c), &attr(a));
    }
    b.build().ok()
}

// ------------------------------------------------------------------------------------------------------------
// Random configs

#[derive(Debug, Clone)]
struct LayerSpec {
    transfer: Option<usize>,
    resident: Option<u32>,
    depth: Option<u32>,
}

#[derive(Debug, Clone)]
struct CompactSpec {
    mode: usize,
    components: Vec<usize>,
    dit: Option<LayerSpec>,
    text_encoder: Option<LayerSpec>,
    budget: Option<u64>,
    keep_dit_resident: Option<bool>,
    pin_memory: Option<bool>,
}

#[derive(Debug, Clone)]
struct ConfigSpec {
    flags: [Option<bool>; 3],
    dlo_use_allgather: Option<bool>,
    dlo_resident_layers: Option<u32>,
    data_parallel_size: Option<u32>,
    sequence_parallel_size: Option<u32>,
    compact: Option<CompactSpec>,
}

fn layer_spec() -> impl Strategy<Value = LayerSpec> {
    // Resident counts near the block counts of the random stacks and of the presets (39..61 blocks).
    let resident = prop_oneof![3 => 0u32..8, 1 => 38u32..62];
    (prop::option::weighted(0.4, 0usize..2), prop::option::of(resident), prop::option::of(1u32..5))
        .prop_map(|(transfer, resident, depth)| LayerSpec { transfer, resident, depth })
}

fn budget() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..4_000, 4_000u64..200_000, Just(u64::MAX), Just(1u64 << 40)]
}

fn config_spec() -> impl Strategy<Value = ConfigSpec> {
    let compact =
        (
            prop_oneof![1 => Just(0usize), 2 => Just(1usize)],
            // A subset of the three components (duplicates are a parse error the config tests already cover).
            (1u8..8).prop_map(|mask| (0..3).filter(|i| mask & (1 << i) != 0).collect::<Vec<usize>>()),
            prop::option::weighted(0.5, layer_spec()),
            prop::option::weighted(0.3, layer_spec()),
            prop::option::of(budget()),
            prop::option::weighted(0.1, any::<bool>()),
            prop::option::of(any::<bool>()),
        )
            .prop_map(|(mode, components, dit, text_encoder, budget, keep_dit_resident, pin_memory)| {
                CompactSpec { mode, components, dit, text_encoder, budget, keep_dit_resident, pin_memory }
            });
    (
        [
            prop::option::weighted(0.2, any::<bool>()),
            prop::option::weighted(0.2, any::<bool>()),
            prop::option::weighted(0.2, any::<bool>()),
        ],
        prop::option::weighted(0.3, any::<bool>()),
        prop::option::weighted(0.3, 0u32..8),
        prop::option::of(prop_oneof![Just(1u32), Just(2), Just(4)]),
        prop::option::of(prop_oneof![Just(1u32), Just(2)]),
        prop::option::weighted(0.7, compact),
    )
        .prop_map(
            |(flags, dlo_use_allgather, dlo_resident_layers, data_parallel_size, sequence_parallel_size, compact)| {
                ConfigSpec {
                    flags,
                    dlo_use_allgather,
                    dlo_resident_layers,
                    data_parallel_size,
                    sequence_parallel_size,
                    compact,
                }
            },
        )
}

/// Configs aimed at the resident-layer and budget rules: the distributed strategy with rank-local DiT transfer and
/// small resident counts (compact or legacy), or layer mode with a budget.
fn focused_config_spec() -> impl Strategy<Value = ConfigSpec> {
    (0usize..3, 0u32..9, prop::option::of(1u32..4), prop::option::of(budget()), any::<bool>()).prop_map(
        |(form, resident, depth, budget, with_encoder)| {
            let legacy = form == 0;
            let components = if with_encoder { vec![0, 1] } else { vec![0] };
            let dit = LayerSpec { transfer: Some(1), resident: (form == 1).then_some(resident), depth };
            ConfigSpec {
                flags: [None, None, legacy.then_some(true)],
                dlo_use_allgather: legacy.then_some(false),
                dlo_resident_layers: legacy.then_some(resident),
                data_parallel_size: None,
                sequence_parallel_size: None,
                compact: (!legacy).then_some(CompactSpec {
                    mode: 1,
                    components,
                    dit: Some(dit),
                    text_encoder: None,
                    budget,
                    keep_dit_resident: None,
                    pin_memory: None,
                }),
            }
        },
    )
}

fn layer_json(l: &LayerSpec, dit: bool) -> Value {
    let mut o = Map::new();
    if let Some(t) = l.transfer {
        o.insert("weight_transfer".into(), json!(["allgather", "rank-local"][t]));
    }
    if let (true, Some(r)) = (dit, l.resident) {
        o.insert("resident_layers".into(), json!(r));
    }
    if let Some(d) = l.depth {
        o.insert("prefetch_depth".into(), json!(d));
    }
    Value::Object(o)
}

fn config_json(s: &ConfigSpec) -> String {
    let mut top = Map::new();
    let names = ["enable_cpu_offload", "enable_layerwise_offload", "enable_distributed_layerwise_offload"];
    for (name, flag) in names.iter().zip(&s.flags) {
        if let Some(f) = flag {
            top.insert(name.to_string(), json!(f));
        }
    }
    if let Some(v) = s.dlo_use_allgather {
        top.insert("dlo_use_allgather".into(), json!(v));
    }
    if let Some(v) = s.dlo_resident_layers {
        top.insert("dlo_resident_layers".into(), json!(v));
    }
    if let Some(v) = s.data_parallel_size {
        top.insert("data_parallel_size".into(), json!(v));
    }
    if let Some(v) = s.sequence_parallel_size {
        top.insert("sequence_parallel_size".into(), json!(v));
    }
    if let Some(c) = &s.compact {
        let mut o = Map::new();
        o.insert("mode".into(), json!(["module", "layer"][c.mode]));
        let comps: Vec<&str> = c.components.iter().map(|&i| ["dit", "text_encoder", "vae"][i]).collect();
        o.insert("components".into(), json!(comps));
        let mut opts = Map::new();
        if let Some(l) = &c.dit {
            opts.insert("dit".into(), layer_json(l, true));
        }
        if let Some(l) = &c.text_encoder {
            opts.insert("text_encoder".into(), layer_json(l, false));
        }
        if !opts.is_empty() {
            o.insert("layer_options".into(), Value::Object(opts));
        }
        if let Some(b) = c.budget {
            o.insert("device_budget".into(), json!(b));
        }
        if let Some(k) = c.keep_dit_resident {
            o.insert("keep_dit_resident".into(), json!(k));
        }
        if let Some(p) = c.pin_memory {
            o.insert("pin_memory".into(), json!(p));
        }
        top.insert("diffusion_offload_config".into(), Value::Object(o));
    }
    Value::Object(top).to_string()
}

// ------------------------------------------------------------------------------------------------------------
// Invariants

/// Whether `inner` lies strictly inside `outer` in the module tree.
fn nested(outer: &str, inner: &str) -> bool {
    inner.len() > outer.len() && inner.starts_with(outer) && inner.as_bytes()[outer.len()] == b'.'
}

fn all_components(plan: &ResolvedPlan) -> Vec<&ResolvedComponent> {
    fn walk<'a>(c: &'a ResolvedComponent, out: &mut Vec<&'a ResolvedComponent>) {
        out.push(c);
        for ch in &c.children {
            walk(ch, out);
        }
    }
    let mut out = Vec::new();
    for c in plan.components() {
        walk(c, &mut out);
    }
    out
}

/// Resolves twice, checks determinism and purity, and returns the result.
fn resolve_checked(p: &PipelineDesc, c: &OffloadConfig) -> Result<ResolvedPlan, PlanError> {
    let (p0, c0) = (p.clone(), c.clone());
    let first = resolve_offload_plan(p, c);
    let second = resolve_offload_plan(p, c);
    assert_eq!(first, second, "the resolver is not deterministic");
    assert_eq!(p, &p0, "the resolver changed the pipeline");
    assert_eq!(c, &c0, "the resolver changed the config");
    if let Err(e) = &first {
        assert!(!e.to_string().trim().is_empty(), "empty error message");
    }
    first
}

fn check_plan(p: &PipelineDesc, c: &OffloadConfig, plan: &ResolvedPlan) {
    assert_eq!(plan.strategy, c.strategy);

    // Components exist, and no module is two components.
    let comps = all_components(plan);
    let mut seen = BTreeSet::new();
    for comp in &comps {
        let m = p.module(&comp.path).unwrap_or_else(|| panic!("component {} does not exist", comp.path));
        assert!(seen.insert(comp.path.as_str()), "component {} listed twice", comp.path);
        if comp.on_demand {
            assert!(m.has_lifecycle, "on-demand {} has no lifecycle", comp.path);
            assert!(comp.selected, "on-demand {} is not selected", comp.path);
        }
        if !comp.selected {
            assert!(comp.stacks.is_empty(), "unselected {} has stacks", comp.path);
        }
    }

    // Stacks: blocks exist under their owner, sizes line up, heads fit, no ring of exactly one block.
    let mut owned: Vec<&str> = Vec::new();
    for (owner, s) in plan.stacks() {
        assert_eq!(s.blocks.len(), s.block_bytes.len(), "{}", s.name);
        assert!(s.resident_head <= s.blocks.len(), "{}: head {} > {}", s.name, s.resident_head, s.blocks.len());
        assert!(s.prefetch_depth >= 1, "{}", s.name);
        assert_ne!(s.streaming().len(), 1, "{} streams exactly one block", s.name);
        assert_eq!(s.resident().len() + s.streaming().len(), s.blocks.len());
        for b in &s.blocks {
            assert!(p.module(b).is_some(), "block {b} of {} does not exist", s.name);
            assert!(nested(&owner.path, b), "block {b} is not inside its owner {}", owner.path);
            owned.push(b);
        }
    }
    owned.sort_unstable();
    for w in owned.windows(2) {
        assert_ne!(w[0], w[1], "block owned twice");
        assert!(!nested(w[0], w[1]), "block {} lies inside block {}", w[1], w[0]);
    }

    // Selection follows the config.
    let selected = |cs: &[ResolvedComponent]| cs.iter().any(|c| c.selected);
    assert!(plan.residents.iter().all(|r| !r.selected && r.stacks.is_empty()));
    match c.strategy {
        OffloadStrategy::None => assert!(comps.iter().all(|x| !x.selected && x.stacks.is_empty())),
        OffloadStrategy::ModelLevel => assert!(comps.iter().all(|x| x.stacks.is_empty() && !x.on_demand)),
        _ => {}
    }
    if let Some(set) = &c.components {
        if selected(&plan.dits) {
            assert!(set.contains(&Component::Dit));
        }
        for e in plan.encoders.iter().filter(|e| e.selected) {
            assert_eq!(e.kind, ComponentKind::TextEncoder, "{} selected", e.path);
            assert!(set.contains(&Component::TextEncoder));
        }
        if selected(&plan.vaes) {
            assert!(set.contains(&Component::Vae));
        }
    }

    // skip_reason only for layerwise under the compatibility topology with no DiT, or for model-level offload
    // without both a selected DiT and a selected encoder stage (then nothing can swap).
    if let Some(r) = &plan.skip_reason {
        if c.strategy == OffloadStrategy::ModelLevel {
            assert_eq!(r, MODEL_SWAP_SKIP_REASON);
            assert!(!(selected(&plan.dits) && selected(&plan.encoders)));
        } else {
            assert_eq!(r, NO_DIT_SKIP_REASON);
            assert_eq!(c.strategy, OffloadStrategy::LayerWise);
            assert!(c.components.is_none());
            assert!(plan.dits.is_empty());
        }
    } else if c.strategy == OffloadStrategy::ModelLevel && !plan.dits.is_empty() && !plan.encoders.is_empty() {
        assert!(selected(&plan.dits) && selected(&plan.encoders), "model-level without a skip reason swaps");
    }

    // The budget adds up and respects the configured bound.
    let b = &plan.budget;
    let total = b
        .always_resident_bytes
        .saturating_add(b.resident_head_bytes)
        .saturating_add(b.slot_bytes)
        .saturating_add(b.on_demand_peak_bytes);
    assert_eq!(b.device_weight_bytes, total);
    assert_eq!(b.budget, c.device_budget);
    if let Some(limit) = c.device_budget {
        if c.strategy != OffloadStrategy::None {
            assert!(b.device_weight_bytes <= limit, "{} > budget {limit}", b.device_weight_bytes);
        }
    }
}

fn parse(spec: &ConfigSpec) -> Option<OffloadConfig> {
    OffloadConfig::from_json_str(&config_json(spec)).ok()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 768, ..ProptestConfig::default() })]

    #[test]
    fn random_pipelines_and_configs_resolve_to_valid_plans(spec in pipeline_spec(), cs in config_spec()) {
        let Some(p) = build_pipeline(&spec) else { return Ok(()) };
        let Some(c) = parse(&cs) else { return Ok(()) };
        if let Ok(plan) = resolve_checked(&p, &c) {
            check_plan(&p, &c, &plan);
        }
    }

    #[test]
    fn coherent_pipelines_and_random_configs_resolve_to_valid_plans(
        spec in coherent_spec(),
        cs in prop_oneof![config_spec(), focused_config_spec()],
    ) {
        let Some(p) = build_pipeline(&spec) else { return Ok(()) };
        let Some(c) = parse(&cs) else { return Ok(()) };
        if let Ok(plan) = resolve_checked(&p, &c) {
            check_plan(&p, &c, &plan);
        }
    }

    #[test]
    fn presets_resolve_to_valid_plans_under_random_configs(name in 0..PRESET_NAMES.len(), cs in config_spec()) {
        let name = PRESET_NAMES[name];
        if !name.ends_with("-tiny") {
            return Ok(());
        }
        let p = preset(name).expect("preset");
        let Some(c) = parse(&cs) else { return Ok(()) };
        if let Ok(plan) = resolve_checked(&p, &c) {
            check_plan(&p, &c, &plan);
        }
    }
}

/// Every resident count around each tiny preset's DiT depth, explicit and legacy: the plan either keeps the rules
/// or is rejected, never a ring of exactly one block.
#[test]
fn resident_counts_sweep_over_the_presets() {
    for name in PRESET_NAMES.iter().filter(|n| n.ends_with("-tiny")) {
        let p = preset(name).expect("preset");
        let n = p.offload_plan.as_ref().expect("plan").block_attrs["transformer"]
            .iter()
            .map(|a| p.module(&format!("transformer.{a}")).expect("list").children.len())
            .sum::<usize>() as u32;
        let (mut accepted, mut rejected) = (0, 0);
        for r in 0..=n + 2 {
            let explicit = format!(
                r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
                    "layer_options": {{"dit": {{"resident_layers": {r}}}}}}}}}"#
            );
            let legacy = format!(
                r#"{{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false,
                    "dlo_resident_layers": {r}}}"#
            );
            for text in [explicit, legacy] {
                let c = OffloadConfig::from_json_str(&text).expect("valid config");
                match resolve_checked(&p, &c) {
                    Ok(plan) => {
                        accepted += 1;
                        check_plan(&p, &c, &plan);
                        let s = &plan.dits[0].stacks[0];
                        let expected = if r + 1 == n { n } else { r.min(n) };
                        assert_eq!(s.resident_head as u32, expected, "{name} resident_layers={r}");
                    }
                    Err(_) => {
                        rejected += 1;
                        assert!(c.components.is_some() && r + 1 == n, "{name}: only r = n - 1 is rejected (r = {r})");
                    }
                }
            }
        }
        assert_eq!(rejected, 1, "{name}");
        assert_eq!(accepted, 2 * (n as usize + 3) - 1, "{name}");
    }
}

/// The generators are not vacuous: most random inputs build and parse, and a fair share resolves.
#[test]
fn generators_reach_every_outcome() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut built, mut parsed, mut resolved, mut rejected, mut streamed) = (0, 0, 0, 0, 0);
    for i in 0..400 {
        let spec = if i % 2 == 0 { pipeline_spec().boxed() } else { coherent_spec().boxed() };
        let spec = spec.new_tree(&mut runner).expect("tree").current();
        let cs = config_spec().new_tree(&mut runner).expect("tree").current();
        let (p, c) = (build_pipeline(&spec), parse(&cs));
        built += usize::from(p.is_some());
        parsed += usize::from(c.is_some());
        let (Some(p), Some(c)) = (p, c) else { continue };
        match resolve_checked(&p, &c) {
            Ok(plan) => {
                resolved += 1;
                if !plan.stacks().is_empty() {
                    streamed += 1;
                }
                check_plan(&p, &c, &plan);
            }
            Err(_) => rejected += 1,
        }
    }
    eprintln!("built {built}, parsed {parsed}, resolved {resolved}, rejected {rejected}, with stacks {streamed}");
    assert!(built >= 100 && parsed >= 100, "built {built}, parsed {parsed}");
    assert!(resolved >= 40, "resolved {resolved}");
    assert!(rejected >= 10, "rejected {rejected}");
    assert!(streamed >= 5, "plans with stacks {streamed}");
}
