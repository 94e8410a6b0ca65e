//! Pipeline descriptions: the builder, the JSON format and the presets.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use weightferry::pipeline::builder::{PipelineBuilder, TensorSpec};
use weightferry::pipeline::json::{load_pipeline_file, load_pipeline_json, to_pipeline_json, MAX_NODES, MAX_REPEAT};
use weightferry::pipeline::presets::{preset, PRESET_NAMES};
use weightferry::pipeline::PipelineError;
use weightferry::pipeline::{DType, ModuleNode, PipelineDesc, StorageDesc, StorageId, TensorDesc, TensorKind};

fn err_text(r: Result<PipelineDesc, PipelineError>) -> String {
    match r {
        Ok(_) => "unexpectedly valid".to_string(),
        Err(e) => e.to_string(),
    }
}

fn build_err(f: impl FnOnce(PipelineBuilder) -> PipelineBuilder) -> String {
    err_text(f(PipelineBuilder::new("P")).build())
}

fn json_err(text: &str) -> String {
    err_text(load_pipeline_json(text))
}

/// Distinct-storage parameter count (elements) under `path`.
fn params(p: &PipelineDesc, path: &str) -> u64 {
    let Some(m) = p.module(path) else { return 0 };
    let mut seen = BTreeSet::new();
    m.tensors_recursive()
        .into_iter()
        .filter(|(_, t)| seen.insert(t.storage))
        .map(|(_, t)| p.storages[&t.storage].numel)
        .sum()
}

fn within(value: f64, target: f64, fraction: f64) -> bool {
    (value - target).abs() <= target * fraction
}

// ------------------------------------------------------------------------------------------------------------
// Builder

fn small() -> PipelineBuilder {
    PipelineBuilder::new("TinyPipeline")
        .module("transformer", "TinyDiT", |m| {
            m.buffer("rope", DType::F32, &[8, 4], false);
            m.linear("x_embedder", DType::Bf16, 16, 32, true);
            m.block_list("blocks", 3, "TinyBlock", |b, _| {
                b.linear("fc", DType::Bf16, 32, 32, true);
                b.buffer("scale", DType::F32, &[32], true);
            });
            m.tensor("proj_out.weight", TensorSpec::new(DType::Bf16, &[16, 32]).transposed());
            m.tie("proj_alias.weight", "blocks.1.fc.weight");
        })
        .module("vae", "TinyVAE", |m| {
            m.has_lifecycle(true);
            let flat = m.storage(DType::Bf16, 432);
            m.tensor("enc", TensorSpec::new(DType::Bf16, &[8, 3, 3, 3]).in_storage(flat));
            m.tensor("dec", TensorSpec::new(DType::Bf16, &[3, 8, 3, 3]).in_storage(flat).offset(216));
        })
        .module("stub", "Unloaded", |m| {
            m.is_loaded(false);
        })
        .dit("transformer")
        .vae("vae")
}

#[test]
fn builder_builds_tree_storages_and_ties() {
    let p = small().build().expect("valid");
    assert_eq!(p.class, "TinyPipeline");
    assert_eq!(p.root.class, "TinyPipeline");
    let names: Vec<&str> = p.root.children.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["transformer", "vae", "stub"]);
    let blocks = p.module("transformer.blocks").expect("blocks");
    assert_eq!(blocks.class, "ModuleList");
    assert!(blocks.is_block_list());
    assert_eq!(blocks.children.len(), 3);
    assert_eq!(p.module("transformer.blocks.2").map(|m| m.class.as_str()), Some("TinyBlock"));
    assert_eq!(p.module("transformer.proj_out").map(|m| m.class.as_str()), Some("Module"));
    assert!(p.module("vae").is_some_and(|m| m.has_lifecycle));
    assert!(p.module("stub").is_some_and(|m| !m.is_loaded));

    let w = p.tensor("transformer.x_embedder.weight").expect("weight");
    assert_eq!((w.shape.clone(), w.strides.clone(), w.kind), (vec![32, 16], vec![16, 1], TensorKind::Parameter));
    let t = p.tensor("transformer.proj_out.weight").expect("proj_out");
    assert_eq!((t.shape.clone(), t.strides.clone()), (vec![16, 32], vec![1, 16]));
    assert_eq!(p.tensor("transformer.rope").map(|t| t.kind), Some(TensorKind::NonPersistentBuffer));
    assert_eq!(p.tensor("transformer.blocks.0.scale").map(|t| t.kind), Some(TensorKind::PersistentBuffer));

    // Canonical ids: depth first, tensors before children, from 0.
    let ids: Vec<u64> = p.root.tensors_recursive().iter().map(|(_, t)| t.storage.0).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 7, 13, 13]);
    let alias = p.tensor("transformer.proj_alias.weight").expect("alias");
    let target = p.tensor("transformer.blocks.1.fc.weight").expect("target");
    assert_eq!(alias, &TensorDesc { name: "weight".into(), ..target.clone() });
    let dec = p.tensor("vae.dec").expect("dec");
    assert_eq!((dec.storage, dec.storage_offset), (StorageId(13), 216));
    assert_eq!(p.storages[&StorageId(13)], StorageDesc { dtype: DType::Bf16, numel: 432 });
    assert_eq!(p.storages.len(), 14);
    assert_eq!(p.validate(), Ok(()));
}

#[test]
fn builder_assigns_canonical_ids_whatever_the_declaration_order() {
    let p = PipelineBuilder::new("P")
        .module("m", "M", |m| {
            m.param("child.w", DType::F32, &[2]);
            m.param("own", DType::F32, &[3]);
            m.tie("alias", "child.w");
        })
        .build()
        .expect("valid");
    let ids: Vec<(String, u64)> = p.root.tensors_recursive().into_iter().map(|(n, t)| (n, t.storage.0)).collect();
    assert_eq!(ids, [("m.own".to_string(), 0), ("m.alias".to_string(), 1), ("m.child.w".to_string(), 1)]);
    assert_eq!(p.storages[&StorageId(0)].numel, 3);
}

