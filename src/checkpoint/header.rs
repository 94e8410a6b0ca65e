//! What a checked checkpoint file's header says, whatever its format (safetensors or GGUF): its tensors (name,
//! dtype, shape and byte range in the file), its string metadata and where its data region starts.

use crate::pipeline::DType;
use std::collections::BTreeMap;

/// One tensor of a file, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileTensor {
    /// Its name in the header (dotted parameter name).
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Byte offset of its data from the start of the file.
    pub offset: u64,
    /// Its byte length.
    pub len: u64,
}

/// A checked header: the tensors by start offset, the string metadata and where the data region starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors in file order (by offset).
    pub tensors: Vec<FileTensor>,
    /// A safetensors header's `__metadata__` map, a GGUF header's string values (empty if none).
    pub metadata: BTreeMap<String, String>,
    /// File offset of the data region (safetensors: `8 + header length`; GGUF: the header's end, aligned).
    pub data_start: u64,
}
