//! Simulated streams: one named worker thread per stream, executing its queue strictly in order.
//!
//! Ops are copies, kernels, event records and event waits. A stream that hits an error (a failed copy or kernel,
//! or a wait on a failed event record) keeps it (sticky, like a CUDA error): its later copies, kernels and waits
//! are skipped, its later event records complete as failed, and `stream_synchronize` returns the error.
//!
//! Invariants: ops complete in enqueue order; an event record's generation is completed before the op is counted
//! complete, so anything ordered after it (by stream order, event, or synchronisation) never sees it pending; an op
//! is registered with the hazard detector under the queue's lock, so
//! the detector's stream order is the queue's order; at shutdown the worker stops after its current op and discards
//! the rest; a closed queue (`destroy_stream`) takes no new op, and its worker exits once it ran every op it holds.

use super::config::Direction;
use super::event::GenStatus;
use super::hazard::Access;
use super::kernel::{KernelFn, SimKernelCtx};
use super::lifecycle::{shut_down_error, wait};
use super::memory::{BytesError, DeviceBuffer, HostBuffer};
use super::stats::StatCounters;
use super::trace::{TraceEvent, TraceKind};
use super::Shared;
use crate::platform::{EventId, HostBufferId, HostMemoryKind, PlatformError, PlatformResult, StreamId};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{lock, thread, Arc, Condvar, Mutex};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A copy between a host and a device buffer (direction given by the [`Op`] variant).
pub(crate) struct CopyOp {
    pub(crate) label: String,
    pub(crate) host: Arc<HostBuffer>,
    pub(crate) host_offset: u64,
    pub(crate) dev: Arc<DeviceBuffer>,
    pub(crate) dev_offset: u64,
    pub(crate) len: u64,
    /// Fail when executed (fault injection).
    pub(crate) inject_failure: bool,
}

/// One queued unit of stream work.
pub(crate) enum Op {
    /// Host → device.
    H2d(CopyOp),
    /// Device → host.
    D2h(CopyOp),
    /// A compute kernel.
    Kernel { label: String, accesses: Vec<(Access, Arc<DeviceBuffer>)>, f: KernelFn },
    /// Completes generation `gen` of `event`.
    Record { event: EventId, gen: u64 },
    /// Blocks the stream until generation `gen` of `event` completed.
    Wait { event: EventId, gen: u64 },
}

struct QueueState {
    ops: VecDeque<Op>,
    enqueued: u64,
    completed: u64,
    error: Option<PlatformError>,
    /// Destroyed: no new op; the worker exits when `ops` is empty.
    closed: bool,
}

/// A stream's queue, shared by the enqueuing threads and its worker.
pub(crate) struct StreamQueue {
    /// Its handle.
    pub(crate) id: StreamId,
    /// Its name.
    pub(crate) name: String,
    /// Extra time per copy and kernel (the `slow_stream` fault).
    extra: Duration,
    state: Mutex<QueueState>,
    cond: Condvar,
    wait_nanos: AtomicU64,
    worker: Mutex<Option<thread::Thread>>,
}

/// The worker must exit: the platform is shutting down.
struct Stopped;

impl StreamQueue {
    /// An empty queue.
    pub(crate) fn new(id: StreamId, name: String, extra: Duration) -> Self {
        StreamQueue {
            id,
            name,
            extra,
            state: Mutex::new(QueueState {
                ops: VecDeque::new(),
                enqueued: 0,
                completed: 0,
                error: None,
                closed: false,
            }),
            cond: Condvar::new(),
            wait_nanos: AtomicU64::new(0),
            worker: Mutex::new(None),
        }
    }

    /// Appends the op `make` builds. Fails (without calling `make`) once the platform is shutting down or the stream
    /// was destroyed. `make` runs under the queue's lock (it registers the op with the hazard detector, whose stream
    /// order must be this queue's order); it must not lock a queue.
    pub(crate) fn push_with(&self, shared: &Shared, make: impl FnOnce() -> Op) -> PlatformResult<()> {
        let mut st = lock(&self.state);
        if shared.life.is_down() {
            return Err(shut_down_error());
        }
        if st.closed {
            return Err(PlatformError::InvalidHandle { what: "stream", id: u64::from(self.id.0) });
        }
        let op = make();
        st.ops.push_back(op);
        st.enqueued += 1;
        drop(st);
        self.cond.notify_all();
        Ok(())
    }

