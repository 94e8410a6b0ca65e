//! The hazard detector: decides from the *order* the streams, events and host synchronisations establish — not from
//! which op happened to finish first — whether two ops that touch the same bytes (at least one writing) are ordered.
//!
//! **Device ops (copies and kernels) against each other: happens-before by vector clocks.** Every stream has a vector
//! clock (one counter per stream). Enqueuing an op on stream `s` ticks `s`'s own counter; the op's epoch is
//! `(s, counter)` and it is ordered after exactly the ops whose epochs the stream's clock covers at that moment.
//! `record_event(e, s)` stores `s`'s clock in `e` (the clock at record time; a re-record replaces it, as in CUDA only
//! the most recent record counts); `stream_wait_event(t, e)` joins `e`'s stored clock into `t`'s clock (the record
//! current at the call). Host synchronisation orders later enqueues too, but only where it is a point of the
//! program, never an observation of timing:
//! - `stream_synchronize(s)` and `destroy_stream(s)` join `s`'s clock (as of the call) into the host clock that every
//!   later enqueue, from any thread, joins. (The scheduler fences through its actors: the thread that asked for a
//!   fence waits for the actor's answer before it enqueues anything that relies on it.)
//! - `event_synchronize(e)` joins `e`'s clock into the calling thread's clock only, which only that thread's later
//!   enqueues join (so a completion watcher waiting for a copy orders nothing the engine enqueues).
//! - `event_query` orders nothing, even when it returns true: a poll that happens to see a copy finished must not
//!   hide a missing wait.
//!
//! Each op is checked when it is enqueued, against a shadow of every buffer (per byte range: the last writer and the
//! last reader of each stream since that write, FastTrack style): a read not ordered after the last write is
//! [`HazardKind::ReadBeforeReady`], a write not ordered after a read since the last write
//! [`HazardKind::OverwriteBeforeLastUse`], a write not ordered after the last write
//! [`HazardKind::WriteWriteRace`]. Enqueue order is consistent with happens-before (an op can only be ordered after
//! ops enqueued before it), so whenever two conflicting ops are unordered a violation is reported, on every run,
//! however fast or slow either one runs.
//!
//! **Host-side accesses and frees, the same way.** `read_host`, `write_host`, `read_device`, `write_device` and the
//! frees are checked against the shadow with what the calling thread is ordered after (the host clock joined with
//! its own): a host read of bytes whose last write the host never synchronised with is
//! [`HazardKind::ReadBeforeReady`], even if that copy happened to finish; a free of a buffer with any such op is
//! [`HazardKind::FreeBeforeLastUse`]. A host call completes before it returns, so everything enqueued after it is
//! ordered after it: a host write clears its range, a host read leaves nothing to check later ops against.
//!
//! Limits: the detector cannot see how host threads hand work to each other (mailboxes, ticket boards), which is
//! why a `stream_synchronize` counts for every thread; a thread enqueuing, at the same time and without any relation
//! to it, work that conflicts with what another thread just drained is taken as ordered (a missed report).
//! Conversely an `event_synchronize` orders its own thread only, so work another thread enqueued on the strength of
//! it, told through a message, would be reported (the scheduler and the engines here never do that: their
//! hand-offs go through fences, that is `stream_synchronize`, or through events the device waits on). The
//! scheduler's own choices (whether a block was prefetched or fetched on demand) may depend on
//! timing; for a given sequence of calls the reports do not.
//!
//! Invariants: the detector never looks at whether an op has run, only at the order the program established, so
//! the same calls report the same violations however fast or slow the streams are; its memory is bounded by the
//! live streams, events, threads and buffers: a destroyed stream's counter leaves every clock (it was joined into
//! the host clock, so everything enqueued later is ordered after its ops) and its epochs leave the shadow; a freed
//! buffer's shadow goes with it.

