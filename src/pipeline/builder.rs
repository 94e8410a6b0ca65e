//! Building and validating pipeline descriptions: the [`PipelineBuilder`] API, the [`PipelineError`] type shared
//! with the JSON loader, and [`PipelineDesc::validate`], the one set of structural rules every description obeys.
//!
//! # Building
//!
//! ```
//! use weightferry::plan::builder::{PipelineBuilder, TensorSpec};
//! use weightferry::plan::DType;
//!
//! let desc = PipelineBuilder::new("TinyPipeline")
//!     .module("transformer", "TinyDiT", |m| {
//!         m.linear("x_embedder", DType::Bf16, 16, 32, true);
//!         m.block_list("blocks", 2, "TinyBlock", |b, _i| {
//!             b.linear("fc", DType::Bf16, 32, 32, true);
//!         });
//!         // A transposed weight: logical [out, in] = [16, 32], stored in-major.
//!         m.tensor("proj_out.weight", TensorSpec::new(DType::Bf16, &[16, 32]).transposed());
//!         // A tied alias: shares the storage of a block weight.
//!         m.tie("proj_alias.weight", "blocks.0.fc.weight");
//!     })
//!     .dit("transformer")
//!     .build()
//!     .expect("valid");
//! assert_eq!(desc.tensor("transformer.proj_alias.weight").map(|t| t.storage),
//!            desc.tensor("transformer.blocks.0.fc.weight").map(|t| t.storage));
//! ```
//!
//! Dotted names (`"x_embedder.weight"`) create the intermediate modules on the way, with class `Module`, unless
//! they were declared before with [`ModuleBuilder::module`]. Tie targets are dotted paths relative to the module the
//! tie is declared on.
//!
//! # Storage identity
//!
//! Every tensor gets its own storage unless it is tied to another tensor or placed in a storage declared with
//! [`ModuleBuilder::storage`]. [`StorageHandle`]s are builder-local; [`PipelineBuilder::build`] assigns the final
//! [`StorageId`]s in canonical order: depth first (a module's tensors, then its children, in declaration order), in
//! order of first appearance, from 0. The JSON loader uses the same order, so a description survives a round trip
//! through JSON unchanged.
//!
//! # Validation rules
//!
//! Checked by [`PipelineBuilder::build`], by the JSON loader and by [`PipelineDesc::validate`]:
//! - class names are non-empty; attribute names are non-empty runs of ASCII letters, digits and `_`;
//! - a module never has two attributes (tensors and children together) with the same name;
//! - every tensor has one stride per dimension, its sizes fit in 64 bits, its dtype equals its storage's dtype, and
//!   its view lies inside its storage (`storage_offset + physical_numel <= storage numel`);
//! - every storage is viewed by at least one tensor;
//! - every declared path (components, offload plan, per-class block attributes) is a valid dotted path.

