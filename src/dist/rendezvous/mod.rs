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

use super::env::LaunchEnv;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

/// First four bytes of every frame (`"WFRV"` read as a little-endian `u32`).
pub const MAGIC: u32 = u32::from_le_bytes(*b"WFRV");
/// Protocol version; ranks of different versions refuse each other. Version 2 added the [`RunId`] to the hello,
/// version 3 the [`Fingerprint`].
pub const VERSION: u16 = 3;
/// Largest payload of one frame (1 GiB).
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// Largest world size: rank 0 holds one connection (one file descriptor) per rank.
pub const MAX_WORLD: usize = 16384;
/// Bytes of a frame header.
const HEADER: usize = 28;

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSE: u8 = 3;
const BCAST: u8 = 4;
const GATHER: u8 = 5;
const GATHERED: u8 = 6;

/// How long rank 0 tries to tell a peer why it ends the rendezvous (best effort).
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);

fn kind_name(kind: u8) -> &'static str {
    match kind {
        HELLO => "hello",
        WELCOME => "welcome",
        REFUSE => "refuse",
        BCAST => "broadcast",
        GATHER | GATHERED => "all_gather",
        _ => "unknown",
    }
}

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

/// Which run a rank belongs to: a digest of a run id the launcher gives every rank of one run
/// ([`LaunchEnv::run_id`]). Rank 0 drops a hello of another run as a stranger's, so a stale or foreign process
/// naming a rank cannot take that rank's place. [`RunId::NONE`] (no run id known) matches only itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RunId(pub u128);

impl RunId {
    /// No run id: every hello without one is taken at its word.
    pub const NONE: RunId = RunId(0);

    /// The digest of a run id string (FNV-1a, 128-bit; never [`RunId::NONE`]).
    pub fn from_name(name: &str) -> RunId {
        RunId(digest(name.as_bytes()))
    }
}

/// FNV-1a, 128-bit, of `bytes`; never 0.
fn digest(bytes: &[u8]) -> u128 {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for b in bytes {
        h ^= u128::from(*b);
        h = h.wrapping_mul(PRIME);
    }
    h.max(1)
}

/// The first 32 bits in hex, or `none` for 0.
fn short_hex(v: u128, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    if v == 0 {
        f.write_str("none")
    } else {
        write!(f, "{:08x}", (v >> 96) as u32)
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        short_hex(self.0, f)
    }
}

/// What a rank runs, as a digest its caller makes (of its serialized job, say; `weightferry run` uses its rank
/// check). Without a run id, rank 0 takes a hello with another fingerprint for a stranger's ([`Rendezvous`]'s
/// module docs); with one, the fingerprint is not compared. [`Fingerprint::NONE`] matches only itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Fingerprint(pub u128);

impl Fingerprint {
    /// No fingerprint.
    pub const NONE: Fingerprint = Fingerprint(0);

    /// The digest of `bytes` (FNV-1a, 128-bit; never [`Fingerprint::NONE`]).
    pub fn of(bytes: &[u8]) -> Fingerprint {
        Fingerprint(digest(bytes))
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        short_hex(self.0, f)
    }
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

/// Settings of a rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// Longest wait for joining, and for each message of an operation.
    pub timeout: Duration,
    /// The run this rank belongs to; [`Rendezvous::connect`] uses [`LaunchEnv::run_id`] when this is
    /// [`RunId::NONE`].
    pub run: RunId,
    /// What this rank runs; compared by rank 0 only without a run id (see the module docs).
    pub fingerprint: Fingerprint,
}

impl Default for RendezvousOptions {
    /// A 60 s timeout, no run id, no fingerprint.
    fn default() -> Self {
        RendezvousOptions { timeout: Duration::from_secs(60), run: RunId::NONE, fingerprint: Fingerprint::NONE }
    }
}

/// Longest time rank 0 gives one accepted connection to send its hello (unless the rendezvous timeout is shorter).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

impl RendezvousOptions {
    /// How long rank 0 gives each accepted connection to send a complete hello before dropping it:
    /// [`HANDSHAKE_TIMEOUT`], or the rendezvous timeout when that is shorter.
    pub fn handshake_timeout(&self) -> Duration {
        self.timeout.min(HANDSHAKE_TIMEOUT)
    }
}

struct Frame {
    kind: u8,
    flags: u8,
    rank: u32,
    seq: u64,
    payload: Vec<u8>,
}

enum FrameError {
    Io(std::io::Error),
    Protocol { magic: u32, version: u16 },
    TooLarge(u64),
}

fn timed_out() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out")
}

/// The flags of a `REFUSE` of the connection's hello (it did not join); 0 when rank 0 ends the rendezvous.
const HELLO_REFUSED: u8 = 1;

