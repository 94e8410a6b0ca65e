//! Events with CUDA semantics, tracked by record generation.
//!
//! Each `record_event` gives the event a new generation (1, 2, …) at enqueue time and puts that generation in the
//! event's pending set; the stream removes it when it reaches the marker. A generation is complete when it is not
//! pending. `stream_wait_event` captures the latest generation at call time and waits for *that* generation only,
//! so a later re-record (on any stream) neither delays nor releases an earlier waiter. `event_query` and
//! `event_synchronize` observe the latest generation, whatever stream it was recorded on: if an event is
//! re-recorded on stream B while an earlier record on stream A is still pending, the event reports complete as
//! soon as B's record completes (as CUDA does: only the most recent record counts).
//!
//! Invariants: a generation is never completed twice and never un-completed; a generation whose stream had failed
//! before its marker is remembered as failed; a destroyed event stays in the table (invisible to callers) until
//! its pending generations complete, so streams waiting on it are still ordered correctly.

use super::lifecycle::{wait, Lifecycle};
use crate::platform::{EventId, PlatformError, PlatformResult};
use crate::sync::{lock, Condvar, Mutex};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Where one generation of an event stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GenStatus {
    /// Its marker has not been reached.
    Pending,
    /// Its marker was reached and the work before it succeeded (or the generation is 0: never recorded).
    Done,
    /// Its marker was reached on a stream whose earlier work failed.
    Failed(String),
}

#[derive(Default)]
struct EventState {
    recorded: u64,
    pending: BTreeSet<u64>,
    failed: BTreeMap<u64, String>,
    destroyed: bool,
}

impl EventState {
    fn status(&self, gen: u64) -> GenStatus {
        if gen == 0 {
            GenStatus::Done
        } else if self.pending.contains(&gen) {
            GenStatus::Pending
        } else if let Some(reason) = self.failed.get(&gen) {
            GenStatus::Failed(reason.clone())
        } else {
            GenStatus::Done
        }
    }
}

struct Events {
    events: HashMap<u32, EventState>,
    next_id: u32,
}

impl Events {
    fn live(&mut self, id: EventId) -> PlatformResult<&mut EventState> {
        match self.events.get_mut(&id.0) {
            Some(ev) if !ev.destroyed => Ok(ev),
            _ => Err(PlatformError::InvalidHandle { what: "event", id: u64::from(id.0) }),
        }
    }
}

/// All events and the condition variable that generation completions are announced on.
pub(crate) struct EventTable {
    state: Mutex<Events>,
    cond: Condvar,
}

impl EventTable {
    /// No events.
    pub(crate) fn new() -> Self {
        EventTable { state: Mutex::new(Events { events: HashMap::new(), next_id: 1 }), cond: Condvar::new() }
    }

    /// Creates an event (never recorded).
    pub(crate) fn create(&self) -> PlatformResult<EventId> {
        let mut st = lock(&self.state);
        let id = st.next_id;
        st.next_id = id.checked_add(1).ok_or_else(|| PlatformError::Driver("event ids exhausted".to_string()))?;
        st.events.insert(id, EventState::default());
        Ok(EventId(id))
    }

    /// Destroys an event; its pending records still complete for streams that wait on them.
    pub(crate) fn destroy(&self, id: EventId) -> PlatformResult<()> {
        let mut st = lock(&self.state);
        let ev = st.live(id)?;
        if ev.pending.is_empty() {
            st.events.remove(&id.0);
        } else {
            ev.destroyed = true;
        }
        Ok(())
    }

    /// Starts a new record of `id`; returns its generation (now pending).
    pub(crate) fn record(&self, id: EventId) -> PlatformResult<u64> {
        let mut st = lock(&self.state);
        let ev = st.live(id)?;
        ev.recorded += 1;
        let gen = ev.recorded;
        ev.pending.insert(gen);
        Ok(gen)
    }

    /// The latest generation of `id` (0 if never recorded).
    pub(crate) fn capture(&self, id: EventId) -> PlatformResult<u64> {
        Ok(lock(&self.state).live(id)?.recorded)
    }

    /// Generation `gen` of `id` was reached; `failure` says why the work before it failed, if it did.
    pub(crate) fn complete(&self, id: EventId, gen: u64, failure: Option<String>) {
        let mut st = lock(&self.state);
        if let Some(ev) = st.events.get_mut(&id.0) {
            if ev.pending.remove(&gen) {
                if let Some(reason) = failure {
                    ev.failed.insert(gen, reason);
                }
            }
            if ev.destroyed && ev.pending.is_empty() {
                st.events.remove(&id.0);
            }
        }
        drop(st);
        self.cond.notify_all();
    }

    /// Status of the latest record of `id`.
    pub(crate) fn query(&self, id: EventId) -> PlatformResult<GenStatus> {
        let mut st = lock(&self.state);
        let ev = st.live(id)?;
        Ok(ev.status(ev.recorded))
    }

    /// Blocks until generation `gen` of `id` is no longer pending; `None` if the platform shut down first.
    /// A missing event (destroyed, all records done) counts as done.
    pub(crate) fn wait_gen(&self, id: EventId, gen: u64, life: &Lifecycle) -> Option<GenStatus> {
        let mut st = lock(&self.state);
        loop {
            let status = st.events.get(&id.0).map_or(GenStatus::Done, |ev| ev.status(gen));
            if status != GenStatus::Pending {
                return Some(status);
            }
            if life.is_down() {
                return None;
            }
            st = wait(&self.cond, st);
        }
    }

    /// Blocks until the latest record of `id` (as of this call) completed; `Ok(None)` if the platform shut down.
    pub(crate) fn synchronize(&self, id: EventId, life: &Lifecycle) -> PlatformResult<Option<GenStatus>> {
        let gen = self.capture(id)?;
        Ok(self.wait_gen(id, gen, life))
    }

    /// Wakes every waiter (used at shutdown).
    pub(crate) fn wake_all(&self) {
        drop(lock(&self.state));
        self.cond.notify_all();
    }
}
