//! The offload plan: what offload will do to a pipeline ([`crate::pipeline`]) under a config, decided before
//! anything is touched: component discovery, the resolver, the device-memory budget planner and the plan report.

pub mod budget;
pub mod discovery;
pub mod report;
pub mod resolver;

pub use resolver::{resolve_offload_plan, BlockStack, ComponentKind, PlanError, ResolvedComponent, ResolvedPlan};