#[test]
fn implicit_modules_can_be_declared_later_but_not_twice() {
    let p = PipelineBuilder::new("P")
        .module("m", "M", |m| {
            m.param("attn.q.weight", DType::F32, &[2, 2]);
            m.module("attn", "Attention", |a| {
                a.param("k", DType::F32, &[2]);
            });
            m.param("attn.v", DType::F32, &[2]);
        })
        .build()
        .expect("valid");
    let attn = p.module("m.attn").expect("attn");
    assert_eq!(attn.class, "Attention");
    assert_eq!(attn.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["k", "v"]);
    assert_eq!(p.module("m.attn.q").map(|m| m.class.as_str()), Some("Module"));

    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.module("attn", "Attention", |_| {});
            m.module("attn", "Attention", |_| {});
        })
    });
    assert_eq!(
        e,
        "m.attn: name declared twice in the same module (tensors and child modules share one namespace); \
         rename or remove one"
    );
}

#[test]
fn builder_rejects_stride_count_mismatch() {
    let e = build_err(|b| {
        b.module("transformer", "T", |m| {
            m.tensor("w", TensorSpec::new(DType::Bf16, &[2, 3]).strides(&[1]));
        })
    });
    assert_eq!(
        e,
        "transformer.w: shape has 2 dimensions but strides has 1; give exactly one stride per dimension, or omit \
         strides for a contiguous tensor"
    );
}

#[test]
fn builder_rejects_views_outside_their_storage() {
    let e = build_err(|b| {
        b.module("vae", "V", |m| {
            let s = m.storage(DType::Bf16, 10);
            m.tensor("w", TensorSpec::new(DType::Bf16, &[4, 4]).in_storage(s));
        })
    });
    assert_eq!(
        e,
        "vae.w: the view needs 16 elements of its storage (storage_offset + span) but the storage holds 10; shrink \
         the view or enlarge the storage"
    );
    let e = build_err(|b| {
        b.module("vae", "V", |m| {
            m.param("a", DType::Bf16, &[4]);
            m.tensor("b", TensorSpec::new(DType::Bf16, &[2]).tied_to("a").offset(3));
        })
    });
    assert_eq!(
        e,
        "vae.b: the view needs 5 elements of its storage (storage_offset + span) but the storage holds 4; shrink \
         the view or enlarge the storage"
    );
}

#[test]
fn builder_rejects_dtype_mismatch_with_storage() {
    let e = build_err(|b| {
        b.module("vae", "V", |m| {
            let s = m.storage(DType::F32, 16);
            m.tensor("w", TensorSpec::new(DType::Bf16, &[4]).in_storage(s));
        })
    });
    assert_eq!(
        e,
        "vae.w: tensor dtype bf16 differs from its storage's dtype f32; a view must have its storage's dtype"
    );
}

#[test]
fn builder_rejects_duplicate_and_invalid_names() {
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.param("w", DType::F32, &[1]);
            m.param("w", DType::F32, &[1]);
        })
    });
    assert_eq!(
        e,
        "m.w: name declared twice in the same module (tensors and child modules share one namespace); rename or \
         remove one"
    );
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.param("lin.weight", DType::F32, &[1]);
            m.param("lin", DType::F32, &[1]);
        })
    });
    assert_eq!(
        e,
        "m.lin: name declared twice in the same module (tensors and child modules share one namespace); rename or \
         remove one"
    );
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.param("bad name", DType::F32, &[1]);
        })
    });
    assert_eq!(
        e,
        "m: `bad name` is not a valid attribute name; use a non-empty name without `.`, spaces or control characters"
    );
    let e = build_err(|b| b.module("a..b", "M", |_| {}));
    assert_eq!(
        e,
        "<root>: `a..b` is not a valid attribute name; use a non-empty name without `.`, spaces or control characters"
    );
    let e = build_err(|b| b.module("m", "", |_| {}));
    assert_eq!(e, "m: class name is empty; give the class, e.g. `ModuleList`");
    assert_eq!(
        err_text(PipelineBuilder::new("").build()),
        "class: class name is empty; give the class, e.g. `ModuleList`"
    );
}

#[test]
fn builder_rejects_invalid_declared_paths() {
    let e = build_err(|b| b.module("transformer", "T", |_| {}).dit("transformer..x"));
    assert_eq!(
        e,
        "components.dit[0]: `transformer..x` is not a valid dotted path; join non-empty names (no spaces or \
         control characters) with single dots, e.g. `transformer.blocks`"
    );
    let e = build_err(|b| b.class_block_attrs("DiT", &["blocks", ""]));
    assert_eq!(
        e,
        "class_block_attrs.DiT[1]: `` is not a valid dotted path; join non-empty names (no spaces or control \
         characters) with single dots, e.g. `transformer.blocks`"
    );
    let mut plan = weightferry::pipeline::OffloadPlanDecl::default();
    plan.block_attrs.insert("transformer".into(), vec!["blocks".into(), "x y".into()]);
    let e = build_err(|b| b.offload_plan(plan));
    assert_eq!(
        e,
        "offload_plan.block_attrs.transformer[1]: `x y` is not a valid dotted path; join non-empty names (no spaces \
         or control characters) with single dots, e.g. `transformer.blocks`"
    );
}