use crate::platform::{DeviceBufferId, EventId, HostBufferId, StreamId};
use crate::sync::{lock, Mutex};
use std::cell::RefCell;
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufferRef {
    /// Device memory.
    Device(DeviceBufferId),
    /// Host memory.
    Host(HostBufferId),
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HazardKind {
    /// The later op (or host call) reads what an earlier op writes without being ordered after it (use before the
    /// copy landed).
    ReadBeforeReady,
    /// The later op (or host call) writes what an earlier op reads without being ordered after it (overwrite before
    /// the last use finished).
    OverwriteBeforeLastUse,
    /// Both write the same bytes without ordering.
    WriteWriteRace,
    /// A buffer was freed without the host being ordered after an op touching it.
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
    /// The op enqueued first, the one `later` is not ordered after.
    pub earlier: OpInfo,
    /// The op enqueued (or the host call made) without being ordered after `earlier`.
    pub later: OpInfo,
    /// The buffer involved.
    pub buffer: BufferRef,
    /// The conflicting bytes (for a free: the bytes of the buffer the unordered op touched).
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
}

/// A vector clock: per stream (by handle), the count of its ops covered. Sorted by stream; absent means 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Clock(Vec<(u32, u64)>);

impl Clock {
    fn get(&self, stream: u32) -> u64 {
        self.0.binary_search_by_key(&stream, |&(s, _)| s).map_or(0, |i| self.0[i].1)
    }

    /// Ticks `stream`'s own counter; returns the new count (the epoch of the op being enqueued).
    fn tick(&mut self, stream: u32) -> u64 {
        match self.0.binary_search_by_key(&stream, |&(s, _)| s) {
            Ok(i) => {
                self.0[i].1 += 1;
                self.0[i].1
            }
            Err(i) => {
                self.0.insert(i, (stream, 1));
                1
            }
        }
    }

    /// The pointwise maximum with `other`, keeping only streams `keep` accepts.
    fn join_if(&mut self, other: &Clock, keep: impl Fn(u32) -> bool) {
        for &(s, n) in &other.0 {
            if !keep(s) {
                continue;
            }
            match self.0.binary_search_by_key(&s, |&(t, _)| t) {
                Ok(i) => self.0[i].1 = self.0[i].1.max(n),
                Err(i) => self.0.insert(i, (s, n)),
            }
        }
    }

    fn join(&mut self, other: &Clock) {
        self.join_if(other, |_| true);
    }

    fn forget(&mut self, stream: u32) {
        self.0.retain(|&(s, _)| s != stream);
    }
}

/// An op's place in its stream, with who it is (for reports).
#[derive(Debug, Clone)]
struct Epoch {
    stream: u32,
    at: u64,
    op: std::sync::Arc<OpInfo>,
}

impl Epoch {
    /// Whether this op is ordered before anything enqueued under `clock`.
    fn before(&self, clock: &Clock) -> bool {
        self.at <= clock.get(self.stream)
    }
    fn same(&self, other: &Epoch) -> bool {
        self.stream == other.stream && self.at == other.at
    }
}

/// What the shadow knows of one byte range: its last writer and, per stream, its last reader since that write.
#[derive(Debug, Clone)]
struct Seg {
    range: Range<u64>,
    write: Option<Epoch>,
    /// Sorted by stream, one per stream (a later read on one stream is ordered after its earlier ones).
    reads: Vec<Epoch>,
}

impl Seg {
    fn empty(range: Range<u64>) -> Seg {
        Seg { range, write: None, reads: Vec::new() }
    }
    fn with_range(&self, range: Range<u64>) -> Seg {
        Seg { range, ..self.clone() }
    }
    fn same_state(&self, other: &Seg) -> bool {
        let w = match (&self.write, &other.write) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same(b),
            _ => false,
        };
        w && self.reads.len() == other.reads.len() && self.reads.iter().zip(&other.reads).all(|(a, b)| a.same(b))
    }
    fn is_blank(&self) -> bool {
        self.write.is_none() && self.reads.is_empty()
    }
}

