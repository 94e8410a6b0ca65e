//! The hazard detector: proves (on the runs it observes) that no op touches memory that an earlier-enqueued,
//! not-yet-completed op on another stream conflicts with.
//!
//! Every copy and kernel receives a global program-order sequence number when it is enqueued and declares the byte
//! ranges it reads and writes. It stays in the in-flight list from enqueue until it completes (or is skipped).
//! When an op starts executing, every in-flight op with a lower sequence number on a *different* stream (ops on
//! one stream are ordered by the stream itself) whose ranges overlap it, with at least one side writing, is a
//! violation: the later op was not ordered after the earlier one. Host-side accesses (`read_host`, `write_host`,
//! `read_device`, `write_device`) and frees are checked the same way against everything in flight.
//!
//! Invariant: an entry leaves the in-flight list before its stream reports the op complete (to event records
//! behind it and to `stream_synchronize`), so correctly ordered work never reports a violation.

use crate::platform::{DeviceBufferId, HostBufferId, StreamId};
use crate::sync::{lock, Mutex};
use std::collections::BTreeMap;
use std::ops::Range;

/// A device range a kernel declares it touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access {
    /// The buffer.
    pub buffer: DeviceBufferId,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// Whether the kernel writes it (otherwise it only reads).
    pub write: bool,
}

impl Access {
    /// A read of `buffer[offset..offset+len]`.
    pub fn read(buffer: DeviceBufferId, offset: u64, len: u64) -> Access {
        Access { buffer, offset, len, write: false }
    }

    /// A write (or read-modify-write) of `buffer[offset..offset+len]`.
    pub fn write(buffer: DeviceBufferId, offset: u64, len: u64) -> Access {
        Access { buffer, offset, len, write: true }
    }
}

/// A buffer a violation concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferRef {
    /// Device memory.
    Device(DeviceBufferId),
    /// Host memory.
    Host(HostBufferId),
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HazardKind {
    /// The later op reads what an earlier, still pending op writes (use before the copy landed).
    ReadBeforeReady,
    /// The later op writes what an earlier, still pending op reads (overwrite before the last use finished).
    OverwriteBeforeLastUse,
    /// Both write the same bytes without ordering.
    WriteWriteRace,
    /// A buffer was freed while an op touching it was still pending.
    FreeBeforeLastUse,
}

/// Identity of an op in a violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpInfo {
    /// Global program-order sequence number (assigned at enqueue, or at the call for host-side accesses).
    pub seq: u64,
    /// The stream it was enqueued on; `None` for host-side accesses and frees.
    pub stream: Option<StreamId>,
    /// The stream's name, or `"host"`.
    pub stream_name: String,
    /// What the op is (kernel label, copy description, or the host call's name).
    pub label: String,
}

/// One detected ordering violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HazardViolation {
    /// What went wrong.
    pub kind: HazardKind,
    /// The op enqueued first, still pending.
    pub earlier: OpInfo,
    /// The op that started (or the host call made) while `earlier` was pending.
    pub later: OpInfo,
    /// The buffer involved.
    pub buffer: BufferRef,
    /// The conflicting bytes (for a free: the bytes the pending op touches).
    pub range: Range<u64>,
}

/// A byte range an op touches (device or host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Touch {
    pub(crate) buffer: BufferRef,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) write: bool,
}

impl Touch {
    fn range(&self) -> Range<u64> {
        self.offset..self.offset.saturating_add(self.len)
    }

    /// The overlapping bytes of two touches of the same buffer, if any.
    fn overlap(&self, other: &Touch) -> Option<Range<u64>> {
        if self.buffer != other.buffer {
            return None;
        }
        let (a, b) = (self.range(), other.range());
        let start = a.start.max(b.start);
        let end = a.end.min(b.end);
        (start < end).then_some(start..end)
    }
}

struct InFlight {
    info: OpInfo,
    touches: Vec<Touch>,
}

struct HazardState {
    next_seq: u64,
    in_flight: BTreeMap<u64, InFlight>,
    violations: Vec<HazardViolation>,
}

