//! Checkpoint views: a file that names a model's tensors otherwise (an original model's single file, fused `qkv`
//! tensors, scale and shift stored the other way round) bound to the model's description through
//! [`Checkpoint::with_views`]: a view of one row range is served from the file (a byte range of it), a view of several
//! is assembled when the model loads, a view held by the module is the caller's; each bad view is its typed error.

use std::collections::BTreeMap;
use std::sync::Arc;
use weightferry::checkpoint::{derive_pipeline, Checkpoint, CheckpointError, DeriveOptions, RowRange, View};
use weightferry::model::{Home, HostModel};
use weightferry::pipeline::PipelineDesc;
use weightferry_actors::platform::PlatformRef;
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/safetensors.rs"]
mod st;
use safetensors::Dtype as S;
use st::{t, write, T};

fn sim() -> PlatformRef {
    Arc::new(SimPlatform::new(SimConfig::default()).unwrap())
}

/// The original file: a fused `qkv` (bf16, 6 rows of 4: q, k, v two rows each), a modulation (f32, 4 rows: shift
/// then scale) and a norm stored under the model's own name.
fn original() -> BTreeMap<String, T> {
    BTreeMap::from([
        ("blk.qkv.weight".to_string(), t(S::BF16, &[6, 4], 1)),
        ("blk.mod.weight".to_string(), t(S::F32, &[4, 4], 2)),
        ("blk.norm.weight".to_string(), t(S::F32, &[4], 3)),
    ])
}

fn rows(source: &str, start: u64, end: u64) -> RowRange {
    RowRange { source: source.into(), start, end }
}

/// The model's views of the original file: q / k / v rows of `qkv`, the modulation as scale then shift, and a
/// tensor only the module holds.
fn views() -> BTreeMap<String, View> {
    BTreeMap::from([
        ("blk.to_q.weight".to_string(), View::Rows(vec![rows("blk.qkv.weight", 0, 2)])),
        ("blk.to_k.weight".to_string(), View::Rows(vec![rows("blk.qkv.weight", 2, 4)])),
        ("blk.to_v.weight".to_string(), View::Rows(vec![rows("blk.qkv.weight", 4, 6)])),
        (
            "blk.norm_out.weight".to_string(),
            View::Rows(vec![rows("blk.mod.weight", 2, 4), rows("blk.mod.weight", 0, 2)]),
        ),
        ("blk.extra.weight".to_string(), View::Module),
    ])
}

/// Bytes of rows `start..end` of `t`.
fn row_bytes(t: &T, start: usize, end: usize) -> Vec<u8> {
    let row = t.data.len() / t.shape[0];
    t.data[start * row..end * row].to_vec()
}

/// The model as diffusers would hold it after converting the original file: its description (derived from a file
/// in the model's names) and each tensor's bytes.
fn model(dir: &std::path::Path, orig: &BTreeMap<String, T>) -> (PipelineDesc, BTreeMap<String, Vec<u8>>) {
    let (qkv, m) = (&orig["blk.qkv.weight"], &orig["blk.mod.weight"]);
    let bf16 = |data: Vec<u8>| T { dtype: S::BF16, shape: vec![data.len() / 8, 4], data };
    let f32 = |data: Vec<u8>, shape: Vec<usize>| T { dtype: S::F32, shape, data };
    let norm_out = [row_bytes(m, 2, 4), row_bytes(m, 0, 2)].concat();
    let named = BTreeMap::from([
        ("blk.to_q.weight".to_string(), bf16(row_bytes(qkv, 0, 2))),
        ("blk.to_k.weight".to_string(), bf16(row_bytes(qkv, 2, 4))),
        ("blk.to_v.weight".to_string(), bf16(row_bytes(qkv, 4, 6))),
        ("blk.norm_out.weight".to_string(), f32(norm_out, vec![4, 4])),
        ("blk.norm.weight".to_string(), f32(orig["blk.norm.weight"].data.clone(), vec![4])),
        ("blk.extra.weight".to_string(), f32(vec![9; 8], vec![2])),
    ]);
    let path = dir.join("model-names.safetensors");
    write(&path, &named);
    let desc = derive_pipeline(&Checkpoint::open(&path).unwrap(), &DeriveOptions::default()).unwrap().desc;
    (desc, named.into_iter().map(|(k, v)| (k, v.data)).collect())
}

