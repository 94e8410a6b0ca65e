//! Building pipeline descriptions in code: the [`PipelineBuilder`] and [`ModuleBuilder`] API, [`TensorSpec`] and
//! [`StorageHandle`].
//!
//! # Building
//!
//! ```
//! use weightferry::pipeline::builder::{PipelineBuilder, TensorSpec};
//! use weightferry::pipeline::DType;
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
//! [`StorageId`](super::StorageId)s in canonical order: depth first (a module's tensors, then its children, in
//! declaration order), in order of first appearance, from 0. The JSON loader uses the same order, so a description
//! survives a round trip through JSON unchanged.
//!
//! Every description the builder returns passed [`PipelineDesc::validate`].

mod assemble;

use super::validate::{is_valid_path, module_at};
use super::{join, ComponentDecls, DType, OffloadPlanDecl, PipelineDesc, PipelineError, TensorDesc, TensorKind};
use std::collections::BTreeMap;

/// Class given to intermediate modules created implicitly by a dotted attribute name.
pub(crate) const IMPLICIT_MODULE_CLASS: &str = "Module";

/// Class of the block lists created by [`ModuleBuilder::block_list`].
pub(crate) const BLOCK_LIST_CLASS: &str = "ModuleList";

/// A builder-local reference to a storage, returned when a tensor or storage is declared; pass it to
/// [`TensorSpec::in_storage`] to make another tensor view the same bytes. The final
/// [`StorageId`](super::StorageId)s are assigned by [`PipelineBuilder::build`].
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
        let (root, storages) = assemble::assemble(root, &tensors, &slots)?;
        let desc = PipelineDesc {
            class,
            root,
            storages,
            components,
            offload_plan,
            class_block_attrs,
            class_block_attr_singular,
            pinned: Vec::new(),
        };
        desc.validate()?;
        Ok(desc)
    }
}