use crate::plan::pipeline::{
    join, ComponentDecls, DType, ModuleNode, OffloadPlanDecl, PipelineDesc, StorageDesc, StorageId, TensorDesc,
    TensorKind,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Class given to intermediate modules created implicitly by a dotted attribute name.
pub const IMPLICIT_MODULE_CLASS: &str = "Module";

/// Class of the block lists created by [`ModuleBuilder::block_list`].
pub const BLOCK_LIST_CLASS: &str = "ModuleList";

/// A pipeline description that breaks a structural rule. `at` names where: a dotted module or tensor path for the
/// builder and [`PipelineDesc::validate`], a JSON path (`modules.transformer.tensors.weight.shape`) for the loader.
/// Every message ends with the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// A declaration this version does not support; the message names the replacement.
    #[error("{at}: {message}")]
    Unsupported {
        /// Where.
        at: String,
        /// Why, and what to declare instead.
        message: &'static str,
    },
    /// The text is not JSON.
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Syntax {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's description.
        message: String,
    },
    /// A pipeline file could not be read.
    #[error("cannot read pipeline file `{path}`: {message}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's description.
        message: String,
    },
    /// A JSON value of the wrong type.
    #[error("{at}: expected {expected}")]
    WrongType {
        /// JSON path of the value.
        at: String,
        /// What was expected there.
        expected: &'static str,
    },
    /// A required key is absent.
    #[error("{at}: required key is missing; {hint}")]
    MissingKey {
        /// JSON path where the key belongs.
        at: String,
        /// How to write it.
        hint: &'static str,
    },
    /// A key the format does not define (usually a typo).
    #[error("{at}: unknown key; expected one of: {expected}")]
    UnknownKey {
        /// JSON path of the unknown key.
        at: String,
        /// The keys allowed in that object.
        expected: &'static str,
    },
    /// A key written twice in one JSON object.
    #[error("{at}: key appears more than once in the same object; keep one")]
    DuplicateKey {
        /// JSON path of the repeated key.
        at: String,
    },
    /// Two attributes of one module share a name.
    #[error("{at}: name declared twice in the same module (tensors and child modules share one namespace); rename or remove one")]
    DuplicateName {
        /// Path of the second declaration.
        at: String,
    },
    /// An attribute name that is not a single identifier-like segment.
    #[error("{at}: `{name}` is not a valid attribute name; use a non-empty name of ASCII letters, digits and `_`")]
    InvalidName {
        /// Where the name was given.
        at: String,
        /// The rejected name.
        name: String,
    },
    /// A declared path that is not a dotted path.
    #[error("{at}: `{path}` is not a valid dotted path; join non-empty names of ASCII letters, digits and `_` with single dots, e.g. `transformer.blocks`")]
    InvalidPath {
        /// Where the path was declared.
        at: String,
        /// The rejected path.
        path: String,
    },
    /// A module or pipeline without a class name.
    #[error("{at}: class name is empty; give the class, e.g. `ModuleList`")]
    EmptyClass {
        /// The module (or `class` for the pipeline).
        at: String,
    },
    /// A dtype name the format does not know.
    #[error("{at}: unknown dtype `{found}`; use one of f32, f16, bf16, f8e4m3, i64, i32, u8")]
    UnknownDType {
        /// Where it was given.
        at: String,
        /// The rejected name.
        found: String,
    },
    /// A tensor kind the format does not know.
    #[error("{at}: unknown tensor kind `{found}`; use parameter, persistent_buffer or non_persistent_buffer")]
    UnknownKind {
        /// Where it was given.
        at: String,
        /// The rejected name.
        found: String,
    },
    /// Strides and shape of different lengths.
    #[error("{at}: shape has {shape_len} dimensions but strides has {strides_len}; give exactly one stride per dimension, or omit strides for a contiguous tensor")]
    StrideRank {
        /// The tensor.
        at: String,
        /// Dimensions in the shape.
        shape_len: usize,
        /// Entries in the strides.
        strides_len: usize,
    },
    /// A size computation that does not fit in 64 bits.
    #[error("{at}: {what} overflows 64 bits; use realistic sizes")]
    Overflow {
        /// The tensor, storage or section.
        at: String,
        /// The quantity that overflowed.
        what: &'static str,
    },
    /// A view reaching past the end of its storage.
    #[error("{at}: the view needs {needed} elements of its storage (storage_offset + span) but the storage holds {numel}; shrink the view or enlarge the storage")]
    ViewOutsideStorage {
        /// The tensor.
        at: String,
        /// `storage_offset + physical_numel`.
        needed: u64,
        /// Elements in the storage.
        numel: u64,
    },
    /// A tensor whose dtype differs from its storage's.
    #[error("{at}: tensor dtype {} differs from its storage's dtype {}; a view must have its storage's dtype", .tensor.name(), .storage.name())]
    DTypeMismatch {
        /// The tensor.
        at: String,
        /// The tensor's dtype.
        tensor: DType,
        /// The storage's dtype.
        storage: DType,
    },
    /// A tie whose target is not a tensor of the pipeline.
    #[error("{at}: `{target}` is not a tensor of this pipeline; name an existing tensor by its dotted path (from the root in JSON, from the declaring module in the builder)")]
    UnknownTensor {
        /// The tie.
        at: String,
        /// The missing target, as an absolute dotted path.
        target: String,
    },
    /// Ties that lead back to where they started.
    #[error("{at}: ties form a cycle through `{target}`; one tensor of the chain must own its storage")]
    TieCycle {
        /// The tensor whose tie chain loops.
        at: String,
        /// A tensor on the loop.
        target: String,
    },
    /// A tensor naming an undeclared storage.
    #[error("{at}: storage `{name}` is not declared; declare it in the top-level `storages` object")]
    UnknownStorage {
        /// The reference.
        at: String,
        /// The missing name.
        name: String,
    },
    /// A tensor referencing a [`StorageId`] missing from the storage table.
    #[error(
        "{at}: storage {id} is not in the pipeline's storage table; add it or point the tensor at an existing storage"
    )]
    MissingStorage {
        /// The tensor.
        at: String,
        /// The missing id.
        id: u64,
    },
    /// A storage that no tensor views.
    #[error("{at}: storage is declared but no tensor views it; remove it or view it from a tensor")]
    UnusedStorage {
        /// The storage.
        at: String,
    },
    /// A tensor given both `tied_to` and `storage`.
    #[error("{at}: `tied_to` and `storage` cannot both be given; a tensor views exactly one storage")]
    ConflictingStorage {
        /// The tensor.
        at: String,
    },
    /// A `repeat` count outside `1..=MAX_REPEAT`.
    #[error("{at}: repeat count {count} is out of range; use 1 to {max}")]
    RepeatCount {
        /// The `repeat` key.
        at: String,
        /// The rejected count.
        count: u64,
        /// The largest allowed count.
        max: u64,
    },
    /// An explicit block of a `repeat` list that is not numbered in order.
    #[error("{at}: the explicit blocks of a repeat must be named 0, 1, … in order; expected `{expected}` here")]
    BlockIndex {
        /// The misnamed block.
        at: String,
        /// The name it should have.
        expected: u64,
    },
    /// A description that expands past the size limit.
    #[error("{at}: the pipeline expands to more than {limit} modules and tensors; use fewer or smaller repeats")]
    TooLarge {
        /// Where the limit was crossed.
        at: String,
        /// The limit.
        limit: u64,
    },
    /// An unsupported `format` string.
    #[error("{at}: unsupported format `{found}`; this version reads `{expected}`")]
    Format {
        /// The `format` key.
        at: String,
        /// The rejected value.
        found: String,
        /// The supported value.
        expected: &'static str,
    },
    /// A [`StorageHandle`] that this builder did not hand out.
    #[error("{at}: the storage handle does not belong to this builder; use a handle returned by the same builder")]
    ForeignHandle {
        /// The tensor.
        at: String,
    },
}

/// Whether `name` is a valid attribute name: non-empty ASCII letters, digits and `_`.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Whether `path` is a valid dotted path: one or more valid names joined by single dots.
pub fn is_valid_path(path: &str) -> bool {
    !path.is_empty() && path.split('.').all(is_valid_name)
}

