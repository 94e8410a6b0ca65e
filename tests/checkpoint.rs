//! Checkpoints: safetensors files written here (by the `safetensors` crate's serializer, and hand-crafted bytes for
//! the malformed cases), read through `weightferry::checkpoint`.
//!
//! Covered: one file with every supported dtype (names, dtypes, shapes, offsets and bytes equal what was written
//! and what the crate itself reads); headers whose entries are in any order; a sharded folder with a block split
//! across two shards; the derived description (module tree, block lists by key format, numeric order, `single_*`
//! lists last, nested numbered lists not streamed) resolves a layerwise plan; `HostModel::from_checkpoint` holds
//! exactly the file's bytes in every storage; each malformed input is its exact typed error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use weightferry::checkpoint::{derive_pipeline, Checkpoint, CheckpointError, DeriveOptions};
use weightferry::config::OffloadConfig;
use weightferry::model::HostModel;
use weightferry::pipeline::{DType, StorageId};
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::PlatformRef;
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/safetensors.rs"]
mod st;
use st::{t, write, T};

/// A fresh empty folder for one test.
fn dir(name: &str) -> PathBuf {
    st::fresh_dir("checkpoint", name)
}

/// A file from a header's JSON text and its data bytes (header length as given).
fn raw(path: &Path, header: &str, data: &[u8]) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

use safetensors::Dtype as S;

/// A small Flux-shaped DiT: 2 double blocks, 11 single blocks (so 10 sorts after 9), nested numbered lists.
fn flux_like() -> BTreeMap<String, T> {
    let mut m = BTreeMap::new();
    let mut seed = 0;
    let mut add = |name: String, dtype: S, shape: &[usize]| {
        seed += 1;
        m.insert(name, t(dtype, shape, seed));
    };
    add("x_embedder.weight".into(), S::BF16, &[8, 4]);
    add("x_embedder.bias".into(), S::BF16, &[8]);
    add("proj_out.weight".into(), S::F32, &[4, 8]);
    add("scale_shift_table".into(), S::F32, &[2, 8]);
    for i in 0..2 {
        add(format!("transformer_blocks.{i}.attn.to_q.weight"), S::BF16, &[8, 8]);
        add(format!("transformer_blocks.{i}.attn.to_out.0.weight"), S::BF16, &[8, 8]);
        add(format!("transformer_blocks.{i}.ff.net.0.proj.weight"), S::F16, &[16, 8]);
        add(format!("transformer_blocks.{i}.ff.net.2.weight"), S::F16, &[8, 16]);
    }
    for i in 0..11 {
        add(format!("single_transformer_blocks.{i}.proj_mlp.weight"), S::BF16, &[8, 8]);
        add(format!("single_transformer_blocks.{i}.norm.linear.bias"), S::F32, &[8]);
    }
    m
}

fn sim() -> PlatformRef {
    Arc::new(SimPlatform::new(SimConfig::default()).unwrap())
}

/// Every storage of a model loaded from `ck` holds exactly the checkpoint tensor's bytes.
fn assert_model_bytes(ck: &Checkpoint, component: &str) {
    let d = derive_pipeline(ck, &DeriveOptions { component: component.into() }).unwrap();
    let desc = Arc::new(d.desc);
    let model = HostModel::from_checkpoint(sim(), desc.clone(), ck, component).unwrap();
    let mut seen = 0;
    for (path, td) in desc.root.tensors_recursive() {
        let key = path.strip_prefix(&format!("{component}.")).unwrap();
        assert_eq!(model.read_storage(td.storage).unwrap(), ck.read_tensor(key).unwrap().unwrap(), "{key}");
        seen += 1;
    }
    assert_eq!(seen, ck.len());
    assert_eq!(model.file_bytes(), ck.tensor_bytes());
    assert_eq!(model.loaded_bytes(), 0);
    model.release();
}

