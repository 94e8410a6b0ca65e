//! The collective contract (AllGather) and its simulated implementation for CI.
//!
//! [`Collective`] is what the collective actor needs from a communicator: its rank, its group size, and an
//! AllGather enqueued on a stream. [`SimCollective`] implements it for ranks that run as threads of one process,
//! each with its own [`SimPlatform`]: [`SimCollectiveGroup::new`] builds one per platform around a shared
//! rendezvous. Every call takes the rank's next sequence number and enqueues a sim kernel on the given stream that
//! declares a read of its input range and a write of its output range; the kernel deposits its input bytes in the
//! rendezvous under that sequence number, waits until every rank deposited, and writes the concatenation (rank
//! order) into its output through its own kernel context. No platform ever touches another platform's memory.
//!
//! Invariant: a group never hangs on a broken collective. The first failure anywhere — a rank's call failing (bad
//! range, injected fault, shut-down platform), two ranks issuing different tags or lengths at one sequence
//! number, two ranks placing one AllGather differently in their shared allocations (the sim's model of the
//! symmetric windows NCCL's copy-engine AllGather needs; [`Placement`]), a rank leaving, or a wait longer than the
//! group timeout — *poisons* the group with a typed
//! [`CollectiveError`]; every pending AllGather kernel of every rank then fails (so their streams report the
//! error) and every later call fails at once without enqueuing anything, so no rank enters an unmatched
//! collective. The tags each rank issued are recorded in call order so tests can compare ranks.

use crate::platform::{DeviceBufferId, PlatformError, StreamId};
use crate::sim::{Access, SimKernelCtx, SimPlatform};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{lock, Arc, Condvar, Mutex, MutexGuard};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The collective contract: one communicator seen from one rank.
///
/// Object-safe. Calls on one communicator must be made in one global order on every rank (the collective actor
/// guarantees it); implementations may detect a divergence but cannot repair it.
pub trait Collective: std::fmt::Debug {
    /// This rank, in `0..world()`.
    fn rank(&self) -> usize;
    /// Ranks in the communicator.
    fn world(&self) -> usize;
    /// Enqueues on `stream` an AllGather of `input = (buffer, offset, len)` from every rank into
    /// `output = (buffer, offset)`, which receives `len · world()` bytes, rank 0's input first. `tag` names what
    /// is gathered (ranks must pass equal tags at equal positions). Errors at enqueue; failures during execution
    /// surface through the stream (events recorded after it fail, `stream_synchronize` returns the error).
    fn all_gather(
        &self,
        stream: StreamId,
        input: (DeviceBufferId, u64, u64),
        output: (DeviceBufferId, u64),
        tag: u64,
    ) -> Result<(), PlatformError>;

    /// AllGathers this communicator enqueued between two shared allocations placed as symmetric windows (NCCL's
    /// copy-engine path; the simulated group's [`Placement::Windows`]). 0 for a communicator without windows.
    fn windowed_gathers(&self) -> u64 {
        0
    }
}

/// Why a collective group is poisoned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// Two ranks issued different tags at one sequence position.
    #[error("AllGather #{seq}: rank {first_rank} issued tag {first_tag:#x}, rank {rank} issued tag {tag:#x}")]
    TagMismatch {
        /// Sequence position.
        seq: u64,
        /// The rank that issued this position first.
        first_rank: usize,
        /// Its tag.
        first_tag: u64,
        /// The rank that disagreed.
        rank: usize,
        /// Its tag.
        tag: u64,
    },
    /// Two ranks issued different input lengths at one sequence position.
    #[error("AllGather #{seq}: rank {first_rank} gathers {first_len} bytes, rank {rank} gathers {len} bytes")]
    LengthMismatch {
        /// Sequence position.
        seq: u64,
        /// The rank that issued this position first.
        first_rank: usize,
        /// Its input length.
        first_len: u64,
        /// The rank that disagreed.
        rank: usize,
        /// Its input length.
        len: u64,
    },
    /// Two ranks placed one AllGather differently in their symmetric windows (shared allocations): NCCL's
    /// copy-engine AllGather would write into the wrong peer buffer. Checked only when a rank gathers between two
    /// shared allocations.
    #[error("AllGather #{seq}: rank {first_rank} gathers {first}, rank {rank} gathers {got}")]
    AsymmetricPlacement {
        /// Sequence position.
        seq: u64,
        /// The rank that issued this position first.
        first_rank: usize,
        /// Its placement.
        first: Placement,
        /// The rank that disagreed.
        rank: usize,
        /// Its placement.
        got: Placement,
    },
    /// A rank's call (or its kernel) failed.
    #[error("AllGather #{seq} failed on rank {rank}: {reason}")]
    RankFailed {
        /// The failing rank.
        rank: usize,
        /// Sequence position.
        seq: u64,
        /// What failed.
        reason: String,
    },
    /// A rank waited longer than the group timeout for its peers.
    #[error("AllGather #{seq}: rank {rank} waited {waited:?} for ranks {missing:?}")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// Sequence position.
        seq: u64,
        /// How long it waited.
        waited: Duration,
        /// Ranks that had not deposited their input.
        missing: Vec<usize>,
    },
    /// A rank dropped its communicator.
    #[error("rank {rank} left the group")]
    RankLeft {
        /// The rank.
        rank: usize,
    },
}

