//! [`RendezvousError`]: why a rendezvous operation failed, each message saying what to fix.

use super::identity::Fingerprint;
use super::wire::{MAX_PAYLOAD, MAX_WORLD, VERSION};
use std::time::Duration;

/// ` (rank 0 refused 2 hellos; the first: …)`, or nothing when it refused none.
fn refusals(refused: usize, first: Option<&str>) -> String {
    match (refused, first) {
        (0, _) | (_, None) => String::new(),
        (1, Some(why)) => format!(" (rank 0 refused 1 hello: {why})"),
        (n, Some(why)) => format!(" (rank 0 refused {n} hellos; the first: {why})"),
    }
}

/// `1-3, 5, 7-9` (sorted ranks, runs of consecutive ranks shortened), so a message stays short for any world.
pub fn rank_ranges(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1] == end + 1 {
            i += 1;
            end = ranks[i];
        }
        out.push(if end == start { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
        if out.len() == 32 && i < ranks.len() {
            out.push(format!("and {} more", ranks.len() - i));
            break;
        }
    }
    out.join(", ")
}

/// Why a rendezvous operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// Rank 0 could not listen.
    #[error("rank 0 cannot listen on port {port}: {reason}; choose another MASTER_PORT (free on the rank-0 host)")]
    Listen {
        /// The port.
        port: u16,
        /// What the OS said.
        reason: String,
    },
    /// A rank could not reach rank 0 in time.
    #[error(
        "rank {rank} cannot reach rank 0 at {addr} within {waited:?}: {reason}; start rank 0 and check MASTER_ADDR \
         and MASTER_PORT (rank 0's host must be reachable from every rank)"
    )]
    Connect {
        /// This rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last error.
        reason: String,
    },
    /// The address of rank 0 is not `host:port` (reported at once: retrying cannot fix it).
    #[error(
        "rank {rank}: {addr:?} is not a host:port address of rank 0 ({reason}); set MASTER_ADDR to the rank-0 host \
         alone (e.g. 10.0.0.1, node0 or ::1) and MASTER_PORT to its port"
    )]
    Address {
        /// This rank.
        rank: usize,
        /// The address given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A world size of 0 or over [`MAX_WORLD`].
    #[error(
        "a rendezvous of {world} ranks: the world size must be in 1..={MAX_WORLD} (rank 0 holds one connection per \
         rank); set WORLD_SIZE to the number of processes (one per GPU)"
    )]
    World {
        /// The world size asked for.
        world: usize,
    },
    /// Not every rank joined in time.
    #[error(
        "rank 0: ranks {} did not join within {waited:?}; start all WORLD_SIZE={world} ranks with the same \
         MASTER_ADDR and MASTER_PORT{}",
        rank_ranges(missing),
        refusals(*refused, first_refusal.as_deref())
    )]
    Incomplete {
        /// The world size.
        world: usize,
        /// Ranks that did not join.
        missing: Vec<usize>,
        /// How long rank 0 waited.
        waited: Duration,
        /// Hellos rank 0 refused meanwhile (another version, run, world size or fingerprint, a rank taken).
        refused: usize,
        /// Why it refused the first of them.
        first_refusal: Option<String>,
    },
    /// A rank joined with another world size.
    #[error(
        "rank {rank} has WORLD_SIZE={theirs} but rank 0 has WORLD_SIZE={ours}; launch every rank with the same \
         WORLD_SIZE"
    )]
    WorldMismatch {
        /// The joining rank.
        rank: usize,
        /// Its world size.
        theirs: usize,
        /// Rank 0's world size.
        ours: usize,
    },
    /// A hello named a rank outside `1..world` (the ranks that join rank 0).
    #[error(
        "a hello as rank {rank}, which is not one of the ranks 1..{world} that join rank 0 in a run of \
         WORLD_SIZE={world}; give every process its own RANK below WORLD_SIZE"
    )]
    BadRank {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// A second process claimed a rank that joined already.
    #[error(
        "two processes claim rank {rank} (it joined from {first}, then {second} claimed it); give every process its \
         own RANK, and every rank of one run the same WEIGHTFERRY_RUN_ID so that rank 0 can tell strangers from its \
         ranks"
    )]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// Where the first claim came from.
        first: String,
        /// Where the second came from.
        second: String,
    },
    /// Without a run id: a hello whose fingerprint differs from rank 0's (taken for a stranger's).
    #[error(
        "rank {rank} has fingerprint {theirs} but rank 0 has {ours} (they run different things), and without a run \
         id rank 0 takes it for a stranger; launch every rank with the same arguments and files, and every rank of \
         one run with the same WEIGHTFERRY_RUN_ID"
    )]
    FingerprintMismatch {
        /// The joining rank.
        rank: usize,
        /// Its fingerprint.
        theirs: Fingerprint,
        /// Rank 0's.
        ours: Fingerprint,
    },
    /// Rank 0 ended the rendezvous (for every rank) and said why.
    #[error("rank 0 ended the rendezvous: {reason}")]
    Refused {
        /// Rank 0's reason.
        reason: String,
    },
    /// Rank 0 refused this rank's hello (it took it for a stranger's, or the rank was taken) and goes on without it.
    #[error("rank 0 refused the hello of this rank {rank}: {reason}")]
    HelloRefused {
        /// This rank.
        rank: usize,
        /// Rank 0's reason.
        reason: String,
    },
    /// A peer does not speak this protocol.
    #[error(
        "{peer} sent magic {magic:#010x} version {version}, not a weightferry rendezvous v{VERSION} frame; is \
         MASTER_PORT used by another program, or do the ranks run different weightferry versions?"
    )]
    Protocol {
        /// Who sent it.
        peer: String,
        /// The magic received.
        magic: u32,
        /// The version received.
        version: u16,
    },
    /// A rank called another operation (or another count of them) than this one.
    #[error(
        "operation #{seq} ({op}): rank {peer} sent {got}; every rank must call the same rendezvous operations in \
         the same order"
    )]
    OutOfStep {
        /// This rank's operation number.
        seq: u64,
        /// This rank's operation.
        op: &'static str,
        /// The peer.
        peer: usize,
        /// What it sent.
        got: String,
    },
    /// A connection failed or timed out.
    #[error("rank {rank}: operation #{seq} ({op}) with rank {peer} failed: {reason}")]
    Io {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The operation.
        op: &'static str,
        /// Its number.
        seq: u64,
        /// What failed.
        reason: String,
    },
    /// A payload over [`MAX_PAYLOAD`].
    #[error("a rendezvous payload of {len} bytes exceeds the limit of {MAX_PAYLOAD} bytes")]
    TooLarge {
        /// Its length.
        len: u64,
    },
    /// `broadcast` called with a payload on a rank other than 0, or without one on rank 0.
    #[error("rank {rank}: broadcast takes the payload on rank 0 (the root) and `None` on every other rank")]
    BroadcastRoot {
        /// This rank.
        rank: usize,
    },
    /// The I/O runtime of the rendezvous could not start.
    #[error("cannot start the rendezvous I/O runtime: {0}")]
    Runtime(String),
    /// An earlier operation failed; nothing more is exchanged.
    #[error("the rendezvous is broken by an earlier failure: {0}")]
    Broken(String),
}