async fn write_frame<W: AsyncWrite + Unpin>(
    s: &mut W,
    kind: u8,
    rank: usize,
    seq: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    write_frame_with(s, kind, 0, rank, seq, payload).await
}

async fn write_frame_with<W: AsyncWrite + Unpin>(
    s: &mut W,
    kind: u8,
    flags: u8,
    rank: usize,
    seq: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.push(kind);
    buf.push(flags);
    buf.extend_from_slice(&(rank as u32).to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf).await?;
    s.flush().await
}

/// Best effort: tells `s` why rank 0 ends the rendezvous, giving up after [`REFUSE_TIMEOUT`].
async fn refuse<W: AsyncWrite + Unpin>(s: &mut W, seq: u64, reason: &str) {
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, write_frame(s, REFUSE, 0, seq, reason.as_bytes())).await;
}

/// Best effort: tells `s` why rank 0 refuses its hello (the rendezvous goes on without it).
async fn refuse_hello<W: AsyncWrite + Unpin>(s: &mut W, reason: &str) {
    let write = write_frame_with(s, REFUSE, HELLO_REFUSED, 0, 0, reason.as_bytes());
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, write).await;
}

async fn read_frame<R: AsyncRead + Unpin>(s: &mut R) -> Result<Frame, FrameError> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h).await.map_err(FrameError::Io)?;
    let le32 = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let le64 = |b: &[u8]| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let magic = le32(&h[0..4]);
    let version = u16::from_le_bytes([h[4], h[5]]);
    if magic != MAGIC || version != VERSION {
        return Err(FrameError::Protocol { magic, version });
    }
    let len = le64(&h[20..28]);
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLarge(len));
    }
    // Grows with what arrives, so a header announcing a large payload allocates nothing up front.
    let mut payload = Vec::new();
    let got = (&mut *s).take(len).read_to_end(&mut payload).await.map_err(FrameError::Io)?;
    if got as u64 != len {
        return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Frame { kind: h[6], flags: h[7], rank: le32(&h[8..12]), seq: le64(&h[12..20]), payload })
}

/// Bytes of a hello: the header, the joiner's world size (`u64`), its run id and its fingerprint (`u128` each).
const HELLO_LEN: usize = HEADER + 8 + 16 + 16;

/// What rank 0 expects of a hello.
#[derive(Debug, Clone, Copy)]
struct Expect {
    world: usize,
    run: RunId,
    fingerprint: Fingerprint,
}

/// What rank 0 makes of the first bytes of a connection.
enum Judged {
    /// Not a weightferry hello: dropped without a word (the reason completes "dropped a connection that …").
    Drop(String),
    /// A hello that cannot join but must not fail the join: told why, then dropped.
    Refuse(String),
    /// A hello of this run (its run id) that cannot join: fails the rendezvous.
    Fatal(RendezvousError),
    /// A hello to take as rank `rank` (if that rank is free).
    Hello { rank: usize },
}

/// Judges the first bytes of a connection (see the module docs); `None` while they are a correct but incomplete
/// hello.
fn judge(b: &[u8], expect: Expect, peer: SocketAddr) -> Option<Judged> {
    if b.len() >= 4 && b[..4] != MAGIC.to_le_bytes() {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        return Some(Judged::Drop(format!("sent magic {magic:#010x}, not a weightferry rendezvous frame")));
    }
    if b.len() >= 6 {
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            let e = RendezvousError::Protocol { peer: peer.to_string(), magic: MAGIC, version };
            return Some(Judged::Refuse(e.to_string()));
        }
    }
    if b.len() >= HEADER {
        let len = u64::from_le_bytes(b[20..28].try_into().unwrap_or([0; 8]));
        if b[6] != HELLO || len != (HELLO_LEN - HEADER) as u64 {
            return Some(Judged::Drop(format!("sent a {} frame of {len} bytes, not a hello", kind_name(b[6]))));
        }
    }
    if b.len() < HELLO_LEN {
        return None;
    }
    let u128_at = |at: usize| u128::from_le_bytes(b[at..at + 16].try_into().unwrap_or([0; 16]));
    let rank = u32::from_le_bytes(b[8..12].try_into().unwrap_or([0; 4])) as usize;
    let theirs = u64::from_le_bytes(b[HEADER..HEADER + 8].try_into().unwrap_or([0; 8]));
    let theirs = usize::try_from(theirs).unwrap_or(usize::MAX);
    let (their_run, their_fp) = (RunId(u128_at(HEADER + 8)), Fingerprint(u128_at(HEADER + 24)));
    let (ours, run) = (expect.world, expect.run);
    if their_run != run {
        return Some(Judged::Refuse(format!(
            "MASTER_PORT belongs to another run (run id {run}), this rank {rank} has run id {their_run}; give every \
             rank of one run the same WEIGHTFERRY_RUN_ID, or use another MASTER_PORT"
        )));
    }
    let unfit = if theirs != ours {
        Some(RendezvousError::WorldMismatch { rank, theirs, ours })
    } else if rank == 0 || rank >= ours {
        Some(RendezvousError::BadRank { rank, world: ours })
    } else if run == RunId::NONE && their_fp != expect.fingerprint {
        Some(RendezvousError::FingerprintMismatch { rank, theirs: their_fp, ours: expect.fingerprint })
    } else {
        None
    };
    Some(match unfit {
        None => Judged::Hello { rank },
        Some(e) if run == RunId::NONE => Judged::Refuse(e.to_string()),
        Some(e) => Judged::Fatal(e),
    })
}

