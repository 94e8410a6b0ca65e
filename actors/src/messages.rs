//! Messages exchanged by the actors: load (prefetch or synchronous fetch), fence, completion, shutdown.
//!
//! A load names its ticket, the events its copies must wait for (the slot's last-use event), the flat copies, and
//! the ready event to record after them. The stream actor publishes "recorded" on the ticket board of the stack
//! that sent it, and its completion watcher reports "completed" through the stack's unbounded mailbox.

use crate::platform::{BlockFile, DeviceBufferId, EventId, HostBufferId, PlatformError};
use crate::slot::Ticket;
use crate::sync::mailbox::Sender;
use crate::sync::{lock, Arc, Condvar, Mutex};

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// Host master → device slot.
    HostToDevice,
    /// Device → host.
    DeviceToHost,
}

/// One flat copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Direction.
    pub direction: CopyDirection,
    /// Host buffer.
    pub host: HostBufferId,
    /// Offset in the host buffer.
    pub host_offset: u64,
    /// Device buffer.
    pub device: DeviceBufferId,
    /// Offset in the device buffer.
    pub device_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A load request: wait, copy, record.
#[derive(Debug)]
pub struct LoadCmd {
    /// Ticket of the load (monotonic per board).
    pub ticket: Ticket,
    /// Slot index it targets (`usize::MAX` for a resident-head buffer), echoed in the completion.
    pub target: usize,
    /// Block (unit) index being loaded, echoed in the completion so errors name it.
    pub block: usize,
    /// Events the copies must wait for (GPU-side).
    pub waits: Vec<EventId>,
    /// The copies.
    pub copies: Vec<CopyOp>,
    /// Event recorded after the copies.
    pub ready: EventId,
    /// A second event recorded after the copies, for a load read from disk: the staging buffer's, whose completion
    /// frees the buffer for the next read (see [`crate::staging`]). `None` for a load from host memory.
    pub staged: Option<EventId>,
    /// Where "recorded" is published.
    pub board: Arc<TicketBoard>,
    /// Where "completed" is reported.
    pub notify: Option<Sender<Completion>>,
}

/// The host buffer a block spec's segment names when it copies from the staging buffer its reads fill: the reader
/// puts in the buffer it filled (a segment naming another buffer, a master, keeps it).
pub const STAGING_HOST: HostBufferId = HostBufferId(u64::MAX);

/// A read of a block's bytes from its checkpoint file into the staging buffer its load copies from.
#[derive(Debug, Clone)]
pub struct FileRead {
    /// The file.
    pub file: std::sync::Arc<dyn BlockFile>,
    /// Offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Offset in the staging buffer of the range's first byte (the copies' `host_offset`s are offsets in that buffer
    /// too); at least `offset % DIRECT_READ_ALIGN`, the start of its [`window`](FileRead::window).
    pub staging_offset: u64,
}

impl FileRead {
    /// The window of the staging buffer this read fills: its start (`staging_offset` less the offset's distance past
    /// a [`DIRECT_READ_ALIGN`](crate::platform::DIRECT_READ_ALIGN) boundary) and length
    /// ([`read_window_len`](crate::platform::read_window_len)). A layout keeps the windows of one buffer apart and,
    /// for direct reads, starts them at aligned offsets.
    pub fn window(&self) -> (u64, u64) {
        let start = self.staging_offset - self.offset % crate::platform::DIRECT_READ_ALIGN;
        (start, crate::platform::read_window_len(self.offset, self.len))
    }
}

impl PartialEq for FileRead {
    /// The same range of the same file (the same object), into the same place.
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.file, &other.file)
            && (self.offset, self.len, self.staging_offset) == (other.offset, other.len, other.staging_offset)
    }
}

impl Eq for FileRead {}

/// A message to a stream actor.
#[derive(Debug)]
pub enum StreamCmd {
    /// Enqueue a load.
    Load(LoadCmd),
    /// Reply once all work enqueued before it has completed.
    Fence {
        /// Reply channel.
        reply: Sender<Result<(), PlatformError>>,
    },
    /// Stop after draining earlier messages.
    Shutdown,
}

/// A load's completion, observed by the stream actor's watcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The load's ticket.
    pub ticket: Ticket,
    /// Its target slot.
    pub target: usize,
    /// The block it loaded.
    pub block: usize,
    /// Whether it succeeded.
    pub result: Result<(), PlatformError>,
}

#[derive(Debug, Default)]
struct BoardState {
    recorded_upto: Ticket,
    failed: Vec<(Ticket, PlatformError)>,
}

/// Per-stack record of which loads have their ready event recorded (so compute may be ordered behind it).
///
/// Loads of one board go through one stream actor, which handles them in FIFO order, so "recorded" is a watermark.
#[derive(Debug, Default)]
pub struct TicketBoard {
    state: Mutex<BoardState>,
    cond: Condvar,
}

impl TicketBoard {
    /// A board with nothing recorded.
    pub fn new() -> Self {
        Self::default()
    }
    /// Publishes that `ticket` (and every earlier ticket) has been enqueued, with its enqueue result.
    pub fn publish(&self, ticket: Ticket, result: Result<(), PlatformError>) {
        let mut st = lock(&self.state);
        if let Err(e) = result {
            st.failed.push((ticket, e));
        }
        if ticket > st.recorded_upto {
            st.recorded_upto = ticket;
        }
        drop(st);
        self.cond.notify_all();
    }
    /// Whether `ticket` has been published, and its result.
    pub fn poll(&self, ticket: Ticket) -> Option<Result<(), PlatformError>> {
        let st = lock(&self.state);
        Self::result_of(&st, ticket)
    }
    fn result_of(st: &BoardState, ticket: Ticket) -> Option<Result<(), PlatformError>> {
        if st.recorded_upto < ticket {
            return None;
        }
        Some(match st.failed.iter().find(|(t, _)| *t == ticket) {
            Some((_, e)) => Err(e.clone()),
            None => Ok(()),
        })
    }
    /// Blocks until `ticket` is published; returns its enqueue result. `alive` is checked while waiting so a
    /// stopped actor cannot hang the caller.
    pub fn wait(&self, ticket: Ticket, alive: &dyn Fn() -> bool) -> Option<Result<(), PlatformError>> {
        let mut st = lock(&self.state);
        loop {
            if let Some(r) = Self::result_of(&st, ticket) {
                return Some(r);
            }
            if !alive() {
                return None;
            }
            st = match self.cond.wait(st) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }
    /// Wakes every waiter (used when an actor stops).
    pub fn wake_all(&self) {
        let _st = lock(&self.state);
        self.cond.notify_all();
    }
}
