//! The reference engine's synthetic weights for the library's tests (`HostModel::synthetic`, `synthetic_bytes`,
//! `splitmix64`): the harness's own generator, `harness/engine/synthetic.rs`, included here through `#[path]`, so
//! one copy serves both crates (the library cannot depend on the harness). Shared by the tests through `#[path]`.
#![allow(dead_code, unused_imports)] // each test uses part of it

#[path = "../../harness/engine/synthetic.rs"]
#[allow(unreachable_pub)] // public in the harness, where it is reachable
mod generator;
pub(crate) use generator::{splitmix64, synthetic_bytes, SyntheticWeights};
