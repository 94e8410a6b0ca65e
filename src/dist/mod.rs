//! Multi-process distributed runs: one process per rank (per GPU), launched the way the ecosystem launches
//! PyTorch jobs.
//!
//! - `env.rs`: [`LaunchEnv`], this process's rank, world size, local rank and rendezvous address, read from
//!   `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (torchrun, `weightferry launch`, job scripts;
//!   SLURM's `SLURM_PROCID` / `SLURM_NTASKS` / `SLURM_LOCALID` as fallbacks).
//! - [`rendezvous`]: [`Rendezvous`], a small TCP exchange through rank 0 (broadcast, all-gather of bytes, barrier)
//!   that ships the NCCL unique id and carries the simulated collective.
//! - `tcp_collective.rs`: [`TcpCollective`], the AllGather contract across processes on the simulated device.
//! - [`allgather_engine`]: which NCCL AllGather a GPU run uses (copy engines or kernels), agreed by every rank.
//! - [`nccl_bootstrap`]: a rank's NCCL bootstrap as one call (the engine agreement, the symmetric heap, rank 0's
//!   unique id) over any [`RankExchange`] (the rendezvous, or a host engine's store); the CUDA side under `nccl`.
//! - [`rank`]: a rank's collective built from the launch environment, the one bootstrap every front end goes
//!   through: [`rank::join`] (the rendezvous with a fingerprint, every rank's fingerprint back) and
//!   [`rank::collective`] (the simulated collective or NCCL over it), typed [`rank::RankError`]s. The library
//!   session composes them for a distributed session, the CLI's distributed `run` with its own rank check.
//!
//! The launcher that starts local ranks (`weightferry launch`) belongs to the harness crate, not to the library.
//!
//! The rendezvous is the control plane and runs on tokio (it owns a current-thread runtime behind a blocking API);
//! the scheduler stays on OS threads.
//!
//! Invariant: every rank of a run calls the same rendezvous operations and the same AllGathers in the same order;
//! any failure (bad environment, a rank out of step or gone, a failed AllGather) is an error naming the rank,
//! never a hang longer than the rendezvous timeout.

pub mod allgather_engine;
mod env;
pub mod nccl_bootstrap;
pub mod rank;
pub mod rendezvous;
mod tcp_collective;

pub use env::{LaunchEnv, LaunchEnvError};
#[cfg(feature = "nccl")]
pub use nccl_bootstrap::{bootstrap_nccl, bootstrap_nccl_from_env, NcclBootstrap};
pub use nccl_bootstrap::{BootstrapError, ExchangeError, RankExchange};
pub use rendezvous::{Fingerprint, Rendezvous, RendezvousError, RendezvousOptions, RunId};
pub use tcp_collective::TcpCollective;
