//! The simulated platform: a [`Platform`](crate::platform::Platform) that runs anywhere, with a hazard detector and fault injection.
//!
//! Device memory is a capacity-limited set of byte vectors, streams are worker threads executing their queues in
//! order, events follow CUDA's record/wait semantics, copies can be throttled to a bandwidth, and faults can be
//! injected deterministically. Its point is the hazard detector: every copy and kernel declares the bytes it
//! touches, and an op that is not ordered after an earlier conflicting op — by stream order, event record and wait,
//! or a host synchronisation, whatever the timing — is recorded as a [`HazardViolation`]; tests use it to prove that
//! the scheduler never reads a slot before its copy landed and never overwrites it before its last reader finished
//! (and never frees memory, or touches it from the host, before it synchronised with the ops on it).
//!
//! Files: [`config`] (settings), `memory` (buffers), `stream` (workers), `event` (generations), [`hazard`]
//! (detector), [`fault`] (injection), [`kernel`] (compute), [`trace`] and [`stats`] (observability),
//! `lifecycle` (shutdown), `platform_impl` (the [`Platform`](crate::platform::Platform) methods).
//!
//! Invariant kept here: every worker thread is owned by the [`SimPlatform`] that spawned it and is joined by
//! `destroy_stream` of its stream or by [`SimPlatform::shutdown`] (called on drop), whichever comes first; a
//! destroyed stream leaves nothing in the stream table; every blocking call returns once shutdown begins.

pub mod config;
mod event;
pub mod fault;
pub mod hazard;
pub mod kernel;
mod lifecycle;
mod memory;
mod platform_impl;
pub mod stats;
mod stream;
pub mod trace;

pub use config::SimConfig;
pub use fault::FaultPlan;

/// The byte a simulated host buffer from [`Platform::alloc_host_uninit`](crate::platform::Platform::alloc_host_uninit)
/// holds until written (its contents are unspecified; a pattern, not zeros, makes a read of unwritten bytes visible).
pub const UNINIT_BYTE: u8 = 0xA5;
pub use hazard::{Access, BufferRef, HazardKind, HazardViolation, OpInfo};
pub use kernel::{KernelError, KernelFn, SimKernelCtx};
pub use stats::{SimHostMemory, SimStats};
pub use trace::{TraceEvent, TraceKind};

use self::fault::FaultCounters;
use self::hazard::{HazardTracker, Touch};
use self::lifecycle::{shut_down_error, Lifecycle};
use self::memory::{check_range, BytesError, DeviceMemory, HostMemory};
use self::stats::StatCounters;
use self::stream::{Op, StreamQueue};
use self::trace::TraceLog;
use crate::platform::{DeviceBufferId, PlatformError, PlatformResult, StreamId};
use crate::sync::{lock, thread, Arc, Mutex};
use std::collections::BTreeMap;
use std::time::Instant;

/// State shared by the platform front end and its stream workers.
pub(crate) struct Shared {
    pub(crate) config: SimConfig,
    pub(crate) epoch: Instant,
    pub(crate) memory: DeviceMemory,
    pub(crate) host: HostMemory,
    pub(crate) events: event::EventTable,
    pub(crate) hazards: HazardTracker,
    pub(crate) faults: FaultCounters,
    pub(crate) trace: TraceLog,
    pub(crate) stats: StatCounters,
    pub(crate) life: Lifecycle,
    /// Buffers from `alloc_device_shared`, in allocation order: the sim's model of symmetric windows.
    pub(crate) windows: Mutex<Vec<DeviceBufferId>>,
}

struct StreamEntry {
    queue: Arc<StreamQueue>,
    worker: Option<thread::JoinHandle<()>>,
}

/// The live streams, by handle (handles are never reused), and the next handle.
#[derive(Default)]
struct StreamTable {
    live: BTreeMap<u32, StreamEntry>,
    next: u32,
}

/// The simulated device. Dropping it (or calling [`SimPlatform::shutdown`]) stops and joins its stream workers.
pub struct SimPlatform {
    shared: Arc<Shared>,
    streams: Mutex<StreamTable>,
}

impl std::fmt::Debug for SimPlatform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let streams: Vec<String> = lock(&self.streams).live.values().map(|s| s.queue.name.clone()).collect();
        f.debug_struct("SimPlatform")
            .field("config", &self.shared.config)
            .field("streams", &streams)
            .field("memory", &self.shared.memory.stats())
            .finish()
    }
}

fn map_device_bytes(what: &'static str, buf: DeviceBufferId, e: BytesError) -> PlatformError {
    match e {
        BytesError::OutOfBounds { offset, len, size } => PlatformError::OutOfBounds { what, offset, len, size },
        BytesError::Freed => PlatformError::InvalidHandle { what: "device buffer", id: buf.0 },
        BytesError::Alloc(reason) | BytesError::Region(reason) => {
            PlatformError::Driver(format!("simulated device memory: {reason}"))
        }
    }
}