/// Checked element count of `shape` (product of the extents).
pub(crate) fn checked_numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &s| acc.checked_mul(s))
}

/// Checked span of a view in its storage: `1 + Σ (size−1)·stride`, 0 for an empty tensor. `shape` and `strides`
/// must have equal lengths.
pub(crate) fn checked_span(shape: &[u64], strides: &[u64]) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().zip(strides).try_fold(1u64, |acc, (&s, &st)| (s - 1).checked_mul(st).and_then(|d| acc.checked_add(d)))
}

/// Checks the per-view rules that need no storage: stride count and 64-bit sizes. Returns the storage elements the
/// view needs (`storage_offset + span`).
pub(crate) fn check_view(
    at: &str,
    dtype: DType,
    shape: &[u64],
    strides: &[u64],
    storage_offset: u64,
) -> Result<u64, PipelineError> {
    if shape.len() != strides.len() {
        return Err(PipelineError::StrideRank {
            at: at.to_string(),
            shape_len: shape.len(),
            strides_len: strides.len(),
        });
    }
    let overflow = |what| PipelineError::Overflow { at: at.to_string(), what };
    let numel = checked_numel(shape).ok_or_else(|| overflow("the element count"))?;
    numel.checked_mul(dtype.size_bytes()).ok_or_else(|| overflow("the byte size"))?;
    let span = checked_span(shape, strides).ok_or_else(|| overflow("the storage span"))?;
    storage_offset.checked_add(span).ok_or_else(|| overflow("storage_offset + span"))
}

/// Checks the storage-dependent rules of one view: dtype equality and fit.
pub(crate) fn check_fit(at: &str, dtype: DType, needed: u64, storage: &StorageDesc) -> Result<(), PipelineError> {
    if dtype != storage.dtype {
        return Err(PipelineError::DTypeMismatch { at: at.to_string(), tensor: dtype, storage: storage.dtype });
    }
    if needed > storage.numel {
        return Err(PipelineError::ViewOutsideStorage { at: at.to_string(), needed, numel: storage.numel });
    }
    Ok(())
}

fn check_path_at(at: String, path: &str) -> Result<(), PipelineError> {
    if is_valid_path(path) {
        Ok(())
    } else {
        Err(PipelineError::InvalidPath { at, path: path.to_string() })
    }
}

fn check_path_list(at: &str, paths: &[String]) -> Result<(), PipelineError> {
    for (i, p) in paths.iter().enumerate() {
        check_path_at(format!("{at}[{i}]"), p)?;
    }
    Ok(())
}

fn check_path_map(at: &str, map: &BTreeMap<String, Vec<String>>) -> Result<(), PipelineError> {
    for (key, paths) in map {
        check_path_at(at.to_string(), key)?;
        check_path_list(&format!("{at}.{key}"), paths)?;
    }
    Ok(())
}

/// Checks that every declared path is a valid dotted path. Error locations use the JSON notation
/// (`components.dit[0]`, `offload_plan.block_attrs.transformer[1]`).
pub(crate) fn check_declarations(
    components: Option<&ComponentDecls>,
    plan: Option<&OffloadPlanDecl>,
    class_block_attrs: &BTreeMap<String, Vec<String>>,
    class_block_attr_singular: &BTreeMap<String, String>,
) -> Result<(), PipelineError> {
    if let Some(c) = components {
        check_path_list("components.dit", &c.dit)?;
        check_path_list("components.encoders", &c.encoders)?;
        check_path_list("components.vaes", &c.vaes)?;
        check_path_list("components.resident", &c.resident)?;
        check_path_list("components.auxiliary", &c.auxiliary)?;
    }
    if let Some(p) = plan {
        check_path_map("offload_plan.block_attrs", &p.block_attrs)?;
        check_path_map("offload_plan.encoder_block_attrs", &p.encoder_block_attrs)?;
        check_path_list("offload_plan.on_demand_component_paths", &p.on_demand_component_paths)?;
        check_path_list("offload_plan.resident_dit_paths", &p.resident_dit_paths)?;
        check_path_list("offload_plan.encoder_dlo_weight_replication", &p.encoder_dlo_weight_replication)?;
        for (dit, subs) in &p.offload_submodules {
            check_path_at("offload_plan.offload_submodules".to_string(), dit)?;
            let at = format!("offload_plan.offload_submodules.{dit}");
            for (child, attr) in subs {
                if !is_valid_name(child) {
                    return Err(PipelineError::InvalidName { at, name: child.clone() });
                }
                check_path_at(format!("{at}.{child}"), attr)?;
            }
        }
        for key in p.encoder_component_types.keys() {
            check_path_at("offload_plan.encoder_component_types".to_string(), key)?;
        }
        check_path_list("offload_plan.resident_encoder_block_paths", &p.resident_encoder_block_paths)?;
        for key in p.layerwise_resident_layers.keys() {
            check_path_at("offload_plan.layerwise_resident_layers".to_string(), key)?;
        }
    }
    for (class, attrs) in class_block_attrs {
        if class.is_empty() {
            return Err(PipelineError::EmptyClass { at: "class_block_attrs".to_string() });
        }
        check_path_list(&format!("class_block_attrs.{class}"), attrs)?;
    }
    for (class, attr) in class_block_attr_singular {
        if class.is_empty() {
            return Err(PipelineError::EmptyClass { at: "class_block_attr".to_string() });
        }
        check_path_at(format!("class_block_attr.{class}"), attr)?;
    }
    Ok(())
}