/// Applies `f`, in address order, to every part of `r` in `segs` (sorted, disjoint), creating blank parts where
/// nothing was known, then merges neighbours that know the same and drops blank ones.
fn apply(segs: &mut Vec<Seg>, r: Range<u64>, mut f: impl FnMut(&mut Seg)) {
    // Fast paths: nothing known yet, or exactly one known part (ops of one layout touch the same ranges again).
    if segs.is_empty() {
        let mut seg = Seg::empty(r);
        f(&mut seg);
        if !seg.is_blank() {
            segs.push(seg);
        }
        return;
    }
    if let Ok(i) = segs.binary_search_by_key(&r.start, |s| s.range.start) {
        if segs[i].range.end == r.end {
            f(&mut segs[i]);
            return;
        }
    }
    let mut out: Vec<Seg> = Vec::with_capacity(segs.len() + 3);
    let mut pos = r.start;
    for mut seg in std::mem::take(segs) {
        if seg.range.end <= r.start {
            out.push(seg);
            continue;
        }
        if seg.range.start >= r.end {
            if pos < r.end {
                let mut gap = Seg::empty(pos..r.end);
                f(&mut gap);
                out.push(gap);
                pos = r.end;
            }
            out.push(seg);
            continue;
        }
        if seg.range.start < r.start {
            out.push(seg.with_range(seg.range.start..r.start));
            seg.range.start = r.start;
        }
        if pos < seg.range.start {
            let mut gap = Seg::empty(pos..seg.range.start);
            f(&mut gap);
            out.push(gap);
        }
        let tail = (seg.range.end > r.end).then(|| seg.with_range(r.end..seg.range.end));
        seg.range.end = seg.range.end.min(r.end);
        f(&mut seg);
        pos = seg.range.end;
        out.push(seg);
        out.extend(tail);
    }
    if pos < r.end {
        let mut gap = Seg::empty(pos..r.end);
        f(&mut gap);
        out.push(gap);
    }
    let mut merged: Vec<Seg> = Vec::with_capacity(out.len());
    for seg in out.into_iter().filter(|s| !s.is_blank()) {
        match merged.last_mut() {
            Some(last) if last.range.end == seg.range.start && last.same_state(&seg) => last.range.end = seg.range.end,
            _ => merged.push(seg),
        }
    }
    *segs = merged;
}

/// The happens-before state: clocks of the live streams, of the events' latest records, of the host.
#[derive(Default)]
struct Order {
    streams: BTreeMap<u32, Clock>,
    events: BTreeMap<u32, Clock>,
    /// What every thread's later enqueues are ordered after (`stream_synchronize`, `destroy_stream`).
    host: Clock,
    shadow: BTreeMap<BufferRef, Vec<Seg>>,
}

struct HazardState {
    next_seq: u64,
    violations: Vec<HazardViolation>,
    order: Order,
}

/// The detector of one platform: the happens-before state, the in-flight list and the recorded violations.
pub(crate) struct HazardTracker {
    state: Mutex<HazardState>,
    /// Names this tracker in the threads' own clocks (a `std` `Arc`: only its identity and liveness matter).
    token: std::sync::Arc<()>,
}

thread_local! {
    /// Per tracker (by its token), what `event_synchronize` calls on this thread observed: this thread's later
    /// enqueues are ordered after it. Freed with the thread; entries of dropped trackers are pruned on use. (Under
    /// loom the model threads share it, which can only add ordering; the loom models run their own platform.)
    static THREAD_CLOCKS: RefCell<Vec<(std::sync::Weak<()>, Clock)>> = const { RefCell::new(Vec::new()) };
}

/// Records `kind` between `earlier` and `later` over `range`, extending the previous violation when it is the same
/// pair and kind on the same buffer (one access checked against several shadow parts).
fn report(
    out: &mut Vec<HazardViolation>,
    kind: HazardKind,
    earlier: &Epoch,
    later: &OpInfo,
    buffer: BufferRef,
    range: Range<u64>,
) {
    if let Some(last) = out.last_mut() {
        if last.kind == kind
            && last.earlier.seq == earlier.op.seq
            && last.later.seq == later.seq
            && last.buffer == buffer
        {
            last.range.start = last.range.start.min(range.start);
            last.range.end = last.range.end.max(range.end);
            return;
        }
    }
    out.push(HazardViolation { kind, earlier: (*earlier.op).clone(), later: later.clone(), buffer, range });
}