#[test]
fn builder_rejects_bad_ties() {
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.tie("alias", "nope.weight");
        })
    });
    assert_eq!(
        e,
        "m.alias: `m.nope.weight` is not a tensor of this pipeline; name an existing tensor by its dotted path (from \
         the root in JSON, from the declaring module in the builder)"
    );
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.tie("a", "b");
            m.tie("b", "a");
        })
    });
    assert!(e.starts_with("m.a: ties form a cycle through `m."), "{e}");
    assert!(e.ends_with("`; one tensor of the chain must own its storage"), "{e}");
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.tie("a", "bad..path");
        })
    });
    assert_eq!(
        e,
        "m.a: `bad..path` is not a valid dotted path; join non-empty names (no spaces or control \
         characters) with single dots, e.g. `transformer.blocks`"
    );
}

#[test]
fn builder_rejects_unused_storages_foreign_handles_and_overflow() {
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.storage(DType::F32, 4);
            m.param("w", DType::F32, &[1]);
        })
    });
    assert_eq!(e, "m (storage #0): storage is declared but no tensor views it; remove it or view it from a tensor");

    let mut foreign = None;
    let _ = PipelineBuilder::new("Other").module("m", "M", |m| {
        foreign = Some(m.param("w", DType::F32, &[1]));
    });
    let Some(foreign) = foreign else { panic!("no handle") };
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.tensor("w", TensorSpec::new(DType::F32, &[1]).in_storage(foreign));
        })
    });
    assert_eq!(e, "m.w: the storage handle does not belong to this builder; use a handle returned by the same builder");

    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.param("w", DType::F32, &[u64::MAX, 2]);
        })
    });
    assert_eq!(e, "m.w: the element count overflows 64 bits; use realistic sizes");
    let e = build_err(|b| {
        b.module("m", "M", |m| {
            m.param("w", DType::F32, &[u64::MAX / 2]);
        })
    });
    assert_eq!(e, "m.w: the byte size overflows 64 bits; use realistic sizes");
}

#[test]
fn empty_tensors_and_scalars_are_valid() {
    let p = PipelineBuilder::new("P")
        .module("m", "M", |m| {
            m.param("scalar", DType::F32, &[]);
            m.param("empty", DType::F32, &[0, 5]);
        })
        .build()
        .expect("valid");
    assert_eq!(p.storages[&StorageId(0)].numel, 1);
    assert_eq!(p.storages[&StorageId(1)].numel, 0);
    assert_eq!(load_pipeline_json(&to_pipeline_json(&p)), Ok(p));
}

#[test]
fn subtree_bytes_counts_tied_storage_once() {
    let p = small().build().expect("valid");
    // rope 8·4·4 + x_embedder (32·16 + 32)·2 + 3 blocks of (32·32 + 32)·2 + 32·4 + proj_out 16·32·2; the alias adds
    // nothing.
    let expected = 128 + 1088 + 3 * (2112 + 128) + 1024;
    assert_eq!(p.subtree_bytes("transformer"), expected);
    assert_eq!(p.subtree_bytes("transformer.proj_alias"), 2048);
    assert_eq!(p.subtree_bytes("vae"), 864);
    assert_eq!(p.subtree_bytes(""), expected + 864);
    assert_eq!(p.subtree_bytes("missing"), 0);
}

#[test]
fn validate_rejects_broken_hand_made_descriptions() {
    let mut p = small().build().expect("valid");
    p.storages.insert(StorageId(99), StorageDesc { dtype: DType::F32, numel: 1 });
    assert_eq!(p.validate(), Err(PipelineError::UnusedStorage { at: "storage 99".into() }));
    let mut p = small().build().expect("valid");
    p.storages.remove(&StorageId(0));
    assert_eq!(
        p.validate().map_err(|e| e.to_string()),
        Err("transformer.rope: storage 0 is not in the pipeline's storage table; add it or point the tensor at an \
             existing storage"
            .to_string())
    );
    let mut p = small().build().expect("valid");
    let mut node = ModuleNode::new("Dup");
    node.tensors.push(p.root.tensors_recursive()[0].1.clone());
    node.tensors.push(p.root.tensors_recursive()[0].1.clone());
    p.root.children.push(("dup".into(), node));
    assert_eq!(p.validate(), Err(PipelineError::DuplicateName { at: "dup.rope".into() }));
}

#[test]
fn canonicalize_renumbers_by_first_appearance() {
    let mut p = small().build().expect("valid");
    let original = p.clone();
    let shift = |id: StorageId| StorageId(1000 - id.0 * 3);
    p.storages = p.storages.into_iter().map(|(id, s)| (shift(id), s)).collect();
    let mut stack = vec![&mut p.root];
    while let Some(m) = stack.pop() {
        for t in &mut m.tensors {
            t.storage = shift(t.storage);
        }
        stack.extend(m.children.iter_mut().map(|(_, c)| c));
    }
    assert_eq!(p.validate(), Ok(()));
    assert_ne!(p, original);
    assert_eq!(load_pipeline_json(&to_pipeline_json(&p)), Ok(original.clone()));
    p.canonicalize_storage_ids();
    assert_eq!(p, original);
}

// ------------------------------------------------------------------------------------------------------------
// JSON

const EXAMPLE: &str = r#"{
  "format": "weightferry-pipeline/1",
  "class": "TinyPipeline",
  "modules": {
    "transformer": {
      "class": "TinyDiT",
      "tensors": {"rope": {"dtype": "f32", "shape": [8, 4], "kind": "non_persistent_buffer"}},
      "children": {
        "x_embedder": {"class": "Linear", "tensors": {
          "weight": {"dtype": "bf16", "shape": [32, 16]},
          "bias": {"dtype": "bf16", "shape": [32]}
        }},
        "blocks": {"repeat": 3, "block": {"class": "TinyBlock",
          "tensors": {"scale": {"dtype": "f32", "shape": [32], "kind": "persistent_buffer"}},
          "children": {"fc": {"class": "Linear", "tensors": {
            "weight": {"dtype": "bf16", "shape": [32, 32]},
            "bias": {"dtype": "bf16", "shape": [32]}
          }}}
        }},
        "proj_out": {"class": "Module", "tensors": {
          "weight": {"dtype": "bf16", "shape": [16, 32], "strides": [1, 16]}
        }},
        "proj_alias": {"class": "Module", "tensors": {
          "weight": {"dtype": "bf16", "shape": [32, 32], "tied_to": "transformer.blocks.1.fc.weight"}
        }}
      }
    },
    "vae": {"class": "TinyVAE", "has_lifecycle": true, "tensors": {
      "enc": {"dtype": "bf16", "shape": [8, 3, 3, 3], "storage": "flat"},
      "dec": {"dtype": "bf16", "shape": [3, 8, 3, 3], "storage": "flat", "storage_offset": 216}
    }},
    "stub": {"class": "Unloaded", "is_loaded": false}
  },
  "storages": {"flat": {"dtype": "bf16", "numel": 432}},
  "components": {"dit": ["transformer"], "vaes": ["vae"]}
}"#;