/// How one accepted connection's handshake ended.
enum Handshake {
    /// Dropped (the reason completes "dropped a connection that …"); `refused`: the reason it was told.
    Drop { why: String, refused: Option<String> },
    /// A hello of this run that cannot join: fails the rendezvous.
    Fatal(RendezvousError),
    /// A hello to take as rank `rank`.
    Hello { rank: usize },
}

/// Reads one accepted connection's hello (never more than [`HELLO_LEN`] bytes, so nothing after it is consumed)
/// within `handshake`, and judges it; a refused hello is told why before it is dropped.
async fn handshake(
    mut stream: TcpStream,
    peer: SocketAddr,
    handshake: Duration,
    expect: Expect,
) -> (TcpStream, Handshake) {
    let mut buf = Vec::with_capacity(HELLO_LEN);
    let read = async {
        let mut chunk = [0u8; HELLO_LEN];
        loop {
            let want = HELLO_LEN - buf.len();
            match stream.read(&mut chunk[..want]).await {
                Ok(0) => return Judged::Drop("closed before sending a hello".into()),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Judged::Drop(format!("failed before sending a hello: {e}")),
            }
            if let Some(j) = judge(&buf, expect, peer) {
                return j;
            }
        }
    };
    let judged = match tokio::time::timeout(handshake, read).await {
        Ok(j) => j,
        Err(_) => Judged::Drop(format!("sent {} of the {HELLO_LEN} bytes of a hello in time", buf.len())),
    };
    let verdict = match judged {
        Judged::Drop(why) => Handshake::Drop { why, refused: None },
        Judged::Refuse(reason) => {
            refuse_hello(&mut stream, &reason).await;
            Handshake::Drop { why: format!("sent a hello rank 0 refused: {reason}"), refused: Some(reason) }
        }
        Judged::Fatal(e) => Handshake::Fatal(e),
        Judged::Hello { rank } => Handshake::Hello { rank },
    };
    (stream, verdict)
}