fn host_info(seq: u64, label: &str) -> OpInfo {
    OpInfo { seq, stream: None, stream_name: "host".to_string(), label: label.to_string() }
}

impl HazardTracker {
    /// Nothing in flight, nothing recorded, no stream.
    pub(crate) fn new() -> Self {
        HazardTracker {
            state: Mutex::new(HazardState { next_seq: 0, violations: Vec::new(), order: Order::default() }),
            token: std::sync::Arc::new(()),
        }
    }

    /// Runs `f` on the calling thread's clock for this tracker (creating it when `create`); `None` when there is
    /// none (or the thread is exiting).
    fn with_thread_clock<R>(&self, create: bool, f: impl FnOnce(&mut Clock) -> R) -> Option<R> {
        THREAD_CLOCKS
            .try_with(|cell| {
                let mut clocks = cell.borrow_mut();
                clocks.retain(|(w, _)| w.strong_count() > 0);
                let mine = std::sync::Arc::downgrade(&self.token);
                let i = match clocks.iter().position(|(w, _)| w.ptr_eq(&mine)) {
                    Some(i) => i,
                    None if create => {
                        clocks.push((mine, Clock::default()));
                        clocks.len() - 1
                    }
                    None => return None,
                };
                Some(f(&mut clocks[i].1))
            })
            .ok()
            .flatten()
    }

    /// A stream was created: its clock starts empty.
    pub(crate) fn stream_created(&self, stream: StreamId) {
        lock(&self.state).order.streams.insert(stream.0, Clock::default());
    }

    /// A stream was destroyed, after everything on it completed (`destroy_stream` waited): the host is ordered after
    /// its ops, so its counter leaves every clock and its epochs leave the shadow.
    pub(crate) fn stream_destroyed(&self, stream: StreamId) {
        let mut st = lock(&self.state);
        let o = &mut st.order;
        let s = stream.0;
        o.streams.remove(&s);
        for c in o.streams.values_mut().chain(o.events.values_mut()) {
            c.forget(s);
        }
        o.host.forget(s);
        for segs in o.shadow.values_mut() {
            for seg in segs.iter_mut() {
                if seg.write.as_ref().is_some_and(|w| w.stream == s) {
                    seg.write = None;
                }
                seg.reads.retain(|r| r.stream != s);
            }
            segs.retain(|seg| !seg.is_blank());
        }
        o.shadow.retain(|_, segs| !segs.is_empty());
    }

    /// The clock of `stream` now, joined with the host's and the calling thread's (what an op enqueued now on it
    /// is ordered after, before its own tick).
    fn stream_clock_now(&self, o: &mut Order, stream: u32) -> Clock {
        let mut c = o.streams.get(&stream).cloned().unwrap_or_default();
        c.join(&o.host);
        let live = &o.streams;
        self.with_thread_clock(false, |t| {
            // Destroyed streams leave this thread's clock too (the host is ordered after their ops).
            t.0.retain(|&(s, _)| live.contains_key(&s));
            c.join(t);
        });
        c
    }