#[test]
fn json_example_equals_the_builder_version() {
    let from_json = load_pipeline_json(EXAMPLE).expect("valid");
    let built = small().build().expect("valid");
    assert_eq!(from_json, built);
}

#[test]
fn json_round_trips_every_preset() {
    for name in PRESET_NAMES {
        let p = preset(name).expect(name);
        let text = to_pipeline_json(&p);
        assert_eq!(load_pipeline_json(&text).as_ref(), Ok(&p), "{name}");
        // Writing is deterministic.
        assert_eq!(to_pipeline_json(&p), text, "{name}");
    }
}

#[test]
fn json_writer_uses_repeat_and_ties() {
    let text = to_pipeline_json(&preset("flux-tiny").expect("preset"));
    assert!(text.contains("\"repeat\": 19"), "{text}");
    assert!(text.contains("\"repeat\": 38"), "{text}");
    assert!(text.contains("\"tied_to\": \"transformer.single_transformer_blocks.0.linear2.weight\""), "{text}");
    assert!(text.contains("\"strides\": [1, 16]"), "{text}");
    // T5 block 0 differs (it holds the relative attention bias): written explicitly before the repeat.
    assert!(text.contains("\"repeat\": 23"), "{text}");
    assert!(text.len() < 40_000, "{}", text.len());
}

#[test]
fn json_round_trips_named_storages_and_root_settings() {
    let p = PipelineBuilder::new("P")
        .root_class("Root")
        .root(|r| {
            r.has_lifecycle(true);
            r.is_loaded(false);
            r.param("root_w", DType::I64, &[3]);
            let s = r.storage(DType::U8, 100);
            r.tensor("packed_a", TensorSpec::new(DType::U8, &[10, 4]).in_storage(s).offset(5));
            r.tensor("packed_b", TensorSpec::new(DType::U8, &[4, 10]).strides(&[1, 4]).in_storage(s));
            r.tensor("off", TensorSpec::new(DType::F8e4m3, &[2]).offset(7));
        })
        .module("m", "Sequential", |m| {
            for i in 0..3 {
                m.module(&i.to_string(), "B", |b| {
                    b.param("w", DType::F16, &[2]);
                });
            }
        })
        .class_block_attr_singular("DiT", "blocks")
        .build()
        .expect("valid");
    let text = to_pipeline_json(&p);
    assert!(text.contains("\"root_class\": \"Root\""), "{text}");
    assert!(text.contains("\"storages\": {\"s1\": {\"dtype\": \"u8\", \"numel\": 100}}"), "{text}");
    assert!(text.contains("\"repeat\": 3"), "{text}");
    assert_eq!(load_pipeline_json(&text), Ok(p));
}

