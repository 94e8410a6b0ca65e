//! The block-stack actor: one per ring of blocks. It owns the residency table of its blocks and the device slots it
//! streams them through, and turns the engine's hook messages into loads for the stream actor.
//!
//! Hook messages are handled synchronously on the engine's thread (the actor's state sits behind an uncontended
//! lock that is never held across a blocking call): `pre_forward(i)` makes block i resident — or orders the engine's
//! compute stream behind its ready event — and prefetches the next `depth` streamed blocks, wrapping into the next
//! pass; `post_forward(i)` records the last-use event of i's slot on the compute stream and releases the slot
//! (the "evict": the slot is reused later behind a GPU-side wait on that event). Completion notifications from the
//! stream actor's watcher arrive in the actor's unbounded mailbox and are drained at every hook.
//!
//! Invariants: (1) compute is ordered behind the ready event of the load that filled a slot before it reads it;
//! (2) a load into a slot waits (on the device) for the slot's last-use event, and slot memory is freed only after
//! that event's completion was observed; (7) device memory is exactly the resident head plus the fixed slot pool
//! allocated at creation: nothing is allocated on the hook path.
//!
//! **Hook submission** ([`Submission::Hook`], rank-local stacks only): the engine thread calling the hook enqueues a
//! streamed load itself, under the stack's lock, in issue order, on the stack's copy stream — the GPU-side wait on
//! the slot's last-use event, the flat copies, the record of the slot's ready event: the very operations the stream
//! actor would enqueue — and the slot is `Ready` at once, so no hook ever waits on the host for a recording and no
//! thread is woken (waking a stream actor parked for a whole block costs tens of µs). Completions are polled
//! instead of watched: every hook's drain queries the ready events of the loads still in flight (one entry per
//! slot, oldest first, stopping at the first incomplete) and turns a failure into the stack's failure as a failed
//! completion does; `fence` synchronises the copy stream and then observes them. A failure to enqueue leaves the
//! slot `Free`, poisons the stack and fails the hook that issued the load (`LoadFailed` naming the block). The
//! resident head still loads through the stream actor, at creation. Invariants (1) and (2) hold unchanged: the
//! same waits are enqueued on the same streams, only from another thread.
//!
//! **Gather path** (distributed layerwise offload, [`BlockStack::with_gather`]): each rank holds only its shard of
//! every block. A load then has two stages: the stack enqueues the rank's shard copies itself on its own shard
//! stream (behind the slot's last-use event) into the slot's own shard buffer, one copy per gather (a section, or a
//! chunk of one), each followed by a record of that gather's own shard-ready event; then it sends one
//! [`GatherCmd`] per gather to the collective actor, each waiting only on its own shard-ready event (the first
//! also on the slot's last-use event; the comm stream is in order), so the AllGather of chunk `j` overlaps the
//! copy of chunk `j + 1`. Every gather records the slot's ready event; compute waits on its last record. The
//! shard-ready events of a slot are created with the stack, as many as the largest block has gathers (at most
//! [`MAX_GATHERS_PER_BLOCK`]): none is created on the hook path. Sequence numbers
//! come from a [`GatherSequence`] shared by every gather stack of the rank, taken on the engine's thread in hook
//! order, so ranks that run the same hook sequence number the same gathers alike (invariant 4). "Recorded" is
//! then read from the gather board (published by the collective actor after the last section's AllGather), never
//! from the stream board. Each slot has its own shard buffer, overwritten only behind the slot's last-use event,
//! which follows the compute that read the gather's output, which follows the gather that read the shard
//! (invariant 2 for the shard buffers). Numbering is deterministic as long as every rank loads the same blocks in
//! the same order: true without block skips; with skips the victim choice may depend on timing. Slot and shard
//! buffers come from `Platform::alloc_device_shared`, so a collective may place them in symmetric windows (NCCL's
//! copy-engine AllGather writes into the peer's buffer at the same window offset); that needs every rank to pick
//! the same slot for the same gather, which holds when every rank runs the same hooks: in a healthy stack slots
//! become free only at disable and after a failure, so the victim choice follows the hook sequence alone.

use crate::collective_actor::{CollectiveHandle, GatherCmd, GatherError};
use crate::error::SchedulerError;
use crate::messages::{Completion, CopyDirection, CopyOp, LoadCmd, TicketBoard};
use crate::platform::{DeviceBufferId, EventId, HostBufferId, PlatformError, PlatformRef, StreamId};
use crate::slot::{SlotState, SlotTable, Ticket};
use crate::stream_actor::StreamHandle;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::mailbox::{self, Receiver, Sender};
use crate::sync::{lock, Arc, Mutex};
use std::collections::VecDeque;

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
    /// Bytes of the device region the block occupies.
    pub device_bytes: u64,
}

impl BlockSpec {
    /// Bytes copied to load the block.
    pub fn copy_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }
}

