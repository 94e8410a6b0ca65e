//! Offload backends: the three strategies built on the scheduler's actors, and the factory that picks one.
//!
//! - [`backend::StreamingBackend`] is the one machine every strategy runs on: host masters per block per dtype,
//!   block-stack actors over a shared copy-stream actor, fixed device placement for state that never moves, and
//!   hooks that turn the engine's `pre_forward` / `post_forward` into scheduler messages.
//! - [`units`] decides, per strategy, what the stacks and their units are (blocks for the layerwise strategies,
//!   whole components for model-level swapping and on-demand staging).
//! - Distributed layerwise offload is the same backend given this rank's collective: `group.rs` holds the
//!   collective actor and the gathered stacks' state, [`distributed`] builds the rank's sharded host masters, and
//!   [`shard_restore`] gives the storages released to the group's shards their loaded host buffers back at
//!   `disable`, by one final gather to host; `tags.rs` numbers both kinds of AllGather alike on every rank.
//!
//! Lifecycle contract: `enable` is transactional (any failure removes every installed hook, frees every device
//! buffer and gives every storage its own host buffer back, so the pipeline can be retried); `disable` releases
//! everything it owns, and when a step fails it keeps what a retry needs; at most one strategy owns offload hooks.

pub mod backend;
pub mod disk_tier;
pub mod distributed;
mod group;
pub mod layout;
pub mod mapped;
pub mod predict;
mod resident;
pub mod shard_restore;
mod tags;
pub mod units;

use crate::config::{Component, OffloadConfig, Strategy, WeightTransfer};
use crate::hooks::HookError;
use crate::model::ModelError;
use crate::pipeline::StorageId;
use crate::plan::PlanError;
use distributed::DistributedError;
use group::Communicator;
use weightferry_actors::collective_actor::{CollectiveFactory, GatherError};
use weightferry_actors::platform::{DeviceBufferId, PlatformError, PlatformRef};
use weightferry_actors::SchedulerError;

pub use backend::{BackendReport, StreamingBackend};
pub use group::{GatherNames, COMM_STREAM};
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
    /// The rank's sharded host masters could not be built.
    #[error(transparent)]
    Shards(#[from] DistributedError),
    /// The collective actor failed (it could not start, or a gather could not be sent).
    #[error(transparent)]
    Collective(#[from] GatherError),
    /// The collective given to the backend does not match the config's offload group.
    #[error(
        "the collective is rank {rank} of {world} ranks, but the config's offload group has {expected} ranks; build \
         the communicator over the config's group (data_parallel_size, or sequence_parallel_size when that is 1)"
    )]
    GroupMismatch {
        /// The collective's rank.
        rank: usize,
        /// The collective's ranks.
        world: usize,
        /// Ranks of the config's group.
        expected: usize,
    },
    /// An AllGather failed: the rank's collective issues no further collective; the storages released to the
    /// group's shards that were not restored stay released (reading them is an error).
    #[error(
        "rank {rank}: collective poisoned ({cause}); {unrestored} released weight storage(s) could not be restored \
         (reading them is an error); the pipeline must be reloaded"
    )]
    Poisoned {
        /// This rank.
        rank: usize,
        /// The failure that poisoned the collective.
        cause: PlatformError,
        /// Released storages not restored.
        unrestored: usize,
    },
    /// The final gather to host failed on this rank alone (a device or host allocation, a copy) while the
    /// collective stayed usable; the storages it did not restore stay released.
    #[error(
        "rank {rank}: restoring the released weights failed ({cause}); {unrestored} storage(s) stay released \
         (reading them is an error); the pipeline must be reloaded"
    )]
    RestoreFailed {
        /// This rank.
        rank: usize,
        /// Released storages not restored.
        unrestored: usize,
        /// The first failure.
        cause: String,
    },
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

/// Creates the backend for `config` — model-level, layerwise or distributed layerwise — or `None` when offload is
/// disabled. Creating a backend touches nothing; an unsupported combination fails here, before any hook or tensor
/// is touched.
///
/// `collective` is this rank's communicator for AllGather transfer (`weight_transfer = "allgather"`): a factory
/// that builds it on the collective actor's own thread (an NCCL communicator is bound to the thread that made it)
/// at the first `enable`, e.g. an NCCL communicator from a unique id the host engine exchanged, or one that
/// [`crate::dist`] bootstraps from the torchrun/SLURM environment. It must span the config's offload group. With
/// a collective, the components that select AllGather shard their blocks over it (also in a group of one rank);
/// without one, AllGather across a group of more than one rank is refused, and a group of one rank copies blocks
/// rank-locally. Components on rank-local transfer never use it.
pub fn get_offload_backend(
    config: &OffloadConfig,
    platform: PlatformRef,
    collective: Option<CollectiveFactory>,
) -> Result<Option<StreamingBackend>, OffloadError> {
    if config.strategy == Strategy::None {
        return Ok(None);
    }
    let gathers = Component::ALL.iter().any(|&c| config.transfer_for(c) == WeightTransfer::Allgather);
    if collective.is_none() && config.group.size > 1 && Component::ALL.iter().any(|&c| config.uses_allgather(c)) {
        return Err(OffloadError::Unsupported(format!(
            "weight_transfer = \"allgather\" across an offload group of {} ranks needs this rank's collective; pass \
             one to get_offload_backend (weightferry::dist builds one from the torchrun/SLURM environment), or set \
             layer_options.<component>.weight_transfer = \"rank-local\"",
            config.group.size
        )));
    }
    let collective = if gathers { collective.map(Communicator::new) } else { None };
    Ok(Some(StreamingBackend::with_collective(config.clone(), platform, collective)))
}