/// Whether the peer of `s` closed the connection (or it failed): a peek that does not wait. Data waiting, or none
/// yet, means it is open.
fn peer_closed(s: &TcpStream) -> bool {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let mut byte = 0u8;
        // SAFETY: `s` owns an open socket for the whole call; recv(2) writes at most 1 byte into `byte`, which lives
        // on this stack frame; MSG_PEEK leaves the byte in the socket, and MSG_DONTWAIT keeps the call from blocking.
        let n =
            unsafe { libc::recv(s.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => !matches!(
                std::io::Error::last_os_error().kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = s;
        false
    }
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "timed out waiting for it".to_string(),
        std::io::ErrorKind::UnexpectedEof => "it closed the connection (the process exited or failed)".to_string(),
        _ => e.to_string(),
    }
}

/// Reads one frame from every stream at once; the first failure (or the timeout, naming the lowest rank not
/// heard from) ends the wait. Frames come back in rank order.
async fn read_from_all(
    streams: &mut [Option<TcpStream>],
    timeout: Duration,
) -> Result<Vec<(usize, Frame)>, (usize, FrameError)> {
    type Read<'a> = Pin<Box<dyn Future<Output = Result<Frame, FrameError>> + Send + 'a>>;
    let mut reads: Vec<(usize, Option<Read<'_>>)> = streams
        .iter_mut()
        .enumerate()
        .filter_map(|(r, s)| s.as_mut().map(|s| (r, Some(Box::pin(read_frame(s)) as Read<'_>))))
        .collect();
    let mut frames: Vec<(usize, Frame)> = Vec::with_capacity(reads.len());
    let mut deadline = std::pin::pin!(tokio::time::sleep(timeout));
    std::future::poll_fn(|cx| {
        for (rank, slot) in reads.iter_mut() {
            let Some(read) = slot.as_mut() else { continue };
            match read.as_mut().poll(cx) {
                Poll::Ready(Ok(f)) => {
                    frames.push((*rank, f));
                    *slot = None;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err((*rank, e))),
                Poll::Pending => {}
            }
        }
        if let Some((rank, _)) = reads.iter().find(|(_, s)| s.is_some()) {
            return match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err((*rank, FrameError::Io(timed_out())))),
                Poll::Pending => Poll::Pending,
            };
        }
        Poll::Ready(Ok(()))
    })
    .await?;
    frames.sort_by_key(|(r, _)| *r);
    Ok(frames)
}

struct State {
    /// Rank 0: the stream of every peer, indexed by rank (`None` at 0). Other ranks: one stream, to rank 0.
    streams: Vec<Option<TcpStream>>,
    seq: u64,
    broken: Option<RendezvousError>,
}

/// The rendezvous of one process; see the module docs. `Sync`: operations from several threads are serialised.
pub struct Rendezvous {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Dropped before the runtime (declaration order), so the sockets deregister from a live reactor.
    state: Mutex<State>,
    /// Drives every network wait; `None` for a single rank, which exchanges nothing.
    rt: Option<Runtime>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

fn runtime() -> Result<Runtime, RendezvousError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| RendezvousError::Runtime(e.to_string()))
}

fn check_world(world: usize) -> Result<(), RendezvousError> {
    if world == 0 || world > MAX_WORLD {
        return Err(RendezvousError::World { world });
    }
    Ok(())
}

/// The address rank 0 listens on for a run whose ranks reach it at `master_addr`: that loopback address when it
/// is one (`127.0.0.1`, `::1`, `localhost`: every rank is on this host, as under `weightferry launch`, so nothing
/// needs to reach it from outside), else all IPv4 interfaces (`0.0.0.0`), since the name may resolve to any of
/// this host's interfaces.
pub fn listen_ip(master_addr: &str) -> IpAddr {
    let host = master_addr.trim();
    if host.eq_ignore_ascii_case("localhost") {
        return IpAddr::V4(Ipv4Addr::LOCALHOST);
    }
    match host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => ip,
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    }
}

/// `host:port`, with an IPv6 literal in brackets.
fn host_port(host: &str, port: u16) -> String {
    let host = host.trim();
    match host.parse::<Ipv6Addr>() {
        Ok(_) => format!("[{host}]:{port}"),
        Err(_) => format!("{host}:{port}"),
    }
}

/// Checks that `addr` is `host:port` (an IPv6 host in brackets); what is wrong otherwise.
fn check_host_port(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("no port".into());
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("{port:?} is not a port"));
    }
    if host.is_empty() {
        return Err("no host".into());
    }
    if host.contains(':') {
        return Err(format!("the host {host:?} has a ':' (a port belongs in MASTER_PORT)"));
    }
    if host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err(format!("the host {host:?} is not a host name"));
    }
    Ok(())
}

impl Rendezvous {
    /// Joins the rendezvous `env` describes: rank 0 listens on `MASTER_PORT` (on [`listen_ip`] of `MASTER_ADDR`)
    /// and waits for every other rank; the others connect to `MASTER_ADDR:MASTER_PORT`. The run id is
    /// `options.run`, else the digest of [`LaunchEnv::run_id`]. A single process needs no connection.
    pub fn connect(env: &LaunchEnv, options: RendezvousOptions) -> Result<Rendezvous, RendezvousError> {
        if env.world <= 1 {
            return Ok(Self::single());
        }
        check_world(env.world)?;
        let mut options = options;
        if options.run == RunId::NONE {
            options.run = env.run_id.as_deref().map_or(RunId::NONE, RunId::from_name);
        }
        let port = env.master_port.unwrap_or(0);
        let host = env.master_addr.as_deref().unwrap_or("127.0.0.1");
        if env.rank == 0 {
            let listener = std::net::TcpListener::bind((listen_ip(host), port))
                .map_err(|e| RendezvousError::Listen { port, reason: e.to_string() })?;
            Self::root(listener, env.world, options)
        } else {
            Self::peer(&host_port(host, port), env.rank, env.world, options)
        }
    }

    /// A rendezvous of one rank (every operation returns at once).
    pub fn single() -> Rendezvous {
        Rendezvous {
            rank: 0,
            world: 1,
            timeout: Duration::ZERO,
            state: Mutex::new(State { streams: vec![None], seq: 0, broken: None }),
            rt: None,
        }
    }

    /// Rank 0 of `world` ranks, accepting on `listener` until every other rank joined; each accepted connection
    /// has [`RendezvousOptions::handshake_timeout`] to send its hello (see [`Rendezvous::root_with_handshake`]).
    pub fn root(
        listener: std::net::TcpListener,
        world: usize,
        options: RendezvousOptions,
    ) -> Result<Rendezvous, RendezvousError> {
        Self::root_with_handshake(listener, world, options, options.handshake_timeout())
    }

