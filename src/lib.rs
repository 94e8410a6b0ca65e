//! weightferry: streams the weights of large diffusion models between host and GPU memory with an actor-based
//! asynchronous transfer scheduler.
//!
//! - [`checkpoint`]: safetensors checkpoints, mapped and checked; descriptions and host models derived from them.
//! - [`config`]: the offload config file (compact and legacy keys), validated into an [`config::OffloadConfig`].
//! - [`pipeline`]: pipeline descriptions: the builder, the JSON format and the presets.
//! - [`plan`]: the pure plan resolver, the device-memory planner and the plan report.
//! - [`hooks`]: the forward-hook registry the strategies install into.
//! - [`dist`]: multi-process runs: the launch environment, the TCP rendezvous, the process launcher, the NCCL
//!   bootstrap.
//! - [`model`], [`offload`], [`platform`]: the host model, the backends every strategy runs on, the hardware.
//! - `textfile.rs` (private): reading user-given text files with a size cap.
//! - [`session`]: the library session, the one way to offload a pipeline: plan, device, collective, host model,
//!   backend and hooks from enable to disable. Start here when embedding weightferry in a host engine.
//! - [`scheduler`]: the scheduler types an embedder needs (platforms, the simulated device, collectives),
//!   re-exported from `weightferry-actors` so that front ends depend on `weightferry` alone.

pub mod checkpoint;
pub mod config;
pub mod diag;
pub mod dist;
pub mod hooks;
pub mod model;
pub mod offload;
pub mod pipeline;
pub mod plan;
pub mod platform;
pub mod session;
mod textfile;

/// The scheduler types an embedder needs, re-exported from `weightferry-actors`: the platform interface and its
/// handles, the simulated device with its config, fault plan, hazard checks, statistics and trace, the collective a
/// distributed rank gathers through (and its simulated group), and the knobs a strategy's block stacks take
/// (copy submission, ordering faults for the checks that must fail).
pub mod scheduler {
    pub use weightferry_actors::collective::{
        Collective, CollectiveError, SimCollective, SimCollectiveGroup, SimCollectiveOptions,
    };
    pub use weightferry_actors::collective_actor::{CollectiveFactory, GatherError, WARM_UP_TAG};
    pub use weightferry_actors::platform::{
        DeviceBufferId, DeviceMemoryStats, EventId, HostBufferId, HostMemoryKind, HostRegion, Platform, PlatformError,
        PlatformRef, PlatformResult, StreamId,
    };
    pub use weightferry_actors::sim::fault::splitmix64;
    pub use weightferry_actors::sim::{
        Access, FaultPlan, SimConfig, SimKernelCtx, SimPlatform, SimStats, TraceEvent, TraceKind,
    };
    pub use weightferry_actors::{OrderingFault, Submission};
}

/// The README's Rust quick start, compiled and run as a doctest so that it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
