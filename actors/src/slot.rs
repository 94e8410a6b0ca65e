//! The slot state machine: the one place that decides what a device slot may do next.
//!
//! A slot moves `Free → Loading(ticket) → Ready → InUse → Releasing → …`. From `Releasing` it either goes back to
//! `Loading` (the next copy is enqueued behind a GPU-side wait on the slot's last-use event, so no host round trip is
//! needed) or, once the last-use event's completion has been *observed*, to `Free` (only then may its memory return
//! to the allocator). A `Releasing` slot still holds its block's bytes, so asking for that block again reuses it
//! (`Releasing → InUse`) without a copy.
//!
//! Invariants kept here: a slot is never loaded while `InUse`; a slot is never freed unless `Free`; every transition
//! names the block and ticket it expects, so a stale completion cannot move a slot that was re-targeted.

use std::fmt;

/// Identifies one load into one slot. Tickets increase monotonically per block stack.
pub type Ticket = u64;

/// Where a slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Holds nothing; its memory may be reused or freed.
    Free,
    /// A copy of `block` was requested under `ticket`; the ready event may not be recorded yet.
    Loading {
        /// Block being loaded.
        block: usize,
        /// The load's ticket.
        ticket: Ticket,
    },
    /// The copy of `block` is enqueued and its ready event recorded: compute can be ordered behind it.
    Ready {
        /// Block held.
        block: usize,
        /// The load's ticket.
        ticket: Ticket,
    },
    /// Compute reading `block` has been enqueued and not yet released.
    InUse {
        /// Block held.
        block: usize,
        /// The load's ticket.
        ticket: Ticket,
    },
    /// `post_forward` recorded the last-use event; the bytes of `block` are still there.
    Releasing {
        /// Block held.
        block: usize,
        /// The load's ticket.
        ticket: Ticket,
    },
}

impl SlotState {
    /// The block a slot holds or is loading.
    pub fn block(&self) -> Option<usize> {
        match *self {
            SlotState::Free => None,
            SlotState::Loading { block, .. }
            | SlotState::Ready { block, .. }
            | SlotState::InUse { block, .. }
            | SlotState::Releasing { block, .. } => Some(block),
        }
    }
    /// The ticket of the load that filled (or is filling) the slot.
    pub fn ticket(&self) -> Option<Ticket> {
        match *self {
            SlotState::Free => None,
            SlotState::Loading { ticket, .. }
            | SlotState::Ready { ticket, .. }
            | SlotState::InUse { ticket, .. }
            | SlotState::Releasing { ticket, .. } => Some(ticket),
        }
    }
    fn name(&self) -> &'static str {
        match self {
            SlotState::Free => "Free",
            SlotState::Loading { .. } => "Loading",
            SlotState::Ready { .. } => "Ready",
            SlotState::InUse { .. } => "InUse",
            SlotState::Releasing { .. } => "Releasing",
        }
    }
}

/// An illegal transition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotError {
    /// Slot index.
    pub slot: usize,
    /// Attempted transition.
    pub action: &'static str,
    /// State it was in.
    pub state: SlotState,
}

impl fmt::Display for SlotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {} cannot {} while {} ({:?})", self.slot, self.action, self.state.name(), self.state)
    }
}

impl std::error::Error for SlotError {}

/// The slots of one ring and the reverse map from block to slot.
#[derive(Debug, Clone)]
pub struct SlotTable {
    slots: Vec<SlotState>,
    /// Per slot: the step (use counter) of its last `InUse`, for victim choice.
    last_used: Vec<u64>,
    clock: u64,
}

impl SlotTable {
    /// `n` free slots.
    pub fn new(n: usize) -> Self {
        SlotTable { slots: vec![SlotState::Free; n], last_used: vec![0; n], clock: 0 }
    }
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    /// Whether the table has no slots.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    /// State of slot `s`.
    pub fn state(&self, s: usize) -> SlotState {
        self.slots[s]
    }
    /// All states.
    pub fn states(&self) -> &[SlotState] {
        &self.slots
    }
    /// The slot holding (or loading) `block`.
    pub fn slot_of(&self, block: usize) -> Option<usize> {
        self.slots.iter().position(|st| st.block() == Some(block))
    }

    fn err(&self, slot: usize, action: &'static str) -> SlotError {
        SlotError { slot, action, state: self.slots[slot] }
    }