    /// Rank 0 of `world` ranks, accepting on `listener` until every other rank joined or `options.timeout` passed.
    ///
    /// Rank 0 keeps accepting while earlier connections are still handshaking, so no connection can hold up the
    /// others: each accepted connection has `handshake` (from its accept) to send a complete hello. Connections
    /// that are not joining ranks of this run are dropped with a `tracing` warning and the wait goes on: one that
    /// stays silent past `handshake`, closes, does not start with [`MAGIC`] (another program: a port scanner, a
    /// health check, HTTP), sends a weightferry frame that is not a hello, a hello of another protocol
    /// [`VERSION`] or of another run ([`RendezvousOptions::run`]; both told why first). With a run id, a hello of
    /// this run that cannot join fails the whole rendezvous, as a misconfigured launch, with the exact error (rank 0
    /// tells the offender and every joined rank why): another world size ([`RendezvousError::WorldMismatch`]), a
    /// rank outside `1..world` ([`RendezvousError::BadRank`]) or one that joined already
    /// ([`RendezvousError::DuplicateRank`]). Without a run id those hellos, and one with another
    /// [`RendezvousOptions::fingerprint`] ([`RendezvousError::FingerprintMismatch`]), are refused and dropped
    /// instead, and a rank claimed twice stays with the first claimant unless its connection closed (the module
    /// docs give the rule).
    pub fn root_with_handshake(
        listener: std::net::TcpListener,
        world: usize,
        options: RendezvousOptions,
        handshake: Duration,
    ) -> Result<Rendezvous, RendezvousError> {
        check_world(world)?;
        let rt = runtime()?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let listen_err = |e: std::io::Error| RendezvousError::Listen { port, reason: e.to_string() };
        listener.set_nonblocking(true).map_err(listen_err)?;
        let streams = rt.block_on(async {
            let listener = TcpListener::from_std(listener).map_err(listen_err)?;
            accept_all(listener, port, world, options, handshake).await
        })?;
        Ok(Rendezvous {
            rank: 0,
            world,
            timeout: options.timeout,
            state: Mutex::new(State { streams, seq: 0, broken: None }),
            rt: Some(rt),
        })
    }

    /// Rank `rank` (not 0) of `world` ranks, joining rank 0 at `addr` (`host:port`), retrying until the timeout.
    /// An `addr` that is not `host:port` is an error at once ([`RendezvousError::Address`]).
    pub fn peer(
        addr: &str,
        rank: usize,
        world: usize,
        options: RendezvousOptions,
    ) -> Result<Rendezvous, RendezvousError> {
        check_world(world)?;
        check_host_port(addr).map_err(|reason| RendezvousError::Address { rank, addr: addr.to_string(), reason })?;
        let rt = runtime()?;
        let s = rt.block_on(join_root(addr, rank, world, options))?;
        Ok(Rendezvous {
            rank,
            world,
            timeout: options.timeout,
            state: Mutex::new(State { streams: vec![Some(s)], seq: 0, broken: None }),
            rt: Some(rt),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the run.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The timeout of every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Rank 0's `root_payload` on every rank. Rank 0 passes `Some(bytes)`, every other rank `None`.
    pub fn broadcast(&self, root_payload: Option<&[u8]>) -> Result<Vec<u8>, RendezvousError> {
        if (self.rank == 0) != root_payload.is_some() {
            return Err(RendezvousError::BroadcastRoot { rank: self.rank });
        }
        if let Some(p) = root_payload {
            if p.len() as u64 > MAX_PAYLOAD {
                return Err(RendezvousError::TooLarge { len: p.len() as u64 });
            }
        }
        let (rt, mut st, seq) = self.begin()?;
        let Some(rt) = rt else { return Ok(root_payload.unwrap_or_default().to_vec()) };
        let result = rt.block_on(async {
            if self.rank == 0 {
                let payload = root_payload.unwrap_or_default();
                self.send_all(&mut st, BCAST, seq, "broadcast", payload).await?;
                Ok(payload.to_vec())
            } else {
                self.expect(&mut st, BCAST, "broadcast", seq).await
            }
        });
        self.finish(rt, &mut st, seq, result)
    }

    /// Every rank's `mine`, indexed by rank (lengths may differ).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        if mine.len() as u64 > MAX_PAYLOAD {
            return Err(RendezvousError::TooLarge { len: mine.len() as u64 });
        }
        let (rt, mut st, seq) = self.begin()?;
        let Some(rt) = rt else { return Ok(vec![mine.to_vec()]) };
        let result = rt.block_on(async {
            if self.rank == 0 {
                self.gather_root(&mut st, seq, mine).await
            } else {
                let s = st.streams[0].as_mut().ok_or(RendezvousError::BadRank { rank: 0, world: self.world })?;
                self.within(write_frame(s, GATHER, self.rank, seq, mine))
                    .await
                    .map_err(|e| self.io(0, "all_gather", seq, &e))?;
                let bytes = self.expect(&mut st, GATHERED, "all_gather", seq).await?;
                decode_gathered(&bytes, self.world).ok_or(RendezvousError::OutOfStep {
                    seq,
                    op: "all_gather",
                    peer: 0,
                    got: format!("a malformed result of {} bytes", bytes.len()),
                })
            }
        });
        self.finish(rt, &mut st, seq, result)
    }

    /// Returns once every rank called it.
    pub fn barrier(&self) -> Result<(), RendezvousError> {
        self.all_gather_bytes(&[]).map(|_| ())
    }

    /// Rank 0's side of an all-gather: every peer's bytes (read from all at once), then the result to each.
    async fn gather_root(&self, st: &mut State, seq: u64, mine: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        let frames = read_from_all(&mut st.streams, self.timeout)
            .await
            .map_err(|(r, e)| self.frame_error(r, "all_gather", seq, e))?;
        let mut all: Vec<Vec<u8>> = vec![mine.to_vec()];
        for (r, f) in frames {
            if f.kind != GATHER || f.seq != seq || f.rank as usize != r {
                return Err(out_of_step(seq, "all_gather", r, &f));
            }
            all.push(f.payload);
        }
        if all.len() != self.world {
            return Err(RendezvousError::BadRank { rank: all.len(), world: self.world });
        }
        let total: usize = all.iter().map(|b| 8 + b.len()).sum::<usize>() + 4;
        if total as u64 > MAX_PAYLOAD {
            return Err(RendezvousError::TooLarge { len: total as u64 });
        }
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&(all.len() as u32).to_le_bytes());
        for b in &all {
            out.extend_from_slice(&(b.len() as u64).to_le_bytes());
            out.extend_from_slice(b);
        }
        self.send_all(st, GATHERED, seq, "all_gather", &out).await?;
        Ok(all)
    }