#[test]
fn json_errors_name_the_json_path() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"shape": [2]}}}}}"#,
            "modules.t.tensors.w.dtype: required key is missing; every tensor needs a dtype, e.g. \"dtype\": \"bf16\"",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "bfloat16", "shape": [2]}}}}}"#,
            "modules.t.tensors.w.dtype: unknown dtype `bfloat16`; use one of f32, f16, bf16, f8e4m3, f8e5m2, i64, i32, i8, u8",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32"}}}}}"#,
            "modules.t.tensors.w.shape: required key is missing; every tensor needs a shape, e.g. \"shape\": [3072, \
             64] ([] for a scalar)",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [2, 3], "strides": [3]}}}}}"#,
            "modules.t.tensors.w.strides: shape has 2 dimensions but strides has 1; give exactly one stride per \
             dimension, or omit strides for a contiguous tensor",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [4, 4], "storage": "s"}}}},
                "storages": {"s": {"dtype": "f32", "numel": 10}}}"#,
            "modules.t.tensors.w: the view needs 16 elements of its storage (storage_offset + span) but the storage \
             holds 10; shrink the view or enlarge the storage",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {
                "a": {"dtype": "f32", "shape": [4]},
                "b": {"dtype": "f32", "shape": [2, 2], "strides": [1, 2], "storage_offset": 1, "tied_to": "t.a"}}}}}"#,
            "modules.t.tensors.b: the view needs 5 elements of its storage (storage_offset + span) but the storage \
             holds 4; shrink the view or enlarge the storage",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {
                "a": {"dtype": "f32", "shape": [4]},
                "b": {"dtype": "bf16", "shape": [4], "tied_to": "t.a"}}}}}"#,
            "modules.t.tensors.b: tensor dtype bf16 differs from its storage's dtype f32; a view must have its \
             storage's dtype",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensor": {}}}}"#,
            "modules.t.tensor: unknown key; expected one of: class, has_lifecycle, is_loaded, tensors, children, repeat",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [1], "stride": [1]}}}}}"#,
            "modules.t.tensors.w.stride: unknown key; expected one of: dtype, shape, strides, kind, storage_offset, \
             tied_to, storage",
        ),
        (
            r#"{"class": "P", "modul": {}}"#,
            "modul: unknown key; expected one of: format, class, modules, tensors, root_class, root_has_lifecycle, \
             root_is_loaded, storages, components, offload_plan, class_block_attrs, class_block_attr, pinned",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [1], "tied_to": "t.blocks.0.w"}}}}}"#,
            "modules.t.tensors.w.tied_to: `t.blocks.0.w` is not a tensor of this pipeline; name an existing tensor by \
             its dotted path (from the root in JSON, from the declaring module in the builder)",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"blocks": {"repeat": 0, "block": {"class": "B"}}}}}}"#,
            "modules.t.children.blocks.repeat: repeat count 0 is out of range; use 1 to 65536",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"blocks": {"repeat": 65537, "block": {"class": "B"}}}}}}"#,
            "modules.t.children.blocks.repeat: repeat count 65537 is out of range; use 1 to 65536",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"blocks": {"repeat": -1, "block": {"class": "B"}}}}}}"#,
            "modules.t.children.blocks.repeat: expected a non-negative integer that fits in 64 bits",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"blocks": {"repeat": 2}}}}}"#,
            "modules.t.children.blocks.block: required key is missing; a repeat needs its block template, e.g. \
             \"block\": {\"class\": \"MyBlock\", \"tensors\": {…}}",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"blocks": {"repeat": 2, "tensors": {}, "block": {"class": "B"}}}}}}"#,
            "modules.t.children.blocks.tensors: unknown key; expected one of: repeat, block, children, class, \
             has_lifecycle, is_loaded",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"blocks": {"children": {"1": {"class": "B"}}, "repeat": 2, "block": {"class": "B"}}}}}}"#,
            "modules.t.children.blocks.children.1: the explicit blocks of a repeat must be named 0, 1, … in order; \
             expected `0` here",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "children": {"a": {"repeat": 65536, "block": {"class": "B", "children": {"b": {"repeat": 65536, "block": {"class": "C"}}}}}}}}}"#,
            "modules.t.children.a.repeat: the pipeline expands to more than 1048576 modules and tensors; use fewer or \
             smaller repeats",
        ),
        (r#"{"class": "P", "modules": {"t": {"class": "T"}, "#, "invalid JSON at line 1, column 48: EOF while parsing a value"),
        ("[1, 2]", "<document>: expected an object"),
        ("", "invalid JSON at line 1, column 0: EOF while parsing a value"),
        (
            r#"{"modules": {}}"#,
            "class: required key is missing; give the pipeline class, e.g. \"class\": \"FluxPipeline\"",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"tensors": {}}}}"#,
            "modules.t.class: required key is missing; every module needs its class, e.g. \"class\": \"Linear\"",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": ""}}}"#,
            "modules.t.class: class name is empty; give the class, e.g. `ModuleList`",
        ),
        (
            r#"{"class": "P", "class": "Q"}"#,
            "class: key appears more than once in the same object; keep one",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T"}, "t": {"class": "T"}}}"#,
            "modules.t: name declared twice in the same module (tensors and child modules share one namespace); \
             rename or remove one",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [1]}}, "children": {"w": {"class": "W"}}}}}"#,
            "modules.t.children.w: name declared twice in the same module (tensors and child modules share one \
             namespace); rename or remove one",
        ),
        (
            r#"{"class": "P", "modules": {"a.b": {"class": "T"}}}"#,
            "modules.a.b: `a.b` is not a valid attribute name; use a non-empty name without `.`, spaces or control characters",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [1e30]}}}}}"#,
            "modules.t.tensors.w.shape[0]: expected a non-negative integer that fits in 64 bits",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [18446744073709551616]}}}}}"#,
            "modules.t.tensors.w.shape[0]: expected a non-negative integer that fits in 64 bits",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [4294967296, 4294967296]}}}}}"#,
            "modules.t.tensors.w: the element count overflows 64 bits; use realistic sizes",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [2], "strides": [18446744073709551615]}}}}}"#,
            "modules.t.tensors.w: the storage span overflows 64 bits; use realistic sizes",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [2], "strides": "1"}}}}}"#,
            "modules.t.tensors.w.strides: expected an array of non-negative integers",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [1], "kind": "buffer"}}}}}"#,
            "modules.t.tensors.w.kind: unknown tensor kind `buffer`; use parameter, persistent_buffer or \
             non_persistent_buffer",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {"w": {"dtype": "f32", "shape": [1], "storage": "x"}}}}}"#,
            "modules.t.tensors.w.storage: storage `x` is not declared; declare it in the top-level `storages` object",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {
                "a": {"dtype": "f32", "shape": [1]},
                "w": {"dtype": "f32", "shape": [1], "storage": "x", "tied_to": "t.a"}}}},
                "storages": {"x": {"dtype": "f32", "numel": 1}}}"#,
            "modules.t.tensors.w: `tied_to` and `storage` cannot both be given; a tensor views exactly one storage",
        ),
        (
            r#"{"class": "P", "storages": {"x": {"dtype": "f32", "numel": 1}}}"#,
            "storages.x: storage is declared but no tensor views it; remove it or view it from a tensor",
        ),
        (
            r#"{"class": "P", "storages": {"x": {"dtype": "f32", "numel": 18446744073709551615}}}"#,
            "storages.x.numel: the byte size overflows 64 bits; use realistic sizes",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "tensors": {
                "a": {"dtype": "f32", "shape": [1], "tied_to": "t.b"},
                "b": {"dtype": "f32", "shape": [1], "tied_to": "t.a"}}}}}"#,
            "modules.t.tensors.a: ties form a cycle through `t.a`; one tensor of the chain must own its storage",
        ),
        (
            r#"{"class": "P", "components": {"dit": ["transformer."]}}"#,
            "components.dit[0]: `transformer.` is not a valid dotted path; join non-empty names (no spaces or \
             control characters) with single dots, e.g. `transformer.blocks`",
        ),
        (
            r#"{"class": "P", "components": {"dits": []}}"#,
            "components.dits: unknown key; expected one of: dit, encoders, vaes, resident, auxiliary",
        ),
        (
            r#"{"class": "P", "offload_plan": {"block_attrs": {"transformer": "blocks"}}}"#,
            "offload_plan.block_attrs.transformer: expected an array of strings",
        ),
        (
            r#"{"class": "P", "offload_plan": {"offload_submodules": {"transformer": {"refiner": 3}}}}"#,
            "offload_plan.offload_submodules.transformer.refiner: expected a string",
        ),
        (
            r#"{"class": "P", "class_block_attrs": {"DiT": ["ok", 1]}}"#,
            "class_block_attrs.DiT[1]: expected a string",
        ),
        (
            r#"{"format": "weightferry-pipeline/2", "class": "P"}"#,
            "format: unsupported format `weightferry-pipeline/2`; this version reads `weightferry-pipeline/1`",
        ),
        (
            r#"{"class": "P", "modules": {"t": {"class": "T", "has_lifecycle": "yes"}}}"#,
            "modules.t.has_lifecycle: expected true or false",
        ),
    ];
    for (text, expected) in cases {
        assert_eq!(json_err(text), *expected, "{text}");
    }
}

