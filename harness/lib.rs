//! weightferry's harness: everything that drives the library without being part of it, organised by role.
//!
//! - [`engine`]: the reference engine (synthetic weights, real compute per module, the forward hooks a host engine
//!   would call); on GPUs (feature `cuda`) its cuBLAS compute.
//! - [`drivers`]: what runs the engine through the library — the single-process `run` driver, resident against
//!   offloaded compared bit for bit, one rank of a distributed run, and the local process launcher.
//! - [`bench`](mod@bench): GPU measurements — the offload benchmark matrix (feature `cuda`) and the shard-gather bench
//!   (feature `nccl`).
//! - [`report`]: the text / JSON run report, the checkpoint summary, the Chrome / Perfetto timeline and the
//!   terminal progress bars.
//! - [`cli`]: the `weightferry` command line (`run`, `plan`, `inspect`, `launch`, `bench`, `bench-gather`): it
//!   parses arguments and dispatches to the above.
//!
//! The library (`weightferry`) never depends on this crate: a host engine embeds the library alone.

pub mod bench;
pub mod cli;
pub mod drivers;
pub mod engine;
pub mod report;