    /// Starts one collective operation: takes the lock and the operation's number. Fails at once when the
    /// rendezvous is broken. The runtime is `None` for a single rank, which has nothing to exchange.
    #[allow(clippy::type_complexity)]
    fn begin(&self) -> Result<(Option<&Runtime>, std::sync::MutexGuard<'_, State>, u64), RendezvousError> {
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(e) = &st.broken {
            return Err(RendezvousError::Broken(e.to_string()));
        }
        let seq = st.seq;
        st.seq += 1;
        Ok((self.rt.as_ref(), st, seq))
    }

    /// Ends operation `seq`: a failure breaks the rendezvous (rank 0 first tells every peer why).
    fn finish<T>(
        &self,
        rt: &Runtime,
        st: &mut State,
        seq: u64,
        result: Result<T, RendezvousError>,
    ) -> Result<T, RendezvousError> {
        if let Err(e) = &result {
            if self.rank == 0 {
                let reason = e.to_string();
                rt.block_on(async {
                    for s in st.streams.iter_mut().flatten() {
                        refuse(s, seq, &reason).await;
                    }
                });
            }
            st.broken = Some(e.clone());
        }
        result
    }

    /// Rank 0: sends one frame to every peer.
    async fn send_all(
        &self,
        st: &mut State,
        kind: u8,
        seq: u64,
        op: &'static str,
        payload: &[u8],
    ) -> Result<(), RendezvousError> {
        for (r, s) in st.streams.iter_mut().enumerate() {
            if let Some(s) = s {
                self.within(write_frame(s, kind, 0, seq, payload)).await.map_err(|e| self.io(r, op, seq, &e))?;
            }
        }
        Ok(())
    }

    /// `f`, or a timed-out error after the timeout.
    async fn within<T>(&self, f: impl Future<Output = std::io::Result<T>>) -> std::io::Result<T> {
        tokio::time::timeout(self.timeout, f).await.unwrap_or_else(|_| Err(timed_out()))
    }

    /// Reads the frame of kind `kind` of operation `seq` from rank 0.
    async fn expect(&self, st: &mut State, kind: u8, op: &'static str, seq: u64) -> Result<Vec<u8>, RendezvousError> {
        let s = st.streams[0].as_mut().ok_or(RendezvousError::BadRank { rank: 0, world: self.world })?;
        let f = tokio::time::timeout(self.timeout, read_frame(s))
            .await
            .unwrap_or_else(|_| Err(FrameError::Io(timed_out())))
            .map_err(|e| self.frame_error(0, op, seq, e))?;
        if f.kind == REFUSE {
            return Err(RendezvousError::Refused { reason: String::from_utf8_lossy(&f.payload).into_owned() });
        }
        if f.kind != kind || f.seq != seq {
            return Err(out_of_step(seq, op, 0, &f));
        }
        Ok(f.payload)
    }

