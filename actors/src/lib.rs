//! weightferry-actors: the transfer scheduler.
//!
//! - [`sync`]: the std/loom shim every primitive comes from.
//! - [`platform`]: the hardware contract (memory, streams, events, copies).
//! - [`sim`]: the simulated platform (runs anywhere; hazard detection and fault injection).
//! - [`slot`]: the slot state machine.
//! - [`messages`]: load / fence / completion messages and the ticket board.
//! - [`stream_actor`]: the actor owning a device stream.
//! - [`block_stack`]: the actor owning a ring of blocks and its device slots.
//! - [`shard`]: equal zero-padded per-rank shards of a flat buffer (distributed layerwise offload).
//! - [`collective`]: the AllGather contract and the simulated multi-rank collective.
//! - [`collective_actor`]: the actor issuing AllGathers in one global order on every rank.

pub mod block_stack;
pub mod collective;
pub mod collective_actor;
pub mod error;
pub mod messages;
pub mod platform;
pub mod reader_actor;
pub mod shard;
pub mod sim;
pub mod slot;
pub mod staging;
pub mod stream_actor;
pub mod sync;

pub use block_stack::{
    BlockLocation, BlockSpec, BlockStack, GatherBlock, GatherPath, GatherSection, GatherSequence, OrderingFault,
    Segment, StackSpec, StackStats, Submission, MAX_GATHERS_PER_BLOCK,
};
pub use error::SchedulerError;
pub use reader_actor::ReaderHandle;
pub use stream_actor::{StreamHandle, StreamOptions};