fn module_at(path: &str) -> String {
    if path.is_empty() {
        "<root>".to_string()
    } else {
        path.to_string()
    }
}

impl PipelineDesc {
    /// Checks every structural rule (see the [module docs](self)). Locations are dotted module/tensor paths, or
    /// `storage N` for a storage, or JSON-style paths for declarations.
    pub fn validate(&self) -> Result<(), PipelineError> {
        if self.class.is_empty() {
            return Err(PipelineError::EmptyClass { at: "class".to_string() });
        }
        let mut total = 0u64;
        for (id, s) in &self.storages {
            let at = format!("storage {}", id.0);
            let bytes = s
                .numel
                .checked_mul(s.dtype.size_bytes())
                .ok_or(PipelineError::Overflow { at: at.clone(), what: "the byte size" })?;
            total = total
                .checked_add(bytes)
                .ok_or(PipelineError::Overflow { at, what: "the total byte size of all storages" })?;
        }
        let mut used = BTreeSet::new();
        let mut stack = vec![(String::new(), &self.root)];
        while let Some((path, m)) = stack.pop() {
            self.validate_module(&path, m, &mut used)?;
            for (name, c) in m.children.iter().rev() {
                stack.push((join(&path, name), c));
            }
        }
        if let Some(id) = self.storages.keys().find(|id| !used.contains(*id)) {
            return Err(PipelineError::UnusedStorage { at: format!("storage {}", id.0) });
        }
        check_declarations(
            self.components.as_ref(),
            self.offload_plan.as_ref(),
            &self.class_block_attrs,
            &self.class_block_attr_singular,
        )
    }

    fn validate_module(&self, path: &str, m: &ModuleNode, used: &mut BTreeSet<StorageId>) -> Result<(), PipelineError> {
        if m.class.is_empty() {
            return Err(PipelineError::EmptyClass { at: module_at(path) });
        }
        let mut names = BTreeSet::new();
        let attr_names = m.tensors.iter().map(|t| t.name.as_str()).chain(m.children.iter().map(|(n, _)| n.as_str()));
        for name in attr_names {
            if !is_valid_name(name) {
                return Err(PipelineError::InvalidName { at: module_at(path), name: name.to_string() });
            }
            if !names.insert(name) {
                return Err(PipelineError::DuplicateName { at: join(path, name) });
            }
        }
        for t in &m.tensors {
            let at = join(path, &t.name);
            let needed = check_view(&at, t.dtype, &t.shape, &t.strides, t.storage_offset)?;
            let storage = self
                .storages
                .get(&t.storage)
                .ok_or(PipelineError::MissingStorage { at: at.clone(), id: t.storage.0 })?;
            check_fit(&at, t.dtype, needed, storage)?;
            used.insert(t.storage);
        }
        Ok(())
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

/// A builder-local reference to a storage, returned when a tensor or storage is declared; pass it to
/// [`TensorSpec::in_storage`] to make another tensor view the same bytes. The final [`StorageId`]s are assigned
/// by [`PipelineBuilder::build`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StorageHandle {
    builder: u64,
    slot: usize,
}

/// Which storage a [`TensorSpec`] views.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// A storage of its own, sized `storage_offset + span`.
    Fresh,
    /// A storage handed out by the same builder.
    Handle(StorageHandle),
    /// The storage of another tensor (dotted path relative to the declaring module).
    TiedTo(String),
}

/// A tensor to declare: dtype, shape and optionally strides, storage offset, kind and storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    dtype: DType,
    shape: Vec<u64>,
    strides: Option<Vec<u64>>,
    storage_offset: u64,
    kind: TensorKind,
    source: Source,
}

impl TensorSpec {
    /// A contiguous parameter of `dtype` and `shape` in a storage of its own.
    pub fn new(dtype: DType, shape: &[u64]) -> Self {
        TensorSpec {
            dtype,
            shape: shape.to_vec(),
            strides: None,
            storage_offset: 0,
            kind: TensorKind::Parameter,
            source: Source::Fresh,
        }
    }
    /// Explicit strides in elements, one per dimension.
    pub fn strides(mut self, strides: &[u64]) -> Self {
        self.strides = Some(strides.to_vec());
        self
    }
    /// Column-major strides: the first dimension varies fastest (for a matrix `[out, in]`, strides `[1, out]`, the
    /// layout of a transposed `[in, out]` tensor).
    pub fn transposed(mut self) -> Self {
        let mut rev = self.shape.clone();
        rev.reverse();
        let mut strides = TensorDesc::contiguous_strides(&rev);
        strides.reverse();
        self.strides = Some(strides);
        self
    }
    /// Offset of the first element in the storage, in elements.
    pub fn offset(mut self, storage_offset: u64) -> Self {
        self.storage_offset = storage_offset;
        self
    }
    /// Parameter or buffer (default: parameter).
    pub fn kind(mut self, kind: TensorKind) -> Self {
        self.kind = kind;
        self
    }
    /// View the storage behind `handle` instead of a new one.
    pub fn in_storage(mut self, handle: StorageHandle) -> Self {
        self.source = Source::Handle(handle);
        self
    }
    /// View the storage of the tensor at `target`, a dotted path relative to the declaring module.
    pub fn tied_to(mut self, target: &str) -> Self {
        self.source = Source::TiedTo(target.to_string());
        self
    }
}

