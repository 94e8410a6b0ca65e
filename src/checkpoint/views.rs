//! A checkpoint named the way a model names its tensors when the file names them otherwise (an original model's
//! single file: a Flux GGUF in Black Forest Labs' names, where one fused `qkv` tensor holds a model's `to_q`,
//! `to_k` and `to_v`). Each model tensor the file lacks by name is a [`View`]: rows of one file tensor (served from
//! the file like any tensor: a byte range of it), rows of several concatenated (assembled into a host master when
//! the checkpoint is loaded), or the module's own (the file holds it in a form no rows give: its bytes come from
//! the module). The caller works the views out (the Python package from the host library's own conversion
//! function); this file checks them against the file before anything is read.

use super::error::CheckpointError;
use super::header::FileTensor;
use super::Checkpoint;
use std::collections::BTreeMap;

/// Rows `start..end` (along dim 0) of the file tensor `source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowRange {
    /// The file tensor's name.
    pub source: String,
    /// First row.
    pub start: u64,
    /// One past the last row.
    pub end: u64,
}

/// Where a model tensor the file does not name lies in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum View {
    /// These rows, concatenated in order (one range: a byte range of the file; several: assembled at load).
    Rows(Vec<RowRange>),
    /// The module holds it in a form the file does not give (its bytes come from the module).
    Module,
}

/// A model tensor a view gives, as the checkpoint holds it.
#[derive(Debug, Clone)]
pub(super) enum ViewTensor {
    /// One byte range of file `file`: `tensor` has the model's name, the source's dtype and the rows' shape.
    Slice { file: usize, tensor: FileTensor },
    /// Byte ranges of files, concatenated: `tensor` names the whole (its `offset` means nothing), `pieces` the
    /// ranges in order with their files.
    Pieces { tensor: FileTensor, pieces: Vec<(usize, FileTensor)> },
}

impl Checkpoint {
    /// This checkpoint with `views` added: each names a model tensor the file does not hold by that name
    /// ([`CheckpointError::BadView`] for a name it holds, an unknown source, rows outside the source, or ranges
    /// that differ in dtype or in their shape past dim 0). Nothing is read.
    pub fn with_views(mut self, views: BTreeMap<String, View>) -> Result<Checkpoint, CheckpointError> {
        for (name, view) in views {
            let bad =
                |reason: String| CheckpointError::BadView { file: self.path.clone(), tensor: name.clone(), reason };
            if self.by_name.contains_key(&name) {
                return Err(bad("the file holds a tensor of this name; a view names only tensors it lacks".into()));
            }
            match view {
                View::Module => {
                    self.module_held.insert(name);
                }
                View::Rows(ranges) => {
                    let derived = self.derive(&name, &ranges).map_err(bad)?;
                    self.derived.insert(name, derived);
                }
            }
        }
        Ok(self)
    }

    /// The tensor `ranges` give, named `name`, or why they cannot.
    fn derive(&self, name: &str, ranges: &[RowRange]) -> Result<ViewTensor, String> {
        let mut pieces = Vec::with_capacity(ranges.len());
        for r in ranges {
            let Some(&(file, ti)) = self.by_name.get(&r.source) else {
                return Err(format!("its rows come from `{}`, which the file does not hold", r.source));
            };
            pieces.push((file, rows_of(&self.files[file].tensors()[ti], r)?));
        }
        let Some((_, first)) = pieces.first() else { return Err("its view names no rows".into()) };
        let (dtype, trailing) = (first.dtype, first.shape[1..].to_vec());
        if let Some((_, other)) = pieces.iter().find(|(_, p)| p.dtype != dtype || p.shape[1..] != trailing[..]) {
            return Err(format!(
                "its rows come from `{}` ({} {:?}) and `{}` ({} {:?}), which differ in dtype or in their shape past \
                 dim 0",
                first.name,
                dtype.name(),
                first.shape,
                other.name,
                other.dtype.name(),
                other.shape
            ));
        }
        if let [(file, only)] = &pieces[..] {
            return Ok(ViewTensor::Slice {
                file: *file,
                tensor: FileTensor { name: name.to_string(), ..only.clone() },
            });
        }
        let rows = pieces.iter().map(|(_, p)| p.shape[0]).sum();
        let len = pieces.iter().map(|(_, p)| p.len).sum();
        let shape = std::iter::once(rows).chain(trailing).collect();
        Ok(ViewTensor::Pieces { tensor: FileTensor { name: name.to_string(), dtype, shape, offset: 0, len }, pieces })
    }
}

/// Rows `r` of `source`, as a file tensor of their own (the source's name; its byte range).
fn rows_of(source: &FileTensor, r: &RowRange) -> Result<FileTensor, String> {
    let Some(&rows) = source.shape.first() else {
        return Err(format!("its rows come from `{}`, a tensor of no dimension (no rows to take)", source.name));
    };
    if r.start >= r.end || r.end > rows {
        return Err(format!(
            "it takes rows {}..{} of `{}`, which has {rows} (shape {:?})",
            r.start, r.end, source.name, source.shape
        ));
    }
    let row_bytes = source.len / rows;
    let shape = std::iter::once(r.end - r.start).chain(source.shape[1..].iter().copied()).collect();
    Ok(FileTensor {
        name: source.name.clone(),
        dtype: source.dtype,
        shape,
        offset: source.offset + r.start * row_bytes,
        len: (r.end - r.start) * row_bytes,
    })
}
