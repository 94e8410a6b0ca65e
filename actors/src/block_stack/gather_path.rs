//! The gather path (distributed layerwise offload, [`BlockStack::with_gather`]): each rank holds only its shard of
//! every block, and a streamed block is rebuilt in its slot by AllGather.
//!
//! A load has two stages: the stack enqueues the rank's shard copies itself on its own shard stream (behind the
//! slot's last-use event) into the slot's own shard buffer, one copy per gather (a section, or a chunk of one), each
//! followed by a record of that gather's own shard-ready event; then it sends one [`GatherCmd`] per gather to the
//! collective actor, each waiting only on its own shard-ready event (the first also on the slot's last-use event;
//! the comm stream is in order), so the AllGather of chunk `j` overlaps the copy of chunk `j + 1`. Every gather
//! records the slot's ready event; compute waits on its last record. The shard-ready events of a slot are created
//! with the stack, as many as the largest block has gathers (at most [`MAX_GATHERS_PER_BLOCK`]): none is created on
//! the hook path.
//!
//! Sequence numbers come from a [`GatherSequence`] shared by every gather stack of the rank, taken on the engine's
//! thread in hook order, so ranks that run the same hook sequence number the same gathers alike (invariant 4).
//! "Recorded" is then read from the gather board (published by the collective actor after the last section's
//! AllGather), never from the stream board. Each slot has its own shard buffer, overwritten only behind the slot's
//! last-use event, which follows the compute that read the gather's output, which follows the gather that read the
//! shard (invariant 2 for the shard buffers). Numbering is deterministic as long as every rank loads the same blocks
//! in the same order: true without block skips; with skips the victim choice may depend on timing. Slot and shard
//! buffers come from `Platform::alloc_device_shared`, so a collective may place them in symmetric windows (NCCL's
//! copy-engine AllGather writes into the peer's buffer at the same window offset); that needs every rank to pick the
//! same slot for the same gather, which holds when every rank runs the same hooks: in a healthy stack slots become
//! free only at disable and after a failure, so the victim choice follows the hook sequence alone.
//!
//! The resident blocks of a gather stack load their full [`BlockSpec`](super::BlockSpec) segments through the
//! stream actor, as on the other paths.

use super::{Allocated, BlockStack, Inner, Load, PathState, StackSpec, Submission};
use crate::collective_actor::{CollectiveHandle, GatherCmd, GatherError};
use crate::error::SchedulerError;
use crate::messages::TicketBoard;
use crate::platform::{DeviceBufferId, EventId, HostBufferId, PlatformError, PlatformRef, StreamId};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{lock, Arc, MutexGuard};

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

/// What a gather stack shares between its hooks (immutable after creation, read without the stack's lock): the
/// collective, the numbering, the shard stream, the gather board and every block's gathers.
#[derive(Debug)]
pub(super) struct GatherLink {
    collective: CollectiveHandle,
    sequence: GatherSequence,
    shard_stream: StreamId,
    /// Where the collective actor publishes a streamed load as recorded (after its last gather).
    pub(super) board: Arc<TicketBoard>,
    /// Per block: its AllGathers.
    blocks: Vec<GatherBlock>,
}

/// Per slot: its shard buffer and one shard-ready event per gather of the largest block; taken at disable.
#[derive(Debug, Default)]
pub(super) struct ShardSlots {
    bufs: Vec<DeviceBufferId>,
    ready: Vec<Vec<EventId>>,
    /// The shard stream ([`GatherLink::shard_stream`]) is not destroyed yet: the first disable destroys it.
    stream_live: bool,
}

/// No shard slots: what [`shards`] gives on the other load paths.
static NO_SHARDS: ShardSlots = ShardSlots { bufs: Vec::new(), ready: Vec::new(), stream_live: false };

/// The stack's shard slots (none on the other load paths).
pub(super) fn shards(g: &Inner) -> &ShardSlots {
    match &g.path {
        PathState::Gather(shards) => shards,
        PathState::Actor | PathState::Hook(_) => &NO_SHARDS,
    }
}

