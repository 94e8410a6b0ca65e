//! Hardware back ends of the platform contract ([`weightferry_actors::platform::Platform`]).
//!
//! The simulated device lives in the `weightferry-actors` crate (it runs anywhere). This module holds the real
//! hardware implementations, each behind its cargo feature:
//!
//! - `cuda` (feature `cuda`): `cuda::CudaPlatform`, NVIDIA GPUs through the CUDA driver API, loaded at run time
//!   (a build without the CUDA toolkit works; a machine without a driver gets
//!   [`weightferry_actors::platform::PlatformError::Unavailable`], never a panic).
//! - `nccl` (feature `nccl`, implies `cuda`): `cuda::nccl::NcclCollective`, the collective contract
//!   ([`weightferry_actors::collective::Collective`]) over NCCL AllGather on a `CudaPlatform`, and
//!   `cuda::symmetric::SymmetricHeap`, the `ncclMemAlloc` memory its copy-engine AllGather maps as symmetric
//!   windows.
//!
//! `host_heap` gives the C heap's free pages back to the system after a host engine released its copies.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host_heap;
pub mod host_memory;
pub mod timeline;
