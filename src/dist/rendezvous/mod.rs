//! A small TCP rendezvous for the processes of one distributed run: rank 0 listens on `MASTER_PORT`, every other
//! rank connects to `MASTER_ADDR:MASTER_PORT` (retrying until the timeout), and they then exchange small messages
//! through rank 0 (a star): [`Rendezvous::broadcast`] (rank 0's bytes to every rank, e.g. the 128-byte NCCL unique
//! id), [`Rendezvous::all_gather_bytes`] (every rank's bytes to every rank, rank order) and
//! [`Rendezvous::barrier`]. The simulated multi-process collective ([`super::TcpCollective`]) runs its AllGathers
//! over it too. Rank 0 listens on the loopback interface when `MASTER_ADDR` is a loopback address (as under
//! `weightferry launch`), else on all IPv4 interfaces.
//!
//! It runs on tokio (the control plane): each [`Rendezvous`] owns a current-thread runtime that its blocking
//! methods drive, so callers stay plain threads (the scheduler's collective actor calls it from its own thread).
//! Do not call it from inside an async task.
//!
//! Wire format: every message is one frame, a 28-byte little-endian header — magic `"WFRV"` ([`MAGIC`]), protocol
//! [`VERSION`], kind, a flags byte, the sender's rank, the operation's sequence number, the payload length —
//! then the payload (at most [`MAX_PAYLOAD`] bytes). Joining is a `HELLO` carrying the joiner's rank, its world
//! size, its [`RunId`] and its [`Fingerprint`], answered by `WELCOME` once every rank has joined, or by `REFUSE`
//! with the reason (flags 1: this hello was refused, [`RendezvousError::HelloRefused`]; 0: rank 0 ended the
//! rendezvous, [`RendezvousError::Refused`]). Rank 0 keeps accepting while it waits, and gives each connection
//! [`RendezvousOptions::handshake_timeout`] to send its hello. Who joins:
//!
//! - A connection that is no weightferry hello (silent, closed, another protocol, another frame) is dropped with a
//!   warning. A hello of another protocol [`VERSION`] or of another run is refused (told why) and dropped.
//! - With a run id (the same on every rank), a hello of this run is taken at its word: one that cannot join
//!   (another world size, a rank outside `1..world`, a rank that joined already) is a misconfigured launch and
//!   fails the rendezvous, rank 0 telling every joined rank why.
//! - Without a run id, rank 0 cannot tell a misconfigured rank from a stranger, so no single hello fails the join:
//!   a hello with another world size or [`Fingerprint`], or a rank outside `1..world`, is refused and dropped; a
//!   second claim on a rank that joined is refused (first come, first served). A refused process fails at once
//!   with the reason; rank 0 keeps accepting, and if the join then times out its error counts the hellos it
//!   refused and quotes the first. The limit: a stranger with this run's world size and fingerprint that claims a
//!   rank first, and stays connected, keeps it; a run id rules that out.
//! - Either way, a claimant whose connection closed before the join completed gives its rank up: the join completes
//!   only with every connection open, and a later claim on that rank takes its place.
//!
//! Invariants: operations are collective — every rank calls the same operations in the same order, and each frame
//! carries the operation's sequence number and kind, so a rank out of step is an error naming it, never a silent
//! mix-up; every wait is bounded by the timeout; after any failure the rendezvous is broken: rank 0 tells every
//! peer why (best effort), and every later operation fails at once with the first error, so no rank waits on a
//! peer that already gave up. One operation at a time holds the connections (a lock), so the rendezvous can be
//! shared between threads. A world size outside `1..=`[`MAX_WORLD`] is an error before anything is allocated.
//!
//! # Layout
//!
//! - `wire.rs` — the frame: header, kinds, limits, reading and writing one;
//! - `identity.rs` — [`RunId`] and [`Fingerprint`], what a hello says of its rank;
//! - `options.rs` — [`RendezvousOptions`];
//! - `error.rs` — [`RendezvousError`];
//! - `accept.rs` — rank 0's side of the join: accepting connections and judging their hellos;
//! - `join.rs` — the constructors of a [`Rendezvous`], and another rank's join of rank 0;
//! - `ops.rs` — [`Rendezvous`] and its operations (broadcast, all-gather, barrier).

mod accept;
mod error;
mod identity;
mod join;
mod ops;
mod options;
mod wire;

pub use error::{rank_ranges, RendezvousError};
pub use identity::{Fingerprint, RunId};
pub use join::listen_ip;
pub use ops::Rendezvous;
pub use options::{RendezvousOptions, HANDSHAKE_TIMEOUT};
pub use wire::{MAGIC, MAX_PAYLOAD, MAX_WORLD, VERSION};
