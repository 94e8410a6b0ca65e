//! What [`PipelineBuilder::build`](super::PipelineBuilder::build) does with the declarations: follows ties to the
//! storage each tensor views, resolves every view, assigns the storage ids in canonical order and turns the pending
//! tree into module nodes.

use super::{PendingModule, PendingTensor, Slot, View};
use crate::pipeline::validate::check_view;
use crate::pipeline::{join, DType, ModuleNode, PipelineError, StorageDesc, StorageId, TensorDesc, TensorKind};
use std::collections::{BTreeMap, HashMap};

/// A tensor's view once ties are followed: dtype, shape, strides, storage offset, kind.
type ResolvedView = (DType, Vec<u64>, Vec<u64>, u64, TensorKind);

/// The storage table of a description.
type Storages = BTreeMap<StorageId, StorageDesc>;

/// The declared tensors with their absolute paths.
struct Tensors<'a> {
    tensors: &'a [PendingTensor],
    slots: &'a [Slot],
    /// Tensor indices with their absolute paths, depth first (a module's tensors, then its children).
    order: Vec<(usize, String)>,
    /// Absolute path of each tensor, by index.
    paths: Vec<String>,
    by_path: HashMap<String, usize>,
}

/// Resolves the declarations under `root` into the module tree and its storage table.
pub(super) fn assemble(
    root: PendingModule,
    tensors: &[PendingTensor],
    slots: &[Slot],
) -> Result<(ModuleNode, Storages), PipelineError> {
    let t = Tensors::new(&root, tensors, slots);
    let root_slot = t.root_slots()?;
    let views = t.views()?;
    let (storages, tensor_ids) = t.storages(&root_slot, &views)?;
    let mut materialize_error = None;
    let root = materialize(root, tensors, &views, &tensor_ids, &mut materialize_error);
    if let Some(e) = materialize_error {
        return Err(e);
    }
    Ok((root, storages))
}

impl<'a> Tensors<'a> {
    fn new(root: &PendingModule, tensors: &'a [PendingTensor], slots: &'a [Slot]) -> Self {
        let mut order: Vec<(usize, String)> = Vec::with_capacity(tensors.len());
        let mut stack = vec![(String::new(), root)];
        while let Some((path, m)) = stack.pop() {
            for &t in &m.tensors {
                order.push((t, join(&path, &tensors[t].name)));
            }
            for (n, c) in m.children.iter().rev() {
                stack.push((join(&path, n), c));
            }
        }
        let mut paths: Vec<String> = vec![String::new(); tensors.len()];
        let mut by_path: HashMap<String, usize> = HashMap::with_capacity(order.len());
        for (t, p) in &order {
            paths[*t] = p.clone();
        }
        for (t, p) in &order {
            by_path.insert(p.clone(), *t);
        }
        Tensors { tensors, slots, order, paths, by_path }
    }

    /// Every slot resolved to a root slot (Fresh or Declared), following alias chains.
    fn root_slots(&self) -> Result<Vec<Option<usize>>, PipelineError> {
        let Tensors { tensors, slots, paths, by_path, .. } = self;
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
                            let at = chain_owner(tensors, paths, start);
                            return Err(PipelineError::TieCycle { at, target: target.clone() });
                        }
                        chain.push(cur);
                        let Some(&t) = by_path.get(target.as_str()) else {
                            let at = chain_owner(tensors, paths, cur);
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
        Ok(root_slot)
    }

    /// Every tensor's view; full aliases copy their target's view.
    fn views(&self) -> Result<Vec<Option<ResolvedView>>, PipelineError> {
        let mut views: Vec<Option<ResolvedView>> = vec![None; self.tensors.len()];
        for (t, _) in &self.order {
            let view = self.view(*t)?;
            check_view(&self.paths[*t], view.0, &view.1, &view.2, view.3)?;
            views[*t] = Some(view);
        }
        Ok(views)
    }

    /// The view of tensor `t`, following full aliases to the tensor that gives it.
    fn view(&self, t: usize) -> Result<ResolvedView, PipelineError> {
        let Tensors { tensors, slots, paths, by_path, .. } = self;
        let mut cur = t;
        let mut steps = 0usize;
        loop {
            match &tensors[cur].view {
                View::Spec { dtype, shape, strides, storage_offset, kind } => {
                    let strides = strides.clone().unwrap_or_else(|| TensorDesc::contiguous_strides(shape));
                    return Ok((*dtype, shape.clone(), strides, *storage_offset, *kind));
                }
                View::Alias => {
                    steps += 1;
                    let target = match &slots[tensors[cur].slot] {
                        Slot::Alias { target } => target,
                        _ => return Err(PipelineError::ForeignHandle { at: paths[cur].clone() }),
                    };
                    if steps > tensors.len() {
                        return Err(PipelineError::TieCycle { at: paths[t].clone(), target: target.clone() });
                    }
                    match by_path.get(target.as_str()) {
                        Some(&next) => cur = next,
                        None => {
                            return Err(PipelineError::UnknownTensor { at: paths[cur].clone(), target: target.clone() })
                        }
                    }
                }
            }
        }
    }

    /// Canonical storage ids (by first appearance) and storage descriptions; the storage id of every tensor.
    fn storages(
        &self,
        root_slot: &[Option<usize>],
        views: &[Option<ResolvedView>],
    ) -> Result<(Storages, Vec<StorageId>), PipelineError> {
        let Tensors { tensors, slots, order, .. } = self;
        let mut ids: HashMap<usize, StorageId> = HashMap::new();
        let mut storages = Storages::new();
        let mut tensor_ids: Vec<StorageId> = vec![StorageId(0); tensors.len()];
        for (t, path) in order {
            let rs = root_slot[tensors[*t].slot].unwrap_or(tensors[*t].slot);
            let id = match ids.get(&rs) {
                Some(id) => *id,
                None => {
                    let id = StorageId(ids.len() as u64);
                    ids.insert(rs, id);
                    storages.insert(id, self.storage_desc(rs, path, views)?);
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
        Ok((storages, tensor_ids))
    }

    /// The storage behind root slot `rs`, first reached from the tensor at `path`.
    fn storage_desc(
        &self,
        rs: usize,
        path: &str,
        views: &[Option<ResolvedView>],
    ) -> Result<StorageDesc, PipelineError> {
        match &self.slots[rs] {
            Slot::Fresh { tensor } => match &views[*tensor] {
                Some((dtype, shape, strides, off, _)) => {
                    let numel = check_view(&self.paths[*tensor], *dtype, shape, strides, *off)?;
                    Ok(StorageDesc { dtype: *dtype, numel })
                }
                None => Err(PipelineError::ForeignHandle { at: path.to_string() }),
            },
            Slot::Declared { dtype, numel, at } => {
                numel
                    .checked_mul(dtype.size_bytes())
                    .ok_or(PipelineError::Overflow { at: at.clone(), what: "the byte size" })?;
                Ok(StorageDesc { dtype: *dtype, numel: *numel })
            }
            Slot::Alias { .. } | Slot::Dead => Err(PipelineError::ForeignHandle { at: path.to_string() }),
        }
    }
}

fn chain_owner(tensors: &[PendingTensor], paths: &[String], slot: usize) -> String {
    tensors.iter().position(|t| t.slot == slot).map_or_else(|| format!("storage #{slot}"), |t| paths[t].clone())
}

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
