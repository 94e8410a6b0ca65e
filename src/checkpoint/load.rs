//! A [`HostModel`] over a checkpoint: each file is lent to the platform as a mapped host buffer and each storage's
//! home is its tensor's range there ([`Home::File`](crate::model::Home::File)): the process holds no copy of the
//! weights. Every tensor of the description is matched to the checkpoint by name, dtype and shape first, except
//! non-persistent buffers: no checkpoint holds them (the module computes them when it is built), so their storages
//! get zero-filled host buffers of their own for the caller to fill from the module.

use super::convert::{self, converts, is_float};
use super::error::CheckpointError;
use super::Checkpoint;
use crate::model::{zeroed_buffers, HostModel, OpenedFile};
use crate::pipeline::{DType, PipelineDesc, StorageId, TensorDesc, TensorKind};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use weightferry_actors::platform::{HostBufferId, HostMemoryKind, PlatformRef};

impl HostModel {
    /// Loads `desc` from `checkpoint`: the description's tensor `<component>.K` is the checkpoint's tensor `K`.
    /// Every tensor of `desc` must lie under `component` and be the whole of its contiguous storage, and every
    /// storage must be filled by a checkpoint tensor of the same dtype and shape (one of its tied tensors:
    /// `match_storages`) ([`CheckpointError::MissingTensor`], [`CheckpointError::DescriptionMismatch`]); all of
    /// this is checked before any file is mapped. Each storage is homed in its file
    /// ([`Home::File`](crate::model::Home::File)); on a platform error every file mapped so far is released. The
    /// storages of non-persistent buffers are not read from the file but zero-filled in buffers of their own
    /// ([`Home::Loaded`](crate::model::Home::Loaded)): the caller writes them ([`write_storage`](Self::write_storage));
    /// [`HostModel::caller_storages`] lists them.
    pub fn from_checkpoint(
        platform: PlatformRef,
        desc: Arc<PipelineDesc>,
        checkpoint: &Checkpoint,
        component: &str,
    ) -> Result<HostModel, CheckpointError> {
        let prefix = format!("{component}.");
        if let Some((path, _)) = desc.root.tensors_recursive().into_iter().find(|(p, _)| !p.starts_with(&prefix)) {
            return Err(CheckpointError::DescriptionMismatch {
                file: checkpoint.path().to_path_buf(),
                tensor: path.clone(),
                reason: format!("the description's tensor `{path}` is outside component `{component}`"),
            });
        }
        Self::from_checkpoints(platform, desc, &[(checkpoint, component)])
    }