    /// Registers an op being enqueued on `stream` (called under the stream queue's lock, so the detector's order of
    /// one stream is the queue's): checks it against the shadow of every buffer it touches, then puts it in
    /// flight. Returns its sequence number.
    pub(crate) fn register(&self, stream: StreamId, stream_name: &str, label: String, touches: Vec<Touch>) -> u64 {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let seq = st.next_seq;
        st.next_seq += 1;
        let info =
            std::sync::Arc::new(OpInfo { seq, stream: Some(stream), stream_name: stream_name.to_string(), label });
        let mut clock = self.stream_clock_now(&mut st.order, stream.0);
        let at = clock.tick(stream.0);
        let epoch = Epoch { stream: stream.0, at, op: info.clone() };
        for t in touches.iter().filter(|t| t.len > 0) {
            let segs = st.order.shadow.entry(t.buffer).or_default();
            let out = &mut st.violations;
            apply(segs, t.range(), |seg| {
                if let Some(w) = seg.write.as_ref().filter(|w| !w.before(&clock)) {
                    let kind = if t.write { HazardKind::WriteWriteRace } else { HazardKind::ReadBeforeReady };
                    report(out, kind, w, &info, t.buffer, seg.range.clone());
                }
                if t.write {
                    for r in seg.reads.iter().filter(|r| !r.before(&clock)) {
                        report(out, HazardKind::OverwriteBeforeLastUse, r, &info, t.buffer, seg.range.clone());
                    }
                    seg.write = Some(epoch.clone());
                    seg.reads.clear();
                } else {
                    match seg.reads.binary_search_by_key(&epoch.stream, |r| r.stream) {
                        Ok(i) => seg.reads[i] = epoch.clone(),
                        Err(i) => seg.reads.insert(i, epoch.clone()),
                    }
                }
            });
        }
        st.order.streams.insert(stream.0, clock);
        seq
    }

    /// `record_event(event, stream)` is being enqueued (under the queue's lock): the event now carries the stream's
    /// clock.
    pub(crate) fn record(&self, stream: StreamId, event: EventId) {
        let mut st = lock(&self.state);
        let clock = self.stream_clock_now(&mut st.order, stream.0);
        st.order.streams.insert(stream.0, clock.clone());
        st.order.events.insert(event.0, clock);
    }

    /// `stream_wait_event(stream, event)` is being enqueued (under the queue's lock): the stream's later ops are
    /// ordered after the event's latest record.
    pub(crate) fn wait(&self, stream: StreamId, event: EventId) {
        let mut st = lock(&self.state);
        let o = &mut st.order;
        let Some(ev) = o.events.get(&event.0) else { return };
        let ev = ev.clone();
        let live = &o.streams;
        let mut c = live.get(&stream.0).cloned().unwrap_or_default();
        c.join_if(&ev, |s| live.contains_key(&s));
        o.streams.insert(stream.0, c);
    }

    /// An event was destroyed: its clock goes.
    pub(crate) fn event_destroyed(&self, event: EventId) {
        lock(&self.state).order.events.remove(&event.0);
    }

    /// The clock of `stream` as of now (what a `stream_synchronize` called now waits for).
    pub(crate) fn stream_clock(&self, stream: StreamId) -> Clock {
        lock(&self.state).order.streams.get(&stream.0).cloned().unwrap_or_default()
    }

    /// The clock of `event`'s latest record as of now (what an `event_synchronize` called now waits for).
    pub(crate) fn event_clock(&self, event: EventId) -> Clock {
        lock(&self.state).order.events.get(&event.0).cloned().unwrap_or_default()
    }

    /// A `stream_synchronize` returned: every later enqueue, from any thread, is ordered after `clock`.
    pub(crate) fn host_synchronized(&self, clock: &Clock) {
        let mut st = lock(&self.state);
        let o = &mut st.order;
        let live = &o.streams;
        o.host.join_if(clock, |s| live.contains_key(&s));
    }

    /// An `event_synchronize` returned on this thread: this thread's later enqueues are ordered after `clock`.
    pub(crate) fn thread_synchronized(&self, clock: &Clock) {
        if clock.0.is_empty() {
            return;
        }
        self.with_thread_clock(true, |t| t.join(clock));
    }

    /// What a host call on this thread now is ordered after: the host's clock joined with the thread's.
    fn host_clock_now(&self, o: &Order) -> Clock {
        let mut c = o.host.clone();
        let live = &o.streams;
        self.with_thread_clock(false, |t| c.join_if(t, |s| live.contains_key(&s)));
        c
    }

