//! The execution trace: one record per executed copy, kernel and stream wait.
//!
//! Invariant: records are appended in the order ops finish; nothing is recorded (and no record is built) while
//! tracing is off.

use crate::platform::HostBufferId;
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{lock, Mutex};
use std::time::Duration;

/// What a trace record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceKind {
    /// A host→device copy.
    H2d,
    /// A device→host copy.
    D2h,
    /// A compute kernel launched with `SimPlatform::launch`.
    Kernel,
    /// A stream blocked on an event.
    Wait,
}

/// One executed op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// Name of the stream that executed it.
    pub stream_name: String,
    /// Kind of op.
    pub kind: TraceKind,
    /// Label (kernel label, or a description of the copy or wait).
    pub label: String,
    /// When it started, since the platform was created.
    pub start: Duration,
    /// How long it ran (or, for a wait, how long the stream was blocked).
    pub duration: Duration,
    /// Bytes moved (0 for kernels and waits).
    pub bytes: u64,
    /// The host side of a copy (its source for host→device, its destination for device→host); `None` for kernels
    /// and waits. Lets a trace writer name a copy by what the buffer holds.
    pub host_buffer: Option<HostBufferId>,
}

/// The trace buffer and its on/off switch.
pub(crate) struct TraceLog {
    enabled: AtomicBool,
    events: Mutex<Vec<TraceEvent>>,
}

impl TraceLog {
    /// An empty log, recording if `enabled`.
    pub(crate) fn new(enabled: bool) -> Self {
        TraceLog { enabled: AtomicBool::new(enabled), events: Mutex::new(Vec::new()) }
    }

    /// Turns recording on or off.
    pub(crate) fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
    }

    /// Appends the record built by `make`, if recording.
    pub(crate) fn record(&self, make: impl FnOnce() -> TraceEvent) {
        if self.enabled.load(Ordering::Relaxed) {
            let event = make();
            lock(&self.events).push(event);
        }
    }

    /// A copy of all records.
    pub(crate) fn snapshot(&self) -> Vec<TraceEvent> {
        lock(&self.events).clone()
    }

    /// Drops all records.
    pub(crate) fn clear(&self) {
        lock(&self.events).clear();
    }
}
