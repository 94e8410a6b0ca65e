//! The pipeline description: a module tree addressed by dotted paths whose leaves are tensors, plus the pipeline's
//! component declarations and offload plan.
//!
//! This is metadata only: shapes, dtypes, strides and storage identity, never weight values. Tied or aliased tensors
//! share one [`StorageId`], so everything downstream (masters, placement, accounting) treats them as one storage.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (e4m3).
    F8e4m3,
    /// 8-bit float (e5m2).
    F8e5m2,
    /// 8-bit signed integer (e.g. int8 quantised weights).
    I8,
    /// 64-bit integer (e.g. position ids).
    I64,
    /// 32-bit integer.
    I32,
    /// Unsigned bytes (e.g. packed quantised weights).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::F8e4m3 | DType::F8e5m2 | DType::I8 | DType::U8 => 1,
            DType::I64 => 8,
        }
    }
    /// Canonical lowercase name, as in the JSON format.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8e4m3 => "f8e4m3",
            DType::F8e5m2 => "f8e5m2",
            DType::I8 => "i8",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U8 => "u8",
        }
    }
}

/// What role a tensor plays in its module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A learned parameter.
    Parameter,
    /// A buffer saved in checkpoints.
    PersistentBuffer,
    /// A buffer rebuilt at load time, never in a checkpoint.
    NonPersistentBuffer,
}

/// Identity of an underlying storage. Two tensors with the same id alias the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StorageId(pub u64);

/// One storage: a flat run of `numel` elements of `dtype`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StorageDesc {
    /// Element type of the storage.
    pub dtype: DType,
    /// Elements in the storage.
    pub numel: u64,
}

impl StorageDesc {
    /// Size in bytes.
    pub fn byte_size(&self) -> u64 {
        self.numel.saturating_mul(self.dtype.size_bytes())
    }
}

/// A tensor: a strided view into a storage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// Attribute name inside its module (`weight`, `bias`, …).
    pub name: String,
    /// Element type (equals its storage's).
    pub dtype: DType,
    /// Extent of each dimension.
    pub shape: Vec<u64>,
    /// Stride of each dimension in elements.
    pub strides: Vec<u64>,
    /// Offset into the storage in elements.
    pub storage_offset: u64,
    /// Which storage it views.
    pub storage: StorageId,
    /// Parameter or buffer.
    pub kind: TensorKind,
}

impl TensorDesc {
    /// Logical element count (product of the shape).
    pub fn numel(&self) -> u64 {
        self.shape.iter().fold(1u64, |acc, &s| acc.saturating_mul(s))
    }
    /// Elements spanned in the storage: `1 + Σ (size−1)·stride`, or 0 for an empty tensor.
    pub fn physical_numel(&self) -> u64 {
        if self.shape.contains(&0) {
            return 0;
        }
        // Saturating: an absurd description must not overflow (validation rejects it with a message).
        self.shape.iter().zip(&self.strides).fold(1u64, |acc, (&s, &st)| acc.saturating_add((s - 1).saturating_mul(st)))
    }
    /// Logical byte size (`numel · element size`).
    pub fn byte_size(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size_bytes())
    }
    /// Row-major contiguous strides for `shape`.
    pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1u64;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(shape[i].max(1));
        }
        strides
    }
}

/// A module: named tensors and ordered child modules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleNode {
    /// Class name (`FluxTransformer2DModel`, `ModuleList`, …). Per-class declarations key on it.
    pub class: String,
    /// Tensors owned directly by this module, in declaration order.
    #[serde(default)]
    pub tensors: Vec<TensorDesc>,
    /// Children in declaration (= execution) order, by attribute name. A block list is a child of class
    /// `ModuleList` whose children are named `0`, `1`, ….
    #[serde(default)]
    pub children: Vec<(String, ModuleNode)>,
    /// The module implements the pipeline-managed lifecycle `load_to_device()` / `offload_to_cpu()`.
    #[serde(default)]
    pub has_lifecycle: bool,
    /// `false` for an unloaded stub (a rank that does not hold this component).
    #[serde(default = "yes")]
    pub is_loaded: bool,
}

fn yes() -> bool {
    true
}

