//! Real checkpoints: safetensors files (one file, or a sharded folder with its index) and GGUF files mapped read-only
//! and checked before any byte is used (`reader.rs`, `index.rs`, `gguf.rs`); a pipeline description derived from their tensor
//! names (`describe.rs`); a [`HostModel`](crate::model::HostModel) filled from the mapping (`load.rs`); reads of
//! byte ranges around the page cache for the disk tier (`direct.rs`); model tensors a file names otherwise, as rows
//! of its tensors (`views.rs`).
//!
//! Every failure is a [`CheckpointError`] naming the file and the tensor; nothing panics on bad input and nothing
//! is read outside a mapping.

pub mod convert;
mod describe;
mod direct;
mod error;
mod gguf;
mod header;
mod index;
mod load;
mod reader;
mod region;
mod views;

pub use describe::{derive_pipeline, BlockList, DeriveOptions, Derived};
pub use direct::{AlignedBuf, DirectFile, DiskSource, DIRECT_ALIGN};
pub use error::CheckpointError;
pub use header::FileTensor;
pub use reader::SafetensorsFile;
pub use region::FileRegion;
pub use views::{RowRange, View};

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use views::ViewTensor;

/// An opened checkpoint: its files, mapped and checked, and every tensor by name.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    index: Option<PathBuf>,
    files: Vec<SafetensorsFile>,
    by_name: BTreeMap<String, (usize, usize)>,
    /// Model tensors the files name otherwise ([`with_views`](Self::with_views)).
    derived: BTreeMap<String, ViewTensor>,
    /// Model tensors the files hold in a form only the module gives.
    module_held: BTreeSet<String>,
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file, a `*.safetensors.index.json`, or a folder holding exactly one index
    /// (sharded) or, without an index, exactly one `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint, CheckpointError> {
        let path = path.as_ref();
        let (index_path, files) = match index::locate(path)? {
            index::Located::Index(ix) => {
                let files = index::open_shards(&ix)?;
                (Some(ix), files)
            }
            index::Located::File(f) => (None, vec![SafetensorsFile::open(&f)?]),
        };
        let mut by_name = BTreeMap::new();
        for (fi, f) in files.iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                // Shards were checked against the index: a name is in one file only.
                by_name.entry(t.name.clone()).or_insert((fi, ti));
            }
        }
        Ok(Checkpoint {
            path: path.to_path_buf(),
            index: index_path,
            files,
            by_name,
            derived: BTreeMap::new(),
            module_held: BTreeSet::new(),
        })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The index file of a sharded checkpoint.
    pub fn index(&self) -> Option<&Path> {
        self.index.as_deref()
    }
    /// Its files (shards in file-name order).
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }
    /// Every tensor by name (name order), with the file it is in.
    pub fn tensors(&self) -> impl Iterator<Item = (&SafetensorsFile, &FileTensor)> {
        self.by_name.values().map(|&(f, t)| (&self.files[f], &self.files[f].tensors()[t]))
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }
    /// Whether it has no tensor.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
    /// A tensor by name, with its file (a view's: the file of its first rows).
    pub fn tensor(&self, name: &str) -> Option<(&SafetensorsFile, &FileTensor)> {
        match self.derived.get(name) {
            Some(ViewTensor::Slice { file, tensor }) => Some((&self.files[*file], tensor)),
            Some(ViewTensor::Pieces { tensor, pieces }) => Some((&self.files[pieces[0].0], tensor)),
            None => self.by_name.get(name).map(|&(f, t)| (&self.files[f], &self.files[f].tensors()[t])),
        }
    }
    /// A tensor that is one byte range of a file, by name, with the index of its file in [`files`](Self::files)
    /// (`None` for one assembled from several: [`is_assembled`](Self::is_assembled)).
    pub fn locate(&self, name: &str) -> Option<(usize, &FileTensor)> {
        match self.derived.get(name) {
            Some(ViewTensor::Slice { file, tensor }) => Some((*file, tensor)),
            Some(ViewTensor::Pieces { .. }) => None,
            None => self.by_name.get(name).map(|&(f, t)| (f, &self.files[f].tensors()[t])),
        }
    }
    /// Whether `name` is a view of rows of several file tensors (read and concatenated, never served from a file).
    pub fn is_assembled(&self, name: &str) -> bool {
        matches!(self.derived.get(name), Some(ViewTensor::Pieces { .. }))
    }
    /// Whether a view says the module holds `name` in a form the file does not give.
    pub fn is_module_held(&self, name: &str) -> bool {
        self.module_held.contains(name)
    }
    /// A tensor's bytes, read from its file ([`SafetensorsFile::read`]; a view's pieces in order); `None` for a name
    /// not in the checkpoint.
    pub fn read_tensor(&self, name: &str) -> Option<Result<Vec<u8>, CheckpointError>> {
        let (f, t) = self.tensor(name)?;
        let mut out = vec![0u8; usize::try_from(t.len).ok()?];
        let Some(ViewTensor::Pieces { pieces, .. }) = self.derived.get(name) else {
            return Some(f.read(t, &mut out).map(|()| out));
        };
        let mut at = 0;
        for (file, piece) in pieces {
            let end = at + piece.len as usize;
            if let Err(e) = self.files[*file].read(piece, &mut out[at..end]) {
                return Some(Err(e));
            }
            at = end;
        }
        Some(Ok(out))
    }
    /// Bytes of all tensors.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors().map(|(_, t)| t.len).sum()
    }
}