/// Where one rank's AllGather reads and writes, in terms of symmetric windows (see [`SimPlatform::window_index`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Input or output outside the shared allocations.
    Unshared,
    /// Both in shared allocations: (window, offset) of the input and of the output.
    Windows {
        /// Window of the input and offset in it.
        input: (usize, u64),
        /// Window of the output and offset in it.
        output: (usize, u64),
    },
}

impl Placement {
    /// Bytes of [`Placement::to_bytes`].
    pub const BYTES: usize = 33;

    /// The placement of an AllGather from `input` into `output` on a device whose shared allocations have the
    /// window indices `window_of` gives.
    pub fn of(
        (in_buf, in_off): (DeviceBufferId, u64),
        (out_buf, out_off): (DeviceBufferId, u64),
        window_of: impl Fn(DeviceBufferId) -> Option<usize>,
    ) -> Placement {
        match (window_of(in_buf), window_of(out_buf)) {
            (Some(i), Some(o)) => Placement::Windows { input: (i, in_off), output: (o, out_off) },
            _ => Placement::Unshared,
        }
    }

    /// A fixed-size encoding, for collectives that exchange placements between processes.
    pub fn to_bytes(&self) -> [u8; Placement::BYTES] {
        let mut b = [0u8; Placement::BYTES];
        if let Placement::Windows { input, output } = self {
            b[0] = 1;
            for (k, v) in [input.0 as u64, input.1, output.0 as u64, output.1].into_iter().enumerate() {
                b[1 + 8 * k..9 + 8 * k].copy_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    /// The placement of [`Placement::to_bytes`]; `None` for bytes no placement encodes to.
    pub fn from_bytes(b: &[u8]) -> Option<Placement> {
        if b.len() != Placement::BYTES {
            return None;
        }
        let word = |k: usize| u64::from_le_bytes(b[1 + 8 * k..9 + 8 * k].try_into().unwrap_or([0; 8]));
        match b[0] {
            0 if b[1..].iter().all(|&x| x == 0) => Some(Placement::Unshared),
            1 => Some(Placement::Windows {
                input: (usize::try_from(word(0)).ok()?, word(1)),
                output: (usize::try_from(word(2)).ok()?, word(3)),
            }),
            _ => None,
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Unshared => f.write_str("outside the shared allocations"),
            Placement::Windows { input, output } => {
                write!(f, "from window {} +{} into window {} +{}", input.0, input.1, output.0, output.1)
            }
        }
    }
}

impl From<CollectiveError> for PlatformError {
    fn from(e: CollectiveError) -> PlatformError {
        PlatformError::Driver(format!("collective group poisoned: {e}"))
    }
}

/// Settings of a simulated group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimCollectiveOptions {
    /// Longest time a rank's AllGather kernel waits for its peers before poisoning the group.
    pub timeout: Duration,
}

impl Default for SimCollectiveOptions {
    /// A 30 s timeout.
    fn default() -> Self {
        SimCollectiveOptions { timeout: Duration::from_secs(30) }
    }
}

/// One sequence position of the rendezvous.
struct Exchange {
    tag: u64,
    len: u64,
    placement: Placement,
    first_rank: usize,
    registered: usize,
    deposits: Vec<Option<Vec<u8>>>,
    collected: usize,
}

struct GroupState {
    poison: Option<CollectiveError>,
    ops: BTreeMap<u64, Exchange>,
    issued: Vec<Vec<u64>>,
}

/// The rendezvous shared by the ranks of one group.
struct Rendezvous {
    world: usize,
    options: SimCollectiveOptions,
    state: Mutex<GroupState>,
    cond: Condvar,
}

impl Rendezvous {
    /// Poisons the group with `e` unless it is poisoned already; returns the reason that stands.
    fn poison_locked(&self, st: &mut GroupState, e: CollectiveError) -> CollectiveError {
        let reason = st.poison.get_or_insert(e).clone();
        self.cond.notify_all();
        reason
    }

    fn poison(&self, e: CollectiveError) -> CollectiveError {
        let mut st = lock(&self.state);
        self.poison_locked(&mut st, e)
    }

    fn exchange<'a>(
        &self,
        st: &'a mut GroupState,
        seq: u64,
        (tag, len, placement): (u64, u64, Placement),
        rank: usize,
    ) -> &'a mut Exchange {
        let world = self.world;
        st.ops.entry(seq).or_insert_with(|| Exchange {
            tag,
            len,
            placement,
            first_rank: rank,
            registered: 0,
            deposits: vec![None; world],
            collected: 0,
        })
    }