    /// [`from_checkpoint`](Self::from_checkpoint) for several components, each from its own checkpoint
    /// (`(checkpoint, component)`, components distinct): a pipeline whose transformer and text encoder come from
    /// their own files. The storages of tensors under none of the components are the caller's, zero-filled like
    /// non-persistent buffers (a VAE the files do not hold, written from the module).
    pub fn from_checkpoints(
        platform: PlatformRef,
        desc: Arc<PipelineDesc>,
        parts: &[(&Checkpoint, &str)],
    ) -> Result<HostModel, CheckpointError> {
        let mut plan = BTreeMap::new();
        let mut own = BTreeSet::new();
        let mut convert = BTreeMap::new();
        for (i, &(checkpoint, component)) in parts.iter().enumerate() {
            let m = match_storages(&desc, checkpoint, component)?;
            convert.extend(m.convert.iter().map(|&id| (id, (i, m.plan[&id].clone()))));
            plan.extend(m.plan.into_iter().filter(|(id, _)| !m.convert.contains(id)).map(|(id, key)| (id, (i, key))));
            own.extend(m.own);
        }
        // A storage a file tensor fills comes from the file.
        own.retain(|id| !plan.contains_key(id) && !convert.contains_key(id));
        // Map every file that holds a tensor of the description: the storages' homes are their tensors' ranges.
        let mut mapped: BTreeMap<(usize, usize), HostBufferId> = BTreeMap::new();
        let release = |mapped: &BTreeMap<(usize, usize), HostBufferId>| {
            for b in mapped.values() {
                let _ = platform.free_host(*b);
            }
        };
        let mut at = BTreeMap::new();
        for (id, (i, key)) in &plan {
            let checkpoint = parts[*i].0;
            let Some((fi, ft)) = checkpoint.locate(key) else { continue };
            let buf = match mapped.get(&(*i, fi)) {
                Some(&b) => b,
                None => match platform.map_host(checkpoint.files()[fi].region()) {
                    Ok(b) => *mapped.entry((*i, fi)).or_insert(b),
                    Err(source) => {
                        release(&mapped);
                        let file = checkpoint.files()[fi].path().to_path_buf();
                        return Err(CheckpointError::Platform { file, source });
                    }
                },
            };
            at.insert(*id, (buf, ft.offset));
        }
        let loaded = match zeroed_buffers(&platform, &desc, own) {
            Ok(loaded) => loaded,
            Err(source) => {
                release(&mapped);
                let file = parts.first().map(|(c, _)| c.path().to_path_buf()).unwrap_or_default();
                return Err(CheckpointError::Platform { file, source });
            }
        };
        let converted = match load_converted(&platform, &desc, parts, &convert) {
            Ok(converted) => converted,
            Err(e) => {
                release(&mapped);
                loaded.values().for_each(|&b| drop(platform.free_host(b)));
                return Err(e);
            }
        };
        let paths = mapped
            .iter()
            .map(|(&(i, fi), &buf)| (buf, parts[i].0.files()[fi].region() as Arc<dyn OpenedFile>))
            .collect();
        Ok(HostModel::from_files(platform, desc, paths, at, loaded, converted))
    }
}

/// Host buffers of the storages built when the checkpoint is loaded (`storage -> (part, key)`): a file tensor in
/// another float dtype, read and converted to the description's; a view of several row ranges, read and concatenated
/// (and converted if need be). On an error every buffer made is freed.
fn load_converted(
    platform: &PlatformRef,
    desc: &PipelineDesc,
    parts: &[(&Checkpoint, &str)],
    convert: &BTreeMap<StorageId, (usize, String)>,
) -> Result<BTreeMap<StorageId, HostBufferId>, CheckpointError> {
    let mut made = BTreeMap::new();
    let result = convert.iter().try_for_each(|(&id, (i, key))| {
        let checkpoint = parts[*i].0;
        let file = || checkpoint.path().to_path_buf();
        let (_, ft) = checkpoint.tensor(key).expect("matched in this checkpoint");
        let to = desc.storages[&id].dtype;
        let bytes = checkpoint.read_tensor(key).expect("matched in this checkpoint")?;
        let bytes = if ft.dtype == to {
            bytes // assembled from several ranges, already in the module's dtype
        } else {
            convert::convert(&bytes, ft.dtype, to).expect("matched as convertible")
        };
        let buf = platform
            .alloc_host(bytes.len().max(1) as u64, HostMemoryKind::Pageable)
            .map_err(|source| CheckpointError::Platform { file: file(), source })?;
        made.insert(id, buf);
        platform.write_host(buf, 0, &bytes).map_err(|source| CheckpointError::Platform { file: file(), source })
    });
    match result {
        Ok(()) => Ok(made),
        Err(e) => {
            made.values().for_each(|&b| drop(platform.free_host(b)));
            Err(e)
        }
    }
}

/// What [`match_storages`] found.
struct Matched {
    /// Which tensor fills each storage (`storage -> key`).
    plan: BTreeMap<StorageId, String>,
    /// The storages the caller fills.
    own: BTreeSet<StorageId>,
    /// The storages of `plan` whose tensor is in another float dtype in the file (converted when loaded) or a view
    /// of several row ranges (assembled when loaded).
    convert: BTreeSet<StorageId>,
}

