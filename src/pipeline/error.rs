//! [`PipelineError`]: what is wrong with a pipeline description, from the builder, the JSON loader or
//! [`PipelineDesc::validate`](super::PipelineDesc::validate).

use super::DType;

/// A pipeline description that breaks a structural rule. `at` names where: a dotted module or tensor path for the
/// builder and [`PipelineDesc::validate`](super::PipelineDesc::validate), a JSON path
/// (`modules.transformer.tensors.weight.shape`) for the loader. Every message ends with the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// A declaration this version does not support; the message names the replacement.
    #[error("{at}: {message}")]
    Unsupported {
        /// Where.
        at: String,
        /// Why, and what to declare instead.
        message: &'static str,
    },
    /// The text is not JSON.
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Syntax {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's description.
        message: String,
    },
    /// A pipeline file could not be read.
    #[error("cannot read pipeline file `{path}`: {message}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's description.
        message: String,
    },
    /// A JSON value of the wrong type.
    #[error("{at}: expected {expected}")]
    WrongType {
        /// JSON path of the value.
        at: String,
        /// What was expected there.
        expected: &'static str,
    },
    /// A required key is absent.
    #[error("{at}: required key is missing; {hint}")]
    MissingKey {
        /// JSON path where the key belongs.
        at: String,
        /// How to write it.
        hint: &'static str,
    },
    /// A key the format does not define (usually a typo).
    #[error("{at}: unknown key; expected one of: {expected}")]
    UnknownKey {
        /// JSON path of the unknown key.
        at: String,
        /// The keys allowed in that object.
        expected: &'static str,
    },
    /// A key written twice in one JSON object.
    #[error("{at}: key appears more than once in the same object; keep one")]
    DuplicateKey {
        /// JSON path of the repeated key.
        at: String,
    },
    /// Two attributes of one module share a name.
    #[error("{at}: name declared twice in the same module (tensors and child modules share one namespace); rename or remove one")]
    DuplicateName {
        /// Path of the second declaration.
        at: String,
    },
    /// An attribute name that is not a single identifier-like segment.
    #[error(
        "{at}: `{name}` is not a valid attribute name; use a non-empty name without `.`, spaces or control characters"
    )]
    InvalidName {
        /// Where the name was given.
        at: String,
        /// The rejected name.
        name: String,
    },
    /// A declared path that is not a dotted path.
    #[error("{at}: `{path}` is not a valid dotted path; join non-empty names (no spaces or control characters) with single dots, e.g. `transformer.blocks`")]
    InvalidPath {
        /// Where the path was declared.
        at: String,
        /// The rejected path.
        path: String,
    },
    /// A module or pipeline without a class name.
    #[error("{at}: class name is empty; give the class, e.g. `ModuleList`")]
    EmptyClass {
        /// The module (or `class` for the pipeline).
        at: String,
    },
    /// A dtype name the format does not know.
    #[error("{at}: unknown dtype `{found}`; use one of f32, f16, bf16, f8e4m3, f8e5m2, i64, i32, i8, u8")]
    UnknownDType {
        /// Where it was given.
        at: String,
        /// The rejected name.
        found: String,
    },
    /// A tensor kind the format does not know.
    #[error("{at}: unknown tensor kind `{found}`; use parameter, persistent_buffer or non_persistent_buffer")]
    UnknownKind {
        /// Where it was given.
        at: String,
        /// The rejected name.
        found: String,
    },
    /// Strides and shape of different lengths.
    #[error("{at}: shape has {shape_len} dimensions but strides has {strides_len}; give exactly one stride per dimension, or omit strides for a contiguous tensor")]
    StrideRank {
        /// The tensor.
        at: String,
        /// Dimensions in the shape.
        shape_len: usize,
        /// Entries in the strides.
        strides_len: usize,
    },
    /// A size computation that does not fit in 64 bits.
    #[error("{at}: {what} overflows 64 bits; use realistic sizes")]
    Overflow {
        /// The tensor, storage or section.
        at: String,
        /// The quantity that overflowed.
        what: &'static str,
    },
    /// A view reaching past the end of its storage.
    #[error("{at}: the view needs {needed} elements of its storage (storage_offset + span) but the storage holds {numel}; shrink the view or enlarge the storage")]
    ViewOutsideStorage {
        /// The tensor.
        at: String,
        /// `storage_offset + physical_numel`.
        needed: u64,
        /// Elements in the storage.
        numel: u64,
    },
    /// A tensor whose dtype differs from its storage's.
    #[error("{at}: tensor dtype {} differs from its storage's dtype {}; a view must have its storage's dtype", .tensor.name(), .storage.name())]
    DTypeMismatch {
        /// The tensor.
        at: String,
        /// The tensor's dtype.
        tensor: DType,
        /// The storage's dtype.
        storage: DType,
    },
    /// A tie whose target is not a tensor of the pipeline.
    #[error("{at}: `{target}` is not a tensor of this pipeline; name an existing tensor by its dotted path (from the root in JSON, from the declaring module in the builder)")]
    UnknownTensor {
        /// The tie.
        at: String,
        /// The missing target, as an absolute dotted path.
        target: String,
    },
    /// A declared module path that names no module of the pipeline.
    #[error("{at}: module `{path}` does not exist in this pipeline; name a module of its tree by its dotted path")]
    UnknownModule {
        /// Where the path was declared.
        at: String,
        /// The missing module.
        path: String,
    },
    /// Ties that lead back to where they started.
    #[error("{at}: ties form a cycle through `{target}`; one tensor of the chain must own its storage")]
    TieCycle {
        /// The tensor whose tie chain loops.
        at: String,
        /// A tensor on the loop.
        target: String,
    },
    /// A tensor naming an undeclared storage.
    #[error("{at}: storage `{name}` is not declared; declare it in the top-level `storages` object")]
    UnknownStorage {
        /// The reference.
        at: String,
        /// The missing name.
        name: String,
    },
    /// A tensor referencing a [`StorageId`](super::StorageId) missing from the storage table.
    #[error(
        "{at}: storage {id} is not in the pipeline's storage table; add it or point the tensor at an existing storage"
    )]
    MissingStorage {
        /// The tensor.
        at: String,
        /// The missing id.
        id: u64,
    },
    /// A storage that no tensor views.
    #[error("{at}: storage is declared but no tensor views it; remove it or view it from a tensor")]
    UnusedStorage {
        /// The storage.
        at: String,
    },
    /// A tensor given both `tied_to` and `storage`.
    #[error("{at}: `tied_to` and `storage` cannot both be given; a tensor views exactly one storage")]
    ConflictingStorage {
        /// The tensor.
        at: String,
    },
    /// A `repeat` count outside `1..=MAX_REPEAT`.
    #[error("{at}: repeat count {count} is out of range; use 1 to {max}")]
    RepeatCount {
        /// The `repeat` key.
        at: String,
        /// The rejected count.
        count: u64,
        /// The largest allowed count.
        max: u64,
    },
    /// An explicit block of a `repeat` list that is not numbered in order.
    #[error("{at}: the explicit blocks of a repeat must be named 0, 1, … in order; expected `{expected}` here")]
    BlockIndex {
        /// The misnamed block.
        at: String,
        /// The name it should have.
        expected: u64,
    },
    /// A description that expands past the size limit.
    #[error("{at}: the pipeline expands to more than {limit} modules and tensors; use fewer or smaller repeats")]
    TooLarge {
        /// Where the limit was crossed.
        at: String,
        /// The limit.
        limit: u64,
    },
    /// An unsupported `format` string.
    #[error("{at}: unsupported format `{found}`; this version reads `{expected}`")]
    Format {
        /// The `format` key.
        at: String,
        /// The rejected value.
        found: String,
        /// The supported value.
        expected: &'static str,
    },
    /// A [`StorageHandle`](super::builder::StorageHandle) that this builder did not hand out.
    #[error("{at}: the storage handle does not belong to this builder; use a handle returned by the same builder")]
    ForeignHandle {
        /// The tensor.
        at: String,
    },
}