/// The in-flight list and the recorded violations.
pub(crate) struct HazardTracker {
    state: Mutex<HazardState>,
}

/// Which conflict two touches form, the earlier one first; `None` when neither writes.
fn classify(earlier: &Touch, later: &Touch) -> Option<HazardKind> {
    match (earlier.write, later.write) {
        (true, true) => Some(HazardKind::WriteWriteRace),
        (true, false) => Some(HazardKind::ReadBeforeReady),
        (false, true) => Some(HazardKind::OverwriteBeforeLastUse),
        (false, false) => None,
    }
}

/// Appends a violation for every conflicting pair between `earlier` and `later`.
fn conflicts(out: &mut Vec<HazardViolation>, earlier: &InFlight, later_info: &OpInfo, later: &[Touch]) {
    for e in &earlier.touches {
        for l in later {
            if let (Some(kind), Some(range)) = (classify(e, l), e.overlap(l)) {
                out.push(HazardViolation {
                    kind,
                    earlier: earlier.info.clone(),
                    later: later_info.clone(),
                    buffer: e.buffer,
                    range,
                });
            }
        }
    }
}

fn host_info(seq: u64, label: &str) -> OpInfo {
    OpInfo { seq, stream: None, stream_name: "host".to_string(), label: label.to_string() }
}

impl HazardTracker {
    /// Nothing in flight, nothing recorded.
    pub(crate) fn new() -> Self {
        HazardTracker {
            state: Mutex::new(HazardState { next_seq: 0, in_flight: BTreeMap::new(), violations: Vec::new() }),
        }
    }

    /// Registers an op being enqueued on `stream`; returns its sequence number.
    pub(crate) fn register(&self, stream: StreamId, stream_name: &str, label: String, touches: Vec<Touch>) -> u64 {
        let mut st = lock(&self.state);
        let seq = st.next_seq;
        st.next_seq += 1;
        let info = OpInfo { seq, stream: Some(stream), stream_name: stream_name.to_string(), label };
        st.in_flight.insert(seq, InFlight { info, touches });
        seq
    }

    /// Op `seq` starts executing: checks it against every earlier pending op on other streams.
    pub(crate) fn start(&self, seq: u64) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(op) = st.in_flight.get(&seq) else { return };
        for earlier in st.in_flight.range(..seq).map(|(_, e)| e) {
            if earlier.info.stream != op.info.stream {
                conflicts(&mut st.violations, earlier, &op.info, &op.touches);
            }
        }
    }

    /// Op `seq` completed (or was skipped or abandoned): it leaves the in-flight list.
    pub(crate) fn complete(&self, seq: u64) {
        lock(&self.state).in_flight.remove(&seq);
    }

    /// A synchronous host-side access (`label` names the call): checked against everything in flight.
    pub(crate) fn host_access(&self, label: &str, touch: Touch) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        if st.in_flight.is_empty() {
            return;
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let info = host_info(seq, label);
        for earlier in st.in_flight.values() {
            conflicts(&mut st.violations, earlier, &info, std::slice::from_ref(&touch));
        }
    }

    /// `buffer` is being freed by `label`: every pending op touching it is a violation.
    pub(crate) fn free(&self, label: &str, buffer: BufferRef) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let seq = st.next_seq;
        st.next_seq += 1;
        let info = host_info(seq, label);
        for earlier in st.in_flight.values() {
            for t in earlier.touches.iter().filter(|t| t.buffer == buffer && t.len > 0) {
                st.violations.push(HazardViolation {
                    kind: HazardKind::FreeBeforeLastUse,
                    earlier: earlier.info.clone(),
                    later: info.clone(),
                    buffer,
                    range: t.range(),
                });
            }
        }
    }

    /// A copy of the recorded violations.
    pub(crate) fn violations(&self) -> Vec<HazardViolation> {
        lock(&self.state).violations.clone()
    }

    /// Returns and clears the recorded violations.
    pub(crate) fn take_violations(&self) -> Vec<HazardViolation> {
        std::mem::take(&mut lock(&self.state).violations)
    }
}
