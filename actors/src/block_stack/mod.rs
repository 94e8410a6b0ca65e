//! The block-stack actor: one per ring of blocks. It owns the residency table of its blocks and the device slots it
//! streams them through, and turns the engine's hook messages into loads.
//!
//! Hook messages are handled synchronously on the engine's thread (the actor's state sits behind an uncontended
//! lock that is never held across a blocking call): `pre_forward(i)` makes block i resident — or orders the engine's
//! compute stream behind its ready event — and prefetches the next `depth` streamed blocks, wrapping into the next
//! pass; `post_forward(i)` records the last-use event of i's slot on the compute stream and releases the slot
//! (the "evict": the slot is reused later behind a GPU-side wait on that event). Completion notifications arrive in
//! the actor's unbounded mailbox and are drained at every hook.
//!
//! Invariants: (1) compute is ordered behind the ready event of the load that filled a slot before it reads it;
//! (2) a load into a slot waits (on the device) for the slot's last-use event, and slot memory is freed only after
//! that event's completion was observed; (7) device memory is exactly the resident head plus the fixed slot pool
//! allocated at creation: nothing is allocated on the hook path.
//!
//! # Layout
//!
//! Like crossbeam-channel's flavors, the stack is one facade ([`BlockStack`], this file) over one bookkeeping core
//! and one load path per way of moving bytes:
//!
//! - `ring.rs` — which blocks are resident, the slot table, the prefetch window, the victim choice and the tickets:
//!   pure, tested beside it;
//! - `actor_path.rs` — [`Submission::Actor`]: a load is a [`LoadCmd`](crate::messages::LoadCmd) to the copy-stream
//!   actor (and the resident head loads this way on every path);
//! - `hook_path.rs` — [`Submission::Hook`]: the hook enqueues the load itself and completions are polled;
//! - `gather_path.rs` — [`BlockStack::with_gather`]: shard copies, then AllGathers through the collective actor;
//! - `ordering_fault.rs` — [`OrderingFault`], the names of the deliberately broken orderings (in every build);
//! - `faults.rs` — the broken orderings themselves, only under `--cfg weightferry_broken`.
//!
//! The facade picks the slot, the ticket and the waits of every load (`issue_load`) and hands it to its
//! `LoadPath`; a path enqueues it and says how "recorded", "completed" and "fenced" are observed on it. Every path
//! enqueues the same waits before it overwrites a slot, so invariants (1) and (2) are argued once, here.
//!
//! A path's own state is held in its variant, not in the facade: what hooks read without the stack's lock in
//! `LoadPath` (the gather path's collective, numbering and board), what they change under it in `PathState` (the
//! hook path's loads in flight, the gather path's shard slots).

mod actor_path;
#[cfg(weightferry_broken)]
mod faults;
mod gather_path;
mod hook_path;
mod ordering_fault;
mod ring;
pub use ring::slot_count;

pub use gather_path::{GatherBlock, GatherPath, GatherSection, GatherSequence, MAX_GATHERS_PER_BLOCK};
pub use ordering_fault::OrderingFault;

use crate::error::SchedulerError;
use crate::messages::{Completion, FileRead, TicketBoard};
use crate::platform::{DeviceBufferId, EventId, HostBufferId, PlatformError, PlatformRef, StreamId};
use crate::reader_actor::ReaderHandle;
use crate::slot::{SlotState, Ticket};
use crate::stream_actor::StreamHandle;
use crate::sync::mailbox::{self, Receiver, Sender};
use crate::sync::{lock, Arc, Mutex, MutexGuard};
use ring::{Found, Ring};

/// A fault point: `fault_point!(stack, Fault => broken, correct)` evaluates `correct`, or — only in a build with
/// `--cfg weightferry_broken`, for a stack built with `OrderingFault::Fault` — `broken`. Without the cfg it expands
/// to `correct` alone: release builds carry no fault check (see `faults.rs`).
#[cfg(not(weightferry_broken))]
macro_rules! fault_point {
    ($stack:expr, $fault:ident => $broken:expr, $correct:expr) => {
        $correct
    };
}
#[cfg(weightferry_broken)]
macro_rules! fault_point {
    ($stack:expr, $fault:ident => $broken:expr, $correct:expr) => {
        if $stack.faults.is(OrderingFault::$fault) {
            $broken
        } else {
            $correct
        }
    };
}

/// One flat copy of a block: a run of its host master to an offset inside the block's device region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Host master buffer.
    pub host: HostBufferId,
    /// Offset in the master.
    pub host_offset: u64,
    /// Bytes.
    pub len: u64,
    /// Offset inside the block's device region.
    pub device_offset: u64,
}

