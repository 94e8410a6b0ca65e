//! Offload backends: the three strategies built on the scheduler's actors, and the factory that picks one.
//!
//! - [`backend::StreamingBackend`] is the one machine every strategy runs on: host masters per block per dtype,
//!   block-stack actors over a shared copy-stream actor, fixed device placement for state that never moves, and
//!   hooks that turn the engine's `pre_forward` / `post_forward` into scheduler messages.
//! - [`units`] decides, per strategy, what the stacks and their units are (blocks for the layerwise strategies,
//!   whole components for model-level swapping and on-demand staging).
//! - [`distributed`] builds per-rank sharded host masters; [`distributed_backend`] runs distributed layerwise
//!   offload end to end, one rank at a time on any platform ([`distributed_backend::run_rank`]) or with simulated
//!   ranks as threads (gather-path block stacks over a collective); [`shard_restore`] gives the storages such a run
//!   released to the group's shards their loaded host buffers back, by one final gather to host.
//!
//! Lifecycle contract: `enable` is transactional (any failure removes every installed hook, frees every device
//! buffer and gives every storage its own host buffer back, so the pipeline can be retried); `disable` releases
//! everything it owns, and when a step fails it keeps what a retry needs; at most one strategy owns offload hooks.

pub mod backend;
pub mod distributed;
pub mod distributed_backend;
pub mod layout;
pub mod resident;
pub mod shard_restore;
pub mod units;

use crate::config::{OffloadConfig, Strategy};
use crate::hooks::HookError;
use crate::model::ModelError;
use crate::plan::{PlanError, StorageId};
use weightferry_actors::platform::{DeviceBufferId, PlatformError, PlatformRef};
use weightferry_actors::SchedulerError;

pub use backend::{BackendReport, StreamingBackend};
pub use resident::ResidentPlacement;

/// Errors of the offload backends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    /// The plan could not be resolved (nothing was touched).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A hook could not be installed or removed.
    #[error(transparent)]
    Hook(#[from] HookError),
    /// The scheduler failed.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// The platform failed.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// The configuration needs something this build or launch cannot provide.
    #[error("{0}")]
    Unsupported(String),
    /// `disable` could not finish; the backend kept its state so calling `disable` again can complete it.
    #[error(
        "failed to fully disable {strategy} offload: {cause}; the backend kept its host masters, call disable again"
    )]
    DisableIncomplete {
        /// Strategy name.
        strategy: &'static str,
        /// First failure.
        cause: String,
    },
    /// A storage is not on the device at the moment it was asked for.
    #[error("storage {storage} is not on the device: {reason}")]
    NotResident {
        /// The storage id.
        storage: u64,
        /// Why.
        reason: String,
    },
    /// The host model could not be read: a storage is released to the shards of a distributed run, or cannot move
    /// between homes. (A platform failure reading it is [`OffloadError::Platform`].)
    #[error(transparent)]
    Model(ModelError),
}

impl From<ModelError> for OffloadError {
    /// A platform failure stays one; every other model error is [`OffloadError::Model`].
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Platform(p) => OffloadError::Platform(p),
            other => OffloadError::Model(other),
        }
    }
}

/// Anything that can say where a storage's bytes are on the device right now.
pub trait WeightSource: Send + Sync {
    /// Device buffer and byte offset of `storage`. Valid for a streamed block between its `pre_forward` and
    /// `post_forward`; always valid for fixed placement.
    fn locate(&self, storage: StorageId) -> Result<(DeviceBufferId, u64), OffloadError>;
}

/// Creates the backend for `config`, or `None` when offload is disabled. Creating a backend touches nothing; an
/// unsupported combination fails here, before any hook or tensor is touched.
pub fn get_offload_backend(
    config: &OffloadConfig,
    platform: PlatformRef,
) -> Result<Option<StreamingBackend>, OffloadError> {
    if config.strategy == Strategy::None {
        return Ok(None);
    }
    if config.group.size > 1 && crate::config::Component::ALL.iter().any(|&c| config.uses_allgather(c)) {
        return Err(OffloadError::Unsupported(format!(
            "weight_transfer = \"allgather\" across an offload group of {} ranks needs one process per rank; this \
             single-process run cannot AllGather. Set layer_options.<component>.weight_transfer = \"rank-local\" or \
             launch one process per GPU",
            config.group.size
        )));
    }
    Ok(Some(StreamingBackend::new(config.clone(), platform)))
}
