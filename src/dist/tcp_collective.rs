//! [`TcpCollective`]: the AllGather contract across processes for ranks on the simulated device, so multi-process
//! runs are testable without GPUs. Each call takes the rank's next sequence number and enqueues a sim kernel on the
//! given stream that declares a read of its input range and a write of its output range; the kernel reads its
//! input through its kernel context, exchanges `(tag, bytes)` with every rank over the [`Rendezvous`], checks that
//! every rank gathered the same tag and length, and writes the concatenation (rank order) into its output.
//!
//! Invariant: after the first failure — a call failing to start (injected fault, shut-down platform), a rank
//! gathering another tag or length at one sequence number, a peer gone or timed out — this rank is poisoned:
//! every pending and later AllGather fails without entering the rendezvous, so it never waits on a collective its
//! peers will not join; a failing peer breaks the rendezvous, so the other ranks fail too (within the rendezvous
//! timeout at worst, at once when the peer's process exits).

use super::rendezvous::Rendezvous;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use weightferry_actors::collective::{Collective, CollectiveError};
use weightferry_actors::platform::{DeviceBufferId, PlatformError, StreamId};
use weightferry_actors::sim::{Access, SimKernelCtx, SimPlatform};

/// One rank of a communicator whose ranks are processes on the simulated device, exchanging over a rendezvous.
pub struct TcpCollective {
    rendezvous: Arc<Rendezvous>,
    platform: Arc<SimPlatform>,
    next_seq: Mutex<u64>,
    fail_at: AtomicU64,
    poison: Arc<Mutex<Option<CollectiveError>>>,
    peer_failed: Arc<AtomicBool>,
}

impl std::fmt::Debug for TcpCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpCollective").field("rank", &self.rank()).field("world", &self.world()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records the first failure and returns it as a platform error.
fn poison(slot: &Mutex<Option<CollectiveError>>, e: CollectiveError) -> PlatformError {
    lock(slot).get_or_insert(e).clone().into()
}

impl TcpCollective {
    /// This process's rank of the communicator over `rendezvous`, running its kernels on `platform`.
    pub fn new(rendezvous: Arc<Rendezvous>, platform: Arc<SimPlatform>) -> TcpCollective {
        TcpCollective {
            rendezvous,
            platform,
            next_seq: Mutex::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            poison: Arc::new(Mutex::new(None)),
            peer_failed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A flag set when an exchange with the other ranks failed (a peer left, timed out, or rank 0 ended the
    /// rendezvous): this rank then fails because another one did. Readable after the collective moved into its
    /// actor.
    pub fn peer_failed_flag(&self) -> Arc<AtomicBool> {
        self.peer_failed.clone()
    }

    /// Testing aid: makes this rank's `nth` call (0-based, counting every call) fail at enqueue.
    pub fn fail_nth_call(&self, nth: u64) {
        self.fail_at.store(nth, Ordering::SeqCst);
    }

    /// The failure that poisoned this rank, if any.
    pub fn poison_reason(&self) -> Option<CollectiveError> {
        lock(&self.poison).clone()
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rendezvous.rank()
    }

    fn world(&self) -> usize {
        self.rendezvous.world()
    }

    fn all_gather(
        &self,
        stream: StreamId,
        input: (DeviceBufferId, u64, u64),
        output: (DeviceBufferId, u64),
        tag: u64,
    ) -> Result<(), PlatformError> {
        let (in_buf, in_off, len) = input;
        let (out_buf, out_off) = output;
        let rank = self.rank();
        // Holding the sequence lock across launch keeps sequence order = stream order.
        let mut next = lock(&self.next_seq);
        if let Some(p) = self.poison_reason() {
            return Err(p.into());
        }
        let seq = *next;
        *next += 1;
        let fail = |reason: String| poison(&self.poison, CollectiveError::RankFailed { rank, seq, reason });
        if self.fail_at.load(Ordering::SeqCst) == seq {
            return Err(fail("injected AllGather failure".to_string()));
        }
        let Some(out_len) = len.checked_mul(self.world() as u64) else {
            return Err(fail(format!("an AllGather of {len} bytes per rank overflows")));
        };
        let (rdv, slot, peer_failed) = (self.rendezvous.clone(), self.poison.clone(), self.peer_failed.clone());
        let body = move |ctx: &SimKernelCtx| -> Result<(), String> {
            let failed = |e: CollectiveError| poison(&slot, e).to_string();
            if let Some(p) = lock(&slot).clone() {
                return Err(PlatformError::from(p).to_string());
            }
            let mut payload = tag.to_le_bytes().to_vec();
            payload.resize(8 + len as usize, 0);
            ctx.read(in_buf, in_off, &mut payload[8..])
                .map_err(|e| failed(CollectiveError::RankFailed { rank, seq, reason: e.to_string() }))?;
            let all = rdv.all_gather_bytes(&payload).map_err(|e| {
                peer_failed.store(true, Ordering::SeqCst);
                failed(CollectiveError::RankFailed { rank, seq, reason: e.to_string() })
            })?;
            let mut gathered = Vec::with_capacity(out_len as usize);
            for (r, b) in all.iter().enumerate() {
                let their_tag = b.get(..8).map(|t| u64::from_le_bytes(t.try_into().unwrap_or([0; 8])));
                if their_tag != Some(tag) {
                    let e = CollectiveError::TagMismatch {
                        seq,
                        first_rank: rank,
                        first_tag: tag,
                        rank: r,
                        tag: their_tag.unwrap_or(u64::MAX),
                    };
                    return Err(failed(e));
                }
                let theirs = b.len() as u64 - 8;
                if theirs != len {
                    let e =
                        CollectiveError::LengthMismatch { seq, first_rank: rank, first_len: len, rank: r, len: theirs };
                    return Err(failed(e));
                }
                gathered.extend_from_slice(&b[8..]);
            }
            ctx.write(out_buf, out_off, &gathered)
                .map_err(|e| failed(CollectiveError::RankFailed { rank, seq, reason: e.to_string() }))
        };
        let accesses = vec![Access::read(in_buf, in_off, len), Access::write(out_buf, out_off, out_len)];
        self.platform
            .launch(stream, &format!("all_gather #{seq} tag {tag:#x}"), accesses, Box::new(body))
            .map_err(|e| fail(e.to_string()))?;
        Ok(())
    }
}