/// One AllGather of a gather-path block: this rank's shard of one section (one dtype) of the block, or of one
/// chunk of a section (chunked transport: the section's chunks are consecutive gathers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherSection {
    /// Host buffer holding this rank's shard.
    pub host: HostBufferId,
    /// Offset of the shard in it.
    pub host_offset: u64,
    /// Bytes of the shard (equal on every rank; padding included).
    pub shard_bytes: u64,
    /// Offset in the block's device region where the `shard_bytes · world` gathered bytes go.
    pub output_offset: u64,
    /// What is gathered: equal on every rank for this section of this block, distinct from other sections.
    pub tag: u64,
}

/// Most AllGathers one gather-path block may need (sections × chunks): a block asking for more is an invalid spec
/// (its chunk size is too small), since every slot holds one shard-ready event per gather.
pub const MAX_GATHERS_PER_BLOCK: usize = 4096;

/// The AllGathers that rebuild one block, issued in this order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GatherBlock {
    /// Gathers: sections, or chunks of sections (at least one, at most [`MAX_GATHERS_PER_BLOCK`]).
    pub sections: Vec<GatherSection>,
}

impl GatherBlock {
    /// Bytes of this rank's shards of the block.
    pub fn shard_bytes(&self) -> u64 {
        self.sections.iter().map(|s| s.shard_bytes).sum()
    }
}

/// The rank's gather numbering, shared by every gather stack of one communicator (clones share the counter).
#[derive(Debug, Clone, Default)]
pub struct GatherSequence(Arc<AtomicU64>);

impl GatherSequence {
    /// A sequence starting at 0.
    pub fn new() -> Self {
        Self::default()
    }
    /// The number the next gather will get.
    pub fn peek(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
    /// Claims `n` consecutive numbers and returns the first. Ranks must claim in one order (the hook order, and
    /// the warm-up gather first).
    pub fn claim(&self, n: u64) -> u64 {
        self.0.fetch_add(n, Ordering::SeqCst)
    }
}

/// How a gather stack rebuilds its streamed blocks.
#[derive(Debug, Clone)]
pub struct GatherPath {
    /// The collective actor of the communicator.
    pub collective: CollectiveHandle,
    /// The rank's gather numbering (shared with the other gather stacks on this communicator).
    pub sequence: GatherSequence,
    /// Per block (in stack order): its AllGathers. Resident blocks load their full `BlockSpec` segments instead.
    pub blocks: Vec<GatherBlock>,
}

/// Deliberately broken orderings, for tests that prove the hazard checks can fail. Never set in production.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderingFault {
    /// Correct behaviour.
    #[default]
    None,
    /// Compute does not wait for the ready event of a slot it reads.
    SkipReadyWait,
    /// A load overwrites a slot without waiting for its last-use event.
    SkipLastUseWait,
    /// `fence` replies once earlier loads are enqueued (recorded) instead of completed.
    FenceOnRecord,
    /// `disable` frees slot memory without observing completion of the copies and reads touching it.
    FreeWithoutSync,
    /// Waits for a load to be recorded ignore that the stream actor stopped (a lost wake-up when it stops).
    IgnoreActorStop,
}

/// Who enqueues a rank-local streamed load on the stack's copy stream.
///
/// Both modes enqueue the same operations on the same stream, in the same order: a GPU-side wait on the slot's
/// last-use event, the flat copies, a record of the slot's ready event. They differ in which thread does it and in
/// how completion is observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Submission {
    /// The hook sends a [`LoadCmd`] to the stream actor, which enqueues it; its completion watcher reports the
    /// completion. The hook thread never calls the driver for a copy, but each prefetch wakes the actor thread,
    /// which costs tens of µs when it has been parked for a long block (a compute-bound run).
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
    /// Prefetch the first streamed blocks at creation (rank-local strategies); the distributed strategy defers the
    /// first prefetch to the first forward.
    pub eager_prefetch: bool,
    /// Test-only ordering fault.
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

struct Inner {
    blocks: Vec<BlockSpec>,
    /// Per block: kept resident (never streamed).
    resident: Vec<bool>,
    depth: usize,
    fault: OrderingFault,
    table: SlotTable,
    slot_bufs: Vec<DeviceBufferId>,
    ready_ev: Vec<EventId>,
    last_use_ev: Vec<EventId>,
    /// Per block: its own device buffer when resident.
    resident_bufs: Vec<Option<DeviceBufferId>>,
    resident_ev: Option<EventId>,
    next_ticket: Ticket,
    /// Per slot: filled by a prefetch (vs. a synchronous fetch) and not yet used.
    prefetched: Vec<bool>,
    mailbox: Receiver<Completion>,
    notify: Sender<Completion>,
    stats: StackStats,
    disabled: bool,
    failure: Option<SchedulerError>,
    /// Gather path: per block its AllGathers (empty without a gather path).
    gather_blocks: Vec<GatherBlock>,
    /// Gather path: per slot its shard buffer and one shard-ready event per gather of the largest block.
    shard_bufs: Vec<DeviceBufferId>,
    shard_ready: Vec<Vec<EventId>>,
    /// Hook submission: loads enqueued by the hooks whose completion has not been observed yet, in the order of each
    /// slot's oldest unobserved load. At most one entry per slot (depth + 1 in all): a reload merges into it.
    in_flight: VecDeque<InFlight>,
}

