//! A [`HostModel`] filled from a checkpoint: each storage's loaded host buffer is written straight from the file's
//! mapping (one copy, exact bytes), after every tensor of the description was matched to the checkpoint by name,
//! dtype and shape.

use super::error::CheckpointError;
use super::Checkpoint;
use crate::model::HostModel;
use crate::plan::{PipelineDesc, TensorDesc};
use std::collections::BTreeMap;
use std::sync::Arc;
use weightferry_actors::platform::{HostMemoryKind, PlatformRef};

impl HostModel {
    /// Loads `desc` from `checkpoint`: the description's tensor `<component>.K` is the checkpoint's tensor `K`.
    /// Every tensor of `desc` must lie under `component`, exist in the checkpoint with the same dtype and shape,
    /// and be the whole of its own contiguous storage ([`CheckpointError::MissingTensor`],
    /// [`CheckpointError::DescriptionMismatch`]); all of this is checked before any buffer is allocated. Buffers
    /// are pageable, one per storage; on a platform error every buffer allocated so far is freed.
    pub fn from_checkpoint(
        platform: PlatformRef,
        desc: Arc<PipelineDesc>,
        checkpoint: &Checkpoint,
        component: &str,
    ) -> Result<HostModel, CheckpointError> {
        let file = || checkpoint.path().to_path_buf();
        let prefix = format!("{component}.");
        let mut plan = BTreeMap::new();
        for (path, t) in desc.root.tensors_recursive() {
            let mismatch = |tensor: &str, reason: String| CheckpointError::DescriptionMismatch {
                file: file(),
                tensor: tensor.to_string(),
                reason,
            };
            let Some(key) = path.strip_prefix(&prefix) else {
                return Err(mismatch(
                    &path,
                    format!("the description's tensor `{path}` is outside component `{component}`"),
                ));
            };
            let Some((_, ft)) = checkpoint.tensor(key) else {
                return Err(CheckpointError::MissingTensor {
                    file: file(),
                    tensor: key.to_string(),
                    expected_by: "pipeline description",
                });
            };
            if ft.dtype != t.dtype || ft.shape != t.shape {
                return Err(mismatch(
                    key,
                    format!(
                        "the checkpoint has {} {:?}, the description {} {:?}",
                        ft.dtype.name(),
                        ft.shape,
                        t.dtype.name(),
                        t.shape
                    ),
                ));
            }
            let whole = desc.storages.get(&t.storage).is_some_and(|s| s.numel == t.numel())
                && t.storage_offset == 0
                && t.strides == TensorDesc::contiguous_strides(&t.shape);
            if !whole || plan.insert(t.storage, key.to_string()).is_some() {
                return Err(mismatch(
                    key,
                    format!(
                        "the description's `{path}` is not the whole contiguous storage it views, or shares it; a \
                         checkpoint tensor fills exactly one storage"
                    ),
                ));
            }
        }
        if let Some(id) = desc.storages.keys().find(|id| !plan.contains_key(id)) {
            return Err(CheckpointError::DescriptionMismatch {
                file: file(),
                tensor: format!("storage {}", id.0),
                reason: "no tensor of the description views this storage".into(),
            });
        }
        let mut loaded = BTreeMap::new();
        let fill = |key: &str| -> Result<_, CheckpointError> {
            let platform_err = |source| CheckpointError::Platform { file: file(), source };
            let bytes = checkpoint.bytes(key).ok_or_else(|| CheckpointError::MissingTensor {
                file: file(),
                tensor: key.to_string(),
                expected_by: "pipeline description",
            })?;
            let buf = platform.alloc_host(bytes.len().max(1) as u64, HostMemoryKind::Pageable).map_err(platform_err)?;
            if let Err(e) = platform.write_host(buf, 0, bytes) {
                let _ = platform.free_host(buf);
                return Err(platform_err(e));
            }
            Ok(buf)
        };
        for (id, key) in &plan {
            match fill(key) {
                Ok(buf) => {
                    loaded.insert(*id, buf);
                }
                Err(e) => {
                    for b in loaded.values() {
                        let _ = platform.free_host(*b);
                    }
                    return Err(e);
                }
            }
        }
        Ok(HostModel::from_loaded(platform, desc, loaded))
    }
}