impl ShardSlots {
    /// Every shard-ready event.
    pub(super) fn events(&self) -> impl Iterator<Item = &EventId> {
        self.ready.iter().flatten()
    }
    /// Takes the buffers and events to free (disable), and whether the shard stream is still to be destroyed
    /// (true once).
    pub(super) fn take(&mut self) -> (Vec<DeviceBufferId>, Vec<EventId>, bool) {
        let events = std::mem::take(&mut self.ready).into_iter().flatten().collect();
        (std::mem::take(&mut self.bufs), events, std::mem::replace(&mut self.stream_live, false))
    }
}

/// The sizes a gather stack's shard memory needs, from [`check`].
#[derive(Debug, Clone, Copy)]
pub(super) struct ShardLayout {
    /// Bytes of each slot's shard buffer: the largest streamed block's shards.
    pub(super) shard_size: u64,
    /// Shard-ready events per slot: the most gathers of a streamed block.
    pub(super) gathers_per_slot: usize,
}

/// Validates a gather path against its stack (before anything is allocated) and widens `region` (per block, the
/// bytes its slot must hold) to the gathered sections, padding included.
pub(super) fn check(
    spec: &StackSpec,
    gp: &GatherPath,
    resident: &[bool],
    region: &mut [u64],
) -> Result<ShardLayout, SchedulerError> {
    let n = spec.blocks.len();
    let invalid = |reason: String| SchedulerError::InvalidSpec { stack: spec.name.clone(), reason };
    if gp.blocks.len() != n {
        return Err(invalid(format!("gather path has {} blocks for {n} blocks", gp.blocks.len())));
    }
    if spec.eager_prefetch {
        return Err(invalid("a gather stack defers its first prefetch to the first forward".into()));
    }
    if spec.submission != Submission::Actor {
        return Err(invalid("a gather stack submits its loads through its actors (submission \"actor\")".into()));
    }
    let world = gp.collective.world() as u64;
    let mut layout = ShardLayout { shard_size: 0, gathers_per_slot: 0 };
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
        layout.gathers_per_slot = layout.gathers_per_slot.max(gb.sections.len());
        let mut total = 0u64;
        for sec in &gb.sections {
            let end = sec.shard_bytes.checked_mul(world).and_then(|l| l.checked_add(sec.output_offset));
            let Some(end) = end else {
                return Err(invalid(format!("block {i}: gathered section overflows")));
            };
            region[i] = region[i].max(end);
            total = total.checked_add(sec.shard_bytes).ok_or_else(|| invalid("shard overflow".into()))?;
        }
        layout.shard_size = layout.shard_size.max(total);
    }
    Ok(layout)
}

/// Allocates each slot's shard buffer and shard-ready events (recorded in `alloc`), then the shard stream.
pub(super) fn alloc(
    platform: &PlatformRef,
    name: &str,
    gp: GatherPath,
    layout: ShardLayout,
    slots: usize,
    alloc: &mut Allocated,
) -> Result<(ShardSlots, GatherLink), SchedulerError> {
    let mut shards = ShardSlots::default();
    for _ in 0..slots {
        shards.bufs.push(alloc.buffer(platform.alloc_device_shared(layout.shard_size.max(1)))?);
        let mut per_gather = Vec::with_capacity(layout.gathers_per_slot);
        for _ in 0..layout.gathers_per_slot {
            per_gather.push(alloc.event(platform)?);
        }
        shards.ready.push(per_gather);
    }
    let link = GatherLink {
        collective: gp.collective,
        sequence: gp.sequence,
        shard_stream: platform.create_stream(&format!("{name}-shard"))?,
        board: Arc::new(TicketBoard::new()),
        blocks: gp.blocks,
    };
    shards.stream_live = true;
    Ok((shards, link))
}

impl GatherLink {
    /// The stream the shard copies run on (the stack's own).
    pub(super) fn shard_stream(&self) -> StreamId {
        self.shard_stream
    }

    /// Whether the collective actor (which publishes on [`GatherLink::board`]) still runs.
    pub(super) fn is_alive(&self) -> bool {
        self.collective.is_alive()
    }

    /// The actor named when it stopped.
    pub(super) fn actor_name(&self, stack: &str) -> String {
        format!("collective for stack '{stack}' (rank {})", self.collective.rank())
    }