#[test]
fn json_deep_nesting_is_an_error_not_a_crash() {
    let deep = "[".repeat(100_000);
    assert_eq!(json_err(&deep), "invalid JSON at line 1, column 128: recursion limit exceeded");
    let mut nested = String::from(r#"{"class": "P", "modules": {"#);
    for _ in 0..200 {
        nested.push_str(r#""m": {"class": "M", "children": {"#);
    }
    assert_eq!(json_err(&nested), "invalid JSON at line 1, column 2106: recursion limit exceeded");
}

#[test]
fn json_accepts_null_declarations_and_defaults() {
    let p = load_pipeline_json(
        r#"{"class": "P", "components": null, "offload_plan": null, "modules": {"t": {"class": "T",
            "children": {"l": {"repeat": 2, "class": "Sequential", "has_lifecycle": true, "block": {"class": "B"}}}}}}"#,
    )
    .expect("valid");
    assert_eq!(p.components, None);
    assert_eq!(p.offload_plan, None);
    let l = p.module("t.l").expect("list");
    assert_eq!((l.class.as_str(), l.has_lifecycle, l.children.len()), ("Sequential", true, 2));
    assert!(l.is_block_list());
    let p = load_pipeline_json(r#"{"class": "P", "components": {}, "offload_plan": {}}"#).expect("valid");
    assert_eq!(p.components, Some(Default::default()));
    assert_eq!(p.offload_plan, Some(Default::default()));
    assert_eq!(load_pipeline_json(&to_pipeline_json(&p)), Ok(p));
}

#[test]
fn json_repeat_with_explicit_head_blocks() {
    let p = load_pipeline_json(
        r#"{"class": "P", "modules": {"enc": {"class": "E", "children": {"block": {
            "children": {"0": {"class": "B", "tensors": {"bias": {"dtype": "f32", "shape": [2]}, "w": {"dtype": "f32", "shape": [2]}}}},
            "repeat": 3,
            "block": {"class": "B", "tensors": {"w": {"dtype": "f32", "shape": [2]}}}}}}}}"#,
    )
    .expect("valid");
    let list = p.module("enc.block").expect("list");
    assert_eq!(list.children.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["0", "1", "2", "3"]);
    assert_eq!(list.children[0].1.tensors.len(), 2);
    assert_eq!(list.children[3].1.tensors.len(), 1);
    assert_eq!(p.storages.len(), 5);
    assert_eq!(load_pipeline_json(&to_pipeline_json(&p)), Ok(p));
}

#[test]
fn json_limits_are_exported() {
    assert_eq!((MAX_REPEAT, MAX_NODES), (65_536, 1_048_576));
}