    fn io(&self, peer: usize, op: &'static str, seq: u64, e: &std::io::Error) -> RendezvousError {
        RendezvousError::Io { rank: self.rank, peer, op, seq, reason: io_reason(e) }
    }

    fn frame_error(&self, peer: usize, op: &'static str, seq: u64, e: FrameError) -> RendezvousError {
        match e {
            FrameError::Io(e) => self.io(peer, op, seq, &e),
            FrameError::Protocol { magic, version } => {
                RendezvousError::Protocol { peer: format!("rank {peer}"), magic, version }
            }
            FrameError::TooLarge(len) => RendezvousError::TooLarge { len },
        }
    }
}

/// Rank 0's join: accepts until every other rank of this run sent its hello (see
/// [`Rendezvous::root_with_handshake`]), then welcomes them all.
async fn accept_all(
    listener: TcpListener,
    port: u16,
    world: usize,
    options: RendezvousOptions,
    handshake_for: Duration,
) -> Result<Vec<Option<TcpStream>>, RendezvousError> {
    let start = Instant::now();
    let expect = Expect { world, run: options.run, fingerprint: options.fingerprint };
    let mut joining = Joining::new(world);
    let mut pending = tokio::task::JoinSet::new();
    let deadline = tokio::time::sleep(options.timeout);
    tokio::pin!(deadline);
    let failure = loop {
        // Complete only with open connections: a claimant that hung up frees its rank for the real one.
        if joining.joined == world && joining.drop_closed() == 0 {
            break None;
        }
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    pending.spawn(async move { (peer, handshake(stream, peer, handshake_for, expect).await) });
                }
                Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::Interrupted
                ) => tracing::warn!("rendezvous: a connection failed before rank 0 accepted it: {e}"),
                Err(e) => break Some((None, RendezvousError::Listen { port, reason: e.to_string() })),
            },
            Some(done) = pending.join_next() => {
                let Ok((peer, (stream, verdict))) = done else { continue };
                match verdict {
                    Handshake::Drop { why, refused } => {
                        tracing::warn!(%peer, "rendezvous: dropped a connection that {why}");
                        joining.note_refusal(refused);
                    }
                    Handshake::Fatal(err) => break Some((Some(stream), err)),
                    Handshake::Hello { rank } => match joining.claim(rank, stream, peer) {
                        Ok(()) => {}
                        Err((offender, err)) if options.run != RunId::NONE => break Some((Some(offender), err)),
                        Err((mut newcomer, err)) => {
                            tracing::warn!(%peer, "rendezvous: refused a second claim on rank {rank}: {err}");
                            let reason = err.to_string();
                            refuse_hello(&mut newcomer, &reason).await;
                            joining.note_refusal(Some(reason));
                        }
                    },
                }
            }
            () = &mut deadline => {
                let missing = (1..world).filter(|&r| joining.streams[r].is_none()).collect();
                let (waited, refused, first_refusal) = (start.elapsed(), joining.refused, joining.first_refusal.take());
                break Some((None, RendezvousError::Incomplete { world, missing, waited, refused, first_refusal }));
            }
        }
    };
    pending.abort_all();
    let mut streams = joining.streams;
    if let Some((mut offender, err)) = failure {
        let reason = err.to_string();
        for s in offender.iter_mut().chain(streams.iter_mut().flatten()) {
            refuse(s, 0, &reason).await;
        }
        return Err(err);
    }
    for (r, s) in streams.iter_mut().enumerate() {
        if let Some(s) = s {
            tokio::time::timeout(options.timeout, write_frame(s, WELCOME, 0, 0, &[]))
                .await
                .unwrap_or_else(|_| Err(timed_out()))
                .map_err(|e| RendezvousError::Io { rank: 0, peer: r, op: "join", seq: 0, reason: io_reason(&e) })?;
        }
    }
    Ok(streams)
}

/// Rank 0's ranks while they join, and the hellos it refused.
struct Joining {
    /// Indexed by rank (`None` at 0 and for ranks not joined).
    streams: Vec<Option<TcpStream>>,
    /// Where each joined rank connected from.
    addrs: Vec<Option<SocketAddr>>,
    /// Ranks joined, rank 0 included.
    joined: usize,
    refused: usize,
    first_refusal: Option<String>,
}

impl Joining {
    fn new(world: usize) -> Joining {
        Joining {
            streams: (0..world).map(|_| None).collect(),
            addrs: vec![None; world],
            joined: 1,
            refused: 0,
            first_refusal: None,
        }
    }

    /// Counts a refused hello (`reason`: what it was told), if it was one.
    fn note_refusal(&mut self, reason: Option<String>) {
        if let Some(reason) = reason {
            self.refused += 1;
            self.first_refusal.get_or_insert(reason);
        }
    }

