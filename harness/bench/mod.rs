//! Benchmarks on GPUs.
//!
//! - `gpu` (feature `cuda`): `weightferry bench`, every offload configuration's step time against its physical
//!   bound.
//! - `gather` (feature `nccl`): `weightferry bench-gather`, the block-rebuild rate of shard H2D + NCCL AllGather
//!   and the compute slowdown it causes.

#[cfg(feature = "nccl")]
pub mod gather;
#[cfg(feature = "cuda")]
pub mod gpu;
