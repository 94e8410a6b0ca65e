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
//! - [`textfile`]: reading user-given text files with a size cap.

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
pub mod textfile;