/// A load enqueued in hook-submission mode, not yet observed complete.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    slot: usize,
    /// The block named if the load fails (the oldest of merged loads).
    block: usize,
    ready: EventId,
    /// Loads this entry's completion stands for (more than one after a slot was reloaded while in flight).
    loads: u64,
}

/// What a gather stack shares between its hooks: the collective, the shard stream and the gather board.
struct GatherShared {
    collective: CollectiveHandle,
    sequence: GatherSequence,
    shard_stream: StreamId,
    board: Arc<TicketBoard>,
}

/// Handle to a block-stack actor. Hook methods take `&self`; the engine drives one stack from one thread.
pub struct BlockStack {
    name: std::sync::Arc<str>,
    platform: PlatformRef,
    compute: StreamId,
    stream: StreamHandle,
    board: Arc<TicketBoard>,
    gather: Option<GatherShared>,
    fault: OrderingFault,
    submission: Submission,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for BlockStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStack").field("name", &self.name).finish()
    }
}

fn cleanup(platform: &PlatformRef, bufs: &[DeviceBufferId], events: &[EventId]) {
    for &b in bufs {
        let _ = platform.free_device(b);
    }
    for &e in events {
        let _ = platform.destroy_event(e);
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
        Self::build(platform, spec, resident, compute, stream, None)
    }

    /// A stack whose streamed blocks are rebuilt by AllGather of per-rank shards (see the module docs): each slot
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
        Self::build(platform, spec, resident, compute, stream, Some(gather))
    }

    fn build(
        platform: PlatformRef,
        spec: StackSpec,
        resident: Option<Vec<bool>>,
        compute: StreamId,
        stream: StreamHandle,
        gather: Option<GatherPath>,
    ) -> Result<BlockStack, SchedulerError> {
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
            for s in &b.segments {
                if s.device_offset.checked_add(s.len).is_none_or(|end| end > b.device_bytes) {
                    return Err(invalid(format!(
                        "block {i}: segment {}+{} exceeds its device region of {} bytes",
                        s.device_offset, s.len, b.device_bytes
                    )));
                }
            }
        }
        // Per block: bytes its slot must hold (the gathered sections may extend past the region by their padding).
        let mut region: Vec<u64> = spec.blocks.iter().map(|b| b.device_bytes).collect();
        let mut shard_size = 0u64;
        let mut gathers_per_slot = 0usize;
        if let Some(gp) = &gather {
            if gp.blocks.len() != n {
                return Err(invalid(format!("gather path has {} blocks for {n} blocks", gp.blocks.len())));
            }
            if spec.eager_prefetch {
                return Err(invalid("a gather stack defers its first prefetch to the first forward".into()));
            }
            if spec.submission != Submission::Actor {
                return Err(invalid(
                    "a gather stack submits its loads through its actors (submission \"actor\")".into(),
                ));
            }
            let world = gp.collective.world() as u64;
            for (i, gb) in gp.blocks.iter().enumerate() {
                if resident[i] {
                    continue;
                }
                if gb.sections.is_empty() {
                    return Err(invalid(format!("block {i}: a gathered block needs at least one section")));
                }
                if gb.sections.len() > MAX_GATHERS_PER_BLOCK {
                    return Err(invalid(format!(
                        "block {i} needs {} AllGathers, more than {MAX_GATHERS_PER_BLOCK}; use a larger chunk size",
                        gb.sections.len()
                    )));
                }
                gathers_per_slot = gathers_per_slot.max(gb.sections.len());
                let mut total = 0u64;
                for sec in &gb.sections {
                    let end = sec.shard_bytes.checked_mul(world).and_then(|l| l.checked_add(sec.output_offset));
                    let Some(end) = end else {
                        return Err(invalid(format!("block {i}: gathered section overflows")));
                    };
                    region[i] = region[i].max(end);
                    total = total.checked_add(sec.shard_bytes).ok_or_else(|| invalid("shard overflow".into()))?;
                }
                shard_size = shard_size.max(total);
            }
        }
        let streaming = resident.iter().filter(|r| !**r).count();
        let slots = if streaming == 0 { 0 } else { (spec.prefetch_depth + 1).min(streaming) };
        let slot_size = region.iter().zip(&resident).filter(|(_, r)| !**r).map(|(b, _)| *b).max().unwrap_or(0);
        let shard_slots = if gather.is_some() { slots } else { 0 };
        let resident_count = n - streaming;

        let mut bufs = Vec::new();
        let mut events = Vec::new();
        let result = (|| -> Result<_, SchedulerError> {
            let mut resident_bufs = Vec::new();
            for (b, &r) in spec.blocks.iter().zip(&resident) {
                if r {
                    let buf = platform.alloc_device(b.device_bytes.max(1))?;
                    bufs.push(buf);
                    resident_bufs.push(Some(buf));
                } else {
                    resident_bufs.push(None);
                }
            }
            let mut slot_bufs = Vec::new();
            for _ in 0..slots {
                // Gather slots receive AllGathers: memory a collective may map for its peers.
                let buf = if gather.is_some() {
                    platform.alloc_device_shared(slot_size.max(1))?
                } else {
                    platform.alloc_device(slot_size.max(1))?
                };
                bufs.push(buf);
                slot_bufs.push(buf);
            }
            let mut ready_ev = Vec::new();
            let mut last_use_ev = Vec::new();
            for _ in 0..slots {
                let e = platform.create_event()?;
                events.push(e);
                ready_ev.push(e);
                let e = platform.create_event()?;
                events.push(e);
                last_use_ev.push(e);
            }
            let resident_ev = if resident_count > 0 {
                let e = platform.create_event()?;
                events.push(e);
                Some(e)
            } else {
                None
            };
            let mut shard_bufs = Vec::new();
            let mut shard_ready = Vec::new();
            for _ in 0..shard_slots {
                let buf = platform.alloc_device_shared(shard_size.max(1))?;
                bufs.push(buf);
                shard_bufs.push(buf);
                let mut per_gather = Vec::with_capacity(gathers_per_slot);
                for _ in 0..gathers_per_slot {
                    let e = platform.create_event()?;
                    events.push(e);
                    per_gather.push(e);
                }
                shard_ready.push(per_gather);
            }
            let shared = match &gather {
                Some(gp) => Some(GatherShared {
                    collective: gp.collective.clone(),
                    sequence: gp.sequence.clone(),
                    shard_stream: platform.create_stream(&format!("{}-shard", spec.name))?,
                    board: Arc::new(TicketBoard::new()),
                }),
                None => None,
            };
            Ok((resident_bufs, slot_bufs, ready_ev, last_use_ev, resident_ev, shard_bufs, shard_ready, shared))
        })();
        let (resident_bufs, slot_bufs, ready_ev, last_use_ev, resident_ev, shard_bufs, shard_ready, shared) =
            match result {
                Ok(v) => v,
                Err(e) => {
                    cleanup(&platform, &bufs, &events);
                    return Err(e);
                }
            };
        let device_bytes =
            spec.blocks.iter().zip(&resident).filter(|(_, r)| **r).map(|(b, _)| b.device_bytes.max(1)).sum::<u64>()
                + slots as u64 * slot_size.max(1)
                + shard_slots as u64 * shard_size.max(1);
        let (notify, mailbox) = mailbox::unbounded();
        let stack = BlockStack {
            name: std::sync::Arc::from(spec.name.as_str()),
            platform: platform.clone(),
            compute,
            stream,
            board: Arc::new(TicketBoard::new()),
            gather: shared,
            fault: spec.ordering_fault,
            submission: spec.submission,
            inner: Mutex::new(Inner {
                blocks: spec.blocks,
                resident,
                depth: spec.prefetch_depth,
                fault: spec.ordering_fault,
                table: SlotTable::new(slots),
                slot_bufs,
                ready_ev,
                last_use_ev,
                resident_bufs,
                resident_ev,
                next_ticket: 1,
                prefetched: vec![false; slots],
                mailbox,
                notify,
                stats: StackStats { resident_blocks: resident_count as u64, device_bytes, ..Default::default() },
                disabled: false,
                failure: None,
                gather_blocks: gather.map(|g| g.blocks).unwrap_or_default(),
                shard_bufs,
                shard_ready,
                in_flight: VecDeque::with_capacity(slots),
            }),
        };
        if let Err(e) =
            stack.load_resident_head().and_then(
                |()| {
                    if spec.eager_prefetch {
                        stack.prefetch_from(None)
                    } else {
                        Ok(())
                    }
                },
            )
        {
            let _ = stack.release_all();
            return Err(e);
        }
        Ok(stack)
    }

    /// The stack's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        lock(&self.inner).blocks.len()
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
        lock(&self.inner).table.states().to_vec()
    }

    fn load_resident_head(&self) -> Result<(), SchedulerError> {
        let mut g = lock(&self.inner);
        if !g.resident.iter().any(|r| *r) {
            return Ok(());
        }
        let ready = g.resident_ev.ok_or_else(|| SchedulerError::InvalidSpec {
            stack: self.name.to_string(),
            reason: "resident head without its event".into(),
        })?;
        let mut tickets = Vec::new();
        for i in 0..g.blocks.len() {
            let Some(dst) = g.resident_bufs[i] else { continue };
            let ticket = g.next_ticket;
            g.next_ticket += 1;
            let copies = copies_for(&g.blocks[i], dst);
            g.stats.loads += 1;
            g.stats.h2d_bytes += g.blocks[i].copy_bytes();
            self.stream.load(LoadCmd {
                ticket,
                target: usize::MAX,
                block: i,
                waits: Vec::new(),
                copies,
                ready,
                board: self.board.clone(),
                notify: None,
            })?;
            tickets.push((ticket, i));
        }
        drop(g);
        // Every head load's enqueue result, not just the last one's: a failed early copy must fail creation.
        for &(ticket, block) in &tickets {
            self.wait_recorded(ticket, block)?;
        }
        // The head must be complete before any compute reads it; this runs once, at creation.
        self.stream.fence().map_err(|e| match e {
            SchedulerError::Platform(source) => SchedulerError::LoadFailed {
                stack: self.name.to_string(),
                block: tickets.first().map_or(0, |t| t.1),
                source,
            },
            e => e,
        })
    }

    /// The board on which a streamed load counts as recorded: the gather board on the gather path.
    fn done_board(&self) -> &Arc<TicketBoard> {
        match &self.gather {
            Some(g) => &g.board,
            None => &self.board,
        }
    }

    /// Whether the actor that publishes on [`Self::done_board`] still runs.
    fn done_alive(&self) -> Box<dyn Fn() -> bool + '_> {
        let ignore_stop = self.fault == OrderingFault::IgnoreActorStop;
        match &self.gather {
            Some(g) => Box::new(move || ignore_stop || g.collective.is_alive()),
            None => Box::new(move || ignore_stop || self.stream.is_alive()),
        }
    }

    fn done_actor(&self) -> String {
        match &self.gather {
            Some(g) => format!("collective for stack '{}' (rank {})", self.name, g.collective.rank()),
            None => format!("stream '{}'", self.stream.name()),
        }
    }

    /// Waits until streamed load `ticket` is recorded (its gather issued, on the gather path).
    fn wait_done(&self, ticket: Ticket, block: usize) -> Result<(), SchedulerError> {
        if self.gather.is_none() {
            return self.wait_recorded(ticket, block);
        }
        match self.done_board().wait(ticket, &*self.done_alive()) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(SchedulerError::LoadFailed { stack: self.name.to_string(), block, source: e }),
            None => Err(SchedulerError::ActorGone { actor: self.done_actor() }),
        }
    }

    fn wait_recorded(&self, ticket: Ticket, block: usize) -> Result<(), SchedulerError> {
        let stream = self.stream.clone();
        let ignore_stop = self.fault == OrderingFault::IgnoreActorStop;
        match self.board.wait(ticket, &move || ignore_stop || stream.is_alive()) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(SchedulerError::LoadFailed { stack: self.name.to_string(), block, source: e }),
            None => Err(SchedulerError::ActorGone { actor: format!("stream '{}'", self.stream.name()) }),
        }
    }

    fn drain(&self, g: &mut Inner) -> Result<(), SchedulerError> {
        while let Ok(Some(c)) = g.mailbox.try_recv() {
            g.stats.completions += 1;
            if let Err(e) = c.result {
                let err = SchedulerError::LoadFailed { stack: self.name.to_string(), block: c.block, source: e };
                g.failure.get_or_insert(err);
            }
        }
        self.poll_in_flight(g);
        if g.disabled {
            return Err(SchedulerError::Disabled { stack: self.name.to_string() });
        }
        match &g.failure {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Hook submission: observes the completion of the loads in flight, in the order of their entries (oldest
    /// first), stopping at the first one not complete: later entries are observed at a later hook, so one
    /// `event_query` per hook when nothing completed. A failed one poisons the stack exactly as a failed completion
    /// reported by a watcher does (`LoadFailed` naming the entry's block).
    fn poll_in_flight(&self, g: &mut Inner) {
        while let Some(f) = g.in_flight.front().copied() {
            let done = match self.platform.event_query(f.ready) {
                Ok(false) => break,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            };
            g.in_flight.pop_front();
            g.stats.completions += f.loads;
            if let Err(source) = done {
                let err = SchedulerError::LoadFailed { stack: self.name.to_string(), block: f.block, source };
                g.failure.get_or_insert(err);
            }
        }
    }

    /// Hook submission: enqueues the load of `block` into slot `s` on the copy stream from this thread, under the
    /// stack's lock: the GPU-side wait on the slot's last-use event (unless `skip_last_use`), the flat copies, the
    /// record of the slot's ready event. On success the load counts as recorded (the slot is `Ready`) and is
    /// tracked until its completion is observed; on failure the slot is `Free` and the stack poisoned.
    fn enqueue_here(
        &self,
        g: &mut Inner,
        s: usize,
        block: usize,
        ticket: Ticket,
        skip_last_use: bool,
    ) -> Result<(), SchedulerError> {
        let stream = self.stream.stream();
        let (ready, last_use, dst) = (g.ready_ev[s], g.last_use_ev[s], g.slot_bufs[s]);
        let p = &self.platform;
        let enqueued = (|| {
            if !skip_last_use {
                p.stream_wait_event(stream, last_use)?;
            }
            for seg in &g.blocks[block].segments {
                p.copy_h2d(stream, seg.host, seg.host_offset, dst, seg.device_offset, seg.len)?;
            }
            p.record_event(ready, stream)
        })();
        if let Err(source) = enqueued {
            let _ = g.table.free(s);
            let err = SchedulerError::LoadFailed { stack: self.name.to_string(), block, source };
            g.failure.get_or_insert(err.clone());
            return Err(err);
        }
        g.table.mark_ready(s, ticket)?;
        // A slot reloaded before its previous load was observed complete: the ready event was just re-recorded, so
        // the older entry now observes this record, whose completion implies the older one's (one in-order stream).
        // Merge in place, so at most one entry per slot is in flight and an error is still seen first on the entry
        // of the oldest load it may come from (it names that block, as a watcher synchronising the re-recorded event
        // would).
        match g.in_flight.iter_mut().find(|f| f.slot == s) {
            Some(old) => old.loads += 1,
            None => g.in_flight.push_back(InFlight { slot: s, block, ready, loads: 1 }),
        }
        Ok(())
    }

    /// Issues a load of `block` into a victim slot, keeping the slots of `keep`. Returns the slot.
    /// `Loading → Ready` for every slot whose load the stream actor has enqueued: a prefetched block the engine then
    /// skipped must become a victim candidate again.
    fn promote_recorded(&self, g: &mut Inner) {
        for s in 0..g.table.len() {
            if let SlotState::Loading { ticket, .. } = g.table.state(s) {
                if let Some(Ok(())) = self.done_board().poll(ticket) {
                    let _ = g.table.mark_ready(s, ticket);
                }
            }
        }
    }

    /// The oldest `Loading` slot's ticket outside `keep`, if any (a synchronous fetch can wait for it).
    fn oldest_loading(g: &Inner, keep: &[usize]) -> Option<Ticket> {
        g.table
            .states()
            .iter()
            .filter_map(|st| match *st {
                SlotState::Loading { block, ticket } if !keep.contains(&block) => Some(ticket),
                _ => None,
            })
            .min()
    }

    fn issue_load(&self, g: &mut Inner, block: usize, keep: &[usize], prefetch: bool) -> Result<usize, SchedulerError> {
        if g.table.choose_victim(keep).is_none() {
            self.promote_recorded(g);
        }
        let s = g
            .table
            .choose_victim(keep)
            .ok_or_else(|| SchedulerError::NoFreeSlot { stack: self.name.to_string(), slots: g.table.len() })?;
        let ticket = g.next_ticket;
        g.next_ticket += 1;
        let skip_last_use = g.fault == OrderingFault::SkipLastUseWait;
        g.table.begin_load(s, block, ticket)?;
        g.prefetched[s] = prefetch;
        if self.submission == Submission::Hook && self.gather.is_none() {
            g.stats.loads += 1;
            g.stats.h2d_bytes += g.blocks[block].copy_bytes();
            self.enqueue_here(g, s, block, ticket, skip_last_use)?;
            return Ok(s);
        }
        let waits = if skip_last_use { Vec::new() } else { vec![g.last_use_ev[s]] };
        if let Some(gs) = &self.gather {
            if let Err(e) = self.issue_gather(g, gs, s, block, ticket) {
                let _ = g.table.free(s);
                return Err(e);
            }
            return Ok(s);
        }
        let copies = copies_for(&g.blocks[block], g.slot_bufs[s]);
        g.stats.loads += 1;
        g.stats.h2d_bytes += g.blocks[block].copy_bytes();
        let cmd = LoadCmd {
            ticket,
            target: s,
            block,
            waits,
            copies,
            ready: g.ready_ev[s],
            board: self.board.clone(),
            notify: Some(g.notify.clone()),
        };
        if let Err(e) = self.stream.load(cmd) {
            let _ = g.table.free(s);
            return Err(e);
        }
        Ok(s)
    }

    /// Gather path of a load into slot `s`: per gather, the shard copy on the shard stream (behind the slot's last
    /// use) and a record of its own shard-ready event; then one AllGather per gather into the slot, numbered from
    /// the shared sequence, each waiting only on its own copy.
    fn issue_gather(
        &self,
        g: &mut Inner,
        gs: &GatherShared,
        s: usize,
        block: usize,
        ticket: Ticket,
    ) -> Result<(), SchedulerError> {
        let skip_last_use = g.fault == OrderingFault::SkipLastUseWait;
        let (shard_buf, last_use, slot_buf) = (g.shard_bufs[s], g.last_use_ev[s], g.slot_bufs[s]);
        let gathers = &g.gather_blocks[block].sections;
        let shard_ready = &g.shard_ready[s];
        let p = &self.platform;
        let enqueued = (|| {
            if gathers.len() > shard_ready.len() {
                let reason = format!("{} gathers but {} shard-ready events", gathers.len(), shard_ready.len());
                return Err(PlatformError::Driver(reason));
            }
            if !skip_last_use {
                p.stream_wait_event(gs.shard_stream, last_use)?;
            }
            let mut off = 0u64;
            for (sec, &ready) in gathers.iter().zip(shard_ready) {
                if sec.shard_bytes > 0 {
                    p.copy_h2d(gs.shard_stream, sec.host, sec.host_offset, shard_buf, off, sec.shard_bytes)?;
                }
                p.record_event(ready, gs.shard_stream)?;
                off += sec.shard_bytes;
            }
            Ok(())
        })();
        if let Err(source) = enqueued {
            let err = SchedulerError::LoadFailed { stack: self.name.to_string(), block, source };
            g.failure.get_or_insert(err.clone());
            return Err(err);
        }
        g.stats.loads += 1;
        g.stats.h2d_bytes += g.gather_blocks[block].shard_bytes();
        let count = g.gather_blocks[block].sections.len();
        let first = gs.sequence.claim(count as u64);
        let mut off = 0u64;
        for k in 0..count {
            let sec = g.gather_blocks[block].sections[k];
            let last = k + 1 == count;
            let ready = g.shard_ready[s][k];
            let waits = if k == 0 && !skip_last_use { vec![ready, last_use] } else { vec![ready] };
            let cmd = GatherCmd {
                seq: first + k as u64,
                ticket,
                target: s,
                block,
                waits,
                input: (shard_buf, off, sec.shard_bytes),
                output: (slot_buf, sec.output_offset),
                ready: g.ready_ev[s],
                tag: sec.tag,
                board: last.then(|| gs.board.clone()),
                notify: last.then(|| g.notify.clone()),
            };
            off += sec.shard_bytes;
            gs.collective.gather(cmd).map_err(|e| {
                let err: SchedulerError = e.into();
                g.failure.get_or_insert(err.clone());
                err
            })?;
        }
        Ok(())
    }

    /// Streamed blocks after `from` (or from the start of the ring when `None`), wrapping, at most `depth`.
    fn upcoming(g: &Inner, from: Option<usize>) -> Vec<usize> {
        let n = g.blocks.len();
        let streaming = g.resident.iter().filter(|r| !**r).count();
        let mut out = Vec::new();
        if streaming == 0 || g.depth == 0 {
            return out;
        }
        let mut i = from.unwrap_or(n - 1);
        for _ in 0..n {
            i = (i + 1) % n;
            if g.resident[i] {
                continue;
            }
            if Some(i) == from {
                break;
            }
            out.push(i);
            if out.len() == g.depth || out.len() == streaming {
                break;
            }
        }
        out
    }

    fn prefetch_from(&self, from: Option<usize>) -> Result<(), SchedulerError> {
        let mut g = lock(&self.inner);
        self.prefetch_locked(&mut g, from)
    }

    fn prefetch_locked(&self, g: &mut Inner, from: Option<usize>) -> Result<(), SchedulerError> {
        let window = Self::upcoming(g, from);
        let mut keep = window.clone();
        if let Some(b) = from {
            keep.push(b);
        }
        for &j in &window {
            if g.table.slot_of(j).is_some() {
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
    /// then prefetch the next blocks. Returns where the block's bytes are.
    pub fn pre_forward(&self, block: usize) -> Result<BlockLocation, SchedulerError> {
        let mut g = lock(&self.inner);
        self.drain(&mut g)?;
        let n = g.blocks.len();
        if block >= n {
            return Err(SchedulerError::NoSuchBlock { stack: self.name.to_string(), block, len: n });
        }
        if let Some(buffer) = g.resident_bufs[block] {
            let loc = BlockLocation { buffer, offset: 0 };
            self.prefetch_locked(&mut g, Some(block))?;
            return Ok(loc);
        }
        let s = match g.table.slot_of(block) {
            Some(s) => {
                match g.table.state(s) {
                    SlotState::InUse { .. } => {
                        return Err(SchedulerError::Slot(crate::slot::SlotError {
                            slot: s,
                            action: "be acquired twice (pre_forward without post_forward)",
                            state: g.table.state(s),
                        }))
                    }
                    SlotState::Releasing { .. } => g.stats.reuse_hits += 1,
                    _ if g.prefetched[s] => g.stats.prefetch_hits += 1,
                    _ => {}
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
                            let Some(t) = Self::oldest_loading(&g, &[block]) else {
                                return Err(SchedulerError::NoFreeSlot {
                                    stack: self.name.to_string(),
                                    slots: g.table.len(),
                                });
                            };
                            drop(g);
                            let r = self.done_board().wait(t, &*self.done_alive());
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
        g.prefetched[s] = false;
        if let SlotState::Loading { ticket, .. } = g.table.state(s) {
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
                let _ = g.table.free(s);
                // A failed load poisons the stack: later hooks report it too, until disable.
                g.failure.get_or_insert(e.clone());
                return Err(e);
            }
            g.table.mark_ready(s, ticket)?;
        }
        if g.fault != OrderingFault::SkipReadyWait {
            self.platform.stream_wait_event(self.compute, g.ready_ev[s])?;
        }
        g.table.acquire(s, block)?;
        let loc = BlockLocation { buffer: g.slot_bufs[s], offset: 0 };
        self.prefetch_locked(&mut g, Some(block))?;
        Ok(loc)
    }

    /// The engine finished enqueuing block `block`'s compute: record its last use and release the slot.
    pub fn post_forward(&self, block: usize) -> Result<(), SchedulerError> {
        let mut g = lock(&self.inner);
        self.drain(&mut g)?;
        let n = g.blocks.len();
        if block >= n {
            return Err(SchedulerError::NoSuchBlock { stack: self.name.to_string(), block, len: n });
        }
        if g.resident[block] {
            return Ok(());
        }
        let s = match g.table.slot_of(block) {
            Some(s) if matches!(g.table.state(s), SlotState::InUse { .. }) => s,
            _ => return Err(SchedulerError::NotInUse { stack: self.name.to_string(), block }),
        };
        self.platform.record_event(g.last_use_ev[s], self.compute)?;
        g.table.release(s, block)?;
        Ok(())
    }

    /// Where a block is now, if it is resident or in a slot.
    pub fn location(&self, block: usize) -> Option<BlockLocation> {
        let g = lock(&self.inner);
        if let Some(buffer) = g.resident_bufs.get(block).copied().flatten() {
            return Some(BlockLocation { buffer, offset: 0 });
        }
        g.table.slot_of(block).map(|s| BlockLocation { buffer: g.slot_bufs[s], offset: 0 })
    }

    /// Returns once every load issued so far has completed and every slot's last use has completed.
    pub fn fence(&self) -> Result<(), SchedulerError> {
        if self.submission == Submission::Hook {
            // Every streamed load is recorded when its hook returns; `FenceOnRecord` stops there.
            if self.fault != OrderingFault::FenceOnRecord {
                let synced = self.platform.stream_synchronize(self.stream.stream());
                self.poll_in_flight(&mut lock(&self.inner));
                synced?;
            }
        } else if self.fault == OrderingFault::FenceOnRecord {
            let last = lock(&self.inner).next_ticket - 1;
            self.wait_recorded(last, usize::MAX)?;
        } else {
            self.stream.fence()?;
        }
        if let Some(gs) = &self.gather {
            self.platform.stream_synchronize(gs.shard_stream)?;
            gs.collective.fence()?;
        }
        let events: Vec<EventId> = lock(&self.inner).last_use_ev.clone();
        for e in events {
            self.platform.event_synchronize(e)?;
        }
        let mut g = lock(&self.inner);
        while let Ok(Some(c)) = g.mailbox.try_recv() {
            g.stats.completions += 1;
            if let Err(e) = c.result {
                g.failure.get_or_insert(SchedulerError::LoadFailed {
                    stack: self.name.to_string(),
                    block: c.block,
                    source: e,
                });
            }
        }
        match &g.failure {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn release_all(&self) -> Result<(), SchedulerError> {
        // Observe completion of every copy and every read before freeing anything.
        let skip_sync = self.fault == OrderingFault::FreeWithoutSync;
        let fenced = match (skip_sync, self.submission) {
            (true, _) => Ok(()),
            // The copy stream holds every load the hooks enqueued (and the resident head, fenced at creation).
            (false, Submission::Hook) => self.platform.stream_synchronize(self.stream.stream()).map_err(Into::into),
            (false, Submission::Actor) => self.stream.fence(),
        };
        let mut g = lock(&self.inner);
        let mut sync_err = None;
        if let (Some(gs), false) = (&self.gather, skip_sync) {
            if let Err(err) = self.platform.stream_synchronize(gs.shard_stream) {
                sync_err.get_or_insert(err);
            }
            // The actor handles its mailbox in order: once this fence is answered every gather sent before it was
            // issued (or refused), so the ready events below cover every write into the slots. A poisoned actor
            // answers at once but has also handled everything before the fence.
            drop(g);
            let gathered = gs.collective.fence();
            g = lock(&self.inner);
            if let Err(e) = gathered {
                if !matches!(e, GatherError::Poisoned { .. }) {
                    sync_err.get_or_insert(e.into());
                }
            }
        }
        for &e in g
            .last_use_ev
            .iter()
            .chain(g.ready_ev.iter())
            .chain(g.resident_ev.iter())
            .chain(g.shard_ready.iter().flatten())
        {
            if skip_sync {
                break;
            }
            if let Err(err) = self.platform.event_synchronize(e) {
                sync_err.get_or_insert(err);
            }
        }
        if !skip_sync {
            // Every ready event was synchronised above: count the hook-submitted loads still tracked as completed.
            self.poll_in_flight(&mut g);
        }
        g.in_flight.clear();
        g.disabled = true;
        for s in 0..g.table.len() {
            if let SlotState::InUse { block, .. } = g.table.state(s) {
                let _ = g.table.release(s, block);
            }
            let _ = g.table.free(s);
        }
        let inner = &mut *g;
        let bufs: Vec<DeviceBufferId> = inner
            .resident_bufs
            .drain(..)
            .flatten()
            .chain(inner.slot_bufs.drain(..))
            .chain(inner.shard_bufs.drain(..))
            .collect();
        let events: Vec<EventId> = inner
            .ready_ev
            .drain(..)
            .chain(inner.last_use_ev.drain(..))
            .chain(inner.resident_ev.take())
            .chain(inner.shard_ready.drain(..).flatten())
            .collect();
        g.stats.device_bytes = 0;
        drop(g);
        cleanup(&self.platform, &bufs, &events);
        fenced?;
        match sync_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Waits for all outstanding work, then frees the slots and the resident head. The stack is unusable after.
    pub fn disable(&self) -> Result<(), SchedulerError> {
        if lock(&self.inner).disabled {
            return Ok(());
        }
        self.release_all()
    }
}

fn copies_for(b: &BlockSpec, dst: DeviceBufferId) -> Vec<CopyOp> {
    b.segments
        .iter()
        .map(|s| CopyOp {
            direction: CopyDirection::HostToDevice,
            host: s.host,
            host_offset: s.host_offset,
            device: dst,
            device_offset: s.device_offset,
            len: s.len,
        })
        .collect()
}