impl ModuleNode {
    /// An empty module of `class`.
    pub fn new(class: impl Into<String>) -> Self {
        ModuleNode {
            class: class.into(),
            tensors: Vec::new(),
            children: Vec::new(),
            has_lifecycle: false,
            is_loaded: true,
        }
    }
    /// Direct child by attribute name. A block list's children are named by their position, so a numeric name is
    /// looked up there first: constant time for the lists of tens of thousands of blocks the format allows.
    pub fn child(&self, name: &str) -> Option<&ModuleNode> {
        if let Some((n, m)) = name.parse::<usize>().ok().and_then(|i| self.children.get(i)) {
            if n == name {
                return Some(m);
            }
        }
        self.children.iter().find(|(n, _)| n == name).map(|(_, m)| m)
    }
    /// Descendant by dotted path relative to this module (`""` is the module itself).
    pub fn get(&self, path: &str) -> Option<&ModuleNode> {
        if path.is_empty() {
            return Some(self);
        }
        let mut cur = self;
        for part in path.split('.') {
            cur = cur.child(part)?;
        }
        Some(cur)
    }
    /// Whether this is a list of blocks (a `ModuleList`/`Sequential` whose children are named 0..n).
    pub fn is_block_list(&self) -> bool {
        (self.class == "ModuleList" || self.class == "Sequential")
            && self.children.iter().enumerate().all(|(i, (n, _))| *n == i.to_string())
    }
    /// Every tensor in this subtree with its dotted path relative to this module, depth-first in declaration order.
    pub fn tensors_recursive(&self) -> Vec<(String, &TensorDesc)> {
        let mut out = Vec::new();
        self.walk_tensors("", &mut out);
        out
    }
    fn walk_tensors<'a>(&'a self, prefix: &str, out: &mut Vec<(String, &'a TensorDesc)>) {
        for t in &self.tensors {
            out.push((join(prefix, &t.name), t));
        }
        for (n, c) in &self.children {
            c.walk_tensors(&join(prefix, n), out);
        }
    }
}

/// Alignment of every storage in device memory and host masters: each storage starts at a multiple of this, so a
/// set of storages packed for the device takes `Σ align_up(bytes)`.
pub const DEVICE_ALIGN: u64 = 256;

/// Rounds `x` up to a multiple of [`DEVICE_ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(DEVICE_ALIGN).saturating_mul(DEVICE_ALIGN)
}

/// Joins dotted path segments, skipping an empty prefix.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else if name.is_empty() {
        prefix.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Components the pipeline declares (the `SupportsComponentDiscovery` protocol). Dotted paths from the root.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentDecls {
    /// Diffusion transformers.
    #[serde(default)]
    pub dit: Vec<String>,
    /// Encoders (text, image).
    #[serde(default)]
    pub encoders: Vec<String>,
    /// VAEs.
    #[serde(default)]
    pub vaes: Vec<String>,
    /// Modules that always stay on the device.
    #[serde(default)]
    pub resident: Vec<String>,
    /// Auxiliary modules.
    #[serde(default)]
    pub auxiliary: Vec<String>,
}

/// The pipeline's offload plan (`OffloadPlan`). Paths are dotted, from the root (children of a DiT are relative to
/// that DiT where noted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadPlanDecl {
    /// DiT path → its ordered block-list paths (relative to the DiT), concatenated into one stack in this order.
    #[serde(default)]
    pub block_attrs: BTreeMap<String, Vec<String>>,
    /// Encoder path → its streamable block-list paths (relative to the encoder); one stack per path.
    #[serde(default)]
    pub encoder_block_attrs: BTreeMap<String, Vec<String>>,
    /// Components whose residency the pipeline manages through `load_to_device` / `offload_to_cpu`.
    #[serde(default)]
    pub on_demand_component_paths: Vec<String>,
    /// DiTs that may keep resident leading layers.
    #[serde(default)]
    pub resident_dit_paths: Vec<String>,
    /// Encoders whose loaded weights are replicated across ranks (safe for AllGather).
    #[serde(default)]
    pub encoder_dlo_weight_replication: Vec<String>,
    /// DiT path → {direct child name → block attribute inside that child} for nested submodules to stage or stream.
    #[serde(default)]
    pub offload_submodules: BTreeMap<String, BTreeMap<String, String>>,
    /// Encoder path → declared component type (only `text_encoder` is valid).
    #[serde(default)]
    pub encoder_component_types: BTreeMap<String, String>,
    /// Encoder block lists (full dotted paths, each also declared in `encoder_block_attrs`) whose leading blocks
    /// stay on the device under `layer_options.text_encoder.resident_layers`.
    #[serde(default)]
    pub resident_encoder_block_paths: Vec<String>,
    /// Deprecated (vLLM-Omni's ordinary-layerwise resident head): DiT path → leading blocks kept on the device.
    /// Used only when the config sets no resident layers and no device budget; `resident_layers` replaces it.
    #[serde(default)]
    pub layerwise_resident_layers: BTreeMap<String, u32>,
}