    /// Drops every joined connection whose peer closed it (its rank is free again); how many.
    fn drop_closed(&mut self) -> usize {
        let mut dropped = 0;
        for (rank, slot) in self.streams.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(peer_closed) {
                let peer = self.addrs[rank];
                tracing::warn!(?peer, "rendezvous: rank {rank}'s connection closed before the join completed");
                *slot = None;
                self.joined -= 1;
                dropped += 1;
            }
        }
        dropped
    }

    /// Takes `stream` from `peer` as rank `rank` (in `1..world`), in place of an earlier claimant whose connection
    /// closed; gives it back with [`RendezvousError::DuplicateRank`] when the earlier one is still open.
    fn claim(&mut self, rank: usize, stream: TcpStream, peer: SocketAddr) -> Result<(), (TcpStream, RendezvousError)> {
        if let Some(first) = &self.streams[rank] {
            if !peer_closed(first) {
                let first = self.addrs[rank].map_or_else(String::new, |a| a.to_string());
                return Err((stream, RendezvousError::DuplicateRank { rank, first, second: peer.to_string() }));
            }
            tracing::warn!(%peer, "rendezvous: rank {rank}'s first connection closed; this one takes its place");
            self.joined -= 1;
        }
        self.streams[rank] = Some(stream);
        self.addrs[rank] = Some(peer);
        self.joined += 1;
        Ok(())
    }
}

/// A rank's join: connects to rank 0 at `addr` (retrying while it is not listening yet, until the timeout), sends
/// its hello and waits for the welcome.
async fn join_root(
    addr: &str,
    rank: usize,
    world: usize,
    options: RendezvousOptions,
) -> Result<TcpStream, RendezvousError> {
    let start = Instant::now();
    let deadline = start + options.timeout;
    let connect_err =
        |reason: String| RendezvousError::Connect { rank, addr: addr.to_string(), waited: start.elapsed(), reason };
    let mut backoff = Duration::from_millis(10);
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(left.min(Duration::from_secs(5)), async {
            let mut addrs = tokio::net::lookup_host(addr).await.map_err(|e| e.to_string())?;
            let a = addrs.next().ok_or_else(|| "the address resolves to nothing".to_string())?;
            TcpStream::connect(a).await.map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|_| Err("connecting timed out".to_string()));
        match attempt {
            Ok(s) => break s,
            Err(reason) if Instant::now() >= deadline => return Err(connect_err(reason)),
            Err(_) => {
                tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    };
    let io = |e: std::io::Error| RendezvousError::Io { rank, peer: 0, op: "join", seq: 0, reason: io_reason(&e) };
    s.set_nodelay(true).map_err(io)?;
    let mut hello = Vec::with_capacity(HELLO_LEN - HEADER);
    hello.extend_from_slice(&(world as u64).to_le_bytes());
    hello.extend_from_slice(&options.run.0.to_le_bytes());
    hello.extend_from_slice(&options.fingerprint.0.to_le_bytes());
    tokio::time::timeout(options.timeout, write_frame(&mut s, HELLO, rank, 0, &hello))
        .await
        .unwrap_or_else(|_| Err(timed_out()))
        .map_err(io)?;
    let reply = tokio::time::timeout(options.timeout, read_frame(&mut s))
        .await
        .unwrap_or_else(|_| Err(FrameError::Io(timed_out())));
    match reply {
        Ok(f) if f.kind == WELCOME => Ok(s),
        Ok(f) if f.kind == REFUSE => {
            let reason = String::from_utf8_lossy(&f.payload).into_owned();
            Err(match f.flags {
                HELLO_REFUSED => RendezvousError::HelloRefused { rank, reason },
                _ => RendezvousError::Refused { reason },
            })
        }
        Ok(f) => Err(RendezvousError::OutOfStep { seq: 0, op: "join", peer: 0, got: kind_name(f.kind).into() }),
        Err(FrameError::Io(e)) => Err(io(e)),
        Err(FrameError::Protocol { magic, version }) => {
            Err(RendezvousError::Protocol { peer: addr.to_string(), magic, version })
        }
        Err(FrameError::TooLarge(len)) => Err(RendezvousError::TooLarge { len }),
    }
}

fn out_of_step(seq: u64, op: &'static str, peer: usize, f: &Frame) -> RendezvousError {
    RendezvousError::OutOfStep { seq, op, peer, got: format!("operation #{} ({})", f.seq, kind_name(f.kind)) }
}

/// Parses rank 0's all-gather result: a `u32` count, then per rank a `u64` length and the bytes.
fn decode_gathered(bytes: &[u8], world: usize) -> Option<Vec<Vec<u8>>> {
    let count = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    if count != world {
        return None;
    }
    let mut at = 4usize;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?) as usize;
        at += 8;
        out.push(bytes.get(at..at.checked_add(len)?)?.to_vec());
        at += len;
    }
    (at == bytes.len()).then_some(out)
}
