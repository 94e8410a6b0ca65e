//! A small TCP rendezvous for the processes of one distributed run: rank 0 listens on `MASTER_PORT` (all IPv4
//! interfaces), every other rank connects to `MASTER_ADDR:MASTER_PORT` (retrying until the timeout), and they then
//! exchange small messages through rank 0 (a star): [`Rendezvous::broadcast`] (rank 0's bytes to every rank, e.g.
//! the 128-byte NCCL unique id), [`Rendezvous::all_gather_bytes`] (every rank's bytes to every rank, rank order)
//! and [`Rendezvous::barrier`]. The simulated multi-process collective ([`super::TcpCollective`]) runs its
//! AllGathers over it too.
//!
//! Wire format: every message is one frame, a 28-byte little-endian header — magic `"WFRV"` ([`MAGIC`]), protocol
//! [`VERSION`], kind, a reserved byte, the sender's rank, the operation's sequence number, the payload length —
//! then the payload (at most [`MAX_PAYLOAD`] bytes). Joining is a `HELLO` carrying the joiner's rank and world
//! size, answered by `WELCOME` once every rank has joined, or by `REFUSE` with the reason. Rank 0 keeps accepting
//! while it waits, and gives each connection [`RendezvousOptions::handshake_timeout`] to send its hello: strangers
//! on the port (silent, another protocol, not a hello) are dropped with a warning and cannot delay the join, while a
//! weightferry hello that cannot join (another version, world size or a taken rank) fails the rendezvous.
//!
//! Invariants: operations are collective — every rank calls the same operations in the same order, and each frame
//! carries the operation's sequence number and kind, so a rank out of step is an error naming it, never a silent
//! mix-up; every wait is bounded by the timeout; after any failure the rendezvous is broken: rank 0 tells every
//! peer why (best effort), and every later operation fails at once with the first error, so no rank waits on a
//! peer that already gave up. One operation at a time holds the connections (a lock), so the rendezvous can be
//! shared between threads.