    /// A synchronous host-side access (`label` names the call): every op on its bytes that the host is not ordered
    /// after is a violation (a read against the last write, a write against the last write and the reads since).
    /// The call completes before it returns, so every op enqueued later is ordered after it: a write leaves its
    /// range with nothing to order against, a read leaves no trace.
    pub(crate) fn host_access(&self, label: &str, touch: Touch) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        if touch.len == 0 || !st.order.shadow.contains_key(&touch.buffer) {
            return;
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let info = host_info(seq, label);
        let clock = self.host_clock_now(&st.order);
        let Some(segs) = st.order.shadow.get_mut(&touch.buffer) else { return };
        let out = &mut st.violations;
        apply(segs, touch.range(), |seg| {
            if let Some(w) = seg.write.as_ref().filter(|w| !w.before(&clock)) {
                let kind = if touch.write { HazardKind::WriteWriteRace } else { HazardKind::ReadBeforeReady };
                report(out, kind, w, &info, touch.buffer, seg.range.clone());
            }
            if touch.write {
                for r in seg.reads.iter().filter(|r| !r.before(&clock)) {
                    report(out, HazardKind::OverwriteBeforeLastUse, r, &info, touch.buffer, seg.range.clone());
                }
                seg.write = None;
                seg.reads.clear();
            }
        });
        if segs.is_empty() {
            st.order.shadow.remove(&touch.buffer);
        }
    }