#[test]
fn views_serve_rows_from_the_file_assemble_pieces_and_leave_the_module_its_own() {
    let dir = st::fresh_dir("views", "bind");
    let orig = original();
    let path = dir.join("original.safetensors");
    write(&path, &orig);
    let (desc, want) = model(&dir, &orig);
    let desc = Arc::new(desc);
    // Without views the file lacks the model's names.
    let plain = Checkpoint::open(&path).unwrap();
    let e = HostModel::from_checkpoint(sim(), desc.clone(), &plain, "transformer").unwrap_err();
    assert!(matches!(&e, CheckpointError::MissingTensor { tensor, .. } if tensor == "blk.extra.weight"), "{e}");

    let ck = Checkpoint::open(&path).unwrap().with_views(views()).unwrap();
    assert!(ck.is_assembled("blk.norm_out.weight") && !ck.is_assembled("blk.to_k.weight"));
    assert!(ck.is_module_held("blk.extra.weight"));
    let model = HostModel::from_checkpoint(sim(), desc.clone(), &ck, "transformer").unwrap();
    for (path, td) in desc.root.tensors_recursive() {
        let key = path.strip_prefix("transformer.").unwrap();
        match key {
            // The caller's: zero-filled until the module's bytes are written.
            "blk.extra.weight" => {
                assert_eq!(model.caller_storages(), [td.storage]);
                assert_eq!(model.read_storage(td.storage).unwrap(), vec![0; 8]);
            }
            // Assembled at load: a buffer of its own.
            "blk.norm_out.weight" => {
                assert!(!matches!(model.home(td.storage), Some(Home::File { .. })), "{key}");
                assert_eq!(model.read_storage(td.storage).unwrap(), want[key], "{key}");
            }
            // Rows of a file tensor: served from the file.
            _ => {
                assert!(matches!(model.home(td.storage), Some(Home::File { .. })), "{key}");
                assert_eq!(model.read_storage(td.storage).unwrap(), want[key], "{key}");
            }
        }
    }
    // to_q / to_k / to_v (3 × 16 bytes) and the norm (16) come from the file.
    assert_eq!(model.file_bytes(), 64);
    model.release();
}

#[test]
fn a_view_the_file_cannot_give_is_its_typed_error() {
    let dir = st::fresh_dir("views", "bad");
    let mut orig = original();
    orig.insert("blk.scalar".into(), t(S::F32, &[], 4));
    let path = dir.join("original.safetensors");
    write(&path, &orig);
    let bad = |name: &str, view: View| {
        let e = Checkpoint::open(&path).unwrap().with_views(BTreeMap::from([(name.to_string(), view)])).unwrap_err();
        match e {
            CheckpointError::BadView { tensor, reason, .. } => {
                assert_eq!(tensor, name);
                reason
            }
            other => panic!("{other}"),
        }
    };
    assert_eq!(
        bad("blk.norm.weight", View::Module),
        "the file holds a tensor of this name; a view names only tensors it lacks"
    );
    assert_eq!(
        bad("blk.to_q.weight", View::Rows(vec![rows("blk.qkv", 0, 2)])),
        "its rows come from `blk.qkv`, which the file does not hold"
    );
    assert_eq!(
        bad("blk.to_q.weight", View::Rows(vec![rows("blk.qkv.weight", 4, 7)])),
        "it takes rows 4..7 of `blk.qkv.weight`, which has 6 (shape [6, 4])"
    );
    assert_eq!(
        bad("blk.to_q.weight", View::Rows(vec![rows("blk.qkv.weight", 2, 2)])),
        "it takes rows 2..2 of `blk.qkv.weight`, which has 6 (shape [6, 4])"
    );
    assert_eq!(
        bad("blk.s", View::Rows(vec![rows("blk.scalar", 0, 1)])),
        "its rows come from `blk.scalar`, a tensor of no dimension (no rows to take)"
    );
    assert_eq!(bad("blk.none", View::Rows(vec![])), "its view names no rows");
    assert_eq!(
        bad("blk.mixed", View::Rows(vec![rows("blk.qkv.weight", 0, 2), rows("blk.mod.weight", 0, 2)])),
        "its rows come from `blk.qkv.weight` (bf16 [2, 4]) and `blk.mod.weight` (f32 [2, 4]), which differ in dtype \
         or in their shape past dim 0"
    );
    let e =
        Checkpoint::open(&path).unwrap().with_views(BTreeMap::from([("x".into(), View::Rows(vec![]))])).unwrap_err();
    assert!(e
        .to_string()
        .ends_with("the file does not match the model's conversion (check that it is this model's file)"));
}