    /// Blocks until every op enqueued before the call completed; returns the stream's sticky error, if any.
    pub(crate) fn synchronize(&self, shared: &Shared) -> PlatformResult<()> {
        if self.is_worker_thread() {
            return Err(PlatformError::Driver(format!("stream '{}' synchronised from its own worker", self.name)));
        }
        let mut st = lock(&self.state);
        let target = st.enqueued;
        loop {
            if st.completed >= target {
                return st.error.clone().map_or(Ok(()), Err);
            }
            if shared.life.is_down() {
                return Err(shut_down_error());
            }
            st = wait(&self.cond, st);
        }
    }

    /// Closes the queue (`destroy_stream`): no new op is taken, and the worker exits once it ran the ops it holds.
    pub(crate) fn close(&self) {
        lock(&self.state).closed = true;
        self.cond.notify_all();
    }

    /// After the worker exited: the stream's sticky error, or the shutdown error if it exited with ops not run.
    pub(crate) fn final_status(&self) -> PlatformResult<()> {
        let st = lock(&self.state);
        if st.completed < st.enqueued {
            return Err(shut_down_error());
        }
        st.error.clone().map_or(Ok(()), Err)
    }

    /// Wakes the worker and every synchroniser (used at shutdown).
    pub(crate) fn wake_all(&self) {
        drop(lock(&self.state));
        self.cond.notify_all();
    }

    /// Total time the stream spent blocked in event waits.
    pub(crate) fn wait_time(&self) -> Duration {
        Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed))
    }

    /// Whether the calling thread is this stream's worker.
    pub(crate) fn is_worker_thread(&self) -> bool {
        let me = thread::current().id();
        lock(&self.worker).as_ref().is_some_and(|w| w.id() == me)
    }
}

/// The worker loop of `queue`: runs until the platform shuts down, or until the stream is destroyed and its queue
/// is empty.
pub(crate) fn run_worker(shared: Arc<Shared>, queue: Arc<StreamQueue>) {
    *lock(&queue.worker) = Some(thread::current());
    loop {
        let (op, prior_error) = {
            let mut st = lock(&queue.state);
            loop {
                if shared.life.is_down() {
                    return;
                }
                if let Some(op) = st.ops.pop_front() {
                    break (op, st.error.clone());
                }
                if st.closed {
                    return;
                }
                st = wait(&queue.cond, st);
            }
        };
        let Ok(new_error) = execute(&shared, &queue, op, prior_error.as_ref()) else { return };
        let mut st = lock(&queue.state);
        if st.error.is_none() {
            st.error = new_error;
        }
        st.completed += 1;
        drop(st);
        queue.cond.notify_all();
    }
}

/// Runs one op; returns the error it put the stream in, if any.
fn execute(
    shared: &Shared,
    q: &StreamQueue,
    op: Op,
    prior: Option<&PlatformError>,
) -> Result<Option<PlatformError>, Stopped> {
    match op {
        Op::H2d(c) => copy(shared, q, c, Direction::H2d, prior),
        Op::D2h(c) => copy(shared, q, c, Direction::D2h, prior),
        Op::Kernel { label, accesses, f } => kernel(shared, q, label, accesses, f, prior),
        Op::Record { event, gen } => {
            let failure = prior.map(|e| format!("stream '{}' failed before this record: {e}", q.name));
            shared.events.complete(event, gen, failure);
            Ok(None)
        }
        Op::Wait { event, gen } => wait_event(shared, q, event, gen, prior),
    }
}

/// The bytes and host buffer a record describes (`(0, None)` for kernels and waits).
type Moved = (u64, Option<HostBufferId>);

fn trace(shared: &Shared, q: &StreamQueue, kind: TraceKind, label: &str, t0: Instant, (bytes, host_buffer): Moved) {
    let duration = t0.elapsed();
    shared.trace.record(|| TraceEvent {
        stream_name: q.name.clone(),
        kind,
        label: label.to_string(),
        start: t0.saturating_duration_since(shared.epoch),
        duration,
        bytes,
        host_buffer,
    });
}

