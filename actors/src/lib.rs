//! weightferry-actors: the transfer scheduler.
//!
//! - [`sync`]: the std/loom shim every primitive comes from.
//! - [`platform`]: the hardware contract (memory, streams, events, copies).
//! - [`sim`]: the simulated platform (runs anywhere; hazard detection and fault injection).

pub mod platform;
pub mod sim;
pub mod sync;