/// A block: its flat copies and the size of its device region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSpec {
    /// Flat copies (one per dtype for well-packed masters).
    pub segments: Vec<Segment>,
    /// For a block of the disk tier: the file ranges its reader reads into a staging buffer before the copies, whose
    /// `host_offset`s are then offsets in that buffer (their `host` is replaced by it). Empty for a block in host
    /// memory. A stack with any such block must be made [`BlockStack::with_reader`].
    pub reads: Vec<FileRead>,
    /// Bytes of the device region the block occupies.
    pub device_bytes: u64,
}

impl BlockSpec {
    /// Bytes copied to load the block.
    pub fn copy_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }
}

/// Who enqueues a rank-local streamed load on the stack's copy stream.
///
/// Both modes enqueue the same operations on the same stream, in the same order: a GPU-side wait on the slot's
/// last-use event, the flat copies, a record of the slot's ready event. They differ in which thread does it and in
/// how completion is observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Submission {
    /// The hook sends a [`LoadCmd`](crate::messages::LoadCmd) to the stream actor, which enqueues it; its
    /// completion watcher reports the completion. The hook thread never calls the driver for a copy, but each
    /// prefetch wakes the actor thread, which costs tens of µs when it has been parked for a long block (a
    /// compute-bound run).
    #[default]
    Actor,
    /// The engine thread calling the hook enqueues the load itself, under the stack's lock, in issue order: no
    /// thread is woken, and the load counts as recorded as soon as the hook returns. Completions are polled
    /// (`event_query` of the ready events of the loads still in flight, oldest first) at every hook, and a fence
    /// synchronises the copy stream directly. Rank-local stacks only: a gather stack always uses its actors. The
    /// host masters should be pinned: a copy from pageable memory synchronises its stream before it starts, so the
    /// hook would wait (holding the stack's lock) for the copy stream, behind the slot's last use (the config
    /// refuses that combination).
    Hook,
}

impl Submission {
    /// The config spelling: `"actor"` or `"hook"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Submission::Actor => "actor",
            Submission::Hook => "hook",
        }
    }
}

/// What a block stack streams and how.
#[derive(Debug, Clone)]
pub struct StackSpec {
    /// Name for errors and reports.
    pub name: String,
    /// Blocks in execution order.
    pub blocks: Vec<BlockSpec>,
    /// Leading blocks kept resident.
    pub resident_head: usize,
    /// Blocks prefetched ahead. 0 means staged: one slot, a unit is loaded only when asked for (whole-component
    /// swapping and on-demand staging).
    pub prefetch_depth: usize,
    /// A static schedule: every streamed block lands in the same slot on every pass (block `k` of the streamed
    /// blocks in slot `k mod slots`, with [`slot_count`]'s slots dividing the streamed count), so its tensors can
    /// be bound once.
    pub static_slots: bool,
    /// Prefetch the first streamed blocks at creation (rank-local strategies); the distributed strategy defers the
    /// first prefetch to the first forward.
    pub eager_prefetch: bool,
    /// Test-only ordering fault: anything but [`OrderingFault::None`] needs a build with
    /// `RUSTFLAGS="--cfg weightferry_broken"` (elsewhere construction fails with
    /// [`SchedulerError::FaultNotBuilt`]).
    pub ordering_fault: OrderingFault,
    /// Who enqueues streamed loads (see [`Submission`]). Must be [`Submission::Actor`] for a gather stack.
    pub submission: Submission,
}

/// Where a block's bytes are on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLocation {
    /// The device buffer.
    pub buffer: DeviceBufferId,
    /// Offset of the block's region in it.
    pub offset: u64,
}

/// Counters of one stack.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StackStats {
    /// Loads issued (prefetches and synchronous fetches).
    pub loads: u64,
    /// Bytes copied host → device.
    pub h2d_bytes: u64,
    /// `pre_forward` found its block prefetched.
    pub prefetch_hits: u64,
    /// `pre_forward` found its block still in a released slot (no copy needed).
    pub reuse_hits: u64,
    /// `pre_forward` had to issue the load itself (block not prefetched, e.g. after a skip).
    pub sync_fetches: u64,
    /// `pre_forward` had to wait on the host for the stream actor to enqueue the load.
    pub record_waits: u64,
    /// Completions observed.
    pub completions: u64,
    /// Resident-head blocks.
    pub resident_blocks: u64,
    /// Device bytes held (resident head + slots).
    pub device_bytes: u64,
}

/// The load path of a stack's streamed blocks (the resident head always loads through the stream actor), with
/// the state only that path has which hooks read without the stack's lock; what they change under the lock is the
/// same variant of [`PathState`].
#[derive(Debug)]
enum LoadPath {
    /// [`Submission::Actor`]: `actor_path.rs`.
    Actor,
    /// [`Submission::Hook`]: `hook_path.rs`.
    Hook,
    /// [`BlockStack::with_gather`]: `gather_path.rs`.
    Gather(gather_path::GatherLink),
    /// [`BlockStack::with_reader`]: the actor path, every load through the disk tier's reader actor.
    Disk(ReaderHandle),
}