fn copy(
    shared: &Shared,
    q: &StreamQueue,
    c: CopyOp,
    dir: Direction,
    prior: Option<&PlatformError>,
) -> Result<Option<PlatformError>, Stopped> {
    if prior.is_some() {
        return Ok(None);
    }
    let t0 = Instant::now();
    let outcome = if c.inject_failure {
        Err("injected asynchronous copy failure".to_string())
    } else {
        let pageable = c.host.kind == HostMemoryKind::Pageable;
        let dur = shared.config.copy_time(dir, c.len, pageable).saturating_add(q.extra);
        if !shared.life.sleep(dur) {
            return Err(Stopped);
        }
        move_bytes(&c, dir)
    };
    let (kind, direction, copies, bytes) = match dir {
        Direction::H2d => (TraceKind::H2d, "host-to-device", &shared.stats.h2d_copies, &shared.stats.h2d_bytes),
        Direction::D2h => (TraceKind::D2h, "device-to-host", &shared.stats.d2h_copies, &shared.stats.d2h_bytes),
    };
    trace(shared, q, kind, &c.label, t0, (c.len, Some(c.host.id)));
    match outcome {
        Ok(()) => {
            StatCounters::bump(copies, 1);
            StatCounters::bump(bytes, c.len);
            Ok(None)
        }
        Err(reason) => Ok(Some(PlatformError::CopyFailed { direction, bytes: c.len, reason })),
    }
}

/// Moves the bytes of a copy; locks the host buffer first, then the device buffer (the only two-lock order).
fn move_bytes(c: &CopyOp, dir: Direction) -> Result<(), String> {
    if c.host.region.is_some() {
        // A mapped source (d2h into one is refused at enqueue): read through the region into the device bytes.
        let mut dev = lock(&c.dev.bytes);
        let res = dev.with_slice_mut(c.dev_offset, c.len, |d| c.host.read(c.host_offset, d));
        return match res {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) | Err(e) => Err(describe_bytes_error(c, e)),
        };
    }
    let mut host = lock(&c.host.bytes);
    let mut dev = lock(&c.dev.bytes);
    let res = match dir {
        Direction::H2d => host.copy_to(c.host_offset, &mut dev, c.dev_offset, c.len),
        Direction::D2h => dev.copy_to(c.dev_offset, &mut host, c.host_offset, c.len),
    };
    res.map_err(|e| describe_bytes_error(c, e))
}

/// A failed copy's reason.
fn describe_bytes_error(c: &CopyOp, e: BytesError) -> String {
    match e {
        BytesError::Freed => {
            format!("host buffer {:?} or device buffer {:?} was freed before the copy ran", c.host.id, c.dev.id)
        }
        BytesError::Alloc(reason) => format!("simulated memory could not be materialised: {reason}"),
        BytesError::OutOfBounds { offset, len, size } => format!("range {offset}+{len} exceeds {size} bytes"),
        BytesError::Region(reason) => format!("mapped host buffer {:?}: {reason}", c.host.id),
    }
}

fn kernel(
    shared: &Shared,
    q: &StreamQueue,
    label: String,
    accesses: Vec<(Access, Arc<DeviceBuffer>)>,
    f: KernelFn,
    prior: Option<&PlatformError>,
) -> Result<Option<PlatformError>, Stopped> {
    if prior.is_some() {
        return Ok(None);
    }
    let t0 = Instant::now();
    if !shared.life.sleep(q.extra) {
        return Err(Stopped);
    }
    let ctx = SimKernelCtx::new(label, accesses);
    let outcome = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&ctx))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(msg)) => Err(msg),
        Err(_) => Err("kernel panicked".to_string()),
    };
    trace(shared, q, TraceKind::Kernel, ctx.label(), t0, (0, None));
    match outcome {
        Ok(()) => {
            StatCounters::bump(&shared.stats.kernels, 1);
            Ok(None)
        }
        Err(msg) => Ok(Some(PlatformError::Driver(format!("kernel '{}' failed: {msg}", ctx.label())))),
    }
}

fn wait_event(
    shared: &Shared,
    q: &StreamQueue,
    event: EventId,
    gen: u64,
    prior: Option<&PlatformError>,
) -> Result<Option<PlatformError>, Stopped> {
    if prior.is_some() {
        return Ok(None);
    }
    let t0 = Instant::now();
    let status = shared.events.wait_gen(event, gen, &shared.life).ok_or(Stopped)?;
    let waited = t0.elapsed();
    q.wait_nanos.fetch_add(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    trace(shared, q, TraceKind::Wait, &format!("wait event {} gen {gen}", event.0), t0, (0, None));
    Ok(match status {
        GenStatus::Failed(reason) => Some(PlatformError::EventFailed { event, reason }),
        GenStatus::Done | GenStatus::Pending => None,
    })
}