#[test]
fn one_file_with_every_dtype_reads_back_exactly() {
    let d = dir("dtypes");
    let mut m = BTreeMap::new();
    let dtypes = [(S::F32, DType::F32), (S::F16, DType::F16), (S::BF16, DType::Bf16), (S::F8_E4M3, DType::F8e4m3)];
    let more = [(S::I64, DType::I64), (S::I32, DType::I32), (S::U8, DType::U8)];
    for (i, (s, _)) in dtypes.iter().chain(&more).enumerate() {
        m.insert(format!("layer_{i}.weight"), t(*s, &[3, i + 1], i as u64));
    }
    m.insert("scalar".into(), t(S::F32, &[], 99));
    m.insert("empty".into(), t(S::I32, &[0, 4], 98));
    let path = d.join("model.safetensors");
    write(&path, &m);
    let ck = Checkpoint::open(&path).unwrap();
    assert_eq!(ck.files().len(), 1);
    assert_eq!(ck.index(), None);
    assert_eq!(ck.len(), 9);
    let file = std::fs::read(&path).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&file).unwrap();
    for (i, (s, ours)) in dtypes.iter().chain(&more).enumerate() {
        let name = format!("layer_{i}.weight");
        let (f, ft) = ck.tensor(&name).unwrap();
        assert_eq!(f.path(), path);
        assert_eq!((ft.dtype, ft.shape.clone()), (*ours, vec![3, i as u64 + 1]));
        assert_eq!(ck.read_tensor(&name).unwrap().unwrap(), m[&name].data.as_slice());
        let view = theirs.tensor(&name).unwrap();
        assert_eq!(view.dtype(), *s);
        assert_eq!(ck.read_tensor(&name).unwrap().unwrap(), view.data());
        // The offset is absolute in the file.
        assert_eq!(&file[ft.offset as usize..(ft.offset + ft.len) as usize], view.data());
    }
    assert_eq!(ck.tensor("scalar").unwrap().1.shape, Vec::<u64>::new());
    assert_eq!(ck.read_tensor("scalar").unwrap().unwrap().len(), 4);
    assert_eq!(ck.read_tensor("empty").unwrap().unwrap(), b"");
    assert_eq!(ck.tensor_bytes(), m.values().map(|t| t.data.len() as u64).sum::<u64>());
    // Files written by the library sort tensors by (dtype descending alignment, name).
    let order: Vec<&str> = ck.files()[0].tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(order[0], "layer_4.weight"); // I64 first
    assert_model_bytes(&ck, "transformer");
    // The folder holding only this file opens it.
    let by_folder = Checkpoint::open(&d).unwrap();
    assert_eq!((by_folder.files()[0].path(), by_folder.len()), (path.as_path(), 9));
    // Anything else is not a checkpoint.
    std::fs::write(d.join("notes.txt"), "x").unwrap();
    assert!(matches!(Checkpoint::open(d.join("notes.txt")).unwrap_err(), CheckpointError::NotACheckpoint { .. }));
}

#[test]
fn header_entries_in_any_order_are_read_by_offset() {
    let d = dir("orders");
    let data: Vec<u8> = (0u8..24).collect();
    let entries = [
        r#""a":{"dtype":"U8","shape":[8],"data_offsets":[16,24]}"#,
        r#""b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}"#,
        r#""c":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}"#,
    ];
    for (k, order) in [[0, 1, 2], [2, 1, 0], [1, 0, 2]].iter().enumerate() {
        let header = format!("{{{}}}", order.iter().map(|&i| entries[i]).collect::<Vec<_>>().join(","));
        let path = d.join(format!("m{k}.safetensors"));
        raw(&path, &header, &data);
        let ck = Checkpoint::open(&path).unwrap();
        let names: Vec<&str> = ck.files()[0].tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b", "c", "a"]);
        assert_eq!(ck.read_tensor("a").unwrap().unwrap(), &data[16..24]);
        assert_eq!(ck.read_tensor("b").unwrap().unwrap(), &data[0..8]);
        assert_eq!(ck.read_tensor("c").unwrap().unwrap(), &data[8..16]);
        assert_eq!(ck.tensor("c").unwrap().1.offset, 8 + header.len() as u64 + 8);
    }
}

