//! Pipeline descriptions and the offload plan: what the model looks like, and what offload will do to it.

pub mod builder;
pub mod json;
pub mod pipeline;
pub mod presets;

pub use pipeline::*;
pub mod budget;
pub mod discovery;
pub mod report;
pub mod resolver;

pub use resolver::{resolve_offload_plan, BlockStack, ComponentKind, PlanError, ResolvedComponent, ResolvedPlan};
