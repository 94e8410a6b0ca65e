//! Drivers: what runs the reference engine through the library and checks the result.
//!
//! - [`compare`]: resident, then offloaded, through one engine, compared bit for bit (every run driver's sequence).
//! - [`run`]: the `run` driver on the simulated platform — the comparison and its report.
//! - [`distributed`]: one rank of a distributed layerwise run (or every rank as threads on the simulated device),
//!   through the library's `get_offload_backend` with the rank's collective.
//! - `gpu` (feature `cuda`): `run --platform cuda`, the same comparison on a GPU.
//! - [`launch`]: `weightferry launch`, which starts the ranks of one distributed run as local processes.

pub mod compare;
pub mod distributed;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod launch;
pub mod run;