    /// `buffer` is being freed by `label`: every op on it that the host is not ordered after is a violation; its
    /// shadow goes.
    pub(crate) fn free(&self, label: &str, buffer: BufferRef) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(segs) = st.order.shadow.remove(&buffer) else { return };
        let seq = st.next_seq;
        st.next_seq += 1;
        let info = host_info(seq, label);
        let clock = self.host_clock_now(&st.order);
        for seg in &segs {
            for e in seg.write.iter().chain(&seg.reads).filter(|e| !e.before(&clock)) {
                report(&mut st.violations, HazardKind::FreeBeforeLastUse, e, &info, buffer, seg.range.clone());
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

    /// Byte ranges the shadow holds, over all buffers (a test aid: it must stay bounded).
    #[cfg(test)]
    pub(crate) fn shadow_parts(&self) -> usize {
        lock(&self.state).order.shadow.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg_ranges(segs: &[Seg]) -> Vec<(Range<u64>, bool, usize)> {
        segs.iter().map(|s| (s.range.clone(), s.write.is_some(), s.reads.len())).collect()
    }

    fn epoch(stream: u32, at: u64) -> Epoch {
        let op =
            OpInfo { seq: at, stream: Some(StreamId(stream)), stream_name: format!("s{stream}"), label: "op".into() };
        Epoch { stream, at, op: std::sync::Arc::new(op) }
    }

    #[test]
    fn apply_splits_fills_and_merges_ranges() {
        let mut segs = Vec::new();
        let w = epoch(0, 1);
        apply(&mut segs, 10..20, |s| s.write = Some(w.clone()));
        assert_eq!(seg_ranges(&segs), vec![(10..20, true, 0)]);
        let r = epoch(1, 1);
        apply(&mut segs, 5..15, |s| s.reads.push(r.clone()));
        assert_eq!(seg_ranges(&segs), vec![(5..10, false, 1), (10..15, true, 1), (15..20, true, 0)]);
        let w2 = epoch(0, 2);
        apply(&mut segs, 0..30, |s| {
            s.write = Some(w2.clone());
            s.reads.clear();
        });
        assert_eq!(seg_ranges(&segs), vec![(0..30, true, 0)]);
        apply(&mut segs, 40..50, |_| {});
        assert_eq!(seg_ranges(&segs), vec![(0..30, true, 0)], "blank parts are not kept");
    }

    fn dev(buf: u64, write: bool) -> Vec<Touch> {
        vec![Touch { buffer: BufferRef::Device(DeviceBufferId(buf)), offset: 0, len: 8, write }]
    }

    fn kinds(t: &HazardTracker) -> Vec<(HazardKind, u64, u64)> {
        t.take_violations().into_iter().map(|v| (v.kind, v.earlier.seq, v.later.seq)).collect()
    }

    #[test]
    fn a_missing_wait_is_reported_even_after_the_earlier_op_completed() {
        let t = HazardTracker::new();
        let (copy, compute, other) = (StreamId(0), StreamId(1), StreamId(2));
        for s in [copy, compute, other] {
            t.stream_created(s);
        }
        let w = t.register(copy, "copy", "fill".into(), dev(1, true));
        t.record(copy, EventId(1));
        // Nothing here knows whether the copy ran: only the order counts.
        let r = t.register(compute, "compute", "read".into(), dev(1, false));
        assert_eq!(kinds(&t), vec![(HazardKind::ReadBeforeReady, w, r)]);
        // Waiting on the event recorded after the copy orders the next read.
        t.wait(compute, EventId(1));
        t.register(compute, "compute", "read again".into(), dev(1, false));
        assert_eq!(kinds(&t), vec![]);
        // Overwriting without waiting for the reads, then with the wait on their last-use event.
        t.record(compute, EventId(2));
        let w2 = t.register(copy, "copy", "refill".into(), dev(1, true));
        // The later of the two reads on the compute stream is the one reported (the earlier is ordered before it).
        assert_eq!(kinds(&t), vec![(HazardKind::OverwriteBeforeLastUse, r + 1, w2)]);
        t.wait(copy, EventId(2));
        t.register(copy, "copy", "refill after the wait".into(), dev(1, true));
        assert_eq!(kinds(&t), vec![]);
        // A host synchronisation with the copy stream orders every later enqueue, on any stream.
        t.host_synchronized(&t.stream_clock(copy));
        t.register(other, "other", "read after the host synchronised".into(), dev(1, false));
        assert_eq!(kinds(&t), vec![]);
        // An event synchronisation orders only this thread's later enqueues (another buffer: `other` read buffer 1).
        let w3 = t.register(copy, "copy", "third fill".into(), dev(2, true));
        t.record(copy, EventId(3));
        let clock = t.event_clock(EventId(3));
        let r3 = std::thread::scope(|s| {
            s.spawn(|| {
                t.thread_synchronized(&clock);
            });
            s.spawn(|| t.register(compute, "compute", "read on another thread".into(), dev(2, false))).join().unwrap()
        });
        assert_eq!(kinds(&t), vec![(HazardKind::ReadBeforeReady, w3, r3)]);
        t.thread_synchronized(&clock);
        t.register(other, "other", "read on the synchronising thread".into(), dev(2, false));
        assert_eq!(kinds(&t), vec![]);
    }

    #[test]
    fn a_destroyed_stream_leaves_the_clocks_and_the_shadow() {
        let t = HazardTracker::new();
        let (copy, compute) = (StreamId(0), StreamId(1));
        t.stream_created(copy);
        t.stream_created(compute);
        t.register(copy, "copy", "fill".into(), dev(1, true));
        t.register(copy, "copy", "fill".into(), dev(2, true));
        assert_eq!(t.shadow_parts(), 2);
        t.stream_destroyed(copy);
        assert_eq!(t.shadow_parts(), 0);
        // Its ops completed before the destroy returned: reading now is ordered.
        t.register(compute, "compute", "read".into(), dev(1, false));
        assert_eq!(kinds(&t), vec![]);
        assert_eq!(t.shadow_parts(), 1);
        t.free("free_device", BufferRef::Device(DeviceBufferId(1)));
        assert_eq!(t.shadow_parts(), 0);
    }

    #[test]
    fn clocks_tick_join_and_forget() {
        let mut a = Clock::default();
        assert_eq!(a.tick(3), 1);
        assert_eq!(a.tick(3), 2);
        let mut b = Clock::default();
        b.tick(1);
        b.join(&a);
        assert_eq!(b, Clock(vec![(1, 1), (3, 2)]));
        b.join_if(&Clock(vec![(2, 7)]), |s| s != 2);
        assert_eq!(b.get(2), 0);
        b.forget(3);
        assert_eq!(b, Clock(vec![(1, 1)]));
    }
}
