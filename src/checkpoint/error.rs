//! The one error type of checkpoint reading, description and loading. Every variant names the file and, where
//! there is one, the tensor; every message ends with what to do.

use std::path::PathBuf;
use weightferry_actors::platform::PlatformError;

/// Why a checkpoint could not be opened, described or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file changed (truncated, resized or rewritten in place) after it was opened, or a read of it failed.
    #[error("{reason}")]
    Changed {
        /// The file.
        file: PathBuf,
        /// What changed, naming the file and the fix.
        reason: String,
    },
    /// The path, a shard or the index could not be opened, read or mapped.
    #[error("{}: cannot read: {source}; check the path and its permissions", file.display())]
    Io {
        /// The file or folder.
        file: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The path is neither a `.safetensors` file, an index, nor a folder with exactly one of either.
    #[error("{}: {reason}", path.display())]
    NotACheckpoint {
        /// The path given.
        path: PathBuf,
        /// What was found and what is expected.
        reason: String,
    },
    /// The file ends before its header (or its 8-byte header length), or before the data its header declares.
    #[error(
        "{}: truncated: the header declares {expected} bytes, the file has {actual}{}; the file is incomplete \
         (re-download or re-save it)",
        file.display(), tensor.as_ref().map(|t| format!(" (tensor `{t}` is cut)")).unwrap_or_default()
    )]
    Truncated {
        /// The file.
        file: PathBuf,
        /// The first tensor that does not fit, if the header itself is complete.
        tensor: Option<String>,
        /// Bytes the header (or its length field) implies.
        expected: u64,
        /// Bytes the file has.
        actual: u64,
    },
    /// The header is not one of its format (safetensors: UTF-8 JSON no larger than the format allows; GGUF: see
    /// `gguf.rs`).
    #[error("{}: corrupt header: {reason}; the file is not a valid {format} file", file.display())]
    CorruptHeader {
        /// The file.
        file: PathBuf,
        /// The format it was read as: `"safetensors"` or `"GGUF"`.
        format: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's dtype is not one the pipeline description supports.
    #[error(
        "{}: tensor `{tensor}` has dtype {dtype}, which weightferry does not support; supported: F32 F16 BF16 \
         F8_E4M3 F8_E5M2 I64 I32 I8 U8 (convert the checkpoint)",
        file.display()
    )]
    UnsupportedDtype {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype as the header spells it.
        dtype: String,
    },
    /// A tensor's byte length is not its shape times its element size (or its offsets are reversed).
    #[error(
        "{}: tensor `{tensor}` ({dtype} {shape:?}) needs {expected} bytes but its offsets span {actual}; the \
         header is corrupt",
        file.display()
    )]
    ShapeBytesMismatch {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype as the header spells it.
        dtype: String,
        /// The shape.
        shape: Vec<u64>,
        /// Bytes the shape and dtype need (saturating).
        expected: u128,
        /// Bytes the offsets span (negative spans count as 0).
        actual: u64,
    },
    /// A tensor's data lies (partly) past the end of the file, and the header's tensors do not tile its data
    /// region (otherwise the file is [`CheckpointError::Truncated`]).
    #[error(
        "{}: tensor `{tensor}` has offsets [{start}, {end}) past the end of the data ({data_len} bytes); the header \
         is corrupt",
        file.display()
    )]
    OffsetsPastEnd {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Start offset in the data region.
        start: u64,
        /// End offset in the data region.
        end: u64,
        /// Bytes in the data region.
        data_len: u64,
    },
    /// Two tensors' byte ranges overlap.
    #[error("{}: tensors `{tensor}` and `{other}` overlap in the data region; the header is corrupt", file.display())]
    Overlap {
        /// The file.
        file: PathBuf,
        /// The later tensor (by start offset).
        tensor: String,
        /// The tensor it overlaps.
        other: String,
    },
    /// The data region has bytes no tensor covers (a hole, or bytes after the last tensor); the safetensors format
    /// forbids both.
    #[error(
        "{}: bytes [{start}, {end}) of the data region belong to no tensor{}; the header is corrupt",
        file.display(), after.as_ref().map(|t| format!(" (after `{t}`)")).unwrap_or_default()
    )]
    Uncovered {
        /// The file.
        file: PathBuf,
        /// The tensor the uncovered bytes follow, if any.
        after: Option<String>,
        /// Start of the uncovered bytes in the data region.
        start: u64,
        /// End of the uncovered bytes.
        end: u64,
    },
    /// The safetensors crate rejected a header our own checks accepted.
    #[error("{}: the safetensors reader rejects the header: {source}", file.display())]
    Rejected {
        /// The file.
        file: PathBuf,
        /// The crate's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The index (`*.safetensors.index.json`) is not valid JSON with a `weight_map` of tensor → shard file.
    #[error("{}: invalid index: {reason}", file.display())]
    InvalidIndex {
        /// The index file.
        file: PathBuf,
        /// What is wrong, and the fix.
        reason: String,
    },
    /// A shard the index names does not exist.
    #[error("{}: shard `{shard}` (holding `{tensor}`) is missing; download every shard the index names", index.display())]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard's file name.
        shard: String,
        /// A tensor the index puts in it.
        tensor: String,
    },
    /// A tensor the index (or the pipeline description) names is not in the file it should be in.
    #[error("{}: tensor `{tensor}` is missing{}", file.display(), hint(expected_by))]
    MissingTensor {
        /// The file (the shard, or for the description the checkpoint path).
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Who expects it: the index or the pipeline description.
        expected_by: &'static str,
    },
    /// A tensor lies in a shard the index does not assign it to, or in two shards.
    #[error(
        "{}: tensor `{tensor}` is also in `{}`{}; a tensor must be in exactly the shard the index names",
        file.display(), other.display(), if *indexed { "" } else { " (the index does not name it there)" }
    )]
    DuplicateTensor {
        /// The shard holding the extra copy.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The other file (the shard the index names, or another shard).
        other: PathBuf,
        /// Whether the index names this file for it.
        indexed: bool,
    },
    /// A shard holds a tensor the index does not name at all.
    #[error(
        "{}: tensor `{tensor}` is not in the index `{}`; the shard does not match its index (re-download both)",
        file.display(), index.display()
    )]
    Unindexed {
        /// The shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The index file.
        index: PathBuf,
    },
    /// A tensor name cannot become a module path (not dotted names without spaces or control characters, or a name that is both
    /// a tensor and a module).
    #[error("{}: tensor `{tensor}`: {reason}", file.display())]
    BadName {
        /// The checkpoint path.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint holds a whole pipeline (component prefixes such as `text_encoder.`, `vae.`, or every key under
    /// `transformer.`); one transformer's checkpoint with its own parameter names is supported.
    #[error(
        "{}: holds pipeline components (top-level prefixes {prefixes:?}); weightferry reads one transformer's \
         checkpoint with its own parameter names, no component prefix: pass the transformer's own file or folder \
         (diffusers layout: <pipeline>/transformer/)",
        file.display()
    )]
    WholePipeline {
        /// The checkpoint path.
        file: PathBuf,
        /// The component prefixes found.
        prefixes: Vec<String>,
    },
    /// A view (a model tensor the file names otherwise: [`View`](super::View)) that the file cannot give.
    #[error(
        "{}: tensor `{tensor}` (a view of the file's tensors, from the model's single-file conversion): {reason}; \
         the file does not match the model's conversion (check that it is this model's file)",
        file.display()
    )]
    BadView {
        /// The checkpoint.
        file: PathBuf,
        /// The model tensor the view names.
        tensor: String,
        /// What the file lacks.
        reason: String,
    },
    /// A tensor of the description and its checkpoint tensor disagree in dtype or shape, or the description's
    /// view is not the whole contiguous storage a checkpoint tensor fills.
    #[error("{}: tensor `{tensor}`: {reason}", file.display())]
    DescriptionMismatch {
        /// The checkpoint path.
        file: PathBuf,
        /// The tensor (its checkpoint name).
        tensor: String,
        /// The disagreement.
        reason: String,
    },
    /// The derived description breaks a structural rule.
    #[error("{}: the derived pipeline description is invalid: {source}", file.display())]
    Description {
        /// The checkpoint path.
        file: PathBuf,
        /// The rule broken.
        #[source]
        source: crate::pipeline::PipelineError,
    },
    /// The platform failed to allocate or fill a host buffer.
    #[error("{}: loading into host memory failed: {source}", file.display())]
    Platform {
        /// The checkpoint path.
        file: PathBuf,
        /// The platform's error.
        #[source]
        source: PlatformError,
    },
}

fn hint(expected_by: &str) -> String {
    match expected_by {
        "index" => " though the index names it; the shard does not match its index (re-download both)".to_string(),
        other => format!(" though the {other} names it; use the checkpoint the description was made for"),
    }
}