/// A whole pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineDesc {
    /// Pipeline class name; the deprecated attribute scan warns once per class.
    pub class: String,
    /// The root module; components are its descendants.
    pub root: ModuleNode,
    /// Every storage referenced by a tensor.
    pub storages: BTreeMap<StorageId, StorageDesc>,
    /// Declared components, or `None` for the deprecated fallback attribute scan.
    #[serde(default)]
    pub components: Option<ComponentDecls>,
    /// The pipeline's offload plan, if it has one.
    #[serde(default)]
    pub offload_plan: Option<OffloadPlanDecl>,
    /// Per-class block attribute declarations (`_layerwise_offload_blocks_attrs`): DiT class → block-list attributes.
    #[serde(default)]
    pub class_block_attrs: BTreeMap<String, Vec<String>>,
    /// Deprecated singular per-class declaration (`_layerwise_offload_blocks_attr`); warns when used.
    #[serde(default)]
    pub class_block_attr_singular: BTreeMap<String, String>,
    /// Modules whose tensors stay on the device for the whole run, whatever unit contains them (an adapter's
    /// weights inside a streamed block: small, and added or deleted independently of the block's weights).
    #[serde(default)]
    pub pinned: Vec<String>,
}

impl PipelineDesc {
    /// The module at a dotted path from the root.
    pub fn module(&self, path: &str) -> Option<&ModuleNode> {
        self.root.get(path)
    }
    /// Bytes of the distinct storages referenced anywhere under `path` (aliases counted once).
    pub fn subtree_bytes(&self, path: &str) -> u64 {
        self.subtree_storages(path).iter().map(|s| self.storages.get(s).map_or(0, StorageDesc::byte_size)).sum()
    }
    /// Device bytes the distinct storages under `path` take when packed (each aligned to [`DEVICE_ALIGN`]).
    pub fn subtree_device_bytes(&self, path: &str) -> u64 {
        self.subtree_storages(path).iter().map(|s| self.storage_device_bytes(*s)).sum()
    }
    /// Device bytes one storage takes when packed.
    pub fn storage_device_bytes(&self, s: StorageId) -> u64 {
        self.storages.get(&s).map_or(0, |d| align_up(d.byte_size()))
    }
    /// Distinct storages referenced under `path`, in first-use order.
    pub fn subtree_storages(&self, path: &str) -> Vec<StorageId> {
        let Some(m) = self.module(path) else { return Vec::new() };
        let mut seen = std::collections::BTreeSet::new();
        m.tensors_recursive().into_iter().filter(|(_, t)| seen.insert(t.storage)).map(|(_, t)| t.storage).collect()
    }

    /// The storages under the [`pinned`](Self::pinned) modules: the fixed placement keeps them whatever unit holds
    /// them.
    pub fn pinned_storages(&self) -> std::collections::BTreeSet<StorageId> {
        self.pinned.iter().flat_map(|path| self.subtree_storages(path)).collect()
    }

    /// The tensor at a dotted path from the root (`transformer.blocks.0.attn.qkv.weight`).
    pub fn tensor(&self, path: &str) -> Option<&TensorDesc> {
        let (module, name) = match path.rsplit_once('.') {
            Some((m, n)) => (m, n),
            None => ("", path),
        };
        self.module(module)?.tensors.iter().find(|t| t.name == name)
    }

    /// Renumbers the storages in canonical order (depth first, a module's tensors before its children, by first
    /// appearance, from 0), the order the builder and the JSON loader produce. Storages no tensor views keep their
    /// relative order after the viewed ones.
    pub fn canonicalize_storage_ids(&mut self) {
        let mut map: BTreeMap<StorageId, StorageId> = BTreeMap::new();
        let mut next = 0u64;
        let mut stack = vec![&self.root];
        while let Some(m) = stack.pop() {
            for t in &m.tensors {
                map.entry(t.storage).or_insert_with(|| {
                    next += 1;
                    StorageId(next - 1)
                });
            }
            for (_, c) in m.children.iter().rev() {
                stack.push(c);
            }
        }
        for id in self.storages.keys() {
            map.entry(*id).or_insert_with(|| {
                next += 1;
                StorageId(next - 1)
            });
        }
        let mut stack = vec![&mut self.root];
        while let Some(m) = stack.pop() {
            for t in &mut m.tensors {
                if let Some(id) = map.get(&t.storage) {
                    t.storage = *id;
                }
            }
            for (_, c) in m.children.iter_mut() {
                stack.push(c);
            }
        }
        let old = std::mem::take(&mut self.storages);
        self.storages = old.into_iter().map(|(id, s)| (map.get(&id).copied().unwrap_or(id), s)).collect();
    }
}