#[test]
fn load_pipeline_file_reads_and_reports_io_errors() {
    let dir = std::env::temp_dir().join(format!("weightferry-pipeline-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("tiny.json");
    std::fs::write(&file, EXAMPLE).expect("write");
    assert_eq!(load_pipeline_file(&file), small().build());
    let missing = dir.join("missing.json");
    assert_eq!(
        err_text(load_pipeline_file(&missing)),
        format!("cannot read pipeline file `{}`: No such file or directory (os error 2)", missing.display())
    );
    // A byte-order mark is dropped.
    let bom = dir.join("bom.json");
    std::fs::write(&bom, format!("\u{feff}{EXAMPLE}")).expect("write");
    assert_eq!(load_pipeline_file(&bom), small().build());
    // A path to an endless device is refused at the size cap at once.
    let zero = dir.join("zero.json");
    std::os::unix::fs::symlink("/dev/zero", &zero).expect("symlink");
    let t = std::time::Instant::now();
    assert_eq!(
        err_text(load_pipeline_file(&zero)),
        format!(
            "cannot read pipeline file `{}`: the file holds more than 16777216 bytes, the most a pipeline description \
             may have; check the path (it may name a device or a huge file)",
            zero.display()
        )
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------------------------------------------------------------
// Presets

#[test]
fn every_preset_name_resolves_and_validates() {
    assert_eq!(PRESET_NAMES, ["flux-dev", "flux-tiny", "wan-14b", "wan-tiny", "qwen-image", "qwen-tiny"]);
    for name in PRESET_NAMES {
        let p = preset(name).expect(name);
        assert_eq!(p.validate(), Ok(()), "{name}");
    }
    assert_eq!(preset("flux"), None);
    assert_eq!(preset(""), None);
}

#[test]
fn flux_dev_is_flux_sized() {
    let p = preset("flux-dev").expect("preset");
    let dit_params = params(&p, "transformer") as f64;
    assert!(within(dit_params, 11.9e9, 0.02), "{dit_params}");
    let dit_bytes = p.subtree_bytes("transformer") as f64;
    assert!(within(dit_bytes, 23.8e9, 0.02), "{dit_bytes}");
    assert_eq!(p.module("transformer.transformer_blocks").map(|m| m.children.len()), Some(19));
    assert_eq!(p.module("transformer.single_transformer_blocks").map(|m| m.children.len()), Some(38));
    let shape = |path: &str| p.tensor(path).map(|t| t.shape.clone()).unwrap_or_default();
    assert_eq!(shape("transformer.x_embedder.weight"), [3072, 64]);
    assert_eq!(shape("transformer.context_embedder.weight"), [3072, 4096]);
    assert_eq!(shape("transformer.transformer_blocks.0.img_mod.lin.weight"), [18432, 3072]);
    assert_eq!(shape("transformer.transformer_blocks.0.txt_attn.qkv.weight"), [9216, 3072]);
    assert_eq!(shape("transformer.transformer_blocks.18.img_mlp.fc1.weight"), [12288, 3072]);
    assert_eq!(shape("transformer.transformer_blocks.18.img_mlp.fc2.weight"), [3072, 12288]);
    assert_eq!(shape("transformer.transformer_blocks.3.img_attn.norm_q.weight"), [128]);
    assert_eq!(shape("transformer.single_transformer_blocks.0.modulation.lin.weight"), [9216, 3072]);
    assert_eq!(shape("transformer.single_transformer_blocks.37.linear1.weight"), [21504, 3072]);
    assert_eq!(shape("transformer.single_transformer_blocks.37.linear2.weight"), [3072, 15360]);
    assert_eq!(shape("transformer.proj_out.weight"), [64, 3072]);
    assert_eq!(shape("text_encoder.encoder.block.23.layer.1.DenseReluDense.wi_1.weight"), [10240, 4096]);
    assert_eq!(p.module("text_encoder.encoder.block").map(|m| m.children.len()), Some(24));
    let vae = params(&p, "vae") as f64;
    assert!(within(vae, 80e6, 0.1), "{vae}");
}

#[test]
fn wan_14b_is_wan_sized() {
    let p = preset("wan-14b").expect("preset");
    let dit_params = params(&p, "transformer") as f64;
    assert!(within(dit_params, 14e9, 0.03), "{dit_params}");
    let dit_bytes = p.subtree_bytes("transformer") as f64;
    assert!(within(dit_bytes, 28e9, 0.03), "{dit_bytes}");
    assert_eq!(p.module("transformer.blocks").map(|m| m.children.len()), Some(40));
    let t = p.tensor("transformer.blocks.7.scale_shift_table").expect("modulation");
    assert_eq!((t.dtype, t.shape.clone()), (DType::F32, vec![1, 6, 5120]));
    let shape = |path: &str| p.tensor(path).map(|t| t.shape.clone()).unwrap_or_default();
    assert_eq!(shape("transformer.blocks.0.attn1.to_q.weight"), [5120, 5120]);
    assert_eq!(shape("transformer.blocks.0.attn2.to_out.bias"), [5120]);
    assert_eq!(shape("transformer.blocks.39.ffn.fc1.weight"), [13824, 5120]);
    assert_eq!(shape("transformer.blocks.39.ffn.fc2.weight"), [5120, 13824]);
    assert_eq!(shape("transformer.patch_embedding.weight"), [5120, 16, 1, 2, 2]);
    assert_eq!(shape("text_encoder.shared.weight"), [256_384, 4096]);
    assert_eq!(p.module("text_encoder.encoder.block").map(|m| m.children.len()), Some(24));
}

#[test]
fn qwen_image_is_qwen_sized() {
    let p = preset("qwen-image").expect("preset");
    let dit_params = params(&p, "transformer") as f64;
    assert!(within(dit_params, 20e9, 0.05), "{dit_params}");
    let dit_bytes = p.subtree_bytes("transformer") as f64;
    assert!(within(dit_bytes, 40.9e9, 0.05), "{dit_bytes}");
    assert_eq!(p.module("transformer.transformer_blocks").map(|m| m.children.len()), Some(60));
    assert_eq!(p.module("text_encoder.model.layers").map(|m| m.children.len()), Some(28));
    let shape = |path: &str| p.tensor(path).map(|t| t.shape.clone()).unwrap_or_default();
    assert_eq!(shape("text_encoder.model.layers.0.self_attn.k_proj.weight"), [512, 3584]);
    assert_eq!(shape("text_encoder.model.layers.27.mlp.down_proj.weight"), [3584, 18944]);
    assert_eq!(shape("transformer.txt_in.weight"), [3072, 3584]);
}

/// For each tensor, the index of the first tensor sharing its storage: the tie structure, independent of ids.
fn tie_pattern(p: &PipelineDesc) -> Vec<usize> {
    let mut first: HashMap<StorageId, usize> = HashMap::new();
    p.root.tensors_recursive().iter().enumerate().map(|(i, (_, t))| *first.entry(t.storage).or_insert(i)).collect()
}

fn module_shape(m: &ModuleNode, path: &str, out: &mut Vec<String>) {
    out.push(format!("{path} {} {} {}", m.class, m.has_lifecycle, m.is_loaded));
    for t in &m.tensors {
        out.push(format!("{path}.{} {} {:?} rank {}", t.name, t.dtype.name(), t.kind, t.shape.len()));
    }
    for (n, c) in &m.children {
        module_shape(c, &format!("{path}.{n}"), out);
    }
}

#[test]
fn tiny_variants_have_the_big_topology() {
    for (big, tiny) in [("flux-dev", "flux-tiny"), ("wan-14b", "wan-tiny"), ("qwen-image", "qwen-tiny")] {
        let b = preset(big).expect(big);
        let t = preset(tiny).expect(tiny);
        let (mut sb, mut st) = (Vec::new(), Vec::new());
        module_shape(&b.root, "", &mut sb);
        module_shape(&t.root, "", &mut st);
        assert_eq!(sb, st, "{tiny}");
        assert_eq!(tie_pattern(&b), tie_pattern(&t), "{tiny}");
        assert_eq!(b.storages.len(), t.storages.len(), "{tiny}");
        assert_eq!(
            (&b.class, &b.components, &b.offload_plan, &b.class_block_attrs),
            (&t.class, &t.components, &t.offload_plan, &t.class_block_attrs),
            "{tiny}"
        );
        let total = t.subtree_bytes("");
        assert!(total < 8 << 20, "{tiny}: {total}");
    }
}

#[test]
fn presets_declare_components_and_plans() {
    let expect_blocks: &[(&str, &[&str], &str)] = &[
        ("flux-dev", &["transformer_blocks", "single_transformer_blocks"], "encoder.block"),
        ("wan-14b", &["blocks"], "encoder.block"),
        ("qwen-image", &["transformer_blocks"], "model.layers"),
    ];
    for (name, dit_blocks, encoder_blocks) in expect_blocks {
        let p = preset(name).expect(name);
        let c = p.components.clone().expect("components");
        assert_eq!(
            (c.dit, c.encoders, c.vaes),
            (vec!["transformer".to_string()], vec!["text_encoder".to_string()], vec!["vae".to_string()])
        );
        let plan = p.offload_plan.clone().expect("plan");
        let blocks: Vec<String> = dit_blocks.iter().map(|s| s.to_string()).collect();
        assert_eq!(plan.block_attrs, BTreeMap::from([("transformer".to_string(), blocks.clone())]));
        assert_eq!(
            plan.encoder_block_attrs,
            BTreeMap::from([("text_encoder".to_string(), vec![encoder_blocks.to_string()])])
        );
        assert_eq!(plan.on_demand_component_paths, ["vae"]);
        assert_eq!(plan.resident_dit_paths, ["transformer"]);
        let dit_class = p.module("transformer").map(|m| m.class.clone()).unwrap_or_default();
        assert_eq!(p.class_block_attrs.get(&dit_class), Some(&blocks));
        for attr in dit_blocks.iter().copied().chain([*encoder_blocks]) {
            let path =
                if attr == *encoder_blocks { format!("text_encoder.{attr}") } else { format!("transformer.{attr}") };
            assert!(p.module(&path).is_some_and(|m| m.is_block_list() && m.children.len() >= 19), "{name}: {path}");
        }
        let vae = p.module("vae").expect("vae");
        assert!(vae.has_lifecycle);
        assert!(p.module("transformer").is_some_and(|m| !m.has_lifecycle));
    }
}

#[test]
fn preset_tensors_follow_the_layout_conventions() {
    for name in PRESET_NAMES {
        let p = preset(name).expect(name);
        let mut transposed = Vec::new();
        let mut stack = vec![(String::new(), &p.root)];
        while let Some((path, m)) = stack.pop() {
            for t in &m.tensors {
                let full = format!("{path}.{}", t.name);
                if m.class == "Linear" && t.name == "weight" {
                    assert_eq!(t.shape.len(), 2, "{name}: {full}");
                }
                if m.class == "Linear" && t.name == "bias" {
                    let weight = m.tensors.iter().find(|w| w.name == "weight").map(|w| w.shape[0]);
                    assert_eq!(Some(t.shape.clone()), weight.map(|o| vec![o]), "{name}: {full}");
                }
                if m.class == "Conv2d" && t.name == "weight" {
                    assert_eq!(t.shape.len(), 4, "{name}: {full}");
                }
                if t.strides != TensorDesc::contiguous_strides(&t.shape) {
                    transposed.push(full.clone());
                }
            }
            for (n, c) in &m.children {
                stack.push((format!("{path}.{n}"), c));
            }
        }
        assert_eq!(transposed, [".transformer.proj_out.weight"], "{name}");
        let t = p.tensor("transformer.proj_out.weight").expect("proj_out");
        assert_eq!(t.strides, [1, t.shape[0]], "{name}");
    }
}

#[test]
fn flux_alias_shares_a_block_weight_and_is_counted_once() {
    for name in ["flux-dev", "flux-tiny"] {
        let p = preset(name).expect(name);
        let alias = p.tensor("transformer.proj_alias.weight").expect("alias");
        let target = p.tensor("transformer.single_transformer_blocks.0.linear2.weight").expect("target");
        assert_eq!(alias.storage, target.storage, "{name}");
        assert_eq!((&alias.shape, &alias.strides, alias.dtype), (&target.shape, &target.strides, target.dtype));
        let storage_bytes = p.storages[&target.storage].byte_size();
        let naive: u64 =
            p.module("transformer").map_or(0, |m| m.tensors_recursive().iter().map(|(_, t)| t.byte_size()).sum());
        assert_eq!(p.subtree_bytes("transformer"), naive - storage_bytes, "{name}");
        assert_eq!(p.subtree_bytes("transformer.proj_alias"), storage_bytes, "{name}");
        // The T5 encoder's token embedding is tied to `shared`.
        assert_eq!(
            p.tensor("text_encoder.encoder.embed_tokens.weight").map(|t| t.storage),
            p.tensor("text_encoder.shared.weight").map(|t| t.storage)
        );
    }
}

#[test]
fn tiny_presets_are_small() {
    assert_eq!(preset("flux-tiny").map(|p| p.subtree_bytes("")), Some(3_514_174));
    assert_eq!(preset("wan-tiny").map(|p| p.subtree_bytes("")), Some(2_275_326));
    assert_eq!(preset("qwen-tiny").map(|p| p.subtree_bytes("")), Some(5_495_838));
}
