//! A sharded checkpoint: a `*.safetensors.index.json` whose `weight_map` assigns each tensor to a shard file beside
//! it. Every shard is opened and checked ([`super::reader`]); then every tensor the index names must be in its
//! shard ([`CheckpointError::MissingTensor`]), and every tensor of a shard must be named by the index for that shard
//! ([`CheckpointError::DuplicateTensor`] if it names another, [`CheckpointError::Unindexed`] if none).

use super::error::CheckpointError;
use super::reader::SafetensorsFile;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Suffix of an index file.
pub(super) const INDEX_SUFFIX: &str = ".safetensors.index.json";

#[derive(serde::Deserialize)]
struct RawIndex {
    weight_map: BTreeMap<String, String>,
}

/// The index's `weight_map` (tensor → shard file name), checked for shard names that stay in the index's folder.
pub(super) fn read_index(index: &Path) -> Result<BTreeMap<String, String>, CheckpointError> {
    let text =
        std::fs::read_to_string(index).map_err(|source| CheckpointError::Io { file: index.to_path_buf(), source })?;
    let invalid = |reason: String| CheckpointError::InvalidIndex { file: index.to_path_buf(), reason };
    let raw: RawIndex = serde_json::from_str(&text)
        .map_err(|e| invalid(format!("{e}; expected {{\"weight_map\": {{tensor: shard file name}}}}")))?;
    if raw.weight_map.is_empty() {
        return Err(invalid("`weight_map` is empty; an index names at least one tensor".into()));
    }
    for (tensor, shard) in &raw.weight_map {
        let plain = !shard.is_empty() && !shard.contains(['/', '\\']) && shard != "." && shard != "..";
        if !plain {
            return Err(invalid(format!(
                "tensor `{tensor}` maps to `{shard}`, not a file name in the index's folder; shards must lie beside \
                 the index"
            )));
        }
    }
    Ok(raw.weight_map)
}

/// Opens every shard `index` names (in file-name order) and checks the shards against the index.
pub(super) fn open_shards(index: &Path) -> Result<Vec<SafetensorsFile>, CheckpointError> {
    let map = read_index(index)?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut shards: BTreeMap<&str, &str> = BTreeMap::new(); // shard → a tensor in it
    for (tensor, shard) in &map {
        shards.entry(shard.as_str()).or_insert(tensor.as_str());
    }
    let mut files = Vec::with_capacity(shards.len());
    for (shard, tensor) in &shards {
        let path = dir.join(shard);
        if !path.is_file() {
            return Err(CheckpointError::MissingShard {
                index: index.to_path_buf(),
                shard: shard.to_string(),
                tensor: tensor.to_string(),
            });
        }
        files.push(SafetensorsFile::open(&path)?);
    }
    let names: Vec<BTreeSet<&str>> =
        files.iter().map(|f| f.tensors().iter().map(|t| t.name.as_str()).collect()).collect();
    let position: BTreeMap<&str, usize> = shards.keys().enumerate().map(|(i, s)| (*s, i)).collect();
    for (tensor, shard) in &map {
        let i = position[shard.as_str()];
        if !names[i].contains(tensor.as_str()) {
            return Err(CheckpointError::MissingTensor {
                file: files[i].path().to_path_buf(),
                tensor: tensor.clone(),
                expected_by: "index",
            });
        }
    }
    for (i, f) in files.iter().enumerate() {
        for t in f.tensors() {
            match map.get(&t.name) {
                None => {
                    return Err(CheckpointError::Unindexed {
                        file: f.path().to_path_buf(),
                        tensor: t.name.clone(),
                        index: index.to_path_buf(),
                    })
                }
                Some(shard) if position[shard.as_str()] != i => {
                    return Err(CheckpointError::DuplicateTensor {
                        file: f.path().to_path_buf(),
                        tensor: t.name.clone(),
                        other: dir.join(shard),
                        indexed: false,
                    })
                }
                Some(_) => {}
            }
        }
    }
    Ok(files)
}

/// What a user's path points at.
pub(crate) enum Located {
    /// A sharded checkpoint's index.
    Index(PathBuf),
    /// One `.safetensors` file.
    File(PathBuf),
}

/// Whether a file name is a sharded checkpoint's index: `*.safetensors.index.json`, or a variant's
/// `*.safetensors.index.<variant>.json` (diffusers' and transformers' `variant=` naming).
fn is_index_name(name: &str) -> bool {
    name.ends_with(INDEX_SUFFIX)
        || name.split_once(".safetensors.index.").is_some_and(|(_, rest)| rest.ends_with(".json") && rest.len() > 5)
}

/// Resolves the path given by the user (see [`super::Checkpoint::open`]).
pub(crate) fn locate(path: &Path) -> Result<Located, CheckpointError> {
    let not = |reason: String| CheckpointError::NotACheckpoint { path: path.to_path_buf(), reason };
    let meta = std::fs::metadata(path).map_err(|source| CheckpointError::Io { file: path.to_path_buf(), source })?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if meta.is_file() {
        if is_index_name(name) {
            return Ok(Located::Index(path.to_path_buf()));
        }
        if name.ends_with(".safetensors") || name.ends_with(".gguf") {
            return Ok(Located::File(path.to_path_buf()));
        }
        return Err(not(format!("not a .safetensors or .gguf file or a *{INDEX_SUFFIX} index")));
    }
    let entries = std::fs::read_dir(path).map_err(|source| CheckpointError::Io { file: path.to_path_buf(), source })?;
    let (mut indexes, mut files) = (Vec::new(), Vec::new());
    for e in entries {
        let e = e.map_err(|source| CheckpointError::Io { file: path.to_path_buf(), source })?;
        let n = e.file_name().to_string_lossy().into_owned();
        if n.ends_with(INDEX_SUFFIX) {
            indexes.push(e.path());
        } else if n.ends_with(".safetensors") {
            files.push(e.path());
        }
    }
    indexes.sort();
    files.sort();
    match (indexes.as_slice(), files.as_slice()) {
        ([index], _) => Ok(Located::Index(index.clone())),
        ([], [file]) => Ok(Located::File(file.clone())),
        ([], []) if path.join("model_index.json").is_file() => {
            Err(not("a diffusers pipeline folder (model_index.json) holds several components; weightferry reads one \
             transformer's checkpoint: pass its transformer/ subfolder"
                .into()))
        }
        ([], []) => Err(not("no .safetensors file or *.safetensors.index.json in this folder".into())),
        ([], many) => Err(not(format!(
            "{} .safetensors files and no *{INDEX_SUFFIX}; pass one file, or the folder of a sharded checkpoint \
             with its index",
            many.len()
        ))),
        (many, _) => Err(not(format!("{} *{INDEX_SUFFIX} files; pass the index to use", many.len()))),
    }
}

#[cfg(test)]
mod tests {
    use super::is_index_name;

    #[test]
    fn an_index_is_named_as_the_libraries_name_it_with_or_without_a_variant() {
        assert!(is_index_name("model.safetensors.index.json"));
        assert!(is_index_name("diffusion_pytorch_model.safetensors.index.fp16.json"));
        assert!(!is_index_name("model.safetensors"));
        assert!(!is_index_name("model.safetensors.index..json"));
        assert!(!is_index_name("config.json"));
    }
}
