//! weightferry's harness: everything that drives the library without being part of it.
//!
//! - [`engine`]: the reference engine (synthetic weights, real compute per module, the forward hooks a host engine
//!   would call) and the single-process `run` driver; on GPUs (feature `cuda`) the cuBLAS engine and the bench.
//! - [`distributed_run`]: one rank of a distributed layerwise run (or every rank as threads on the simulated device),
//!   through the library's `get_offload_backend` with the rank's collective.
//! - [`report`], [`trace`]: the text / JSON run report and the Chrome / Perfetto timeline.
//! - [`progress`]: a run's progress as the device makes it, and the terminal progress bars.
//! - [`cli`]: the `weightferry` command line (`run`, `plan`, `launch`, `bench`, `bench-gather`).
//!
//! The library (`weightferry`) never depends on this crate: a host engine embeds the library alone.

pub mod cli;
pub mod distributed_run;
pub mod engine;
pub mod progress;
pub mod report;
pub mod trace;