/// Which tensor of `checkpoint` fills each storage of `component` (`storage -> key`), and the storages the caller
/// fills (non-persistent buffers: no checkpoint holds them; tensors outside `component`: another part's or the
/// caller's). A storage several tensors view whole (tied weights, e.g. an encoder's input embedding and its shared
/// table) is filled from the first of them the checkpoint holds: a file saved from a model with tied weights keeps
/// one name of each tie. Every tensor of `component` that views a storage must be the whole of its contiguous
/// storage, and every one the checkpoint holds must match it in shape and dtype, or be in another float dtype
/// (converted: [`convert`](super::convert)); a view of several row ranges is assembled, and one a view says the module
/// holds is the caller's ([`View`](super::View)). A GGUF file's quantized tensor that the module holds as floats of another
/// shape (diffusers dequantizes the ones a model keeps in f32) is the caller's, like a non-persistent buffer.
fn match_storages(desc: &PipelineDesc, checkpoint: &Checkpoint, component: &str) -> Result<Matched, CheckpointError> {
    let file = || checkpoint.path().to_path_buf();
    let mismatch = |tensor: &str, reason: String| CheckpointError::DescriptionMismatch {
        file: file(),
        tensor: tensor.to_string(),
        reason,
    };
    let prefix = format!("{component}.");
    let mut views: BTreeMap<StorageId, Vec<String>> = BTreeMap::new();
    let mut own = BTreeSet::new();
    let mut convert = BTreeSet::new();
    for (path, t) in desc.root.tensors_recursive() {
        let Some(key) = path.strip_prefix(&prefix) else {
            own.insert(t.storage);
            continue;
        };
        if t.kind == TensorKind::NonPersistentBuffer {
            own.insert(t.storage);
            continue;
        }
        let whole = desc.storages.get(&t.storage).is_some_and(|s| s.numel == t.numel())
            && t.storage_offset == 0
            && t.strides == TensorDesc::contiguous_strides(&t.shape);
        if !whole {
            return Err(mismatch(
                key,
                format!(
                    "the description's `{path}` is not the whole contiguous storage it views; a checkpoint tensor \
                     fills exactly one storage"
                ),
            ));
        }
        if checkpoint.is_module_held(key) {
            // A view says the file holds it in a form only the module gives.
            own.insert(t.storage);
            continue;
        }
        if let Some((f, ft)) = checkpoint.tensor(key) {
            if ft.shape == t.shape && (converts(ft.dtype, t.dtype) || checkpoint.is_assembled(key)) {
                convert.insert(t.storage);
            } else if f.is_gguf() && ft.dtype == DType::U8 && is_float(t.dtype) {
                // A quantized tensor the module holds dequantized (diffusers keeps some in f32): the module's own.
                own.insert(t.storage);
                continue;
            } else if ft.dtype != t.dtype || ft.shape != t.shape {
                let (fd, dd) = (ft.dtype.name(), t.dtype.name());
                let reason = format!("the checkpoint has {fd} {:?}, the description {dd} {:?}", ft.shape, t.shape);
                return Err(mismatch(key, reason));
            }
        }
        views.entry(t.storage).or_default().push(key.to_string());
    }
    let mut plan = BTreeMap::new();
    for (id, keys) in views {
        match keys.iter().find(|k| checkpoint.tensor(k).is_some()) {
            Some(key) => {
                plan.insert(id, key.clone());
            }
            None if own.contains(&id) => {}
            None => {
                return Err(CheckpointError::MissingTensor {
                    file: file(),
                    tensor: keys[0].clone(),
                    expected_by: "pipeline description",
                })
            }
        }
    }
    if let Some(id) = desc.storages.keys().find(|id| !plan.contains_key(id) && !own.contains(id)) {
        return Err(CheckpointError::DescriptionMismatch {
            file: file(),
            tensor: format!("storage {}", id.0),
            reason: "no tensor of the description views this storage".into(),
        });
    }
    Ok(Matched { plan, own, convert })
}