/// How a declared tensor's view is known.
#[derive(Debug, Clone)]
enum View {
    /// Given explicitly.
    Spec { dtype: DType, shape: Vec<u64>, strides: Option<Vec<u64>>, storage_offset: u64, kind: TensorKind },
    /// Copied from the tie target (a full alias).
    Alias,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    view: View,
    slot: usize,
}

#[derive(Debug, Clone)]
enum Slot {
    /// Owned by one tensor, sized by its view.
    Fresh { tensor: usize },
    /// Declared with an explicit dtype and size.
    Declared { dtype: DType, numel: u64, at: String },
    /// The storage of the tensor at an absolute path.
    Alias { target: String },
    /// A placeholder after an error (build fails anyway).
    Dead,
}

#[derive(Debug, Clone)]
struct PendingModule {
    class: String,
    explicit: bool,
    tensors: Vec<usize>,
    children: Vec<(String, PendingModule)>,
    has_lifecycle: bool,
    is_loaded: bool,
}

impl PendingModule {
    fn new(class: &str, explicit: bool) -> Self {
        PendingModule {
            class: class.to_string(),
            explicit,
            tensors: Vec::new(),
            children: Vec::new(),
            has_lifecycle: false,
            is_loaded: true,
        }
    }
}

#[derive(Debug)]
struct State {
    id: u64,
    tensors: Vec<PendingTensor>,
    slots: Vec<Slot>,
    error: Option<PipelineError>,
}

impl State {
    fn fail(&mut self, e: PipelineError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }
    fn new_slot(&mut self, slot: Slot) -> StorageHandle {
        self.slots.push(slot);
        StorageHandle { builder: self.id, slot: self.slots.len() - 1 }
    }
}

fn next_builder_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Splits a dotted attribute name into its segments, checking each.
fn segments<'n>(state: &mut State, base: &str, name: &'n str) -> Option<Vec<&'n str>> {
    if !is_valid_path(name) {
        state.fail(PipelineError::InvalidName { at: module_at(base), name: name.to_string() });
        return None;
    }
    Some(name.split('.').collect())
}

/// Walks (creating implicit modules) to the parent of the last segment. Returns the parent and its path.
fn walk<'m>(
    state: &mut State,
    tensors: &[PendingTensor],
    node: &'m mut PendingModule,
    base: &str,
    parents: &[&str],
) -> Option<(&'m mut PendingModule, String)> {
    let mut cur = node;
    let mut path = base.to_string();
    for seg in parents {
        let next = join(&path, seg);
        if cur.tensors.iter().any(|&t| tensors[t].name == *seg) {
            state.fail(PipelineError::DuplicateName { at: next });
            return None;
        }
        let idx = match cur.children.iter().position(|(n, _)| n == seg) {
            Some(i) => i,
            None => {
                cur.children.push((seg.to_string(), PendingModule::new(IMPLICIT_MODULE_CLASS, false)));
                cur.children.len() - 1
            }
        };
        cur = &mut cur.children[idx].1;
        path = next;
    }
    Some((cur, path))
}

/// Declares modules, tensors and storages inside one module. Errors are recorded and reported by
/// [`PipelineBuilder::build`]; every method accepts any input without panicking.
#[derive(Debug)]
pub struct ModuleBuilder<'a> {
    state: &'a mut State,
    node: &'a mut PendingModule,
    path: String,
}

