//! The parsed tree before storages are resolved, and its resolution: ties and storage names followed to the
//! storage each tensor views, canonical storage ids, every view checked against its storage, module nodes made.

use crate::pipeline::validate::check_fit;
use crate::pipeline::{join, DType, ModuleNode, PipelineError, StorageDesc, StorageId, TensorDesc, TensorKind};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

/// Where a parsed tensor's storage comes from.
#[derive(Debug, Clone)]
pub(super) enum Src {
    Own,
    Named(String),
    Tied(String),
}

/// A parsed tensor.
#[derive(Debug, Clone)]
pub(super) struct PTensor {
    pub(super) name: String,
    pub(super) dtype: DType,
    pub(super) shape: Vec<u64>,
    pub(super) strides: Vec<u64>,
    pub(super) storage_offset: u64,
    pub(super) kind: TensorKind,
    pub(super) src: Src,
    /// Storage elements the view needs.
    pub(super) needed: u64,
    /// JSON path of the tensor object.
    pub(super) at: Rc<str>,
}

/// A parsed module.
#[derive(Debug, Clone)]
pub(super) struct PModule {
    pub(super) class: String,
    pub(super) has_lifecycle: bool,
    pub(super) is_loaded: bool,
    pub(super) tensors: Vec<PTensor>,
    pub(super) children: Vec<(String, PModule)>,
    /// Modules plus tensors in this subtree.
    pub(super) nodes: u64,
}

/// Where a tensor's storage comes from, after following ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    /// Owned by the tensor with this flat index.
    Own(usize),
    /// The named storage with this index in the declaration list.
    Named(usize),
}

/// Resolves ties and storage names, assigns canonical storage ids and checks every view against its storage.
pub(super) fn resolve(
    root: PModule,
    declared: &[(String, StorageDesc)],
) -> Result<(ModuleNode, BTreeMap<StorageId, StorageDesc>), PipelineError> {
    // Flat depth-first list of tensors with their absolute paths.
    let mut flat: Vec<(String, &PTensor)> = Vec::new();
    let mut stack: Vec<(String, &PModule)> = vec![(String::new(), &root)];
    while let Some((path, m)) = stack.pop() {
        for t in &m.tensors {
            flat.push((join(&path, &t.name), t));
        }
        for (n, c) in m.children.iter().rev() {
            stack.push((join(&path, n), c));
        }
    }
    let by_path: HashMap<&str, usize> = flat.iter().enumerate().map(|(i, (p, _))| (p.as_str(), i)).collect();
    let by_name: HashMap<&str, usize> = declared.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();

    // Follow tie chains iteratively; 0 = unvisited, 1 = on the current chain, 2 = resolved.
    let mut keys: Vec<Option<Key>> = vec![None; flat.len()];
    let mut mark = vec![0u8; flat.len()];
    for start in 0..flat.len() {
        let mut chain = Vec::new();
        let mut cur = start;
        let key = loop {
            if mark[cur] == 2 {
                match keys[cur] {
                    Some(k) => break k,
                    None => {
                        return Err(PipelineError::TieCycle {
                            at: flat[start].1.at.to_string(),
                            target: flat[cur].0.clone(),
                        })
                    }
                }
            }
            if mark[cur] == 1 {
                return Err(PipelineError::TieCycle { at: flat[start].1.at.to_string(), target: flat[cur].0.clone() });
            }
            let t = flat[cur].1;
            match &t.src {
                Src::Own => break Key::Own(cur),
                Src::Named(n) => match by_name.get(n.as_str()) {
                    Some(&i) => break Key::Named(i),
                    None => return Err(PipelineError::UnknownStorage { at: join(&t.at, "storage"), name: n.clone() }),
                },
                Src::Tied(target) => {
                    mark[cur] = 1;
                    chain.push(cur);
                    match by_path.get(target.as_str()) {
                        Some(&next) => cur = next,
                        None => {
                            return Err(PipelineError::UnknownTensor {
                                at: join(&t.at, "tied_to"),
                                target: target.clone(),
                            })
                        }
                    }
                }
            }
        };
        for c in chain {
            keys[c] = Some(key);
            mark[c] = 2;
        }
        keys[start] = Some(key);
        mark[start] = 2;
    }

    // Canonical ids by first appearance; check every view.
    let mut ids: HashMap<Key, StorageId> = HashMap::new();
    let mut table: BTreeMap<StorageId, StorageDesc> = BTreeMap::new();
    let mut tensor_ids: Vec<StorageId> = Vec::with_capacity(flat.len());
    for (i, (_, t)) in flat.iter().enumerate() {
        let key = keys[i].unwrap_or(Key::Own(i));
        let next = StorageId(ids.len() as u64);
        let id = *ids.entry(key).or_insert(next);
        let desc = match key {
            Key::Own(o) => StorageDesc { dtype: flat[o].1.dtype, numel: flat[o].1.needed },
            Key::Named(n) => declared[n].1.clone(),
        };
        check_fit(&t.at, t.dtype, t.needed, &desc)?;
        table.entry(id).or_insert(desc);
        tensor_ids.push(id);
    }
    for (i, (name, _)) in declared.iter().enumerate() {
        if !ids.contains_key(&Key::Named(i)) {
            return Err(PipelineError::UnusedStorage { at: join("storages", name) });
        }
    }
    drop(flat);
    let mut next = 0usize;
    let node = materialize(root, &tensor_ids, &mut next);
    Ok((node, table))
}

/// Turns the pending tree into module nodes, taking storage ids in the same depth-first order as `resolve`.
fn materialize(m: PModule, ids: &[StorageId], next: &mut usize) -> ModuleNode {
    let mut node = ModuleNode::new(m.class);
    node.has_lifecycle = m.has_lifecycle;
    node.is_loaded = m.is_loaded;
    for t in m.tensors {
        let storage = ids.get(*next).copied().unwrap_or(StorageId(0));
        *next += 1;
        node.tensors.push(TensorDesc {
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            strides: t.strides,
            storage_offset: t.storage_offset,
            storage,
            kind: t.kind,
        });
    }
    for (n, c) in m.children {
        node.children.push((n, materialize(c, ids, next)));
    }
    node
}