/// The state only the stack's load path has, under the stack's lock (the variant of its [`LoadPath`]).
#[derive(Debug)]
enum PathState {
    /// The actor path keeps nothing: the stream actor reports completions in the mailbox.
    Actor,
    /// The hook path's loads in flight, polled at every hook.
    Hook(hook_path::InFlight),
    /// The gather path's shard buffers and events.
    Gather(gather_path::ShardSlots),
}

impl PathState {
    /// Forgets the loads in flight and takes the shard buffers and events to free (disable), and whether the
    /// shard stream is still to be destroyed (once).
    fn release(&mut self) -> (Vec<DeviceBufferId>, Vec<EventId>, bool) {
        match self {
            PathState::Actor => (Vec::new(), Vec::new(), false),
            PathState::Hook(in_flight) => {
                in_flight.clear();
                (Vec::new(), Vec::new(), false)
            }
            PathState::Gather(shards) => shards.take(),
        }
    }
}

/// One streamed load, as the facade hands it to a load path: the slot (already `Loading` under `ticket`) and the
/// events the device must wait for before it overwrites the slot (its last-use event).
#[derive(Debug)]
struct Load<'a> {
    slot: usize,
    block: usize,
    ticket: Ticket,
    waits: &'a [EventId],
}

/// The device memory and events of a stack's resident blocks and slots: allocated at creation, freed by disable.
#[derive(Debug)]
struct SlotMemory {
    /// Per block: its own device buffer when resident.
    resident_bufs: Vec<Option<DeviceBufferId>>,
    /// Recorded after the resident head's copies.
    resident_ev: Option<EventId>,
    /// Per slot: its buffer, sized to the largest streamed block.
    slot_bufs: Vec<DeviceBufferId>,
    /// Per slot: recorded after the load that fills it.
    ready_ev: Vec<EventId>,
    /// Per slot: recorded on the compute stream after the compute that read it.
    last_use_ev: Vec<EventId>,
}

impl SlotMemory {
    /// Allocates, in this order (fault injection counts allocations): the resident blocks' buffers, the slot
    /// buffers (`shared` for gather slots: memory a collective may map for its peers), each slot's ready and
    /// last-use events, the resident head's event.
    fn alloc(
        platform: &PlatformRef,
        blocks: &[BlockSpec],
        resident: &[bool],
        slots: usize,
        slot_size: u64,
        shared: bool,
        alloc: &mut Allocated,
    ) -> Result<SlotMemory, SchedulerError> {
        let mut resident_bufs = Vec::with_capacity(blocks.len());
        for (b, &r) in blocks.iter().zip(resident) {
            resident_bufs.push(if r {
                Some(alloc.buffer(platform.alloc_device(b.device_bytes.max(1)))?)
            } else {
                None
            });
        }
        let mut slot_bufs = Vec::with_capacity(slots);
        for _ in 0..slots {
            let buf = if shared {
                platform.alloc_device_shared(slot_size.max(1))
            } else {
                platform.alloc_device(slot_size.max(1))
            };
            slot_bufs.push(alloc.buffer(buf)?);
        }
        let (mut ready_ev, mut last_use_ev) = (Vec::with_capacity(slots), Vec::with_capacity(slots));
        for _ in 0..slots {
            ready_ev.push(alloc.event(platform)?);
            last_use_ev.push(alloc.event(platform)?);
        }
        let resident_ev = if resident.iter().any(|r| *r) { Some(alloc.event(platform)?) } else { None };
        Ok(SlotMemory { resident_bufs, resident_ev, slot_bufs, ready_ev, last_use_ev })
    }

    /// Every event a load or a read may still be pending on: last uses, ready events, the resident head's.
    fn events(&self) -> impl Iterator<Item = &EventId> {
        self.last_use_ev.iter().chain(self.ready_ev.iter()).chain(self.resident_ev.iter())
    }

    /// Takes the buffers and events to free (disable).
    fn take(&mut self) -> (Vec<DeviceBufferId>, Vec<EventId>) {
        let bufs = self.resident_bufs.drain(..).flatten().chain(self.slot_bufs.drain(..)).collect();
        let events = self.ready_ev.drain(..).chain(self.last_use_ev.drain(..)).chain(self.resident_ev.take()).collect();
        (bufs, events)
    }
}

/// What `build` allocated so far, freed again if a later step fails.
#[derive(Debug, Default)]
struct Allocated {
    bufs: Vec<DeviceBufferId>,
    events: Vec<EventId>,
}