    /// `Free | Ready | Releasing → Loading`: a new copy of `block` is requested into slot `s`.
    /// `Ready` (loaded, never used: the engine skipped it) may be overwritten too.
    pub fn begin_load(&mut self, s: usize, block: usize, ticket: Ticket) -> Result<(), SlotError> {
        match self.slots[s] {
            SlotState::Free | SlotState::Releasing { .. } | SlotState::Ready { .. } => {
                self.slots[s] = SlotState::Loading { block, ticket };
                Ok(())
            }
            _ => Err(self.err(s, "begin a load")),
        }
    }
    /// `Loading(ticket) → Ready`: the ready event was recorded.
    pub fn mark_ready(&mut self, s: usize, ticket: Ticket) -> Result<(), SlotError> {
        match self.slots[s] {
            SlotState::Loading { block, ticket: t } if t == ticket => {
                self.slots[s] = SlotState::Ready { block, ticket };
                Ok(())
            }
            _ => Err(self.err(s, "become ready")),
        }
    }
    /// `Ready | Releasing → InUse` for `block`.
    pub fn acquire(&mut self, s: usize, block: usize) -> Result<(), SlotError> {
        match self.slots[s] {
            SlotState::Ready { block: b, ticket } | SlotState::Releasing { block: b, ticket } if b == block => {
                self.slots[s] = SlotState::InUse { block, ticket };
                self.clock += 1;
                self.last_used[s] = self.clock;
                Ok(())
            }
            _ => Err(self.err(s, "be acquired")),
        }
    }
    /// `InUse → Releasing`: the last-use event was recorded.
    pub fn release(&mut self, s: usize, block: usize) -> Result<(), SlotError> {
        match self.slots[s] {
            SlotState::InUse { block: b, ticket } if b == block => {
                self.slots[s] = SlotState::Releasing { block, ticket };
                Ok(())
            }
            _ => Err(self.err(s, "be released")),
        }
    }
    /// `Releasing | Ready | Loading → Free`: the caller observed completion of every copy into and every read of the
    /// slot (used at disable and after a failed load).
    pub fn free(&mut self, s: usize) -> Result<(), SlotError> {
        match self.slots[s] {
            SlotState::InUse { .. } => Err(self.err(s, "be freed")),
            _ => {
                self.slots[s] = SlotState::Free;
                Ok(())
            }
        }
    }
    /// Picks a slot to load into: a free slot first, else the least recently used slot that is neither `InUse`,
    /// `Loading`, nor holding a block in `keep`. `None` when every slot is pinned.
    pub fn choose_victim(&self, keep: &[usize]) -> Option<usize> {
        if let Some(s) = self.slots.iter().position(|st| *st == SlotState::Free) {
            return Some(s);
        }
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, st)| matches!(st, SlotState::Ready { .. } | SlotState::Releasing { .. }))
            .filter(|(_, st)| st.block().is_none_or(|b| !keep.contains(&b)))
            // Prefer slots whose block was never used (a skipped prefetch), then the least recently used.
            .min_by_key(|(s, st)| (matches!(st, SlotState::Releasing { .. }), self.last_used[*s]))
            .map(|(s, _)| s)
    }
    /// Whether any slot is `InUse` or `Loading`.
    pub fn busy(&self) -> bool {
        self.slots.iter().any(|st| matches!(st, SlotState::InUse { .. } | SlotState::Loading { .. }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_cycle_and_reuse_without_copy() {
        let mut t = SlotTable::new(2);
        t.begin_load(0, 7, 1).unwrap();
        assert_eq!(t.slot_of(7), Some(0));
        t.mark_ready(0, 1).unwrap();
        t.acquire(0, 7).unwrap();
        t.release(0, 7).unwrap();
        assert_eq!(t.state(0), SlotState::Releasing { block: 7, ticket: 1 });
        // Same block again: reused in place.
        t.acquire(0, 7).unwrap();
        t.release(0, 7).unwrap();
        t.begin_load(0, 8, 2).unwrap();
        assert_eq!(t.state(0), SlotState::Loading { block: 8, ticket: 2 });
    }

    #[test]
    fn illegal_transitions_are_rejected() {
        let mut t = SlotTable::new(1);
        assert_eq!(t.acquire(0, 1).unwrap_err().to_string(), "slot 0 cannot be acquired while Free (Free)");
        t.begin_load(0, 1, 5).unwrap();
        assert!(t.begin_load(0, 2, 6).is_err(), "cannot retarget a loading slot");
        assert!(t.mark_ready(0, 4).is_err(), "stale ticket");
        t.mark_ready(0, 5).unwrap();
        t.acquire(0, 1).unwrap();
        assert!(t.begin_load(0, 2, 6).is_err(), "cannot overwrite a slot in use");
        assert!(t.free(0).is_err(), "cannot free a slot in use");
        assert!(t.release(0, 2).is_err(), "wrong block");
        t.release(0, 1).unwrap();
        t.free(0).unwrap();
        assert_eq!(t.state(0), SlotState::Free);
    }

    #[test]
    fn victim_skips_kept_loading_and_in_use_slots() {
        let mut t = SlotTable::new(3);
        for (s, b) in [(0usize, 10usize), (1, 11), (2, 12)] {
            t.begin_load(s, b, s as u64 + 1).unwrap();
            t.mark_ready(s, s as u64 + 1).unwrap();
        }
        t.acquire(0, 10).unwrap();
        t.release(0, 10).unwrap();
        t.acquire(1, 11).unwrap();
        // Slot 2 holds an unused prefetch (skipped), slot 0 is releasing, slot 1 in use.
        assert_eq!(t.choose_victim(&[]), Some(2));
        assert_eq!(t.choose_victim(&[12]), Some(0));
        assert_eq!(t.choose_victim(&[12, 10]), None);
    }
}
