//! Errors of the scheduler.

use crate::block_stack::OrderingFault;
use crate::platform::PlatformError;
use crate::slot::SlotError;

/// What can go wrong inside the scheduler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// The platform refused or failed an operation.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// An illegal slot transition (a scheduler bug or a misuse of the hook protocol).
    #[error("slot protocol violated: {0}")]
    Slot(#[from] SlotError),
    /// A block index outside the stack.
    #[error("block {block} is outside stack '{stack}' of {len} blocks")]
    NoSuchBlock {
        /// Stack name.
        stack: String,
        /// Requested block.
        block: usize,
        /// Blocks in the stack.
        len: usize,
    },
    /// `post_forward` for a block that is not in use.
    #[error("post_forward for block {block} of stack '{stack}' without a matching pre_forward")]
    NotInUse {
        /// Stack name.
        stack: String,
        /// The block.
        block: usize,
    },
    /// Every slot is pinned (in use or loading) so nothing can be loaded.
    #[error("stack '{stack}': all {slots} slots are in use; call post_forward for finished blocks before pre_forward")]
    NoFreeSlot {
        /// Stack name.
        stack: String,
        /// Slot count.
        slots: usize,
    },
    /// A device actor is gone (its thread ended).
    #[error("the {actor} actor stopped")]
    ActorGone {
        /// Which actor.
        actor: String,
    },
    /// A load failed on the device.
    #[error("loading block {block} of stack '{stack}' failed: {source}")]
    LoadFailed {
        /// Stack name.
        stack: String,
        /// The block.
        block: usize,
        /// The platform error.
        source: PlatformError,
    },
    /// The stack was disabled.
    #[error("stack '{stack}' is disabled")]
    Disabled {
        /// Stack name.
        stack: String,
    },
    /// An invalid stack description.
    #[error("invalid stack '{stack}': {reason}")]
    InvalidSpec {
        /// Stack name.
        stack: String,
        /// What is wrong.
        reason: String,
    },
    /// A stack asked for a deliberately broken ordering in a build that does not contain them.
    #[error(
        "stack '{stack}': ordering fault {fault:?} needs a build with RUSTFLAGS=\"--cfg weightferry_broken\" \
         (test builds only)"
    )]
    FaultNotBuilt {
        /// Stack name.
        stack: String,
        /// The fault asked for.
        fault: OrderingFault,
    },
}
