//! The pipeline description: what the model looks like (its module tree, tensors, storages and declarations), built
//! in code ([`builder`]), read from and written to its JSON format ([`json`]), or taken from the built-in
//! [`presets`]. Metadata only, never weight values; the offload plan made from it lives in [`crate::plan`].

pub mod builder;
mod desc;
mod error;
pub mod json;
pub mod presets;
mod validate;

pub use desc::{
    align_up, join, ComponentDecls, DType, ModuleNode, OffloadPlanDecl, PipelineDesc, StorageDesc, StorageId,
    TensorDesc, TensorKind, DEVICE_ALIGN,
};
pub use error::PipelineError;
pub(crate) use validate::is_valid_name;
