//! Property tests of the pipeline JSON loader and the builder: no input makes the loader panic, every accepted
//! document is valid and round-trips, and random builder pipelines round-trip through JSON.

use proptest::prelude::*;
use std::collections::BTreeSet;
use weightferry::pipeline::builder::{PipelineBuilder, TensorSpec};
use weightferry::pipeline::json::{load_pipeline_json, to_pipeline_json};
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::{DType, PipelineDesc, TensorKind};

const EXAMPLE: &str = r#"{
  "format": "weightferry-pipeline/1",
  "class": "TinyPipeline",
  "modules": {
    "transformer": {"class": "TinyDiT",
      "tensors": {"rope": {"dtype": "f32", "shape": [8, 4], "kind": "non_persistent_buffer"}},
      "children": {
        "blocks": {"children": {"0": {"class": "B0", "tensors": {"x": {"dtype": "bf16", "shape": [2]}}}},
                   "repeat": 3, "block": {"class": "TinyBlock",
          "children": {"fc": {"class": "Linear", "tensors": {"weight": {"dtype": "bf16", "shape": [4, 4]}}}}}},
        "proj_out": {"class": "Linear", "tensors": {"weight": {"dtype": "bf16", "shape": [2, 4], "strides": [1, 2]}}},
        "proj_alias": {"class": "Module", "tensors": {
          "weight": {"dtype": "bf16", "shape": [4, 4], "tied_to": "transformer.blocks.1.fc.weight"}}}
      }},
    "vae": {"class": "TinyVAE", "has_lifecycle": true, "tensors": {
      "enc": {"dtype": "bf16", "shape": [2, 3], "storage": "flat"},
      "dec": {"dtype": "bf16", "shape": [3, 2], "storage": "flat", "storage_offset": 6}}}
  },
  "storages": {"flat": {"dtype": "bf16", "numel": 12}},
  "components": {"dit": ["transformer"], "vaes": ["vae"]},
  "offload_plan": {"block_attrs": {"transformer": ["blocks"]}, "offload_submodules": {"transformer": {"a": "b"}}},
  "class_block_attrs": {"TinyDiT": ["blocks"]},
  "class_block_attr": {"TinyDiT": "blocks"}
}"#;

/// Anything the loader accepts is valid and survives a round trip.
fn check_accepted(text: &str) {
    if let Ok(p) = load_pipeline_json(text) {
        assert_eq!(p.validate(), Ok(()));
        assert_eq!(load_pipeline_json(&to_pipeline_json(&p)).as_ref(), Ok(&p));
        let distinct: u64 = p.storages.values().map(|s| s.byte_size()).sum();
        assert_eq!(p.subtree_bytes(""), distinct);
    }
}

const TOKENS: &[&str] = &[
    "-1",
    "0",
    "1",
    "65536",
    "65537",
    "1e400",
    "1.5",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "null",
    "true",
    "\"\"",
    "\"bf16\"",
    "\"x.y\"",
    "\"transformer.blocks.0.fc.weight\"",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\"repeat\": 65536, ",
    "\"tied_to\": \"transformer.rope\", ",
    "\"storage\": \"flat\", ",
    "\"strides\": [1], ",
    "\"storage_offset\": 18446744073709551615, ",
    "[[[[[[[[",
];

#[derive(Debug, Clone)]
enum Edit {
    Delete { at: usize, len: usize },
    Insert { at: usize, token: usize },
    Replace { at: usize, len: usize, token: usize },
}

fn edit_strategy() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1usize..8).prop_map(|(at, len)| Edit::Delete { at, len }),
        (any::<usize>(), 0..TOKENS.len()).prop_map(|(at, token)| Edit::Insert { at, token }),
        (any::<usize>(), 1usize..6, 0..TOKENS.len()).prop_map(|(at, len, token)| Edit::Replace { at, len, token }),
    ]
}

/// Applies edits to ASCII text (every position is a char boundary).
fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut s = text.to_string();
    for e in edits {
        let n = s.len().max(1);
        match e {
            Edit::Delete { at, len } => {
                let a = at % n;
                let b = (a + len).min(s.len());
                if a <= b && b <= s.len() {
                    s.replace_range(a..b, "");
                }
            }
            Edit::Insert { at, token } => {
                let a = (at % n).min(s.len());
                s.insert_str(a, TOKENS[*token]);
            }
            Edit::Replace { at, len, token } => {
                let a = at % n;
                let b = (a + len).min(s.len());
                if a <= b && b <= s.len() {
                    s.replace_range(a..b, TOKENS[*token]);
                }
            }
        }
    }
    s
}

/// A random module tree for the builder.
#[derive(Debug, Clone)]
struct Node {
    tensors: Vec<(usize, Vec<u64>, bool, usize)>,
    children: Vec<Node>,
    list: bool,
}