impl SimPlatform {
    /// A simulated device configured by `config`. Fails with [`PlatformError::Unavailable`] on an invalid config.
    pub fn new(config: SimConfig) -> PlatformResult<SimPlatform> {
        config.validate().map_err(|e| PlatformError::Unavailable(format!("invalid sim config: {e}")))?;
        let tracing = config.tracing;
        let shared = Shared {
            memory: DeviceMemory::new(config.device_capacity),
            config,
            epoch: Instant::now(),
            host: HostMemory::new(),
            events: event::EventTable::new(),
            hazards: HazardTracker::new(),
            faults: FaultCounters::new(),
            trace: TraceLog::new(tracing),
            stats: StatCounters::new(),
            life: Lifecycle::new(),
            windows: Mutex::new(Vec::new()),
        };
        Ok(SimPlatform { shared: Arc::new(shared), streams: Mutex::new(StreamTable::default()) })
    }

    /// The configuration it was created with.
    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    pub(crate) fn queue(&self, stream: StreamId) -> PlatformResult<Arc<StreamQueue>> {
        lock(&self.streams)
            .live
            .get(&stream.0)
            .map(|s| s.queue.clone())
            .ok_or(PlatformError::InvalidHandle { what: "stream", id: u64::from(stream.0) })
    }

    /// Position of `buf` among this device's shared allocations ([`crate::platform::Platform::alloc_device_shared`],
    /// in allocation order), or `None` for ordinary memory: what a symmetric window is to NCCL. Ranks that allocate
    /// alike give counterpart buffers equal positions.
    pub fn window_index(&self, buf: DeviceBufferId) -> Option<usize> {
        lock(&self.shared.windows).iter().position(|&b| b == buf)
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// Enqueues a compute kernel on `stream`. `accesses` declares every device range it reads or writes (checked
    /// against the buffers now: unknown buffers and out-of-range accesses fail here); the kernel can touch only
    /// those, through its [`SimKernelCtx`]. A kernel that returns an error (or panics) puts its stream in the
    /// sticky error state.
    pub fn launch(&self, stream: StreamId, label: &str, accesses: Vec<Access>, f: KernelFn) -> PlatformResult<()> {
        let queue = self.queue(stream)?;
        let mut resolved = Vec::with_capacity(accesses.len());
        for a in accesses {
            let buf = self.shared.memory.get(a.buffer)?;
            check_range("kernel access", a.offset, a.len, buf.len)?;
            resolved.push((a, buf));
        }
        let touches = resolved
            .iter()
            .map(|(a, _)| Touch { buffer: BufferRef::Device(a.buffer), offset: a.offset, len: a.len, write: a.write })
            .collect();
        let shared = &self.shared;
        queue.push_with(shared, || {
            shared.hazards.register(stream, &queue.name, label.to_string(), touches);
            Op::Kernel { label: label.to_string(), accesses: resolved, f }
        })
    }

    /// Reads device memory from the host, synchronously (a debugging and test aid: call it after synchronising
    /// with the work that wrote the range, or the hazard detector records a violation).
    pub fn read_device(&self, buf: DeviceBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()> {
        self.check_up()?;
        let b = self.shared.memory.get(buf)?;
        let len = out.len() as u64;
        check_range("device read", offset, len, b.len)?;
        let touch = Touch { buffer: BufferRef::Device(buf), offset, len, write: false };
        self.shared.hazards.host_access("read_device", touch);
        let res = lock(&b.bytes).read(offset, out);
        res.map_err(|e| map_device_bytes("device read", buf, e))
    }

    /// Writes device memory from the host, synchronously (a debugging and test aid, checked like `read_device`).
    pub fn write_device(&self, buf: DeviceBufferId, offset: u64, data: &[u8]) -> PlatformResult<()> {
        self.check_up()?;
        let b = self.shared.memory.get(buf)?;
        let len = data.len() as u64;
        check_range("device write", offset, len, b.len)?;
        let touch = Touch { buffer: BufferRef::Device(buf), offset, len, write: true };
        self.shared.hazards.host_access("write_device", touch);
        let res = lock(&b.bytes).write(offset, data);
        res.map_err(|e| map_device_bytes("device write", buf, e))
    }

    /// The hazard violations recorded so far.
    pub fn violations(&self) -> Vec<HazardViolation> {
        self.shared.hazards.violations()
    }

    /// Returns and clears the hazard violations recorded so far.
    pub fn take_violations(&self) -> Vec<HazardViolation> {
        self.shared.hazards.take_violations()
    }

    /// Operation counters, with each stream's time blocked in event waits.
    pub fn stats(&self) -> SimStats {
        let waits = lock(&self.streams).live.values().map(|s| (s.queue.name.clone(), s.queue.wait_time())).collect();
        self.shared.stats.snapshot(waits)
    }

    /// The host buffers this platform holds now: bytes (all, and pinned), count, and the peak bytes so far.
    pub fn host_memory(&self) -> SimHostMemory {
        self.shared.host.usage()
    }

    /// The trace of executed ops (in completion order) recorded while tracing was on.
    pub fn trace(&self) -> Vec<TraceEvent> {
        self.shared.trace.snapshot()
    }

    /// Turns trace recording on or off.
    pub fn set_tracing(&self, on: bool) {
        self.shared.trace.set_enabled(on);
    }

    /// Drops the recorded trace.
    pub fn clear_trace(&self) {
        self.shared.trace.clear();
    }

    /// Streams created and not destroyed (each has its worker thread).
    pub fn stream_count(&self) -> usize {
        lock(&self.streams).live.len()
    }

    /// The name a stream was created with.
    pub fn stream_name(&self, stream: StreamId) -> PlatformResult<String> {
        Ok(self.queue(stream)?.name.clone())
    }

    /// Stops the platform: workers finish their current op, discard the rest of their queues and are joined;
    /// blocked callers return [`PlatformError::Unavailable`], as does every later call that enqueues or waits.
    /// Idempotent. Called on drop.
    pub fn shutdown(&self) {
        self.shared.life.begin_shutdown();
        self.shared.events.wake_all();
        let workers: Vec<(Arc<StreamQueue>, thread::JoinHandle<()>)> = lock(&self.streams)
            .live
            .values_mut()
            .filter_map(|s| s.worker.take().map(|w| (s.queue.clone(), w)))
            .collect();
        for (queue, _) in &workers {
            queue.wake_all();
        }
        for (queue, worker) in workers {
            // A kernel that drops the last handle to its platform runs shutdown on its own worker: that worker
            // exits by itself after the kernel returns, and joining it here would deadlock.
            if !queue.is_worker_thread() {
                // A worker that panicked has nothing left to clean up.
                let _ = worker.join();
            }
        }
    }

    pub(crate) fn check_up(&self) -> PlatformResult<()> {
        if self.shared.life.is_down() {
            Err(shut_down_error())
        } else {
            Ok(())
        }
    }

    pub(crate) fn spawn_stream(&self, name: &str) -> PlatformResult<StreamId> {
        let mut streams = lock(&self.streams);
        // Checked under the streams lock: a concurrent shutdown either sees this worker or makes this call fail.
        self.check_up()?;
        let id = StreamId(streams.next);
        let next =
            streams.next.checked_add(1).ok_or_else(|| PlatformError::Driver("stream ids exhausted".to_string()))?;
        let extra = match &self.shared.config.faults.slow_stream {
            Some((slow, extra)) if slow == name => *extra,
            _ => std::time::Duration::ZERO,
        };
        let queue = Arc::new(StreamQueue::new(id, name.to_string(), extra));
        let (shared, q) = (self.shared.clone(), queue.clone());
        let worker = thread::spawn_named(&format!("wf-sim-{name}"), move || stream::run_worker(shared, q))
            .map_err(|e| PlatformError::Driver(format!("cannot spawn the worker of stream '{name}': {e}")))?;
        self.shared.hazards.stream_created(id);
        streams.next = next;
        streams.live.insert(id.0, StreamEntry { queue, worker: Some(worker) });
        Ok(id)
    }

    /// `destroy_stream`: closes the queue, waits for its worker to run what it holds and joins it, then forgets the
    /// stream (the hazard detector takes the wait as a host synchronisation with everything the stream ran).
    pub(crate) fn destroy_stream_impl(&self, stream: StreamId) -> PlatformResult<()> {
        let queue = self.queue(stream)?;
        if queue.is_worker_thread() {
            return Err(PlatformError::Driver(format!("stream '{}' destroyed from its own worker", queue.name)));
        }
        let entry = lock(&self.streams)
            .live
            .remove(&stream.0)
            .ok_or(PlatformError::InvalidHandle { what: "stream", id: u64::from(stream.0) })?;
        queue.close();
        if let Some(worker) = entry.worker {
            // A worker that panicked has nothing left to clean up.
            let _ = worker.join();
        }
        self.shared.hazards.stream_destroyed(stream);
        queue.final_status()
    }
}

impl Drop for SimPlatform {
    fn drop(&mut self) {
        self.shutdown();
    }
}