use super::env::LaunchEnv;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// First four bytes of every frame (`"WFRV"` read as a little-endian `u32`).
pub const MAGIC: u32 = u32::from_le_bytes(*b"WFRV");
/// Protocol version; ranks of different versions refuse each other.
pub const VERSION: u16 = 1;
/// Largest payload of one frame (1 GiB).
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// Bytes of a frame header.
const HEADER: usize = 28;

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSE: u8 = 3;
const BCAST: u8 = 4;
const GATHER: u8 = 5;
const GATHERED: u8 = 6;

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
    /// Not every rank joined in time.
    #[error(
        "rank 0: ranks {missing:?} did not join within {waited:?}; start all WORLD_SIZE={world} ranks with the same \
         MASTER_ADDR and MASTER_PORT"
    )]
    Incomplete {
        /// The world size.
        world: usize,
        /// Ranks that did not join.
        missing: Vec<usize>,
        /// How long rank 0 waited.
        waited: Duration,
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
    /// Two processes joined with one rank (or a rank outside the group joined).
    #[error("two processes joined as rank {rank} (or it is outside 0..{world}); give every process its own RANK")]
    BadRank {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// Rank 0 refused this rank, or gave up and said why.
    #[error("rank 0 ended the rendezvous: {reason}")]
    Refused {
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
    /// An earlier operation failed; nothing more is exchanged.
    #[error("the rendezvous is broken by an earlier failure: {0}")]
    Broken(String),
}

/// Settings of a rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// Longest wait for joining, and for each message of an operation.
    pub timeout: Duration,
}

impl Default for RendezvousOptions {
    /// A 60 s timeout.
    fn default() -> Self {
        RendezvousOptions { timeout: Duration::from_secs(60) }
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
    rank: u32,
    seq: u64,
    payload: Vec<u8>,
}

enum FrameError {
    Io(std::io::Error),
    Protocol { magic: u32, version: u16 },
    TooLarge(u64),
}

fn write_frame(s: &mut TcpStream, kind: u8, rank: usize, seq: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.push(kind);
    buf.push(0);
    buf.extend_from_slice(&(rank as u32).to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> Result<Frame, FrameError> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h).map_err(FrameError::Io)?;
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
    let mut payload = vec![0u8; len as usize];
    s.read_exact(&mut payload).map_err(FrameError::Io)?;
    Ok(Frame { kind: h[6], rank: le32(&h[8..12]), seq: le64(&h[12..20]), payload })
}

/// Bytes of a hello: the header and the joiner's world size (`u64`).
const HELLO_LEN: usize = HEADER + 8;

/// A connection rank 0 accepted that has not sent its whole hello yet (read without blocking).
struct Pending {
    stream: TcpStream,
    peer: std::net::SocketAddr,
    /// The bytes of the hello so far (never more than [`HELLO_LEN`], so nothing after the hello is consumed).
    buf: Vec<u8>,
    /// When it is dropped unless its hello is complete.
    deadline: Instant,
}

/// Where one pending connection's handshake stands.
enum Handshake {
    /// Its hello is incomplete and its deadline has not passed.
    Waiting,
    /// Not a joining weightferry rank (the reason completes "dropped a connection that …"): drop it, go on.
    Drop(String),
    /// A weightferry frame (right magic) of another protocol version.
    Wrong { magic: u32, version: u16 },
    /// A complete hello.
    Hello { rank: usize, theirs: usize },
}

impl Pending {
    /// Reads what has arrived (without blocking) and judges the bytes so far.
    fn advance(&mut self) -> Handshake {
        let mut chunk = [0u8; HELLO_LEN];
        loop {
            let want = HELLO_LEN - self.buf.len();
            if want == 0 {
                break;
            }
            match self.stream.read(&mut chunk[..want]) {
                Ok(0) => return Handshake::Drop("closed before sending a hello".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Handshake::Drop(format!("failed before sending a hello: {e}")),
            }
        }
        let b = &self.buf;
        if b.len() >= 4 && b[..4] != MAGIC.to_le_bytes() {
            let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            return Handshake::Drop(format!("sent magic {magic:#010x}, not a weightferry rendezvous frame"));
        }
        if b.len() >= 6 {
            let version = u16::from_le_bytes([b[4], b[5]]);
            if version != VERSION {
                return Handshake::Wrong { magic: MAGIC, version };
            }
        }
        if b.len() >= HEADER {
            let len = u64::from_le_bytes(b[20..28].try_into().unwrap_or([0; 8]));
            if b[6] != HELLO || len != 8 {
                return Handshake::Drop(format!("sent a {} frame of {len} bytes, not a hello", kind_name(b[6])));
            }
        }
        if b.len() == HELLO_LEN {
            let rank = u32::from_le_bytes(b[8..12].try_into().unwrap_or([0; 4])) as usize;
            let theirs = u64::from_le_bytes(b[HEADER..].try_into().unwrap_or([0; 8])) as usize;
            return Handshake::Hello { rank, theirs };
        }
        if Instant::now() >= self.deadline {
            return Handshake::Drop(format!("sent {} of the {HELLO_LEN} bytes of a hello in time", b.len()));
        }
        Handshake::Waiting
    }
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "timed out waiting for it".to_string(),
        std::io::ErrorKind::UnexpectedEof => "it closed the connection (the process exited or failed)".to_string(),
        _ => e.to_string(),
    }
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
    state: Mutex<State>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl Rendezvous {
    /// Joins the rendezvous `env` describes: rank 0 listens on `MASTER_PORT` (all IPv4 interfaces) and waits for
    /// every other rank; the others connect to `MASTER_ADDR:MASTER_PORT`. A single process needs no connection.
    pub fn connect(env: &LaunchEnv, options: RendezvousOptions) -> Result<Rendezvous, RendezvousError> {
        if env.world <= 1 {
            return Ok(Self::single());
        }
        let port = env.master_port.unwrap_or(0);
        if env.rank == 0 {
            let listener = TcpListener::bind(("0.0.0.0", port))
                .map_err(|e| RendezvousError::Listen { port, reason: e.to_string() })?;
            Self::root(listener, env.world, options)
        } else {
            let addr = format!("{}:{port}", env.master_addr.as_deref().unwrap_or("127.0.0.1"));
            Self::peer(&addr, env.rank, env.world, options)
        }
    }

    /// A rendezvous of one rank (every operation returns at once).
    pub fn single() -> Rendezvous {
        Rendezvous {
            rank: 0,
            world: 1,
            timeout: Duration::ZERO,
            state: Mutex::new(State { streams: vec![None], seq: 0, broken: None }),
        }
    }

    /// Rank 0 of `world` ranks, accepting on `listener` until every other rank joined; each accepted connection
    /// has [`RendezvousOptions::handshake_timeout`] to send its hello (see [`Rendezvous::root_with_handshake`]).
    pub fn root(
        listener: TcpListener,
        world: usize,
        options: RendezvousOptions,
    ) -> Result<Rendezvous, RendezvousError> {
        Self::root_with_handshake(listener, world, options, options.handshake_timeout())
    }

    /// Rank 0 of `world` ranks, accepting on `listener` until every other rank joined or `options.timeout` passed.
    ///
    /// Rank 0 keeps accepting while earlier connections are still handshaking, so no connection can hold up the
    /// others: each accepted connection has `handshake` (from its accept) to send a complete hello, read without
    /// blocking. Connections that are not joining weightferry ranks are dropped with a `tracing` warning and the
    /// wait goes on: one that stays silent past `handshake`, closes, does not start with [`MAGIC`] (another
    /// program: a port scanner, a health check, HTTP), or sends a weightferry frame that is not a hello.
    /// A hello from a weightferry peer that cannot join fails the whole rendezvous, as a misconfigured launch,
    /// with the exact error (rank 0 tells the offender and every joined rank why): another protocol
    /// [`VERSION`] ([`RendezvousError::Protocol`]), another world size ([`RendezvousError::WorldMismatch`]), a
    /// rank already joined or outside `1..world` ([`RendezvousError::BadRank`]).
    pub fn root_with_handshake(
        listener: TcpListener,
        world: usize,
        options: RendezvousOptions,
        handshake: Duration,
    ) -> Result<Rendezvous, RendezvousError> {
        let start = Instant::now();
        let deadline = start + options.timeout;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        listener.set_nonblocking(true).map_err(|e| RendezvousError::Listen { port, reason: e.to_string() })?;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut pending: Vec<Pending> = Vec::new();
        let fail = |streams: &mut Vec<Option<TcpStream>>, offender: Option<&mut TcpStream>, err: RendezvousError| {
            let reason = err.to_string();
            for s in offender.into_iter().chain(streams.iter_mut().flatten()) {
                let _ = write_frame(s, REFUSE, 0, 0, reason.as_bytes());
            }
            Err(err)
        };
        while streams.iter().skip(1).any(Option::is_none) {
            let mut progressed = false;
            loop {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        progressed = true;
                        let setup = stream.set_nonblocking(true).and_then(|()| stream.set_nodelay(true));
                        match setup {
                            Ok(()) => pending.push(Pending {
                                stream,
                                peer,
                                buf: Vec::with_capacity(HELLO_LEN),
                                deadline: Instant::now() + handshake,
                            }),
                            Err(e) => tracing::warn!(%peer, "rendezvous: dropped a connection: {e}"),
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::ConnectionAborted
                                | std::io::ErrorKind::ConnectionReset
                                | std::io::ErrorKind::Interrupted
                        ) =>
                    {
                        tracing::warn!("rendezvous: a connection failed before rank 0 accepted it: {e}");
                    }
                    Err(e) => return fail(&mut streams, None, RendezvousError::Listen { port, reason: e.to_string() }),
                }
            }
            let mut i = 0;
            while i < pending.len() {
                let step = pending[i].advance();
                if !matches!(step, Handshake::Waiting) {
                    progressed = true;
                }
                match step {
                    Handshake::Waiting => i += 1,
                    Handshake::Drop(why) => {
                        let p = pending.swap_remove(i);
                        tracing::warn!(peer = %p.peer, "rendezvous: dropped a connection that {why}");
                    }
                    Handshake::Wrong { magic, version } => {
                        let mut p = pending.swap_remove(i);
                        let err = RendezvousError::Protocol { peer: p.peer.to_string(), magic, version };
                        return fail(&mut streams, Some(&mut p.stream), err);
                    }
                    Handshake::Hello { rank, theirs } => {
                        let mut p = pending.swap_remove(i);
                        let err = if theirs != world {
                            Some(RendezvousError::WorldMismatch { rank, theirs, ours: world })
                        } else if rank == 0 || rank >= world || streams[rank].is_some() {
                            Some(RendezvousError::BadRank { rank, world })
                        } else {
                            None
                        };
                        if let Some(err) = err {
                            return fail(&mut streams, Some(&mut p.stream), err);
                        }
                        let setup = p
                            .stream
                            .set_nonblocking(false)
                            .and_then(|()| p.stream.set_read_timeout(Some(options.timeout)))
                            .and_then(|()| p.stream.set_write_timeout(Some(options.timeout)));
                        match setup {
                            Ok(()) => streams[rank] = Some(p.stream),
                            Err(e) => tracing::warn!(peer = %p.peer, rank, "rendezvous: dropped rank {rank}: {e}"),
                        }
                    }
                }
            }
            if streams.iter().skip(1).all(Option::is_some) {
                break;
            }
            if Instant::now() >= deadline {
                let missing = (1..world).filter(|&r| streams[r].is_none()).collect();
                return fail(
                    &mut streams,
                    None,
                    RendezvousError::Incomplete { world, missing, waited: start.elapsed() },
                );
            }
            if !progressed {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        drop(pending);
        for (r, s) in streams.iter_mut().enumerate() {
            if let Some(s) = s {
                write_frame(s, WELCOME, 0, 0, &[]).map_err(|e| RendezvousError::Io {
                    rank: 0,
                    peer: r,
                    op: "join",
                    seq: 0,
                    reason: io_reason(&e),
                })?;
            }
        }
        Ok(Rendezvous {
            rank: 0,
            world,
            timeout: options.timeout,
            state: Mutex::new(State { streams, seq: 0, broken: None }),
        })
    }

    /// Rank `rank` (not 0) of `world` ranks, joining rank 0 at `addr` (`host:port`), retrying until the timeout.
    pub fn peer(
        addr: &str,
        rank: usize,
        world: usize,
        options: RendezvousOptions,
    ) -> Result<Rendezvous, RendezvousError> {
        let start = Instant::now();
        let deadline = start + options.timeout;
        let connect_err =
            |reason: String| RendezvousError::Connect { rank, addr: addr.to_string(), waited: start.elapsed(), reason };
        let mut s = loop {
            let attempt = addr.to_socket_addrs().map_err(|e| e.to_string()).and_then(|mut addrs| {
                let a = addrs.next().ok_or_else(|| "the address resolves to nothing".to_string())?;
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                TcpStream::connect_timeout(&a, left.min(Duration::from_secs(5))).map_err(|e| e.to_string())
            });
            match attempt {
                Ok(s) => break s,
                Err(reason) if Instant::now() >= deadline => return Err(connect_err(reason)),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let io = |e: std::io::Error| RendezvousError::Io { rank, peer: 0, op: "join", seq: 0, reason: io_reason(&e) };
        s.set_nodelay(true).map_err(io)?;
        s.set_read_timeout(Some(options.timeout)).map_err(io)?;
        s.set_write_timeout(Some(options.timeout)).map_err(io)?;
        write_frame(&mut s, HELLO, rank, 0, &(world as u64).to_le_bytes()).map_err(io)?;
        match read_frame(&mut s) {
            Ok(f) if f.kind == WELCOME => {}
            Ok(f) if f.kind == REFUSE => {
                return Err(RendezvousError::Refused { reason: String::from_utf8_lossy(&f.payload).into_owned() })
            }
            Ok(f) => {
                return Err(RendezvousError::OutOfStep { seq: 0, op: "join", peer: 0, got: kind_name(f.kind).into() })
            }
            Err(FrameError::Io(e)) => return Err(io(e)),
            Err(FrameError::Protocol { magic, version }) => {
                return Err(RendezvousError::Protocol { peer: addr.to_string(), magic, version })
            }
            Err(FrameError::TooLarge(len)) => return Err(RendezvousError::TooLarge { len }),
        }
        let mut streams: Vec<Option<TcpStream>> = vec![None];
        streams[0] = Some(s);
        Ok(Rendezvous {
            rank,
            world,
            timeout: options.timeout,
            state: Mutex::new(State { streams, seq: 0, broken: None }),
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
        self.operation(|st, seq| {
            if self.rank == 0 {
                let payload = root_payload.unwrap_or_default();
                for (r, s) in st.streams.iter_mut().enumerate() {
                    if let Some(s) = s {
                        write_frame(s, BCAST, 0, seq, payload).map_err(|e| self.io(r, "broadcast", seq, &e))?;
                    }
                }
                Ok(payload.to_vec())
            } else {
                self.expect(st, BCAST, "broadcast", seq)
            }
        })
    }

    /// Every rank's `mine`, indexed by rank (lengths may differ).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        if mine.len() as u64 > MAX_PAYLOAD {
            return Err(RendezvousError::TooLarge { len: mine.len() as u64 });
        }
        self.operation(|st, seq| {
            if self.rank == 0 {
                let mut all: Vec<Vec<u8>> = vec![mine.to_vec()];
                for r in 1..self.world {
                    let Some(s) = st.streams[r].as_mut() else {
                        return Err(RendezvousError::BadRank { rank: r, world: self.world });
                    };
                    let f = read_frame(s).map_err(|e| self.frame_error(r, "all_gather", seq, e))?;
                    if f.kind != GATHER || f.seq != seq || f.rank as usize != r {
                        return Err(out_of_step(seq, "all_gather", r, &f));
                    }
                    all.push(f.payload);
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
                for (r, s) in st.streams.iter_mut().enumerate() {
                    if let Some(s) = s {
                        write_frame(s, GATHERED, 0, seq, &out).map_err(|e| self.io(r, "all_gather", seq, &e))?;
                    }
                }
                Ok(all)
            } else {
                let s = st.streams[0].as_mut().ok_or(RendezvousError::BadRank { rank: 0, world: self.world })?;
                write_frame(s, GATHER, self.rank, seq, mine).map_err(|e| self.io(0, "all_gather", seq, &e))?;
                let bytes = self.expect(st, GATHERED, "all_gather", seq)?;
                decode_gathered(&bytes, self.world).ok_or(RendezvousError::OutOfStep {
                    seq,
                    op: "all_gather",
                    peer: 0,
                    got: format!("a malformed result of {} bytes", bytes.len()),
                })
            }
        })
    }

    /// Returns once every rank called it.
    pub fn barrier(&self) -> Result<(), RendezvousError> {
        self.all_gather_bytes(&[]).map(|_| ())
    }

    /// Runs one collective operation under the lock; any failure breaks the rendezvous (rank 0 first tells every
    /// peer why).
    fn operation<T>(
        &self,
        f: impl FnOnce(&mut State, u64) -> Result<T, RendezvousError>,
    ) -> Result<T, RendezvousError> {
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(e) = &st.broken {
            return Err(RendezvousError::Broken(e.to_string()));
        }
        let seq = st.seq;
        st.seq += 1;
        let result = f(&mut st, seq);
        if let Err(e) = &result {
            if self.rank == 0 {
                let reason = e.to_string();
                for s in st.streams.iter_mut().flatten() {
                    let _ = write_frame(s, REFUSE, 0, seq, reason.as_bytes());
                }
            }
            st.broken = Some(e.clone());
        }
        result
    }

    /// Reads the frame of kind `kind` of operation `seq` from rank 0.
    fn expect(&self, st: &mut State, kind: u8, op: &'static str, seq: u64) -> Result<Vec<u8>, RendezvousError> {
        let s = st.streams[0].as_mut().ok_or(RendezvousError::BadRank { rank: 0, world: self.world })?;
        let f = read_frame(s).map_err(|e| self.frame_error(0, op, seq, e))?;
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