    /// A load into slot `load.slot`: per gather, the shard copy on the shard stream (behind `load.waits`, the
    /// slot's last use) and a record of its own shard-ready event; then one AllGather per gather into the slot,
    /// numbered from the shared sequence, each waiting only on its own copy (the first also on `load.waits`). A
    /// failure to enqueue or to reach the collective poisons the stack (the caller frees the slot).
    pub(super) fn issue(&self, st: &BlockStack, g: &mut Inner, load: &Load<'_>) -> Result<(), SchedulerError> {
        let (s, block) = (load.slot, load.block);
        let (shard_buf, slot_buf, slot_ready) = (shards(g).bufs[s], g.mem.slot_bufs[s], g.mem.ready_ev[s]);
        let gb = &self.blocks[block];
        let shard_ready = &shards(g).ready[s];
        let p = &st.platform;
        let enqueued = (|| {
            if gb.sections.len() > shard_ready.len() {
                let reason = format!("{} gathers but {} shard-ready events", gb.sections.len(), shard_ready.len());
                return Err(PlatformError::Driver(reason));
            }
            for &e in load.waits {
                p.stream_wait_event(self.shard_stream, e)?;
            }
            let mut off = 0u64;
            for (sec, &ready) in gb.sections.iter().zip(shard_ready) {
                if sec.shard_bytes > 0 {
                    p.copy_h2d(self.shard_stream, sec.host, sec.host_offset, shard_buf, off, sec.shard_bytes)?;
                }
                p.record_event(ready, self.shard_stream)?;
                off += sec.shard_bytes;
            }
            Ok(())
        })();
        if let Err(source) = enqueued {
            return Err(g.poison(SchedulerError::LoadFailed { stack: st.name.to_string(), block, source }));
        }
        g.stats.loads += 1;
        g.stats.h2d_bytes += gb.shard_bytes();
        let count = gb.sections.len();
        let first = self.sequence.claim(count as u64);
        let mut off = 0u64;
        for (k, sec) in gb.sections.iter().enumerate() {
            let last = k + 1 == count;
            let mut waits = vec![shards(g).ready[s][k]];
            if k == 0 {
                waits.extend_from_slice(load.waits);
            }
            let cmd = GatherCmd {
                seq: first + k as u64,
                ticket: load.ticket,
                target: s,
                block,
                waits,
                input: (shard_buf, off, sec.shard_bytes),
                output: (slot_buf, sec.output_offset),
                ready: slot_ready,
                tag: sec.tag,
                board: last.then(|| self.board.clone()),
                notify: last.then(|| g.notify.clone()),
            };
            off += sec.shard_bytes;
            if let Err(e) = self.collective.gather(cmd) {
                return Err(g.poison(e.into()));
            }
        }
        Ok(())
    }

    /// The gather part of a fence: the shard copies and every gather sent so far have completed.
    pub(super) fn fence(&self, platform: &PlatformRef) -> Result<(), SchedulerError> {
        platform.stream_synchronize(self.shard_stream)?;
        self.collective.fence()?;
        Ok(())
    }

    /// The gather part of observing everything before disable frees memory; errors go to `sync_err` (the first
    /// one wins). The stack's lock is released while the collective actor fences.
    pub(super) fn sync_for_release<'a>(
        &self,
        st: &'a BlockStack,
        g: MutexGuard<'a, Inner>,
        sync_err: &mut Option<SchedulerError>,
    ) -> MutexGuard<'a, Inner> {
        if let Err(err) = st.platform.stream_synchronize(self.shard_stream) {
            sync_err.get_or_insert(err.into());
        }
        // The actor handles its mailbox in order: once this fence is answered every gather sent before it was
        // issued (or refused), so the ready events synchronised next cover every write into the slots. A poisoned
        // actor answers at once but has also handled everything before the fence.
        drop(g);
        let gathered = self.collective.fence();
        let g = lock(&st.inner);
        if let Err(e) = gathered {
            if !matches!(e, GatherError::Poisoned { .. }) {
                sync_err.get_or_insert(e.into());
            }
        }
        g
    }
}