    /// Records rank `rank`'s call at `seq`, checking it against the ranks that issued `seq` before.
    fn register(&self, rank: usize, seq: u64, tag: u64, len: u64, placement: Placement) -> Result<(), CollectiveError> {
        let mut st = lock(&self.state);
        if let Some(p) = &st.poison {
            return Err(p.clone());
        }
        if let Some(list) = st.issued.get_mut(rank) {
            list.push(tag);
        }
        let ex = self.exchange(&mut st, seq, (tag, len, placement), rank);
        let mismatch = if ex.tag != tag {
            Some(CollectiveError::TagMismatch { seq, first_rank: ex.first_rank, first_tag: ex.tag, rank, tag })
        } else if ex.len != len {
            Some(CollectiveError::LengthMismatch { seq, first_rank: ex.first_rank, first_len: ex.len, rank, len })
        } else if ex.placement != placement {
            let (first_rank, first) = (ex.first_rank, ex.placement);
            Some(CollectiveError::AsymmetricPlacement { seq, first_rank, first, rank, got: placement })
        } else {
            ex.registered += 1;
            None
        };
        match mismatch {
            Some(e) => Err(self.poison_locked(&mut st, e)),
            None => Ok(()),
        }
    }

    /// The kernel side: deposits `input` at `seq`, waits for every rank, returns the gathered bytes.
    fn exchange_bytes(&self, rank: usize, seq: u64, tag: u64, input: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        let len = input.len() as u64;
        let start = Instant::now();
        let deadline = start + self.options.timeout;
        let mut st: MutexGuard<'_, GroupState> = lock(&self.state);
        {
            // Registered before the kernel ran, so the exchange exists; the placement argument is not used then.
            let ex = self.exchange(&mut st, seq, (tag, len, Placement::Unshared), rank);
            if ex.tag == tag && ex.len == len {
                if let Some(slot) = ex.deposits.get_mut(rank) {
                    *slot = Some(input);
                }
            }
        }
        self.cond.notify_all();
        loop {
            let complete = st.ops.get(&seq).is_some_and(|ex| ex.deposits.iter().all(Option::is_some));
            if complete {
                break;
            }
            if let Some(p) = &st.poison {
                return Err(p.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = st
                    .ops
                    .get(&seq)
                    .map(|ex| (0..self.world).filter(|&r| ex.deposits[r].is_none()).collect())
                    .unwrap_or_default();
                let e = CollectiveError::Timeout { rank, seq, waited: now - start, missing };
                return Err(self.poison_locked(&mut st, e));
            }
            st = match self.cond.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        let world = self.world;
        let Some(ex) = st.ops.get_mut(&seq) else {
            return Err(CollectiveError::RankFailed { rank, seq, reason: "exchange vanished".to_string() });
        };
        let gathered: Vec<u8> = ex.deposits.iter().flatten().flat_map(|d| d.iter().copied()).collect();
        ex.collected += 1;
        if ex.collected == world {
            st.ops.remove(&seq);
        }
        Ok(gathered)
    }
}

/// Builds the ranks of a simulated communicator.
#[derive(Debug)]
pub struct SimCollectiveGroup;

impl SimCollectiveGroup {
    /// One communicator per platform (rank = index), with default options.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(platforms: Vec<Arc<SimPlatform>>) -> Vec<SimCollective> {
        Self::with_options(platforms, SimCollectiveOptions::default())
    }

    /// One communicator per platform (rank = index).
    pub fn with_options(platforms: Vec<Arc<SimPlatform>>, options: SimCollectiveOptions) -> Vec<SimCollective> {
        let world = platforms.len();
        let group = Arc::new(Rendezvous {
            world,
            options,
            state: Mutex::new(GroupState { poison: None, ops: BTreeMap::new(), issued: vec![Vec::new(); world] }),
            cond: Condvar::new(),
        });
        platforms
            .into_iter()
            .enumerate()
            .map(|(rank, platform)| SimCollective {
                rank,
                platform,
                group: group.clone(),
                next_seq: Mutex::new(0),
                fail_at: AtomicU64::new(u64::MAX),
                windowed: AtomicU64::new(0),
            })
            .collect()
    }
}

/// One rank of a simulated communicator. Dropping it poisons the group (its peers cannot gather without it).
pub struct SimCollective {
    rank: usize,
    platform: Arc<SimPlatform>,
    group: Arc<Rendezvous>,
    next_seq: Mutex<u64>,
    fail_at: AtomicU64,
    windowed: AtomicU64,
}

impl std::fmt::Debug for SimCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCollective").field("rank", &self.rank).field("world", &self.group.world).finish()
    }
}

