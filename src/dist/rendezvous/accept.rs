//! Rank 0's side of the join: it accepts connections until every other rank of its run sent a hello it takes,
//! judging each hello (see the rules in the parent module's docs) and welcoming them all.

use super::error::RendezvousError;
use super::identity::{Fingerprint, RunId};
use super::options::RendezvousOptions;
use super::wire::{
    io_reason, kind_name, refuse, refuse_hello, timed_out, write_frame, HEADER, HELLO, HELLO_LEN, MAGIC, VERSION,
    WELCOME,
};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// Rank 0's join: accepts until every other rank of this run sent its hello (see
/// [`Rendezvous::root_with_handshake`](super::Rendezvous::root_with_handshake)), then welcomes them all.
pub(super) async fn accept_all(
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

/// Judges the first bytes of a connection (the rules of the parent module's docs); `None` while they are a correct but
/// incomplete hello.
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
