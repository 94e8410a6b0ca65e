//! `weightferry._core`, the native module of the Python package `weightferry`: a small, torch-free surface over
//! the library (strings in, strings out).
//!
//! [`api`] is the logic (config and pipeline loading, the plan report as JSON, the CLI's error texts, panics
//! turned into errors) and builds without Python; `bindings` (feature `python`, which maturin enables) is the pyo3
//! module over it. Plain cargo builds therefore never link libpython.

pub mod api;
#[cfg(feature = "python")]
mod bindings;
