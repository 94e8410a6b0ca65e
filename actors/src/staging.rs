//! The staging ring of the disk tier: the one place that decides when a pinned staging buffer may be filled again.
//!
//! A block served from disk is read from its checkpoint file into a staging buffer (host memory the device can copy
//! from), then copied to its device slot on the copy stream. The ring holds a few such buffers, used in turn. A
//! buffer moves `Free → Filling(ticket) → Queued(ticket) → Free`: `Filling` while the host reads the file into it,
//! `Queued` once the copies that read it are enqueued and the event recorded after them, and `Free` again only once
//! that event's completion has been *observed* on the host — only then may the next read overwrite it.
//!
//! Invariants kept here: a buffer is never filled unless `Free` (never while the copies of an earlier load may
//! still read it); every transition names the ticket it expects, so a stale report cannot move a buffer that was
//! taken again; a read that failed before anything was enqueued gives the buffer back at once (`Filling → Free`).

use std::fmt;

use crate::slot::Ticket;

/// Where a staging buffer is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagingState {
    /// Holds nothing the device may still read: the next read may fill it.
    Free,
    /// The host is reading load `ticket`'s bytes into it.
    Filling {
        /// The load's ticket.
        ticket: Ticket,
    },
    /// The copies of load `ticket` that read it are enqueued, with an event recorded after them.
    Queued {
        /// The load's ticket.
        ticket: Ticket,
    },
}

impl StagingState {
    fn name(&self) -> &'static str {
        match self {
            StagingState::Free => "Free",
            StagingState::Filling { .. } => "Filling",
            StagingState::Queued { .. } => "Queued",
        }
    }
}

/// An illegal transition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingError {
    /// Buffer index.
    pub buffer: usize,
    /// Attempted transition.
    pub action: &'static str,
    /// State it was in.
    pub state: StagingState,
}

impl fmt::Display for StagingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "staging buffer {} cannot {} while {} ({:?})",
            self.buffer,
            self.action,
            self.state.name(),
            self.state
        )
    }
}

impl std::error::Error for StagingError {}

/// What the next read must do before it may fill a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextBuffer {
    /// Buffer `0` is free: fill it.
    Free(usize),
    /// Buffer `0` still serves load `1`: observe the completion of that load's copies first, then call
    /// [`StagingRing::completed`].
    AfterCopies(usize, Ticket),
}

/// The staging buffers of one reader, used in turn.
#[derive(Debug, Clone)]
pub struct StagingRing {
    buffers: Vec<StagingState>,
    next: usize,
}

impl StagingRing {
    /// `n` free buffers (at least one).
    pub fn new(n: usize) -> Self {
        StagingRing { buffers: vec![StagingState::Free; n.max(1)], next: 0 }
    }
    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }
    /// Whether the ring has no buffers (never: [`new`](Self::new) makes at least one).
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }
    /// State of buffer `b`.
    pub fn state(&self, b: usize) -> StagingState {
        self.buffers[b]
    }

    fn err(&self, buffer: usize, action: &'static str) -> StagingError {
        StagingError { buffer, action, state: self.buffers[buffer] }
    }

    /// The buffer the next read goes to (in turn), and whether the copies of its last load must complete first.
    pub fn next(&self) -> NextBuffer {
        match self.buffers[self.next] {
            StagingState::Queued { ticket } => NextBuffer::AfterCopies(self.next, ticket),
            _ => NextBuffer::Free(self.next),
        }
    }

    /// `Free → Filling(ticket)` for the buffer [`next`](Self::next) named; the turn moves on.
    pub fn begin_fill(&mut self, b: usize, ticket: Ticket) -> Result<(), StagingError> {
        if b != self.next || self.buffers[b] != StagingState::Free {
            return Err(self.err(b, "be filled"));
        }
        self.buffers[b] = StagingState::Filling { ticket };
        self.next = (b + 1) % self.buffers.len();
        Ok(())
    }

    /// `Filling(ticket) → Queued(ticket)`: the copies reading the buffer are enqueued, their event recorded.
    pub fn queued(&mut self, b: usize, ticket: Ticket) -> Result<(), StagingError> {
        if self.buffers[b] != (StagingState::Filling { ticket }) {
            return Err(self.err(b, "be queued"));
        }
        self.buffers[b] = StagingState::Queued { ticket };
        Ok(())
    }

    /// `Queued(ticket) → Free`: the completion of the copies of load `ticket` was observed.
    pub fn completed(&mut self, b: usize, ticket: Ticket) -> Result<(), StagingError> {
        if self.buffers[b] != (StagingState::Queued { ticket }) {
            return Err(self.err(b, "complete"));
        }
        self.buffers[b] = StagingState::Free;
        Ok(())
    }

    /// `Filling(ticket) → Free`: the read failed, or its copies could not be enqueued (nothing reads the buffer).
    pub fn abandoned(&mut self, b: usize, ticket: Ticket) -> Result<(), StagingError> {
        if self.buffers[b] != (StagingState::Filling { ticket }) {
            return Err(self.err(b, "be abandoned"));
        }
        self.buffers[b] = StagingState::Free;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_used_in_turn_and_refilled_only_after_their_copies_completed() {
        let mut r = StagingRing::new(2);
        assert_eq!(r.next(), NextBuffer::Free(0));
        r.begin_fill(0, 1).unwrap();
        r.queued(0, 1).unwrap();
        assert_eq!(r.next(), NextBuffer::Free(1));
        r.begin_fill(1, 2).unwrap();
        r.queued(1, 2).unwrap();
        // Buffer 0's copies may still be reading it.
        assert_eq!(r.next(), NextBuffer::AfterCopies(0, 1));
        assert_eq!(
            r.begin_fill(0, 3).unwrap_err().to_string(),
            "staging buffer 0 cannot be filled while Queued (Queued { ticket: 1 })"
        );
        r.completed(0, 1).unwrap();
        assert_eq!(r.next(), NextBuffer::Free(0));
        r.begin_fill(0, 3).unwrap();
        assert_eq!(r.state(0), StagingState::Filling { ticket: 3 });
    }

    #[test]
    fn stale_tickets_and_out_of_turn_fills_are_rejected() {
        let mut r = StagingRing::new(2);
        assert!(r.begin_fill(1, 1).is_err(), "not its turn");
        r.begin_fill(0, 1).unwrap();
        assert!(r.queued(0, 2).is_err(), "another load's ticket");
        assert!(r.completed(0, 1).is_err(), "nothing enqueued yet");
        r.queued(0, 1).unwrap();
        assert!(r.abandoned(0, 1).is_err(), "its copies are enqueued: only their completion frees it");
        assert!(r.completed(0, 7).is_err(), "stale ticket");
        r.completed(0, 1).unwrap();
        assert_eq!(r.state(0), StagingState::Free);
    }

    #[test]
    fn a_failed_read_gives_its_buffer_back_at_once() {
        let mut r = StagingRing::new(1);
        r.begin_fill(0, 4).unwrap();
        r.abandoned(0, 4).unwrap();
        assert_eq!(r.next(), NextBuffer::Free(0));
        r.begin_fill(0, 5).unwrap();
        assert_eq!(r.len(), 1);
    }
}