impl SimCollective {
    /// Makes this rank's `nth` call (0-based, counting every call) fail at enqueue, poisoning the group.
    pub fn fail_nth_call(&self, nth: u64) {
        self.fail_at.store(nth, Ordering::SeqCst);
    }

    /// The reason the group is poisoned, if it is.
    pub fn poison_reason(&self) -> Option<CollectiveError> {
        lock(&self.group.state).poison.clone()
    }

    /// The tags this rank issued, in call order (calls refused because the group was already poisoned are not
    /// recorded).
    pub fn issued_tags(&self) -> Vec<u64> {
        lock(&self.group.state).issued.get(self.rank).cloned().unwrap_or_default()
    }

    /// The tags every rank issued, indexed by rank.
    pub fn group_issued_tags(&self) -> Vec<Vec<u64>> {
        lock(&self.group.state).issued.clone()
    }

    /// The platform this rank runs on.
    pub fn platform(&self) -> &Arc<SimPlatform> {
        &self.platform
    }

    fn fail(&self, seq: u64, e: PlatformError) -> PlatformError {
        self.group.poison(CollectiveError::RankFailed { rank: self.rank, seq, reason: e.to_string() }).into()
    }
}

impl Drop for SimCollective {
    fn drop(&mut self) {
        self.group.poison(CollectiveError::RankLeft { rank: self.rank });
    }
}

impl Collective for SimCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
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
        // Holding the rank's sequence lock across registration and launch keeps sequence order = stream order.
        let mut next = lock(&self.next_seq);
        if let Some(p) = self.poison_reason() {
            return Err(p.into());
        }
        let seq = *next;
        *next += 1;
        if self.fail_at.load(Ordering::SeqCst) == seq {
            return Err(self.fail(seq, PlatformError::Driver("injected AllGather failure".to_string())));
        }
        let out_len = len.checked_mul(self.group.world as u64).ok_or_else(|| {
            self.fail(seq, PlatformError::OutOfBounds { what: "all_gather output", offset: out_off, len, size: 0 })
        })?;
        let placement = Placement::of((in_buf, in_off), (out_buf, out_off), |b| self.platform.window_index(b));
        self.group.register(self.rank, seq, tag, len, placement)?;
        let group = self.group.clone();
        let rank = self.rank;
        let accesses = vec![Access::read(in_buf, in_off, len), Access::write(out_buf, out_off, out_len)];
        let body = move |ctx: &SimKernelCtx| -> Result<(), String> {
            let mut bytes = vec![0u8; len as usize];
            if let Err(e) = ctx.read(in_buf, in_off, &mut bytes) {
                let reason = e.to_string();
                return Err(group.poison(CollectiveError::RankFailed { rank, seq, reason }).to_string());
            }
            let gathered = group.exchange_bytes(rank, seq, tag, bytes).map_err(|e| e.to_string())?;
            ctx.write(out_buf, out_off, &gathered).map_err(|e| {
                let reason = e.to_string();
                group.poison(CollectiveError::RankFailed { rank, seq, reason }).to_string()
            })
        };
        self.platform
            .launch(stream, &format!("all_gather #{seq} tag {tag:#x}"), accesses, Box::new(body))
            .map_err(|e| self.fail(seq, e))?;
        if matches!(placement, Placement::Windows { .. }) {
            self.windowed.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn windowed_gathers(&self) -> u64 {
        self.windowed.load(Ordering::SeqCst)
    }
}