impl Allocated {
    /// Records an allocated buffer.
    fn buffer(&mut self, r: Result<DeviceBufferId, PlatformError>) -> Result<DeviceBufferId, PlatformError> {
        let b = r?;
        self.bufs.push(b);
        Ok(b)
    }
    /// Creates and records an event.
    fn event(&mut self, platform: &PlatformRef) -> Result<EventId, PlatformError> {
        let e = platform.create_event()?;
        self.events.push(e);
        Ok(e)
    }
}

/// Frees buffers, then destroys events, ignoring errors (creation failed, or disable already reports the first).
fn cleanup(platform: &PlatformRef, bufs: &[DeviceBufferId], events: &[EventId]) {
    for &b in bufs {
        let _ = platform.free_device(b);
    }
    for &e in events {
        let _ = platform.destroy_event(e);
    }
}

/// The stack's mutable state, behind its lock.
#[derive(Debug)]
struct Inner {
    ring: Ring,
    mem: SlotMemory,
    /// The load path's own state.
    path: PathState,
    mailbox: Receiver<Completion>,
    notify: Sender<Completion>,
    stats: StackStats,
    disabled: bool,
    failure: Option<SchedulerError>,
}

impl Inner {
    /// Poisons the stack with `err` (the first failure wins; later hooks report it until disable) and returns it.
    fn poison(&mut self, err: SchedulerError) -> SchedulerError {
        self.failure.get_or_insert(err.clone());
        err
    }

