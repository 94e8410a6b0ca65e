//! A pipeline description derived from a checkpoint's tensor names, dtypes and shapes.
//!
//! - **Module tree**: a dotted name is a module path and a tensor (`transformer_blocks.3.attn.to_q.weight` →
//!   module `transformer_blocks.3.attn.to_q`, tensor `weight`), placed under one DiT component (default
//!   `transformer`). Every tensor owns one contiguous storage (safetensors cannot express aliasing), kind
//!   `parameter`. A checkpoint has no execution order: children are ordered by name, numbers numerically, and
//!   attributes named `single_*` after the others (Flux's double-stream blocks run before its single-stream ones).
//! - **Block lists**, by the key format: a direct child of the component whose children are exactly the modules
//!   `0 … N−1` (a numbered child list under a named attribute: `transformer_blocks.N.`, `single_transformer_blocks.N.`,
//!   `blocks.N.`, `layers.N.`, `block.N.`, …) is a `ModuleList` of `Block`s and is declared in the offload plan's
//!   `block_attrs`, in child order. Deeper numbered lists (`to_out.0`, `ff.net.0`) stay inside their modules.
//!   Numbered children with a gap are a plain `Module`, never streamed.
//! - **Whole pipelines** are refused ([`CheckpointError::WholePipeline`]): keys under a pipeline component
//!   (`text_encoder.`, `text_encoder_2.`, `text_encoder_3.`, `vae.`, `unet.`, `image_encoder.`), the single-file
//!   Stable Diffusion layout (`model.diffusion_model.`, `first_stage_model.`, `cond_stage_model.`, `conditioner.`),
//!   or every key under `transformer.` (a pipeline's transformer with its component prefix). Supported is one
//!   transformer's checkpoint with its own parameter names, as diffusers saves `<pipeline>/transformer/`.

use super::error::CheckpointError;
use super::Checkpoint;
use crate::pipeline::is_valid_name;
use crate::pipeline::{
    ComponentDecls, DType, ModuleNode, OffloadPlanDecl, PipelineDesc, StorageDesc, StorageId, TensorDesc, TensorKind,
};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

/// Top-level prefixes that mark a checkpoint of a whole pipeline.
pub(super) const PIPELINE_PREFIXES: &[&str] = &[
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "vae",
    "unet",
    "image_encoder",
    "first_stage_model",
    "cond_stage_model",
    "conditioner",
];

/// Pipeline class of a derived description.
pub(super) const PIPELINE_CLASS: &str = "CheckpointPipeline";
/// Class of the derived DiT component.
pub(super) const DIT_CLASS: &str = "CheckpointDiT";
/// Class of each block of a derived block list.
pub(super) const BLOCK_CLASS: &str = "Block";

/// How to derive the description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeriveOptions {
    /// Name of the DiT component under the root (default `transformer`).
    pub component: String,
}

impl Default for DeriveOptions {
    fn default() -> Self {
        DeriveOptions { component: "transformer".into() }
    }
}

/// A block list found in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockList {
    /// Attribute name (relative to the component).
    pub attr: String,
    /// Number of blocks.
    pub blocks: usize,
    /// Tensors in all its blocks.
    pub tensors: usize,
    /// Bytes of all its blocks.
    pub bytes: u64,
}

/// A derived description and what was found.
#[derive(Debug, Clone)]
pub struct Derived {
    /// The one-DiT pipeline description.
    pub desc: PipelineDesc,
    /// The DiT component's path (checkpoint tensor `K` is the description's `<component>.K`).
    pub component: String,
    /// The block lists, in `block_attrs` order.
    pub block_lists: Vec<BlockList>,
}

enum Node {
    Tensor { dtype: DType, shape: Vec<u64> },
    Module(BTreeMap<String, Node>),
}

/// Numbers numerically before other names; `single_*` after the rest.
fn child_order(a: &str, b: &str) -> Ordering {
    let key = |s: &str| (s.starts_with("single_"), s.parse::<u64>().ok().map_or(1, |_| 0), s.parse::<u64>().ok());
    key(a).cmp(&key(b)).then_with(|| a.cmp(b))
}

/// Whether `name` is a canonical decimal index (`0`, `17`, not `01`).
fn is_index(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) && (name == "0" || !name.starts_with('0'))
}