impl ModuleBuilder<'_> {
    /// Dotted path of this module from the root (`""` for the root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Declares a contiguous parameter in a storage of its own.
    pub fn param(&mut self, name: &str, dtype: DType, shape: &[u64]) -> StorageHandle {
        self.tensor(name, TensorSpec::new(dtype, shape))
    }

    /// Declares a contiguous buffer in a storage of its own; `persistent` buffers are saved in checkpoints.
    pub fn buffer(&mut self, name: &str, dtype: DType, shape: &[u64], persistent: bool) -> StorageHandle {
        let kind = if persistent { TensorKind::PersistentBuffer } else { TensorKind::NonPersistentBuffer };
        self.tensor(name, TensorSpec::new(dtype, shape).kind(kind))
    }

    /// Declares a tensor from a full spec. Returns the handle of the storage it views.
    pub fn tensor(&mut self, name: &str, spec: TensorSpec) -> StorageHandle {
        let TensorSpec { dtype, shape, strides, storage_offset, kind, source } = spec;
        let view = View::Spec { dtype, shape, strides, storage_offset, kind };
        let slot = match source {
            Source::Fresh => None,
            Source::Handle(h) => {
                if h.builder != self.state.id || h.slot >= self.state.slots.len() {
                    let at = join(&self.path, name);
                    self.state.fail(PipelineError::ForeignHandle { at });
                    return self.state.new_slot(Slot::Dead);
                }
                Some(h.slot)
            }
            Source::TiedTo(target) => Some(self.alias_slot(name, &target)),
        };
        self.push_tensor(name, view, slot)
    }

    /// Declares `name` as a full alias of the tensor at `target` (a dotted path relative to this module): same
    /// dtype, shape, strides, offset, kind and storage.
    pub fn tie(&mut self, name: &str, target: &str) -> StorageHandle {
        let slot = self.alias_slot(name, target);
        self.push_tensor(name, View::Alias, Some(slot))
    }

    /// Declares a storage of `numel` elements of `dtype` for tensors to view through [`TensorSpec::in_storage`].
    /// It must be viewed by at least one tensor.
    pub fn storage(&mut self, dtype: DType, numel: u64) -> StorageHandle {
        let count = self.state.slots.iter().filter(|s| matches!(s, Slot::Declared { .. })).count();
        let at = format!("{} (storage #{count})", module_at(&self.path));
        self.state.new_slot(Slot::Declared { dtype, numel, at })
    }

    /// Declares a child module `name` (dotted names create implicit intermediates) of `class` and fills it.
    pub fn module(&mut self, name: &str, class: &str, f: impl FnOnce(&mut ModuleBuilder<'_>)) -> &mut Self {
        let Some(segs) = segments(self.state, &self.path, name) else {
            self.scratch(class, f);
            return self;
        };
        let (last, parents) = match segs.split_last() {
            Some(x) => x,
            None => return self,
        };
        let state = &mut *self.state;
        let tensors = std::mem::take(&mut state.tensors);
        let found = walk(state, &tensors, self.node, &self.path, parents);
        let target = match found {
            Some((parent, ppath)) => {
                let at = join(&ppath, last);
                if parent.tensors.iter().any(|&t| tensors[t].name == *last) {
                    state.fail(PipelineError::DuplicateName { at });
                    None
                } else {
                    match parent.children.iter().position(|(n, _)| n == last) {
                        Some(i) if parent.children[i].1.explicit => {
                            state.fail(PipelineError::DuplicateName { at });
                            None
                        }
                        Some(i) => {
                            let c = &mut parent.children[i].1;
                            c.class = class.to_string();
                            c.explicit = true;
                            Some((c, at))
                        }
                        None => {
                            parent.children.push((last.to_string(), PendingModule::new(class, true)));
                            let i = parent.children.len() - 1;
                            Some((&mut parent.children[i].1, at))
                        }
                    }
                }
            }
            None => None,
        };
        state.tensors = tensors;
        match target {
            Some((node, path)) => {
                let mut child = ModuleBuilder { state, node, path };
                f(&mut child);
            }
            None => {
                let mut scratch = PendingModule::new(class, true);
                let mut child = ModuleBuilder { state, node: &mut scratch, path: join(&self.path, name) };
                f(&mut child);
            }
        }
        self
    }

    /// Declares a block list: a child `name` of class `ModuleList` with `count` children `0`, `1`, … of
    /// `block_class`, each filled by `f(block, index)`.
    pub fn block_list(
        &mut self,
        name: &str,
        count: usize,
        block_class: &str,
        mut f: impl FnMut(&mut ModuleBuilder<'_>, usize),
    ) -> &mut Self {
        self.module(name, BLOCK_LIST_CLASS, |list| {
            for i in 0..count {
                list.module(&i.to_string(), block_class, |b| f(b, i));
            }
        })
    }

    /// Declares a `Linear` child `name`: `weight` `[out_features, in_features]` contiguous, and `bias`
    /// `[out_features]` when `bias` is true.
    pub fn linear(&mut self, name: &str, dtype: DType, in_features: u64, out_features: u64, bias: bool) -> &mut Self {
        self.module(name, "Linear", |l| {
            l.param("weight", dtype, &[out_features, in_features]);
            if bias {
                l.param("bias", dtype, &[out_features]);
            }
        })
    }

    /// Declares a normalisation child `name` of `class` with `weight` `[dim]` and, when `bias` is true, `bias`
    /// `[dim]`.
    pub fn norm(&mut self, name: &str, class: &str, dtype: DType, dim: u64, bias: bool) -> &mut Self {
        self.module(name, class, |l| {
            l.param("weight", dtype, &[dim]);
            if bias {
                l.param("bias", dtype, &[dim]);
            }
        })
    }

    /// Marks whether the module implements the pipeline-managed lifecycle (`load_to_device` / `offload_to_cpu`).
    pub fn has_lifecycle(&mut self, yes: bool) -> &mut Self {
        self.node.has_lifecycle = yes;
        self
    }

    /// Marks whether the module is loaded (`false`: an unloaded stub on a rank that does not hold it).
    pub fn is_loaded(&mut self, yes: bool) -> &mut Self {
        self.node.is_loaded = yes;
        self
    }

    fn scratch(&mut self, class: &str, f: impl FnOnce(&mut ModuleBuilder<'_>)) {
        let mut scratch = PendingModule::new(class, true);
        let mut child = ModuleBuilder { state: &mut *self.state, node: &mut scratch, path: self.path.clone() };
        f(&mut child);
    }

    fn alias_slot(&mut self, name: &str, target: &str) -> usize {
        let slot = Slot::Alias { target: join(&self.path, target) };
        if !is_valid_path(target) {
            self.state.fail(PipelineError::InvalidPath { at: join(&self.path, name), path: target.to_string() });
        }
        self.state.new_slot(slot).slot
    }

    fn push_tensor(&mut self, name: &str, view: View, slot: Option<usize>) -> StorageHandle {
        let Some(segs) = segments(self.state, &self.path, name) else {
            return self.state.new_slot(Slot::Dead);
        };
        let Some((last, parents)) = segs.split_last() else {
            return self.state.new_slot(Slot::Dead);
        };
        let state = &mut *self.state;
        let tensors = std::mem::take(&mut state.tensors);
        let found = walk(state, &tensors, self.node, &self.path, parents);
        let parent = match found {
            Some((parent, ppath)) => {
                let clash = parent.tensors.iter().any(|&t| tensors[t].name == *last)
                    || parent.children.iter().any(|(n, _)| n == last);
                if clash {
                    state.fail(PipelineError::DuplicateName { at: join(&ppath, last) });
                    None
                } else {
                    Some(parent)
                }
            }
            None => None,
        };
        state.tensors = tensors;
        let Some(parent) = parent else {
            return state.new_slot(Slot::Dead);
        };
        let index = state.tensors.len();
        let slot = match slot {
            Some(s) => s,
            None => state.new_slot(Slot::Fresh { tensor: index }).slot,
        };
        state.tensors.push(PendingTensor { name: last.to_string(), view, slot });
        parent.tensors.push(index);
        StorageHandle { builder: state.id, slot }
    }
}

/// Builds a [`PipelineDesc`]: modules through closures, then declarations, then [`build`](Self::build).
#[derive(Debug)]
pub struct PipelineBuilder {
    class: String,
    state: State,
    root: PendingModule,
    components: Option<ComponentDecls>,
    offload_plan: Option<OffloadPlanDecl>,
    class_block_attrs: BTreeMap<String, Vec<String>>,
    class_block_attr_singular: BTreeMap<String, String>,
}

impl PipelineBuilder {
    /// A pipeline of class `class`; the root module gets the same class unless [`root_class`](Self::root_class)
    /// says otherwise.
    pub fn new(class: &str) -> Self {
        PipelineBuilder {
            class: class.to_string(),
            state: State { id: next_builder_id(), tensors: Vec::new(), slots: Vec::new(), error: None },
            root: PendingModule::new(class, true),
            components: None,
            offload_plan: None,
            class_block_attrs: BTreeMap::new(),
            class_block_attr_singular: BTreeMap::new(),
        }
    }

    /// Sets the root module's class.
    pub fn root_class(mut self, class: &str) -> Self {
        self.root.class = class.to_string();
        self
    }

    /// Declares a top-level module (a component or any other attribute of the pipeline) and fills it.
    pub fn module(self, name: &str, class: &str, f: impl FnOnce(&mut ModuleBuilder<'_>)) -> Self {
        self.root(|r| {
            r.module(name, class, f);
        })
    }

    /// Gives access to the root module (root tensors, ties across components, lifecycle flags).
    pub fn root(mut self, f: impl FnOnce(&mut ModuleBuilder<'_>)) -> Self {
        let mut b = ModuleBuilder { state: &mut self.state, node: &mut self.root, path: String::new() };
        f(&mut b);
        self
    }

    /// Sets the component declarations (replacing any given before).
    pub fn components(mut self, components: ComponentDecls) -> Self {
        self.components = Some(components);
        self
    }

    /// Adds a DiT path to the component declarations.
    pub fn dit(mut self, path: &str) -> Self {
        self.components.get_or_insert_with(ComponentDecls::default).dit.push(path.to_string());
        self
    }

    /// Adds an encoder path to the component declarations.
    pub fn encoder(mut self, path: &str) -> Self {
        self.components.get_or_insert_with(ComponentDecls::default).encoders.push(path.to_string());
        self
    }

    /// Adds a VAE path to the component declarations.
    pub fn vae(mut self, path: &str) -> Self {
        self.components.get_or_insert_with(ComponentDecls::default).vaes.push(path.to_string());
        self
    }

    /// Sets the offload plan.
    pub fn offload_plan(mut self, plan: OffloadPlanDecl) -> Self {
        self.offload_plan = Some(plan);
        self
    }

    /// Declares the block-list attributes of DiT class `class` (`_layerwise_offload_blocks_attrs`).
    pub fn class_block_attrs(mut self, class: &str, attrs: &[&str]) -> Self {
        self.class_block_attrs.insert(class.to_string(), attrs.iter().map(|a| a.to_string()).collect());
        self
    }

    /// Declares the deprecated singular block attribute of DiT class `class` (`_layerwise_offload_blocks_attr`).
    pub fn class_block_attr_singular(mut self, class: &str, attr: &str) -> Self {
        self.class_block_attr_singular.insert(class.to_string(), attr.to_string());
        self
    }

    /// Resolves ties, assigns storage ids in canonical order and validates. Returns the first error found.
    pub fn build(self) -> Result<PipelineDesc, PipelineError> {
        let PipelineBuilder {
            class,
            state,
            root,
            components,
            offload_plan,
            class_block_attrs,
            class_block_attr_singular,
        } = self;
        if let Some(e) = state.error {
            return Err(e);
        }
        let State { tensors, slots, .. } = state;

        // Absolute paths in depth-first order.
        let mut order: Vec<(usize, String)> = Vec::with_capacity(tensors.len());
        let mut stack = vec![(String::new(), &root)];
        while let Some((path, m)) = stack.pop() {
            for &t in &m.tensors {
                order.push((t, join(&path, &tensors[t].name)));
            }
            for (n, c) in m.children.iter().rev() {
                stack.push((join(&path, n), c));
            }
        }
        let mut paths: Vec<String> = vec![String::new(); tensors.len()];
        let mut by_path: HashMap<&str, usize> = HashMap::with_capacity(order.len());
        for (t, p) in &order {
            paths[*t] = p.clone();
        }
        for (t, p) in &order {
            by_path.insert(p.as_str(), *t);
        }

        // Resolve every slot to a root slot (Fresh or Declared), following alias chains.
        let mut root_slot: Vec<Option<usize>> = vec![None; slots.len()];
        for start in 0..slots.len() {
            let mut chain = Vec::new();
            let mut cur = start;
            let resolved = loop {
                if let Some(r) = root_slot[cur] {
                    break r;
                }
                match &slots[cur] {
                    Slot::Fresh { .. } | Slot::Declared { .. } | Slot::Dead => break cur,
                    Slot::Alias { target } => {
                        if chain.len() > slots.len() {
                            let at = chain_owner(&tensors, &paths, start);
                            return Err(PipelineError::TieCycle { at, target: target.clone() });
                        }
                        chain.push(cur);
                        let Some(&t) = by_path.get(target.as_str()) else {
                            let at = chain_owner(&tensors, &paths, cur);
                            return Err(PipelineError::UnknownTensor { at, target: target.clone() });
                        };
                        cur = tensors[t].slot;
                    }
                }
            };
            root_slot[start] = Some(resolved);
            for c in chain {
                root_slot[c] = Some(resolved);
            }
        }

        // Resolve every view; full aliases copy their target's view.
        let mut views: Vec<Option<ResolvedView>> = vec![None; tensors.len()];
        for (t, _) in &order {
            let mut cur = *t;
            let mut steps = 0usize;
            let view = loop {
                match &tensors[cur].view {
                    View::Spec { dtype, shape, strides, storage_offset, kind } => {
                        let strides = strides.clone().unwrap_or_else(|| TensorDesc::contiguous_strides(shape));
                        break (*dtype, shape.clone(), strides, *storage_offset, *kind);
                    }
                    View::Alias => {
                        steps += 1;
                        let target = match &slots[tensors[cur].slot] {
                            Slot::Alias { target } => target,
                            _ => return Err(PipelineError::ForeignHandle { at: paths[cur].clone() }),
                        };
                        if steps > tensors.len() {
                            return Err(PipelineError::TieCycle { at: paths[*t].clone(), target: target.clone() });
                        }
                        match by_path.get(target.as_str()) {
                            Some(&next) => cur = next,
                            None => {
                                return Err(PipelineError::UnknownTensor {
                                    at: paths[cur].clone(),
                                    target: target.clone(),
                                })
                            }
                        }
                    }
                }
            };
            check_view(&paths[*t], view.0, &view.1, &view.2, view.3)?;
            views[*t] = Some(view);
        }

        // Canonical storage ids and storage descriptions.
        let mut ids: HashMap<usize, StorageId> = HashMap::new();
        let mut storages: BTreeMap<StorageId, StorageDesc> = BTreeMap::new();
        let mut tensor_ids: Vec<StorageId> = vec![StorageId(0); tensors.len()];
        for (t, path) in &order {
            let rs = root_slot[tensors[*t].slot].unwrap_or(tensors[*t].slot);
            let id = match ids.get(&rs) {
                Some(id) => *id,
                None => {
                    let id = StorageId(ids.len() as u64);
                    let desc = match &slots[rs] {
                        Slot::Fresh { tensor } => match &views[*tensor] {
                            Some((dtype, shape, strides, off, _)) => {
                                let numel = check_view(&paths[*tensor], *dtype, shape, strides, *off)?;
                                StorageDesc { dtype: *dtype, numel }
                            }
                            None => return Err(PipelineError::ForeignHandle { at: path.clone() }),
                        },
                        Slot::Declared { dtype, numel, at } => {
                            numel
                                .checked_mul(dtype.size_bytes())
                                .ok_or(PipelineError::Overflow { at: at.clone(), what: "the byte size" })?;
                            StorageDesc { dtype: *dtype, numel: *numel }
                        }
                        Slot::Alias { .. } | Slot::Dead => {
                            return Err(PipelineError::ForeignHandle { at: path.clone() })
                        }
                    };
                    ids.insert(rs, id);
                    storages.insert(id, desc);
                    id
                }
            };
            tensor_ids[*t] = id;
        }
        for (i, s) in slots.iter().enumerate() {
            if let Slot::Declared { at, .. } = s {
                if !ids.contains_key(&i) {
                    return Err(PipelineError::UnusedStorage { at: at.clone() });
                }
            }
        }

        // Assemble the tree.
        let mut materialize_error = None;
        let root = materialize(root, &tensors, &views, &tensor_ids, &mut materialize_error);
        if let Some(e) = materialize_error {
            return Err(e);
        }
        let desc = PipelineDesc {
            class,
            root,
            storages,
            components,
            offload_plan,
            class_block_attrs,
            class_block_attr_singular,
        };
        desc.validate()?;
        Ok(desc)
    }
}

fn chain_owner(tensors: &[PendingTensor], paths: &[String], slot: usize) -> String {
    tensors.iter().position(|t| t.slot == slot).map_or_else(|| format!("storage #{slot}"), |t| paths[t].clone())
}

type ResolvedView = (DType, Vec<u64>, Vec<u64>, u64, TensorKind);

fn materialize(
    m: PendingModule,
    tensors: &[PendingTensor],
    views: &[Option<ResolvedView>],
    ids: &[StorageId],
    error: &mut Option<PipelineError>,
) -> ModuleNode {
    let mut node = ModuleNode::new(m.class);
    node.has_lifecycle = m.has_lifecycle;
    node.is_loaded = m.is_loaded;
    for t in m.tensors {
        match &views[t] {
            Some((dtype, shape, strides, storage_offset, kind)) => node.tensors.push(TensorDesc {
                name: tensors[t].name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                strides: strides.clone(),
                storage_offset: *storage_offset,
                storage: ids[t],
                kind: *kind,
            }),
            None => {
                if error.is_none() {
                    *error = Some(PipelineError::ForeignHandle { at: tensors[t].name.clone() });
                }
            }
        }
    }
    for (n, c) in m.children {
        node.children.push((n, materialize(c, tensors, views, ids, error)));
    }
    node
}