#[test]
fn derived_description_finds_block_lists_by_key_format() {
    let d = dir("derive");
    let path = d.join("diffusion_pytorch_model.safetensors");
    write(&path, &flux_like());
    let ck = Checkpoint::open(&path).unwrap();
    let der = derive_pipeline(&ck, &DeriveOptions::default()).unwrap();
    assert_eq!(der.component, "transformer");
    let lists: Vec<(&str, usize, usize)> =
        der.block_lists.iter().map(|b| (b.attr.as_str(), b.blocks, b.tensors)).collect();
    assert_eq!(lists, [("transformer_blocks", 2, 8), ("single_transformer_blocks", 11, 22)]);
    assert_eq!(der.block_lists[0].bytes, 2 * (128 + 128 + 256 + 256));
    let desc = &der.desc;
    let plan = desc.offload_plan.as_ref().unwrap();
    assert_eq!(plan.block_attrs["transformer"], ["transformer_blocks", "single_transformer_blocks"]);
    assert_eq!(desc.components.as_ref().unwrap().dit, ["transformer"]);
    let dit = desc.module("transformer").unwrap();
    let children: Vec<&str> = dit.children.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(children, ["proj_out", "transformer_blocks", "x_embedder", "single_transformer_blocks"]);
    assert_eq!(dit.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["scale_shift_table"]);
    let singles = desc.module("transformer.single_transformer_blocks").unwrap();
    assert!(singles.is_block_list());
    let order: Vec<&str> = singles.children.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(order, ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"]);
    assert_eq!(singles.children[10].1.class, "Block");
    let q = desc.tensor("transformer.transformer_blocks.1.attn.to_q.weight").unwrap();
    assert_eq!((q.dtype, q.shape.clone(), q.strides.clone()), (DType::Bf16, vec![8, 8], vec![8, 1]));
    // Deeper numbered lists stay inside their block: `to_out.0` is a one-entry list, `ff.net` (0, 2) has a gap.
    assert_eq!(desc.module("transformer.transformer_blocks.0.attn.to_out").unwrap().class, "ModuleList");
    assert_eq!(desc.module("transformer.transformer_blocks.0.ff.net").unwrap().class, "Module");
    assert_eq!(desc.storages.len(), ck.len());
    let config =
        OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#)
            .unwrap();
    let resolved = resolve_offload_plan(desc, &config).unwrap();
    let stacks = resolved.stacks();
    assert_eq!(stacks.len(), 1);
    assert_eq!(stacks[0].1.attrs, ["transformer_blocks", "single_transformer_blocks"]);
    assert_eq!(stacks[0].1.blocks.len(), 13);
    assert_eq!(stacks[0].1.blocks[2], "transformer.single_transformer_blocks.0");
    // Another component name.
    let other = derive_pipeline(&ck, &DeriveOptions { component: "dit".into() }).unwrap();
    assert!(other.desc.module("dit.transformer_blocks.1").is_some());
    assert_model_bytes(&ck, "dit");
}

#[test]
fn other_key_formats_are_block_lists() {
    let d = dir("formats");
    for (attr, nested) in [("blocks", false), ("layers", false), ("block", false), ("double_blocks", true)] {
        let mut m = BTreeMap::new();
        for i in 0..3 {
            m.insert(format!("{attr}.{i}.w"), t(S::F16, &[2, 2], i));
        }
        if nested {
            m.insert("encoder.layers.0.w".into(), t(S::F16, &[2], 7));
        }
        m.insert("head.weight".into(), t(S::F16, &[2, 2], 9));
        let path = d.join(format!("{attr}.safetensors"));
        write(&path, &m);
        let der = derive_pipeline(&Checkpoint::open(&path).unwrap(), &DeriveOptions::default()).unwrap();
        let lists: Vec<(&str, usize)> = der.block_lists.iter().map(|b| (b.attr.as_str(), b.blocks)).collect();
        assert_eq!(lists, [(attr, 3)], "{attr}");
    }
}

/// Writes a two-shard checkpoint whose block 1 is split across the shards; returns the folder and the tensors.
fn sharded(name: &str) -> (PathBuf, BTreeMap<String, T>) {
    let d = dir(name);
    let all = flux_like();
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    let mut map = BTreeMap::new();
    for (k, v) in all.iter() {
        let first = k.starts_with("transformer_blocks.0.")
            || k.starts_with("transformer_blocks.1.attn")
            || k.starts_with("x_embedder")
            || k == "proj_out.weight";
        let (shard, to) = if first {
            ("model-00001-of-00002.safetensors", &mut a)
        } else {
            ("model-00002-of-00002.safetensors", &mut b)
        };
        to.insert(k.clone(), T { dtype: v.dtype, shape: v.shape.clone(), data: v.data.clone() });
        map.insert(k.clone(), shard.to_string());
    }
    write(&d.join("model-00001-of-00002.safetensors"), &a);
    write(&d.join("model-00002-of-00002.safetensors"), &b);
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    (d, all)
}

#[test]
fn sharded_folder_with_a_block_split_across_shards() {
    let (d, all) = sharded("sharded");
    for path in [d.clone(), d.join("model.safetensors.index.json")] {
        let ck = Checkpoint::open(&path).unwrap();
        assert_eq!(ck.index(), Some(d.join("model.safetensors.index.json").as_path()));
        assert_eq!(ck.files().len(), 2);
        assert_eq!(ck.len(), all.len());
        for (k, v) in &all {
            assert_eq!(ck.read_tensor(k).unwrap().unwrap(), v.data.as_slice(), "{k}");
        }
        let (f1, _) = ck.tensor("transformer_blocks.1.attn.to_q.weight").unwrap();
        let (f2, _) = ck.tensor("transformer_blocks.1.ff.net.2.weight").unwrap();
        assert_ne!(f1.path(), f2.path());
        let der = derive_pipeline(&ck, &DeriveOptions::default()).unwrap();
        assert_eq!(der.block_lists.iter().map(|b| b.blocks).collect::<Vec<_>>(), [2, 11]);
        assert_model_bytes(&ck, "transformer");
    }
}

fn err(path: &Path) -> CheckpointError {
    Checkpoint::open(path).unwrap_err()
}

const GOOD_A: &str = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;

#[test]
fn malformed_files_are_their_typed_errors() {
    let d = dir("malformed");
    let p = |n: &str| d.join(format!("{n}.safetensors"));
    // Corrupt header JSON.
    raw(&p("json"), r#"{"a":{"dtype":"F32","#, &[0; 8]);
    assert!(matches!(err(&p("json")), CheckpointError::CorruptHeader { file, reason, .. }
        if file == p("json") && reason.starts_with("invalid JSON")));
    // A name twice.
    raw(&p("twice"), &format!("{{{GOOD_A},{GOOD_A}}}"), &[0; 8]);
    assert!(
        matches!(err(&p("twice")), CheckpointError::CorruptHeader { reason, .. } if reason.contains("`a` appears twice"))
    );
    // Unsupported dtype, known to safetensors or not.
    for dt in ["F64", "BOOL", "Q4"] {
        raw(&p("dtype"), &format!(r#"{{"w":{{"dtype":"{dt}","shape":[1],"data_offsets":[0,8]}}}}"#), &[0; 8]);
        assert!(matches!(err(&p("dtype")), CheckpointError::UnsupportedDtype { file, tensor, dtype }
            if file == p("dtype") && tensor == "w" && dtype == dt));
    }
    // Shape against bytes.
    raw(&p("shape"), r#"{"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}}"#, &[0; 8]);
    assert!(
        matches!(err(&p("shape")), CheckpointError::ShapeBytesMismatch { tensor, expected: 6, actual: 8, .. } if tensor == "w")
    );
    raw(&p("reversed"), r#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}}"#, &[0; 8]);
    assert!(
        matches!(err(&p("reversed")), CheckpointError::ShapeBytesMismatch { tensor, expected: 0, actual: 0, .. } if tensor == "w")
    );
    // Offsets past the end (the tensors do not tile: a hole before `b`).
    raw(&p("past"), &format!(r#"{{{GOOD_A},"b":{{"dtype":"U8","shape":[4],"data_offsets":[100,104]}}}}"#), &[0; 8]);
    assert!(
        matches!(err(&p("past")), CheckpointError::OffsetsPastEnd { tensor, start: 100, end: 104, data_len: 8, .. } if tensor == "b")
    );
    // Overlapping tensors.
    raw(&p("overlap"), &format!(r#"{{{GOOD_A},"b":{{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}}}"#), &[0; 8]);
    assert!(
        matches!(err(&p("overlap")), CheckpointError::Overlap { tensor, other, .. } if tensor == "b" && other == "a")
    );
    // A hole, and bytes after the last tensor.
    raw(&p("hole"), &format!(r#"{{{GOOD_A},"b":{{"dtype":"U8","shape":[4],"data_offsets":[12,16]}}}}"#), &[0; 16]);
    assert!(
        matches!(err(&p("hole")), CheckpointError::Uncovered { after: Some(a), start: 8, end: 12, .. } if a == "a")
    );
    raw(&p("trailing"), &format!("{{{GOOD_A}}}"), &[0; 12]);
    assert!(matches!(err(&p("trailing")), CheckpointError::Uncovered { start: 8, end: 12, .. }));
    // Truncated: the length field, the header, the data.
    std::fs::write(p("short"), [1, 0, 0]).unwrap();
    assert!(matches!(err(&p("short")), CheckpointError::Truncated { tensor: None, expected: 8, actual: 3, .. }));
    let mut b = 200u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{\"a\":");
    std::fs::write(p("cut_header"), &b).unwrap();
    assert!(matches!(
        err(&p("cut_header")),
        CheckpointError::Truncated { tensor: None, expected: 208, actual: 13, .. }
    ));
    let mut m = BTreeMap::new();
    m.insert("a".to_string(), t(S::F32, &[4], 1));
    m.insert("b".to_string(), t(S::F32, &[4], 2));
    write(&p("full"), &m);
    let full = std::fs::read(p("full")).unwrap();
    std::fs::write(p("cut"), &full[..full.len() - 5]).unwrap();
    assert!(matches!(err(&p("cut")), CheckpointError::Truncated { tensor: Some(t), expected, actual, .. }
        if t == "b" && expected == full.len() as u64 && actual == full.len() as u64 - 5));
    // A header length beyond the format's limit.
    std::fs::write(p("huge"), (200_000_000u64).to_le_bytes()).unwrap();
    assert!(matches!(err(&p("huge")), CheckpointError::CorruptHeader { .. }));
    // A name that cannot be a module path, and a name that is both tensor and module.
    // (torch's names: `a-b` is one, as a ModuleDict key; a space is not.)
    raw(&p("name"), r#"{"a b.w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, &[0]);
    let ck = Checkpoint::open(p("name")).unwrap();
    assert!(matches!(derive_pipeline(&ck, &DeriveOptions::default()).unwrap_err(),
        CheckpointError::BadName { tensor, .. } if tensor == "a b.w"));
    raw(
        &p("both"),
        r#"{"a.b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a.b.c":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
        &[0, 0],
    );
    let ck = Checkpoint::open(p("both")).unwrap();
    assert!(matches!(derive_pipeline(&ck, &DeriveOptions::default()).unwrap_err(),
        CheckpointError::BadName { tensor, reason, .. } if tensor == "a.b.c" && reason == "`a.b` is both a tensor and a module"));
    // Messages name the file and the tensor.
    let msg = err(&p("overlap")).to_string();
    assert!(msg.starts_with(&format!("{}: tensors `b` and `a` overlap", p("overlap").display())), "{msg}");
}

#[test]
fn whole_pipelines_are_refused() {
    let d = dir("whole");
    let mut m = BTreeMap::new();
    m.insert("transformer.blocks.0.w".to_string(), t(S::F16, &[2], 1));
    m.insert("text_encoder.layers.0.w".to_string(), t(S::F16, &[2], 2));
    m.insert("vae.decoder.w".to_string(), t(S::F16, &[2], 3));
    write(&d.join("all.safetensors"), &m);
    let ck = Checkpoint::open(d.join("all.safetensors")).unwrap();
    assert!(matches!(derive_pipeline(&ck, &DeriveOptions::default()).unwrap_err(),
        CheckpointError::WholePipeline { prefixes, .. } if prefixes == ["text_encoder", "transformer", "vae"]));
    let mut m = BTreeMap::new();
    m.insert("model.diffusion_model.input_blocks.0.w".to_string(), t(S::F16, &[2], 1));
    write(&d.join("sd.safetensors"), &m);
    let ck = Checkpoint::open(d.join("sd.safetensors")).unwrap();
    assert!(matches!(derive_pipeline(&ck, &DeriveOptions::default()).unwrap_err(),
        CheckpointError::WholePipeline { prefixes, .. } if prefixes == ["model.diffusion_model"]));
    // Only the transformer, but under its component prefix.
    let mut m = BTreeMap::new();
    m.insert("transformer.blocks.0.w".to_string(), t(S::F16, &[2], 1));
    m.insert("transformer.proj_out.w".to_string(), t(S::F16, &[2], 2));
    write(&d.join("prefixed.safetensors"), &m);
    let ck = Checkpoint::open(d.join("prefixed.safetensors")).unwrap();
    let e = derive_pipeline(&ck, &DeriveOptions::default()).unwrap_err();
    assert!(matches!(&e, CheckpointError::WholePipeline { prefixes, .. } if prefixes == &["transformer"]));
    assert!(
        e.to_string()
            .ends_with("pass the transformer's own file or folder (diffusers layout: <pipeline>/transformer/)"),
        "{e}"
    );
    // An attribute that happens to be called `transformer` beside others is an ordinary module.
    m.insert("proj_in.w".to_string(), t(S::F16, &[2], 3));
    write(&d.join("attr.safetensors"), &m);
    let ck = Checkpoint::open(d.join("attr.safetensors")).unwrap();
    let der = derive_pipeline(&ck, &DeriveOptions::default()).unwrap();
    assert!(der.desc.module("transformer.transformer.blocks.0").is_some());
    // A diffusers pipeline folder.
    let p = dir("pipeline_folder");
    std::fs::write(p.join("model_index.json"), "{}").unwrap();
    std::fs::create_dir_all(p.join("transformer")).unwrap();
    assert!(
        matches!(err(&p), CheckpointError::NotACheckpoint { reason, .. } if reason.contains("pass its transformer/ subfolder"))
    );
}

#[test]
fn sharded_inconsistencies_are_their_typed_errors() {
    let index = |d: &Path| d.join("model.safetensors.index.json");
    let set_map = |d: &Path, f: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(index(d)).unwrap()).unwrap();
        f(v["weight_map"].as_object_mut().unwrap());
        std::fs::write(index(d), v.to_string()).unwrap();
    };
    // A missing shard.
    let (d, _) = sharded("missing_shard");
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    assert!(matches!(err(&d), CheckpointError::MissingShard { shard, tensor, .. }
        if shard == "model-00002-of-00002.safetensors" && tensor == "scale_shift_table"));
    // The index names a tensor its shard lacks.
    let (d, _) = sharded("missing_tensor");
    set_map(&d, &|m| {
        m.insert("extra.weight".into(), "model-00001-of-00002.safetensors".into());
    });
    assert!(matches!(err(&d), CheckpointError::MissingTensor { file, tensor, expected_by: "index" }
        if tensor == "extra.weight" && file == d.join("model-00001-of-00002.safetensors")));
    // A tensor in two shards.
    let (d, all) = sharded("two_shards");
    let mut a = BTreeMap::new();
    for (k, v) in &all {
        if k.starts_with("transformer_blocks.0.")
            || k.starts_with("transformer_blocks.1.attn")
            || k.starts_with("x_embedder")
            || k == "proj_out.weight"
            || k == "scale_shift_table"
        {
            a.insert(k.clone(), T { dtype: v.dtype, shape: v.shape.clone(), data: v.data.clone() });
        }
    }
    write(&d.join("model-00001-of-00002.safetensors"), &a);
    assert!(matches!(err(&d), CheckpointError::DuplicateTensor { file, tensor, other, indexed: false }
        if tensor == "scale_shift_table" && file == d.join("model-00001-of-00002.safetensors")
            && other == d.join("model-00002-of-00002.safetensors")));
    // A shard tensor the index does not name.
    let (d, _) = sharded("unindexed");
    set_map(&d, &|m| {
        m.remove("proj_out.weight");
    });
    assert!(matches!(err(&d), CheckpointError::Unindexed { tensor, .. } if tensor == "proj_out.weight"));
    // Invalid index: not JSON, a shard outside the folder.
    let (d, _) = sharded("bad_index");
    set_map(&d, &|m| {
        m.insert("proj_out.weight".into(), "../model.safetensors".into());
    });
    assert!(matches!(err(&d), CheckpointError::InvalidIndex { reason, .. } if reason.contains("not a file name")));
    std::fs::write(index(&d), "{").unwrap();
    assert!(matches!(err(&d), CheckpointError::InvalidIndex { .. }));
    // Two indexes.
    std::fs::write(d.join("other.safetensors.index.json"), "{}").unwrap();
    assert!(
        matches!(err(&d), CheckpointError::NotACheckpoint { reason, .. } if reason.starts_with("2 *.safetensors.index.json files"))
    );
    std::fs::remove_file(d.join("other.safetensors.index.json")).unwrap();
    // A folder with two files and no index.
    std::fs::remove_file(index(&d)).unwrap();
    assert!(
        matches!(err(&d), CheckpointError::NotACheckpoint { reason, .. } if reason.starts_with("2 .safetensors files"))
    );
    // A malformed shard is that shard's error.
    let (d, _) = sharded("bad_shard");
    std::fs::write(d.join("model-00002-of-00002.safetensors"), [0u8; 4]).unwrap();
    assert!(
        matches!(err(&d), CheckpointError::Truncated { file, .. } if file == d.join("model-00002-of-00002.safetensors"))
    );
}

/// A Flux-like checkpoint written in its own folder, opened, and the description derived from it.
fn flux_like_checkpoint(name: &str) -> (Checkpoint, weightferry::pipeline::PipelineDesc) {
    let path = dir(name).join("m.safetensors");
    write(&path, &flux_like());
    let ck = Checkpoint::open(&path).unwrap();
    let desc = derive_pipeline(&ck, &DeriveOptions::default()).unwrap().desc;
    (ck, desc)
}

#[test]
fn a_tied_weight_is_filled_from_the_one_name_of_its_tie_the_checkpoint_holds() {
    let (ck, desc) = flux_like_checkpoint("tied");
    // `x_embedder.weight` and a second name over its storage (as a tied embedding), the second in no file.
    let mut tied = desc.clone();
    let embedder = tied.root.children[0].1.children.iter_mut().find(|(n, _)| n == "x_embedder").unwrap();
    let mut alias = embedder.1.tensors.iter().find(|t| t.name == "weight").unwrap().clone();
    alias.name = "weight_tied".into();
    embedder.1.tensors.push(alias.clone());
    let model = HostModel::from_checkpoint(sim(), Arc::new(tied.clone()), &ck, "transformer").unwrap();
    assert_eq!(model.read_storage(alias.storage).unwrap(), ck.read_tensor("x_embedder.weight").unwrap().unwrap());
    // With neither name in the checkpoint, the first one the description names is the missing tensor.
    let embedder = tied.root.children[0].1.children.iter_mut().find(|(n, _)| n == "x_embedder").unwrap();
    embedder.1.tensors.iter_mut().find(|t| t.name == "weight").unwrap().name = "weight_gone".into();
    let e = HostModel::from_checkpoint(sim(), Arc::new(tied), &ck, "transformer").unwrap_err();
    assert!(
        matches!(&e, CheckpointError::MissingTensor { tensor, expected_by: "pipeline description", .. }
        if tensor == "x_embedder.weight_gone"),
        "{e}"
    );
}

#[test]
fn a_description_that_does_not_match_the_checkpoint_is_refused() {
    let (ck, mut desc) = flux_like_checkpoint("mismatch");
    // A tensor the checkpoint lacks.
    let mut missing = desc.clone();
    missing.root.children[0].1.tensors[0].name = "scale_shift_tablX".into();
    let e = HostModel::from_checkpoint(sim(), Arc::new(missing), &ck, "transformer").unwrap_err();
    assert!(
        matches!(e, CheckpointError::MissingTensor { tensor, expected_by: "pipeline description", .. } if tensor == "scale_shift_tablX")
    );
    // A shape mismatch.
    let t0 = &mut desc.root.children[0].1.tensors[0];
    t0.shape = vec![8, 2];
    t0.strides = vec![2, 1];
    let e = HostModel::from_checkpoint(sim(), Arc::new(desc.clone()), &ck, "transformer").unwrap_err();
    assert!(
        matches!(&e, CheckpointError::DescriptionMismatch { tensor, reason, .. }
        if tensor == "scale_shift_table" && reason == "the checkpoint has f32 [2, 8], the description f32 [8, 2]"),
        "{e}"
    );
    // Tensors outside the component.
    let e = HostModel::from_checkpoint(sim(), Arc::new(desc), &ck, "dit").unwrap_err();
    assert!(matches!(e, CheckpointError::DescriptionMismatch { .. }));
    let _ = StorageId(0);
}

#[test]
fn a_non_persistent_buffer_is_left_to_the_caller_and_every_other_storage_comes_from_the_file() {
    use weightferry::model::Home;
    use weightferry::pipeline::{StorageDesc, TensorDesc, TensorKind};

    let (ck, mut desc) = flux_like_checkpoint("non_persistent");
    // A rotary table no checkpoint holds: 4 f32 values in a storage of its own.
    let id = StorageId(desc.storages.keys().map(|s| s.0).max().unwrap() + 1);
    desc.storages.insert(id, StorageDesc { dtype: DType::F32, numel: 4 });
    desc.root.children[0].1.tensors.push(TensorDesc {
        name: "freqs".into(),
        dtype: DType::F32,
        shape: vec![4],
        strides: vec![1],
        storage_offset: 0,
        storage: id,
        kind: TensorKind::NonPersistentBuffer,
    });
    let mut model = HostModel::from_checkpoint(sim(), Arc::new(desc.clone()), &ck, "transformer").unwrap();
    assert_eq!(model.caller_storages(), [id]);
    assert!(matches!(model.home(id), Some(Home::Loaded { .. })));
    assert_eq!(model.read_storage(id).unwrap(), vec![0; 16]);
    assert!(desc.storages.keys().filter(|s| **s != id).all(|s| matches!(model.home(*s), Some(Home::File { .. }))));
    model.write_storage(id, &[7; 16]).unwrap();
    assert_eq!(model.read_storage(id).unwrap(), vec![7; 16]);
    // The same tensor as a persistent buffer must be in the file.
    let t = desc.root.children[0].1.tensors.last_mut().unwrap();
    t.kind = TensorKind::PersistentBuffer;
    let e = HostModel::from_checkpoint(sim(), Arc::new(desc), &ck, "transformer").unwrap_err();
    assert!(matches!(&e, CheckpointError::MissingTensor { tensor, .. } if tensor.ends_with("freqs")), "{e}");
}
