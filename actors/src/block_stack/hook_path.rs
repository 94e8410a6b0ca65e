//! Hook submission ([`Submission::Hook`](super::Submission::Hook), rank-local stacks only): the engine thread
//! calling the hook enqueues a streamed load itself, under the stack's lock, in issue order, on the stack's copy
//! stream — the GPU-side wait on the slot's last-use event, the flat copies, the record of the slot's ready event:
//! the very operations the stream actor would enqueue — and the slot is `Ready` at once, so no hook ever waits on
//! the host for a recording and no thread is woken (waking a stream actor parked for a whole block costs tens of
//! µs).
//!
//! Completions are polled instead of watched: every hook's drain queries the ready events of the loads still in
//! flight ([`InFlight`]: one entry per slot, oldest first, stopping at the first incomplete) and turns a failure
//! into the stack's failure as a failed completion does; `fence` synchronises the copy stream and then observes
//! them. A failure to enqueue leaves the slot `Free`, poisons the stack and fails the hook that issued the load
//! (`LoadFailed` naming the block). Invariants (1) and (2) hold unchanged: the same waits are enqueued on the same
//! streams, only from another thread.

use super::{BlockStack, Inner, Load, PathState};
use crate::error::SchedulerError;
use crate::platform::EventId;
use crate::sync::lock;
use std::collections::VecDeque;

/// Loads enqueued by the hooks whose completion has not been observed yet, in the order of each slot's oldest
/// unobserved load. At most one entry per slot (depth + 1 in all): a reload merges into it.
#[derive(Debug, Default)]
pub(super) struct InFlight(VecDeque<Entry>);

/// A load enqueued by a hook, not yet observed complete.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: usize,
    /// The block named if the load fails (the oldest of merged loads).
    block: usize,
    ready: EventId,
    /// Loads this entry's completion stands for (more than one after a slot was reloaded while in flight).
    loads: u64,
}

impl InFlight {
    /// Room for one entry per slot.
    pub(super) fn with_capacity(slots: usize) -> Self {
        InFlight(VecDeque::with_capacity(slots))
    }

    /// Forgets every entry (disable).
    pub(super) fn clear(&mut self) {
        self.0.clear();
    }

    /// Tracks a load into `slot` whose ready event was just recorded. A slot reloaded before its previous load was
    /// observed complete: the ready event was re-recorded, so the older entry now observes this record, whose
    /// completion implies the older one's (one in-order stream). Merge in place, so at most one entry per slot is
    /// in flight and an error is still seen first on the entry of the oldest load it may come from (it names that
    /// block, as a watcher synchronising the re-recorded event would).
    fn track(&mut self, slot: usize, block: usize, ready: EventId) {
        match self.0.iter_mut().find(|f| f.slot == slot) {
            Some(old) => old.loads += 1,
            None => self.0.push_back(Entry { slot, block, ready, loads: 1 }),
        }
    }
}

/// Enqueues the load of `load.block` into `load.slot` on the copy stream from this thread, under the stack's
/// lock: the GPU-side waits (the slot's last-use event), the flat copies, the record of the slot's ready event. On
/// success the load counts as recorded (the slot is `Ready`) and is tracked until its completion is observed; on
/// failure the stack is poisoned (the caller frees the slot).
pub(super) fn issue(st: &BlockStack, g: &mut Inner, load: &Load<'_>) -> Result<(), SchedulerError> {
    let spec = &st.blocks[load.block];
    g.stats.loads += 1;
    g.stats.h2d_bytes += spec.copy_bytes();
    let stream = st.stream.stream();
    let (ready, dst) = (g.mem.ready_ev[load.slot], g.mem.slot_bufs[load.slot]);
    let p = &st.platform;
    let enqueued = (|| {
        for &e in load.waits {
            p.stream_wait_event(stream, e)?;
        }
        for seg in &spec.segments {
            p.copy_h2d(stream, seg.host, seg.host_offset, dst, seg.device_offset, seg.len)?;
        }
        p.record_event(ready, stream)
    })();
    if let Err(source) = enqueued {
        return Err(g.poison(SchedulerError::LoadFailed { stack: st.name.to_string(), block: load.block, source }));
    }
    g.ring.table.mark_ready(load.slot, load.ticket)?;
    if let PathState::Hook(in_flight) = &mut g.path {
        in_flight.track(load.slot, load.block, ready);
    }
    Ok(())
}

/// Observes the completion of the loads in flight, oldest entry first, stopping at the first one not complete:
/// later entries are observed at a later hook, so one `event_query` per hook when nothing completed. A failed one
/// poisons the stack exactly as a failed completion reported by a watcher does (`LoadFailed` naming the entry's
/// block). Nothing on the other load paths.
pub(super) fn poll(st: &BlockStack, g: &mut Inner) {
    loop {
        let PathState::Hook(in_flight) = &mut g.path else { return };
        let Some(f) = in_flight.0.front().copied() else { return };
        let done = match st.platform.event_query(f.ready) {
            Ok(false) => break,
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        in_flight.0.pop_front();
        g.stats.completions += f.loads;
        if let Err(source) = done {
            g.poison(SchedulerError::LoadFailed { stack: st.name.to_string(), block: f.block, source });
        }
    }
}

/// The loads part of a fence: every streamed load was enqueued on the copy stream when its hook returned, so
/// synchronise that stream, then observe the loads in flight (even when the synchronisation failed).
pub(super) fn fence(st: &BlockStack) -> Result<(), SchedulerError> {
    let synced = st.platform.stream_synchronize(st.stream.stream());
    poll(st, &mut lock(&st.inner));
    synced.map_err(Into::into)
}
