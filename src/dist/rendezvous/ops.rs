//! The operations of a joined [`Rendezvous`]: broadcast, all-gather of bytes and barrier, each collective and
//! numbered, a failure breaking the rendezvous for every later operation.

use super::error::RendezvousError;
use super::wire::{
    io_reason, kind_name, read_frame, refuse, timed_out, write_frame, Frame, FrameError, BCAST, GATHER, GATHERED,
    MAX_PAYLOAD, REFUSE,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::Poll;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::runtime::Runtime;

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

pub(super) struct State {
    /// Rank 0: the stream of every peer, indexed by rank (`None` at 0). Other ranks: one stream, to rank 0.
    pub(super) streams: Vec<Option<TcpStream>>,
    pub(super) seq: u64,
    pub(super) broken: Option<RendezvousError>,
}

/// The rendezvous of one process; see the [module docs](super). `Sync`: operations from several threads are
/// serialised.
pub struct Rendezvous {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) timeout: Duration,
    /// Dropped before the runtime (declaration order), so the sockets deregister from a live reactor.
    pub(super) state: Mutex<State>,
    /// Drives every network wait; `None` for a single rank, which exchanges nothing.
    pub(super) rt: Option<Runtime>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl Rendezvous {
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