    /// The stack's failure, if it is poisoned.
    fn status(&self) -> Result<(), SchedulerError> {
        match &self.failure {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

/// Handle to a block-stack actor. Hook methods take `&self`; the engine drives one stack from one thread.
pub struct BlockStack {
    name: std::sync::Arc<str>,
    platform: PlatformRef,
    compute: StreamId,
    /// The copy-stream actor: the resident head on every path, the streamed loads on the actor path; its stream is
    /// the one hook submission enqueues on.
    stream: StreamHandle,
    /// Where the stream actor publishes a load as recorded.
    board: Arc<TicketBoard>,
    /// Blocks in execution order.
    blocks: Vec<BlockSpec>,
    path: LoadPath,
    #[cfg(weightferry_broken)]
    faults: faults::Faults,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for BlockStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStack").field("name", &self.name).finish()
    }
}

impl BlockStack {
    /// Allocates the resident head and the slot pool, loads the resident head (waiting for it), and — with
    /// `eager_prefetch` — prefetches the first streamed blocks. On any failure everything allocated is released.
    pub fn new(
        platform: PlatformRef,
        spec: StackSpec,
        compute: StreamId,
        stream: StreamHandle,
    ) -> Result<BlockStack, SchedulerError> {
        Self::with_resident_set(platform, spec, None, compute, stream)
    }

    /// Like [`BlockStack::new`], but keeps exactly the blocks marked in `resident` resident (any set, not only a
    /// leading head; `spec.resident_head` is ignored when a set is given). Spreading resident blocks between
    /// streamed ones lets every copy overlap the compute of the resident blocks around it.
    pub fn with_resident_set(
        platform: PlatformRef,
        spec: StackSpec,
        resident: Option<Vec<bool>>,
        compute: StreamId,
        stream: StreamHandle,
    ) -> Result<BlockStack, SchedulerError> {
        Self::build(platform, spec, resident, compute, stream, None, None)
    }

    /// Like [`BlockStack::with_resident_set`], for a stack with blocks of the disk tier (their [`BlockSpec::reads`]):
    /// every load, the resident head's included, goes through `reader`, which reads those blocks into its staging
    /// buffers and hands each load on to `stream` (the reader's own stream actor) in ticket order. The caller owns
    /// the reader and destroys it after the stack, before the stream.
    pub fn with_reader(
        platform: PlatformRef,
        spec: StackSpec,
        resident: Option<Vec<bool>>,
        compute: StreamId,
        stream: StreamHandle,
        reader: ReaderHandle,
    ) -> Result<BlockStack, SchedulerError> {
        if spec.submission != Submission::Actor {
            return Err(SchedulerError::InvalidSpec {
                stack: spec.name.clone(),
                reason: "a stack with a reader submits through actors (Submission::Actor)".into(),
            });
        }
        Self::build(platform, spec, resident, compute, stream, None, Some(reader))
    }

    /// A stack whose streamed blocks are rebuilt by AllGather of per-rank shards (see `gather_path.rs`): each slot
    /// gets its own shard buffer (sized to the largest block's shards) and is sized to hold the gathered bytes of
    /// its largest block, padding included. Resident blocks (per `resident` or `spec.resident_head`) load their
    /// full `BlockSpec` segments through `stream` as usual. `spec.eager_prefetch` must be false: the first
    /// gathers are issued by the first forward, inside the same hook sequence on every rank.
    pub fn with_gather(
        platform: PlatformRef,
        spec: StackSpec,
        resident: Option<Vec<bool>>,
        compute: StreamId,
        stream: StreamHandle,
        gather: GatherPath,
    ) -> Result<BlockStack, SchedulerError> {
        Self::build(platform, spec, resident, compute, stream, Some(gather), None)
    }

    fn build(
        platform: PlatformRef,
        spec: StackSpec,
        resident: Option<Vec<bool>>,
        compute: StreamId,
        stream: StreamHandle,
        gather: Option<GatherPath>,
        reader: Option<ReaderHandle>,
    ) -> Result<BlockStack, SchedulerError> {
        let resident = Self::check_spec(&spec, resident, reader.is_some())?;
        // Per block: bytes its slot must hold (the gathered sections may extend past the region by their padding).
        let mut region: Vec<u64> = spec.blocks.iter().map(|b| b.device_bytes).collect();
        let layout = match &gather {
            Some(gp) => Some(gather_path::check(&spec, gp, &resident, &mut region)?),
            None => None,
        };
        let slots = Ring::slot_count(&resident, spec.prefetch_depth, spec.static_slots);
        let slot_size = region.iter().zip(&resident).filter(|(_, r)| !**r).map(|(b, _)| *b).max().unwrap_or(0);
        let resident_count = resident.iter().filter(|r| **r).count();

        let mut alloc = Allocated::default();
        let allocated = (|| {
            let mem =
                SlotMemory::alloc(&platform, &spec.blocks, &resident, slots, slot_size, gather.is_some(), &mut alloc)?;
            let gather = match (gather, layout) {
                (Some(gp), Some(layout)) => {
                    Some(gather_path::alloc(&platform, &spec.name, gp, layout, slots, &mut alloc)?)
                }
                _ => None,
            };
            Ok::<_, SchedulerError>((mem, gather))
        })();
        let (mem, gather) = match allocated {
            Ok(v) => v,
            Err(e) => {
                cleanup(&platform, &alloc.bufs, &alloc.events);
                return Err(e);
            }
        };
        let shard_bytes = layout.map_or(0, |l| slots as u64 * l.shard_size.max(1));
        let device_bytes =
            spec.blocks.iter().zip(&resident).filter(|(_, r)| **r).map(|(b, _)| b.device_bytes.max(1)).sum::<u64>()
                + slots as u64 * slot_size.max(1)
                + shard_bytes;
        let (state, path) = match gather {
            Some((shards, link)) => (PathState::Gather(shards), LoadPath::Gather(link)),
            None if spec.submission == Submission::Hook => {
                (PathState::Hook(hook_path::InFlight::with_capacity(slots)), LoadPath::Hook)
            }
            None => match reader {
                Some(r) => (PathState::Actor, LoadPath::Disk(r)),
                None => (PathState::Actor, LoadPath::Actor),
            },
        };
        let (notify, mailbox) = mailbox::unbounded();
        let stack = BlockStack {
            name: std::sync::Arc::from(spec.name.as_str()),
            platform,
            compute,
            stream,
            board: Arc::new(TicketBoard::new()),
            blocks: spec.blocks,
            path,
            #[cfg(weightferry_broken)]
            faults: faults::Faults::new(spec.ordering_fault),
            inner: Mutex::new(Inner {
                ring: Ring::new(resident, spec.prefetch_depth, spec.static_slots),
                mem,
                path: state,
                mailbox,
                notify,
                stats: StackStats { resident_blocks: resident_count as u64, device_bytes, ..Default::default() },
                disabled: false,
                failure: None,
            }),
        };
        let started = actor_path::load_resident_head(&stack).and_then(|()| {
            if spec.eager_prefetch {
                stack.prefetch_from(None)
            } else {
                Ok(())
            }
        });
        if let Err(e) = started {
            let _ = stack.release_all();
            return Err(e);
        }
        Ok(stack)
    }

    /// Checks a stack's spec before anything is allocated (a fault this build lacks, no blocks, a resident set of
    /// the wrong length or a head past the end, a segment outside its block's region); returns the resident set.
    fn check_spec(spec: &StackSpec, resident: Option<Vec<bool>>, reader: bool) -> Result<Vec<bool>, SchedulerError> {
        #[cfg(not(weightferry_broken))]
        if spec.ordering_fault != OrderingFault::None {
            return Err(SchedulerError::FaultNotBuilt { stack: spec.name.clone(), fault: spec.ordering_fault });
        }
        let n = spec.blocks.len();
        let invalid = |reason: String| SchedulerError::InvalidSpec { stack: spec.name.clone(), reason };
        if n == 0 {
            return Err(invalid("it has no blocks".into()));
        }
        let resident = match resident {
            Some(mask) if mask.len() != n => {
                return Err(invalid(format!("resident set has {} entries for {n} blocks", mask.len())))
            }
            Some(mask) => mask,
            None if spec.resident_head > n => {
                return Err(invalid(format!("resident head {} exceeds its {n} blocks", spec.resident_head)))
            }
            None => (0..n).map(|i| i < spec.resident_head).collect(),
        };
        for (i, b) in spec.blocks.iter().enumerate() {
            if !b.reads.is_empty() && !reader {
                return Err(invalid(format!("block {i} is read from disk, and the stack has no reader")));
            }
            for s in &b.segments {
                if s.device_offset.checked_add(s.len).is_none_or(|end| end > b.device_bytes) {
                    return Err(invalid(format!(
                        "block {i}: segment {}+{} exceeds its device region of {} bytes",
                        s.device_offset, s.len, b.device_bytes
                    )));
                }
            }
        }
        Ok(resident)
    }

    /// The stack's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    /// Whether the stack has no blocks (never true for a constructed stack).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counters so far.
    pub fn stats(&self) -> StackStats {
        lock(&self.inner).stats
    }

    /// Slot states (for tests and reports).
    pub fn slot_states(&self) -> Vec<SlotState> {
        lock(&self.inner).ring.table.states().to_vec()
    }

    /// The board on which a streamed load counts as recorded: the gather board on the gather path.
    fn done_board(&self) -> &TicketBoard {
        match &self.path {
            LoadPath::Gather(link) => &link.board,
            LoadPath::Actor | LoadPath::Hook | LoadPath::Disk(_) => &self.board,
        }
    }

    /// Whether the actor that publishes on [`Self::done_board`] still runs.
    fn done_alive(&self) -> bool {
        match &self.path {
            LoadPath::Gather(link) => link.is_alive(),
            LoadPath::Actor | LoadPath::Hook => self.stream.is_alive(),
            LoadPath::Disk(r) => r.is_alive(),
        }
    }

    /// The actor that publishes on [`Self::done_board`], for `ActorGone`.
    fn done_actor(&self) -> String {
        match &self.path {
            LoadPath::Gather(link) => link.actor_name(&self.name),
            LoadPath::Actor | LoadPath::Hook => format!("stream '{}'", self.stream.name()),
            LoadPath::Disk(r) => format!("reader '{}'", r.name()),
        }
    }

    /// Blocks (without the stack's lock) until `ticket` is published on `board`; `None` when the publishing actor
    /// stopped first (`alive` turned false). Fault point `IgnoreActorStop`.
    fn wait_ticket(
        &self,
        board: &TicketBoard,
        ticket: Ticket,
        alive: &dyn Fn() -> bool,
    ) -> Option<Result<(), PlatformError>> {
        fault_point!(self, IgnoreActorStop => board.wait(ticket, &|| true), board.wait(ticket, alive))
    }

    /// Waits until streamed load `ticket` is recorded (its gather issued, on the gather path).
    fn wait_done(&self, ticket: Ticket, block: usize) -> Result<(), SchedulerError> {
        let LoadPath::Gather(link) = &self.path else {
            return actor_path::wait_recorded(self, ticket, block);
        };
        match self.wait_ticket(&link.board, ticket, &|| link.is_alive()) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(SchedulerError::LoadFailed { stack: self.name.to_string(), block, source: e }),
            None => Err(SchedulerError::ActorGone { actor: self.done_actor() }),
        }
    }

    /// Observes every completion reported so far: the mailbox (watchers, the stream and collective actors) and
    /// the hook path's loads in flight. A failed one poisons the stack.
    fn observe_completions(&self, g: &mut Inner) {
        while let Ok(Some(c)) = g.mailbox.try_recv() {
            g.stats.completions += 1;
            if let Err(source) = c.result {
                g.poison(SchedulerError::LoadFailed { stack: self.name.to_string(), block: c.block, source });
            }
        }
        hook_path::poll(self, g);
    }

    /// The start of every hook: observes completions, then fails if the stack is disabled or poisoned.
    fn drain(&self, g: &mut Inner) -> Result<(), SchedulerError> {
        self.observe_completions(g);
        if g.disabled {
            return Err(SchedulerError::Disabled { stack: self.name.to_string() });
        }
        g.status()
    }

    /// `Loading → Ready` for every slot whose load is recorded on the done board.
    fn promote_recorded(&self, g: &mut Inner) {
        let board = self.done_board();
        g.ring.promote(|ticket| matches!(board.poll(ticket), Some(Ok(()))));
    }

    /// Issues a load of `block` into a victim slot, keeping the slots of `keep`, through the stack's load path.
    /// Returns the slot. On failure the slot is `Free` again. Fault point `SkipLastUseWait`.
    fn issue_load(&self, g: &mut Inner, block: usize, keep: &[usize], prefetch: bool) -> Result<usize, SchedulerError> {
        if g.ring.victim(block, keep).is_none() {
            self.promote_recorded(g);
        }
        let s = g
            .ring
            .victim(block, keep)
            .ok_or_else(|| SchedulerError::NoFreeSlot { stack: self.name.to_string(), slots: g.ring.table.len() })?;
        let ticket = g.ring.begin(s, block, prefetch)?;
        // Invariant 2: every path makes the device wait for the slot's last use before it overwrites the slot.
        let last_use = [g.mem.last_use_ev[s]];
        let waits: &[EventId] = fault_point!(self, SkipLastUseWait => &[], &last_use);
        let load = Load { slot: s, block, ticket, waits };
        let issued = match &self.path {
            LoadPath::Actor | LoadPath::Disk(_) => actor_path::issue(self, g, &load),
            LoadPath::Hook => hook_path::issue(self, g, &load),
            LoadPath::Gather(link) => link.issue(self, g, &load),
        };
        if let Err(e) = issued {
            let _ = g.ring.table.free(s);
            return Err(e);
        }
        Ok(s)
    }

    fn prefetch_from(&self, from: Option<usize>) -> Result<(), SchedulerError> {
        let mut g = lock(&self.inner);
        self.prefetch_locked(&mut g, from)
    }

    /// Loads the blocks of the prefetch window after `from` that no slot holds, until no slot is free.
    fn prefetch_locked(&self, g: &mut Inner, from: Option<usize>) -> Result<(), SchedulerError> {
        let (window, keep) = g.ring.window(from);
        for &j in &window {
            if g.ring.table.slot_of(j).is_some() {
                continue;
            }
            match self.issue_load(g, j, &keep, true) {
                Ok(_) => {}
                Err(SchedulerError::NoFreeSlot { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The engine is about to run block `block`: make it resident (ordering the compute stream behind its copy),
    /// then prefetch the next blocks. Returns where the block's bytes are. Fault point `SkipReadyWait`.
    pub fn pre_forward(&self, block: usize) -> Result<BlockLocation, SchedulerError> {
        let mut g = lock(&self.inner);
        self.drain(&mut g)?;
        let n = self.blocks.len();
        if block >= n {
            return Err(SchedulerError::NoSuchBlock { stack: self.name.to_string(), block, len: n });
        }
        if let Some(buffer) = g.mem.resident_bufs[block] {
            let loc = BlockLocation { buffer, offset: 0 };
            self.prefetch_locked(&mut g, Some(block))?;
            return Ok(loc);
        }
        let s = match g.ring.claim(block)? {
            Some((s, found)) => {
                match found {
                    Found::Reused => g.stats.reuse_hits += 1,
                    Found::Prefetched => g.stats.prefetch_hits += 1,
                    Found::Fetched => {}
                }
                s
            }
            None => {
                g.stats.sync_fetches += 1;
                loop {
                    match self.issue_load(&mut g, block, &[block], false) {
                        Ok(s) => break s,
                        Err(SchedulerError::NoFreeSlot { .. }) => {
                            // Every other slot is still being loaded (prefetches of blocks the engine skipped):
                            // wait, without the lock, until the oldest is enqueued, then take it.
                            let Some(t) = g.ring.oldest_loading(&[block]) else {
                                return Err(SchedulerError::NoFreeSlot {
                                    stack: self.name.to_string(),
                                    slots: g.ring.table.len(),
                                });
                            };
                            drop(g);
                            let r = self.wait_ticket(self.done_board(), t, &|| self.done_alive());
                            g = lock(&self.inner);
                            if r.is_none() {
                                return Err(SchedulerError::ActorGone { actor: self.done_actor() });
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        };
        g.ring.unmark_prefetched(s);
        if let SlotState::Loading { ticket, .. } = g.ring.table.state(s) {
            let outcome = match self.done_board().poll(ticket) {
                Some(r) => {
                    r.map_err(|source| SchedulerError::LoadFailed { stack: self.name.to_string(), block, source })
                }
                None => {
                    g.stats.record_waits += 1;
                    // Never hold the stack lock across a blocking wait.
                    drop(g);
                    let r = self.wait_done(ticket, block);
                    g = lock(&self.inner);
                    r
                }
            };
            if let Err(e) = outcome {
                let _ = g.ring.table.free(s);
                // A failed load poisons the stack: later hooks report it too, until disable.
                return Err(g.poison(e));
            }
            g.ring.table.mark_ready(s, ticket)?;
        }
        // Invariant 1: compute reads the slot only after the load that filled it.
        fault_point!(self, SkipReadyWait => (), self.platform.stream_wait_event(self.compute, g.mem.ready_ev[s])?);
        g.ring.table.acquire(s, block)?;
        let loc = BlockLocation { buffer: g.mem.slot_bufs[s], offset: 0 };
        self.prefetch_locked(&mut g, Some(block))?;
        Ok(loc)
    }

    /// The engine finished enqueuing block `block`'s compute: record its last use and release the slot.
    pub fn post_forward(&self, block: usize) -> Result<(), SchedulerError> {
        let mut g = lock(&self.inner);
        self.drain(&mut g)?;
        let n = self.blocks.len();
        if block >= n {
            return Err(SchedulerError::NoSuchBlock { stack: self.name.to_string(), block, len: n });
        }
        if g.ring.is_resident(block) {
            return Ok(());
        }
        let s = match g.ring.table.slot_of(block) {
            Some(s) if matches!(g.ring.table.state(s), SlotState::InUse { .. }) => s,
            _ => return Err(SchedulerError::NotInUse { stack: self.name.to_string(), block }),
        };
        self.platform.record_event(g.mem.last_use_ev[s], self.compute)?;
        g.ring.table.release(s, block)?;
        Ok(())
    }

    /// Where a block is now, if it is resident or in a slot.
    pub fn location(&self, block: usize) -> Option<BlockLocation> {
        let g = lock(&self.inner);
        if let Some(buffer) = g.mem.resident_bufs.get(block).copied().flatten() {
            return Some(BlockLocation { buffer, offset: 0 });
        }
        g.ring.table.slot_of(block).map(|s| BlockLocation { buffer: g.mem.slot_bufs[s], offset: 0 })
    }

    /// The loads part of a fence on the copy stream: every load issued there so far has completed.
    fn fence_copy_stream(&self) -> Result<(), SchedulerError> {
        match &self.path {
            LoadPath::Hook => hook_path::fence(self),
            LoadPath::Actor | LoadPath::Gather(_) => self.stream.fence(),
            LoadPath::Disk(r) => r.fence(),
        }
    }

    /// Returns once every load issued so far has completed and every slot's last use has completed; then reports
    /// the stack's failure, if any (a disabled stack fences too). Fault point `FenceOnRecord`.
    pub fn fence(&self) -> Result<(), SchedulerError> {
        fault_point!(self, FenceOnRecord => faults::fence_on_record(self), self.fence_copy_stream())?;
        if let LoadPath::Gather(link) = &self.path {
            link.fence(&self.platform)?;
        }
        let events: Vec<EventId> = lock(&self.inner).mem.last_use_ev.clone();
        for e in events {
            self.platform.event_synchronize(e)?;
        }
        let mut g = lock(&self.inner);
        self.observe_completions(&mut g);
        g.status()
    }

    /// Observes the completion of every copy and every read touching the stack's memory (the first error is
    /// returned, after the rest was still observed), and returns the lock for freeing it.
    fn observe_all(&self) -> (MutexGuard<'_, Inner>, Result<(), SchedulerError>) {
        // The copy stream holds every load the hooks enqueued (and the resident head, fenced at creation).
        let fenced = match &self.path {
            LoadPath::Hook => self.platform.stream_synchronize(self.stream.stream()).map_err(Into::into),
            LoadPath::Actor | LoadPath::Gather(_) => self.stream.fence(),
            LoadPath::Disk(r) => r.fence(),
        };
        let mut g = lock(&self.inner);
        let mut sync_err = None;
        if let LoadPath::Gather(link) = &self.path {
            g = link.sync_for_release(self, g, &mut sync_err);
        }
        for &e in g.mem.events().chain(gather_path::shards(&g).events()) {
            if let Err(err) = self.platform.event_synchronize(e) {
                sync_err.get_or_insert(err.into());
            }
        }
        // Every ready event was synchronised above: count the hook-submitted loads still tracked as completed.
        hook_path::poll(self, &mut g);
        let observed = fenced.and(sync_err.map_or(Ok(()), Err));
        (g, observed)
    }

    /// Observes everything (fault point `FreeWithoutSync`), then frees the slots, the resident head and the
    /// events, and destroys the gather path's shard stream; the stack is disabled after.
    fn release_all(&self) -> Result<(), SchedulerError> {
        let (mut g, observed) = fault_point!(self, FreeWithoutSync => (lock(&self.inner), Ok(())), self.observe_all());
        let (shard_bufs, shard_events, destroy_shard_stream) = g.path.release();
        g.disabled = true;
        g.ring.free_all();
        let (mut bufs, mut events) = g.mem.take();
        bufs.extend(shard_bufs);
        events.extend(shard_events);
        g.stats.device_bytes = 0;
        drop(g);
        cleanup(&self.platform, &bufs, &events);
        if let (LoadPath::Gather(link), true) = (&self.path, destroy_shard_stream) {
            // The stack created it; nothing is enqueued on it any more. A failure of its work was observed above.
            let _ = self.platform.destroy_stream(link.shard_stream());
        }
        observed
    }

    /// Waits for all outstanding work, then frees the slots and the resident head. The stack is unusable after.
    pub fn disable(&self) -> Result<(), SchedulerError> {
        if lock(&self.inner).disabled {
            return Ok(());
        }
        self.release_all()
    }
}