fn node_strategy() -> impl Strategy<Value = Node> {
    let tensor = (0usize..7, prop::collection::vec(0u64..5, 0..3), any::<bool>(), 0usize..3);
    let leaf = (prop::collection::vec(tensor.clone(), 0..3), any::<bool>()).prop_map(|(tensors, list)| Node {
        tensors,
        children: Vec::new(),
        list,
    });
    leaf.prop_recursive(4, 40, 4, move |inner| {
        (prop::collection::vec(tensor.clone(), 0..3), prop::collection::vec(inner, 0..4), any::<bool>())
            .prop_map(|(tensors, children, list)| Node { tensors, children, list })
    })
}

const DTYPES: [DType; 7] = [DType::F32, DType::F16, DType::Bf16, DType::F8e4m3, DType::I64, DType::I32, DType::U8];
const KINDS: [TensorKind; 3] = [TensorKind::Parameter, TensorKind::PersistentBuffer, TensorKind::NonPersistentBuffer];

fn fill(m: &mut weightferry::pipeline::builder::ModuleBuilder<'_>, node: &Node, paths: &mut Vec<String>) {
    for (i, (dtype, shape, transposed, kind)) in node.tensors.iter().enumerate() {
        let mut spec = TensorSpec::new(DTYPES[*dtype], shape).kind(KINDS[*kind]);
        if *transposed {
            spec = spec.transposed();
        }
        let name = format!("t{i}");
        m.tensor(&name, spec);
        let base = m.path().to_string();
        paths.push(if base.is_empty() { name } else { format!("{base}.{name}") });
    }
    for (i, c) in node.children.iter().enumerate() {
        let name = if node.list && node.tensors.is_empty() { i.to_string() } else { format!("c{i}") };
        let class = if c.list { "ModuleList" } else { "Block" };
        m.module(&name, class, |cm| fill(cm, c, paths));
    }
}

fn random_pipeline(root: &Node, ties: &[usize]) -> Option<PipelineDesc> {
    let mut paths = Vec::new();
    let b = PipelineBuilder::new("RandomPipeline").root(|r| fill(r, root, &mut paths));
    let b = b.root(|r| {
        if !paths.is_empty() {
            for (k, target) in ties.iter().enumerate() {
                r.tie(&format!("alias{k}"), &paths[target % paths.len()]);
            }
        }
    });
    let desc = b.build();
    assert!(desc.is_ok(), "{desc:?}");
    desc.ok()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_strings_never_panic(text in any::<String>()) {
        check_accepted(&text);
    }

    #[test]
    fn json_like_strings_never_panic(text in "[\\[\\]{}\",:0-9a-z_. -]{0,120}") {
        check_accepted(&text);
    }

    #[test]
    fn mutated_example_never_panics(edits in prop::collection::vec(edit_strategy(), 1..6)) {
        check_accepted(&mutate(EXAMPLE, &edits));
    }

    #[test]
    fn random_builder_pipelines_round_trip(root in node_strategy(), ties in prop::collection::vec(any::<usize>(), 0..3)) {
        if let Some(p) = random_pipeline(&root, &ties) {
            prop_assert_eq!(p.validate(), Ok(()));
            prop_assert_eq!(load_pipeline_json(&to_pipeline_json(&p)), Ok(p.clone()));
            let distinct: BTreeSet<_> = p.root.tensors_recursive().into_iter().map(|(_, t)| t.storage).collect();
            prop_assert_eq!(distinct.len(), p.storages.len());
        }
    }
}

/// Replaces the `n`-th value (pre-order) of `v` with `new`; returns whether it was found.
fn replace_nth(v: &mut serde_json::Value, n: &mut usize, new: &serde_json::Value) -> bool {
    if *n == 0 {
        *v = new.clone();
        return true;
    }
    *n -= 1;
    match v {
        serde_json::Value::Array(items) => items.iter_mut().any(|x| replace_nth(x, n, new)),
        serde_json::Value::Object(map) => map.values_mut().any(|x| replace_nth(x, n, new)),
        _ => false,
    }
}

fn value_strategy() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(|n| json!(n)),
        (0u64..70_000).prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|x| json!(x)),
        prop::sample::select(vec![
            "bf16",
            "f32",
            "u8",
            "parameter",
            "transformer.rope",
            "flat",
            "",
            "a..b",
            "ModuleList"
        ])
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::vec(
                (prop::sample::select(vec!["class", "dtype", "shape", "repeat", "block", "x"]), inner),
                0..3
            )
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn structurally_mutated_example_never_panics(at in 0usize..200, new in value_strategy()) {
        let mut doc: serde_json::Value = serde_json::from_str(EXAMPLE).unwrap_or_default();
        let mut n = at;
        replace_nth(&mut doc, &mut n, &new);
        check_accepted(&doc.to_string());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn mutated_preset_json_never_panics(edits in prop::collection::vec(edit_strategy(), 1..4)) {
        let text = preset("wan-tiny").map(|p| to_pipeline_json(&p)).unwrap_or_default();
        check_accepted(&mutate(&text, &edits));
    }
}

#[test]
fn example_is_valid() {
    let p = load_pipeline_json(EXAMPLE).expect("valid");
    assert_eq!(p.module("transformer.blocks").map(|m| m.children.len()), Some(4));
    check_accepted(EXAMPLE);
}
