//! The offload plan: what offload will do to a pipeline ([`crate::pipeline`]) under a config, decided before
//! anything is touched: component discovery, the resolver, the device-memory budget planner and the plan report.
//!
//! The resolved plan's types ([`ResolvedPlan`], [`ResolvedComponent`], [`StackPlan`], [`BudgetPlan`]) live apart
//! from the resolver and the budget planner that fill them, so the two never import each other.

pub mod budget;
pub mod bytes;
pub mod discovery;
pub mod report;
mod resolved;
pub mod resolver;
mod stack;

pub use resolved::{BudgetPlan, ComponentKind, ResolvedComponent, ResolvedPlan};
pub use resolver::{resolve_offload_plan, PlanError};
pub use stack::StackPlan;
