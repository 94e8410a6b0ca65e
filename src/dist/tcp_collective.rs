//! [`TcpCollective`]: the AllGather contract across processes for ranks on the simulated device, so multi-process
//! runs are testable without GPUs. Each call takes the rank's next sequence number and enqueues a sim kernel on the
//! given stream that declares a read of its input range and a write of its output range; the kernel reads its
//! input through its kernel context, exchanges `(tag, placement, bytes)` with every rank over the [`Rendezvous`],
//! checks that every rank gathered the same tag and length at the same placement in its shared allocations (the
//! symmetric windows NCCL's copy-engine AllGather needs; [`Placement`]), and writes the concatenation (rank order)
//! into its output.
//!
//! Invariant: after the first failure — a call failing to start (injected fault, shut-down platform), a rank
//! gathering another tag, length or placement at one sequence number, a peer gone or timed out — this rank is
//! poisoned:
//! every pending and later AllGather fails without entering the rendezvous, so it never waits on a collective its
//! peers will not join; a failing peer breaks the rendezvous, so the other ranks fail too (within the rendezvous
//! timeout at worst, at once when the peer's process exits).

use super::rendezvous::Rendezvous;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use weightferry_actors::collective::{Collective, CollectiveError, Placement};
use weightferry_actors::platform::{DeviceBufferId, PlatformError, StreamId};
use weightferry_actors::sim::{Access, SimKernelCtx, SimPlatform};

/// Bytes before the data in an exchanged AllGather payload: the tag, then the encoded [`Placement`].
const HEADER: usize = 8 + Placement::BYTES;

/// One rank of a communicator whose ranks are processes on the simulated device, exchanging over a rendezvous.
pub struct TcpCollective {
    rendezvous: Arc<Rendezvous>,
    platform: Arc<SimPlatform>,
    next_seq: Mutex<u64>,
    fail_at: AtomicU64,
    poison: Arc<Mutex<Option<CollectiveError>>>,
    peer_failed: Arc<AtomicBool>,
    windowed: AtomicU64,
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
            windowed: AtomicU64::new(0),
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
        let placement = Placement::of((in_buf, in_off), (out_buf, out_off), |b| self.platform.window_index(b));
        let (rdv, slot, peer_failed) = (self.rendezvous.clone(), self.poison.clone(), self.peer_failed.clone());
        let body = move |ctx: &SimKernelCtx| -> Result<(), String> {
            let failed = |e: CollectiveError| poison(&slot, e).to_string();
            if let Some(p) = lock(&slot).clone() {
                return Err(PlatformError::from(p).to_string());
            }
            // Header: the tag, then where this rank gathers (checked for symmetry, as NCCL's windows need).
            let mut payload = tag.to_le_bytes().to_vec();
            payload.extend_from_slice(&placement.to_bytes());
            payload.resize(HEADER + len as usize, 0);
            ctx.read(in_buf, in_off, &mut payload[HEADER..])
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
                let theirs = (b.len() as u64).saturating_sub(HEADER as u64);
                if b.len() < HEADER || theirs != len {
                    let e =
                        CollectiveError::LengthMismatch { seq, first_rank: rank, first_len: len, rank: r, len: theirs };
                    return Err(failed(e));
                }
                let got = Placement::from_bytes(&b[8..HEADER]);
                if got != Some(placement) {
                    let e = match got {
                        Some(got) => CollectiveError::AsymmetricPlacement {
                            seq,
                            first_rank: rank,
                            first: placement,
                            rank: r,
                            got,
                        },
                        None => CollectiveError::RankFailed { rank: r, seq, reason: "malformed placement".into() },
                    };
                    return Err(failed(e));
                }
                gathered.extend_from_slice(&b[HEADER..]);
            }
            ctx.write(out_buf, out_off, &gathered)
                .map_err(|e| failed(CollectiveError::RankFailed { rank, seq, reason: e.to_string() }))
        };
        let accesses = vec![Access::read(in_buf, in_off, len), Access::write(out_buf, out_off, out_len)];
        self.platform
            .launch(stream, &format!("all_gather #{seq} tag {tag:#x}"), accesses, Box::new(body))
            .map_err(|e| fail(e.to_string()))?;
        if matches!(placement, Placement::Windows { .. }) {
            self.windowed.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn windowed_gathers(&self) -> u64 {
        self.windowed.load(Ordering::SeqCst)
    }
}