/// Derives the one-DiT description of `ckpt` (see the module doc).
pub fn derive_pipeline(ckpt: &Checkpoint, opts: &DeriveOptions) -> Result<Derived, CheckpointError> {
    let file = || ckpt.path().to_path_buf();
    let mut prefixes = BTreeSet::new();
    for (_, t) in ckpt.tensors() {
        let top = t.name.split('.').next().unwrap_or("");
        if PIPELINE_PREFIXES.contains(&top) || t.name.starts_with("model.diffusion_model.") {
            prefixes.insert(if top == "model" { "model.diffusion_model".to_string() } else { top.to_string() });
        } else if top == "transformer" {
            prefixes.insert(top.to_string());
        }
    }
    let all_under_transformer = !ckpt.is_empty() && ckpt.tensors().all(|(_, t)| t.name.starts_with("transformer."));
    if prefixes.iter().any(|p| p != "transformer") || all_under_transformer {
        return Err(CheckpointError::WholePipeline { file: file(), prefixes: prefixes.into_iter().collect() });
    }
    let mut root: BTreeMap<String, Node> = BTreeMap::new();
    for (_, t) in ckpt.tensors() {
        let bad = |reason: String| CheckpointError::BadName { file: file(), tensor: t.name.clone(), reason };
        let parts: Vec<&str> = t.name.split('.').collect();
        if let Some(p) = parts.iter().find(|p| !is_valid_name(p)) {
            return Err(bad(format!(
                "segment `{p}` is not a module or tensor name (non-empty, no spaces or control characters, joined by \
                 single dots)"
            )));
        }
        let Some((leaf, path)) = parts.split_last() else { continue };
        let mut cur = &mut root;
        for (i, p) in path.iter().enumerate() {
            let node = cur.entry(p.to_string()).or_insert_with(|| Node::Module(BTreeMap::new()));
            cur = match node {
                Node::Module(m) => m,
                Node::Tensor { .. } => {
                    return Err(bad(format!("`{}` is both a tensor and a module", parts[..=i].join("."))));
                }
            };
        }
        if cur.contains_key(*leaf) {
            return Err(bad(format!("`{}` is both a tensor and a module", t.name)));
        }
        cur.insert(leaf.to_string(), Node::Tensor { dtype: t.dtype, shape: t.shape.clone() });
    }
    let mut storages = BTreeMap::new();
    let mut dit = build(DIT_CLASS, &root, &mut storages);
    let mut block_lists = Vec::new();
    for (attr, child) in &mut dit.children {
        if child.class == "ModuleList" {
            for (_, b) in &mut child.children {
                b.class = BLOCK_CLASS.into();
            }
            let tensors = child.tensors_recursive();
            let bytes = tensors.iter().map(|(_, t)| t.byte_size()).sum();
            block_lists.push(BlockList {
                attr: attr.clone(),
                blocks: child.children.len(),
                tensors: tensors.len(),
                bytes,
            });
        }
    }
    let component = opts.component.clone();
    let mut pipeline_root = ModuleNode::new(PIPELINE_CLASS);
    pipeline_root.children.push((component.clone(), dit));
    let mut block_attrs = BTreeMap::new();
    if !block_lists.is_empty() {
        block_attrs.insert(component.clone(), block_lists.iter().map(|b| b.attr.clone()).collect());
    }
    let desc = PipelineDesc {
        class: PIPELINE_CLASS.into(),
        root: pipeline_root,
        storages,
        components: Some(ComponentDecls { dit: vec![component.clone()], ..ComponentDecls::default() }),
        offload_plan: Some(OffloadPlanDecl {
            block_attrs,
            resident_dit_paths: vec![component.clone()],
            ..OffloadPlanDecl::default()
        }),
        class_block_attrs: BTreeMap::new(),
        class_block_attr_singular: BTreeMap::new(),
        pinned: Vec::new(),
    };
    desc.validate().map_err(|source| CheckpointError::Description { file: file(), source })?;
    Ok(Derived { desc, component, block_lists })
}

/// Builds one module: its tensors, then its children (storages numbered depth first, as the builder does).
fn build(class: &str, nodes: &BTreeMap<String, Node>, storages: &mut BTreeMap<StorageId, StorageDesc>) -> ModuleNode {
    let mut m = ModuleNode::new(class);
    let mut names: Vec<&String> = nodes.keys().collect();
    names.sort_by(|a, b| child_order(a, b));
    for name in &names {
        if let Node::Tensor { dtype, shape } = &nodes[*name] {
            let id = StorageId(storages.len() as u64);
            let numel = shape.iter().product::<u64>();
            storages.insert(id, StorageDesc { dtype: *dtype, numel });
            m.tensors.push(TensorDesc {
                name: name.to_string(),
                dtype: *dtype,
                shape: shape.clone(),
                strides: TensorDesc::contiguous_strides(shape),
                storage_offset: 0,
                storage: id,
                kind: TensorKind::Parameter,
            });
        }
    }
    for name in &names {
        if let Node::Module(children) = &nodes[*name] {
            let listed = !children.is_empty()
                && children.iter().all(|(k, v)| is_index(k) && matches!(v, Node::Module(_)))
                && children.keys().filter_map(|k| k.parse::<usize>().ok()).max() == Some(children.len() - 1);
            let class = if listed { "ModuleList" } else { "Module" };
            m.children.push((name.to_string(), build(class, children, storages)));
        }
    }
    m
}
