//! The CUDA platform: the [`Platform`] contract on an NVIDIA GPU through the CUDA driver API.
//!
//! The driver is loaded at run time through cudarc (`dynamic-loading`), so building needs no CUDA toolkit and a
//! machine without a driver or a device gets [`PlatformError::Unavailable`] from [`CudaPlatform::new`] instead of
//! a panic. Everything runs on the device's primary context, made current on each calling thread as needed.
//!
//! - Device memory: `cuMemAlloc` / `cuMemFree`, counted against a capacity (the device's total memory, or a lower
//!   cap from [`CudaPlatform::with_capacity_limit`]), with a peak counter. `alloc_device_shared` (the gather
//!   stacks' buffers) allocates through an installed [`ExternalDeviceMemory`] instead, when there is one (NCCL's
//!   symmetric heap, for the copy-engine AllGather).
//! - Host memory: pinned buffers from `cuMemHostAlloc` with flags 0 (cached, not write-combined, so CPU fills run
//!   at memory speed), or pageable buffers from the system allocator.
//! - Streams: `CU_STREAM_NON_BLOCKING`. Events: `CU_EVENT_DISABLE_TIMING`, owned by the platform (cudarc's automatic
//!   event tracking is disabled on the context).
//! - Copies: `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` on the given stream, bounds-checked.
//!
//! The raw accessors ([`CudaPlatform::raw_stream`], [`CudaPlatform::device_ptr`], [`CudaPlatform::context`]) let a
//! GPU engine launch its own work (cuBLAS, kernels) on the platform's streams and memory.

pub mod blas;
mod driver;
mod host_copy;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nccl")]
mod nccl_lib;
mod resources;
#[cfg(feature = "nccl")]
pub mod symmetric;
pub mod timeline;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext};
use weightferry_actors::platform::{
    DeviceBufferId, DeviceMemoryStats, EventId, HostBufferId, HostMemoryKind, HostRegion, Platform, PlatformError,
    PlatformResult, StreamId,
};

use driver::{bind_or_err, describe};
pub use resources::ExternalDeviceMemory;
use resources::{DeviceAlloc, EventEntry, HandleTable, HostAlloc, StreamEntry};

/// Direction label of host-to-device copy errors.
const H2D: &str = "host-to-device";
/// Direction label of device-to-host copy errors.
const D2H: &str = "device-to-host";

/// The [`Platform`] contract on one CUDA device.
///
/// Cheap to share (`Arc<CudaPlatform>` or `Arc<dyn Platform>`); every method may be called from any thread.
/// Dropping it synchronises every stream it created and then frees every buffer, stream and event still live.
pub struct CudaPlatform {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    device_name: String,
    total_mem: u64,
    capacity: u64,
    in_use: AtomicU64,
    peak: AtomicU64,
    device: HandleTable<DeviceAlloc>,
    host: HandleTable<HostAlloc>,
    streams: HandleTable<StreamEntry>,
    events: HandleTable<EventEntry>,
    /// Freed pinned buffers kept for reuse, by exact size (pinning costs ≈0.43 s per GiB; an offload backend that is
    /// disabled and enabled again asks for the same sizes).
    pinned_cache: std::sync::Mutex<PinnedCache>,
    /// Timing spans of copies and kernels, when armed (see [`timeline`]).
    timeline: timeline::Timeline,
    /// Where `alloc_device_shared` allocates, once installed (else it is `alloc_device`).
    shared_memory: std::sync::OnceLock<Arc<dyn ExternalDeviceMemory>>,
}

/// Pinned buffers kept after `free_host`, up to a byte limit.
#[derive(Default)]
struct PinnedCache {
    limit: u64,
    bytes: u64,
    by_len: std::collections::HashMap<u64, Vec<HostAlloc>>,
}

impl CudaPlatform {
    /// Opens device `ordinal` (retaining its primary context). Its capacity is the device's total memory.
    ///
    /// Returns [`PlatformError::Unavailable`] (never panics) when libcuda cannot be loaded, the driver is too old,
    /// or the device does not exist.
    pub fn new(ordinal: usize) -> PlatformResult<CudaPlatform> {
        let opened = driver::open_context(ordinal)?;
        tracing::debug!(
            target: "weightferry::cuda",
            ordinal,
            device = %opened.name,
            total_mem = opened.total_mem,
            "opened CUDA device"
        );
        Ok(CudaPlatform {
            ctx: opened.ctx,
            ordinal,
            device_name: opened.name,
            total_mem: opened.total_mem,
            capacity: opened.total_mem,
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            device: HandleTable::new(),
            host: HandleTable::new(),
            streams: HandleTable::new(),
            events: HandleTable::new(),
            pinned_cache: std::sync::Mutex::new(PinnedCache::default()),
            timeline: timeline::Timeline::default(),
            shared_memory: std::sync::OnceLock::new(),
        })
    }

    /// Installs the allocator of [`Platform::alloc_device_shared`] (NCCL's symmetric heap, for the copy-engine
    /// AllGather). Once per platform: a second call returns `false` and changes nothing. Install it before the
    /// buffers that should come from it are allocated.
    pub fn set_shared_device_memory(&self, memory: Arc<dyn ExternalDeviceMemory>) -> bool {
        self.shared_memory.set(memory).is_ok()
    }

    /// Whether an allocator of [`Platform::alloc_device_shared`] is installed
    /// ([`CudaPlatform::set_shared_device_memory`]).
    pub fn has_shared_device_memory(&self) -> bool {
        self.shared_memory.get().is_some()
    }

    /// Number of CUDA devices visible to this process (honouring `CUDA_VISIBLE_DEVICES`).
    ///
    /// Returns [`PlatformError::Unavailable`] (never panics) when libcuda cannot be loaded or initialised; a
    /// working driver with no device gives `Ok(0)`.
    pub fn device_count() -> PlatformResult<usize> {
        driver::device_count()
    }

    /// Keeps up to `bytes` of freed pinned host memory for reuse by later allocations of the same size (0, the
    /// default, frees pinned memory at once). Reused buffers are zero-filled like fresh ones.
    #[must_use]
    pub fn with_pinned_cache(self, bytes: u64) -> CudaPlatform {
        self.pinned_cache.lock().unwrap_or_else(|e| e.into_inner()).limit = bytes;
        self
    }

    /// Frees every cached pinned buffer.
    pub fn trim_pinned_cache(&self) {
        let mut cache = self.pinned_cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.by_len.clear();
        cache.bytes = 0;
    }

    /// Caps the device memory this platform hands out at `bytes` (for budget tests and for sharing a device):
    /// allocations beyond it fail with [`PlatformError::OutOfMemory`]. A cap above the device's total memory
    /// is lowered to the total.
    #[must_use]
    pub fn with_capacity_limit(mut self, bytes: u64) -> CudaPlatform {
        self.capacity = bytes.min(self.total_mem);
        self
    }

    /// The device ordinal this platform drives.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it (e.g. `"NVIDIA H200"`).
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Total memory of the device in bytes (the capacity, unless capped).
    pub fn total_memory(&self) -> u64 {
        self.total_mem
    }

    /// The primary context of the device, as a cudarc context (event tracking disabled).
    ///
    /// For engines that launch their own work: wrap a platform stream with
    /// `CudaContext::wrap_borrowed_stream(platform.raw_stream(id))` and order that work against the platform's
    /// copies through the platform's events (cudarc will not do it automatically).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the platform's context current on the calling thread (every platform method does this itself;
    /// engines calling the driver directly on a new thread need it).
    pub fn bind_to_thread(&self) -> PlatformResult<()> {
        bind_or_err(self.ctx.cu_ctx())
    }

    /// The driver handle of a stream, or `None` for an unknown handle. It stays valid until the stream is destroyed
    /// (`destroy_stream`) or the platform drops.
    pub fn raw_stream(&self, stream: StreamId) -> Option<sys::CUstream> {
        self.streams.get(u64::from(stream.0)).map(|s| s.raw())
    }

    /// Gives a stream that other code owns (torch's current stream; null is the legacy default stream) a
    /// platform handle, so hooks can order it behind copies (`stream_wait_event`) and record its reads
    /// (`record_event`). The platform never destroys it; dropping the platform synchronises it like its own.
    ///
    /// # Safety
    /// `raw` must be null or a live stream of this platform's context (the device's primary context) and must
    /// stay alive until the platform drops or no caller uses the returned handle any more.
    pub unsafe fn adopt_stream(&self, raw: sys::CUstream, name: &str) -> PlatformResult<StreamId> {
        let id = small_handle(self.streams.next_handle(), "stream")?;
        self.streams.insert(u64::from(id), StreamEntry::borrowed(&self.ctx, raw, name));
        Ok(StreamId(id))
    }

    /// Whether `ptr` (a device address from another library, e.g. a torch tensor's `data_ptr()`) lies in memory of
    /// this platform's context: the check that torch and weightferry share the device's primary context.
    /// `Ok(false)` for an address the driver does not know as device memory.
    pub fn shares_context_with(&self, ptr: u64) -> PlatformResult<bool> {
        self.bind_to_thread()?;
        driver::pointer_context(ptr).map(|ctx| ctx == Some(self.ctx.cu_ctx())).map_err(|e| {
            PlatformError::Driver(format!("cannot query the context of address {ptr:#x}: {}", describe(e)))
        })
    }

    /// The driver handle of an event, or `None` for an unknown handle. It stays valid until the event is
    /// destroyed.
    pub fn raw_event(&self, event: EventId) -> Option<sys::CUevent> {
        self.events.get(u64::from(event.0)).map(|e| e.raw())
    }

    /// Allocates `bytes` of device memory through `cuMemAlloc`, or through `external` when given, counted against
    /// the capacity.
    fn alloc_device_with(
        &self,
        bytes: u64,
        external: Option<Arc<dyn ExternalDeviceMemory>>,
    ) -> PlatformResult<DeviceBufferId> {
        let after = self.reserve(bytes)?;
        let unreserve = || {
            self.in_use.fetch_sub(bytes, Ordering::AcqRel);
        };
        if let Err(e) = self.bind_to_thread() {
            unreserve();
            return Err(e);
        }
        let alloc = match external {
            None => DeviceAlloc::new(&self.ctx, bytes).map_err(|e| {
                if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    PlatformError::OutOfMemory { requested: bytes, in_use: after - bytes, capacity: self.capacity }
                } else {
                    PlatformError::Driver(format!("cuMemAlloc of {bytes} bytes failed: {}", describe(e)))
                }
            }),
            Some(external) => DeviceAlloc::new_external(&self.ctx, bytes, external)
                .map_err(|e| PlatformError::Driver(format!("shared device allocation of {bytes} bytes failed: {e}"))),
        };
        let alloc = match alloc {
            Ok(alloc) => alloc,
            Err(e) => {
                unreserve();
                return Err(e);
            }
        };
        self.peak.fetch_max(after, Ordering::AcqRel);
        let id = self.device.next_handle();
        self.device.insert(id, alloc);
        Ok(DeviceBufferId(id))
    }

    /// Device address and size of a device buffer, or `None` for an unknown handle. The address stays valid
    /// until the buffer is freed (a zero-length buffer has address 0).
    pub fn device_ptr(&self, buf: DeviceBufferId) -> Option<(sys::CUdeviceptr, u64)> {
        self.device.get(buf.0).map(|d| (d.ptr(), d.len()))
    }

    /// Zeroes all of device buffer `buf`, ordered on `stream` (no host wait).
    pub fn zero_device_async(&self, buf: DeviceBufferId, stream: StreamId) -> Result<(), PlatformError> {
        let (ptr, len) =
            self.device_ptr(buf).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })?;
        let raw =
            self.raw_stream(stream).ok_or(PlatformError::InvalidHandle { what: "stream", id: u64::from(stream.0) })?;
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by this platform and `raw` a live stream of its
        // context, both looked up just above; the memset is stream-ordered and `cuMemFree` waits for outstanding
        // device work before releasing memory, so a later free cannot pull the buffer from under it.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, len as usize, raw) }
            .map_err(|e| PlatformError::Driver(format!("memset: {e:?}")))
    }

    /// Start address and size of a host buffer, or `None` for an unknown handle or a mapped one (read those with
    /// `read_host`: touching a file's mapping could fault). The memory stays valid until the buffer is freed;
    /// reading or writing it through the pointer is the caller's `unsafe` business.
    pub fn host_ptr(&self, buf: HostBufferId) -> Option<(*mut u8, u64)> {
        self.host.get(buf.0).filter(|h| h.region().is_none()).map(|h| (h.ptr(), h.len()))
    }

    /// The address a device copy may read host buffer `buf` at, if it is page-locked (pinned, or a mapping
    /// registered with the driver): the source of the copies a captured CUDA graph replays. `None` for an unknown
    /// handle, pageable memory or an unregistered mapping. The CPU never reads through it.
    pub fn dma_source(&self, buf: HostBufferId) -> Option<u64> {
        let h = self.host.get(buf.0)?;
        let locked = h.kind() == HostMemoryKind::Pinned || (h.region().is_some() && h.is_registered());
        locked.then(|| h.ptr() as u64)
    }

    /// Measures host-to-device bandwidth in bytes per second: `iters` flat copies of `bytes` from a fresh pinned
    /// buffer into a fresh device buffer on a fresh stream, after one warm-up copy, timed around a stream
    /// synchronise. The buffers count against the capacity while the probe runs and are freed afterwards.
    pub fn measure_h2d_bandwidth(&self, bytes: u64, iters: u32) -> PlatformResult<f64> {
        if bytes == 0 || iters == 0 {
            return Err(PlatformError::Driver("the bandwidth probe needs bytes > 0 and iters > 0".to_string()));
        }
        let host = self.alloc_host(bytes, HostMemoryKind::Pinned)?;
        let dev = match self.alloc_device(bytes) {
            Ok(dev) => dev,
            Err(e) => {
                // The allocation error is the one worth reporting.
                let _ = self.free_host(host);
                return Err(e);
            }
        };
        let measured = self.time_h2d(host, dev, bytes, iters);
        let freed_dev = self.free_device(dev);
        let freed_host = self.free_host(host);
        let rate = measured?;
        freed_dev?;
        freed_host?;
        Ok(rate)
    }

    fn time_h2d(&self, host: HostBufferId, dev: DeviceBufferId, bytes: u64, iters: u32) -> PlatformResult<f64> {
        self.bind_to_thread()?;
        let stream = StreamEntry::new(&self.ctx, "bandwidth-probe")
            .map_err(|e| PlatformError::Driver(format!("cannot create the probe stream: {}", describe(e))))?;
        let src = self.host_entry(host)?;
        let dst = self.device_entry(dev)?;
        let len = usize::try_from(bytes).map_err(|_| PlatformError::Driver("probe size too large".to_string()))?;
        let copy = || {
            // SAFETY: `src` and `dst` are live (their `Arc`s are held until after the final synchronise below)
            // and both are `bytes` long; `stream` is a live stream of the current context.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst.ptr(), src.ptr().cast_const().cast(), len, stream.raw()) }
                .result()
                .map_err(|e| PlatformError::CopyFailed { direction: H2D, bytes, reason: describe(e) })
        };
        let sync = || {
            stream
                .synchronize()
                .map_err(|e| PlatformError::Driver(format!("bandwidth probe stream failed: {}", describe(e))))
        };
        copy()?;
        sync()?;
        let start = Instant::now();
        let mut issued = Ok(());
        for _ in 0..iters {
            issued = copy();
            if issued.is_err() {
                break;
            }
        }
        // Always drain the stream before the buffers can be freed, even when an enqueue failed.
        let drained = sync();
        let elapsed = start.elapsed().as_secs_f64();
        issued?;
        drained?;
        Ok(bytes as f64 * f64::from(iters) / elapsed.max(f64::MIN_POSITIVE))
    }

    fn device_entry(&self, buf: DeviceBufferId) -> PlatformResult<Arc<DeviceAlloc>> {
        self.device.get(buf.0).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })
    }

    /// A host buffer of `bytes` and `kind` (a pinned one from the cache of freed pinned buffers where one of that
    /// length waits), zero-filled when `zeroed`, else with whatever the allocation held.
    fn alloc_host_with(&self, bytes: u64, kind: HostMemoryKind, zeroed: bool) -> PlatformResult<HostBufferId> {
        if kind == HostMemoryKind::Pinned {
            self.bind_to_thread()?;
        }
        let cached = if kind == HostMemoryKind::Pinned {
            let mut cache = self.pinned_cache.lock().unwrap_or_else(|e| e.into_inner());
            let hit = cache.by_len.get_mut(&bytes).and_then(Vec::pop);
            if hit.is_some() {
                cache.bytes -= bytes;
            }
            hit
        } else {
            None
        };
        let alloc = match cached {
            Some(a) => {
                if zeroed && a.len() > 0 {
                    // SAFETY: the cached buffer is owned by this value alone (it left the handle table when it was
                    // freed) and spans `a.len()` bytes.
                    unsafe { std::ptr::write_bytes(a.ptr(), 0, a.len() as usize) };
                }
                a
            }
            None => HostAlloc::new(&self.ctx, bytes, kind, zeroed)?,
        };
        let id = self.host.next_handle();
        self.host.insert(id, alloc);
        Ok(HostBufferId(id))
    }

    fn host_entry(&self, buf: HostBufferId) -> PlatformResult<Arc<HostAlloc>> {
        self.host.get(buf.0).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })
    }

    fn stream_entry(&self, stream: StreamId) -> PlatformResult<Arc<StreamEntry>> {
        self.streams
            .get(u64::from(stream.0))
            .ok_or(PlatformError::InvalidHandle { what: "stream", id: u64::from(stream.0) })
    }

    fn event_entry(&self, event: EventId) -> PlatformResult<Arc<EventEntry>> {
        self.events
            .get(u64::from(event.0))
            .ok_or(PlatformError::InvalidHandle { what: "event", id: u64::from(event.0) })
    }

    /// Reserves `bytes` of the capacity, returning the use after the reservation.
    fn reserve(&self, bytes: u64) -> PlatformResult<u64> {
        let mut current = self.in_use.load(Ordering::Relaxed);
        loop {
            let next = match current.checked_add(bytes) {
                Some(next) if next <= self.capacity => next,
                _ => {
                    return Err(PlatformError::OutOfMemory {
                        requested: bytes,
                        in_use: current,
                        capacity: self.capacity,
                    })
                }
            };
            match self.in_use.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(next),
                Err(actual) => current = actual,
            }
        }
    }
}

/// Checks `offset + len <= size` without overflow.
fn check_range(what: &'static str, offset: u64, len: u64, size: u64) -> PlatformResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(PlatformError::OutOfBounds { what, offset, len, size }),
    }
}

/// Converts a checked in-bounds host offset or length (bounded by a buffer that exists in memory) to `usize`.
fn host_usize(v: u64) -> usize {
    // A value already checked against the size of a live host buffer always fits.
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// A `u32` handle from a table counter, or an error once 2^32 handles were issued.
fn small_handle(raw: u64, what: &str) -> PlatformResult<u32> {
    u32::try_from(raw).map_err(|_| PlatformError::Driver(format!("{what} handles exhausted")))
}

impl fmt::Debug for CudaPlatform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPlatform")
            .field("ordinal", &self.ordinal)
            .field("device", &self.device_name)
            .field("capacity", &self.capacity)
            .field("in_use", &self.in_use.load(Ordering::Relaxed))
            .field("device_buffers", &self.device.len())
            .field("host_buffers", &self.host.len())
            .field("streams", &self.streams.len())
            .field("events", &self.events.len())
            .finish()
    }
}

impl Platform for CudaPlatform {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_memory(&self) -> DeviceMemoryStats {
        DeviceMemoryStats {
            capacity: self.capacity,
            in_use: self.in_use.load(Ordering::Acquire),
            peak: self.peak.load(Ordering::Acquire),
        }
    }

    fn reset_peak(&self) {
        self.peak.store(self.in_use.load(Ordering::Acquire), Ordering::Release);
    }

    fn alloc_device(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        self.alloc_device_with(bytes, None)
    }

    fn alloc_device_shared(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        self.alloc_device_with(bytes, self.shared_memory.get().cloned())
    }

    fn free_device(&self, buf: DeviceBufferId) -> PlatformResult<()> {
        let entry =
            self.device.remove(buf.0).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })?;
        self.in_use.fetch_sub(entry.len(), Ordering::AcqRel);
        match Arc::try_unwrap(entry) {
            Ok(alloc) => alloc
                .release()
                .map_err(|e| PlatformError::Driver(format!("freeing device buffer {} failed: {e}", buf.0))),
            // A concurrent call still holds it for a moment; the last holder frees it.
            Err(_) => Ok(()),
        }
    }

    fn device_buffer_len(&self, buf: DeviceBufferId) -> PlatformResult<u64> {
        Ok(self.device_entry(buf)?.len())
    }

    fn alloc_host(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        self.alloc_host_with(bytes, kind, true)
    }

    fn alloc_host_uninit(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        self.alloc_host_with(bytes, kind, false)
    }

    fn free_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        let entry = self.host.remove(buf.0).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })?;
        match Arc::try_unwrap(entry) {
            Ok(alloc) if alloc.kind() == HostMemoryKind::Pinned => {
                let mut cache = self.pinned_cache.lock().unwrap_or_else(|e| e.into_inner());
                if cache.bytes + alloc.len() <= cache.limit {
                    cache.bytes += alloc.len();
                    cache.by_len.entry(alloc.len()).or_default().push(alloc);
                    return Ok(());
                }
                drop(cache);
                alloc.release().map_err(|e| {
                    PlatformError::Driver(format!("freeing host buffer {} failed: {}", buf.0, describe(e)))
                })
            }
            Ok(alloc) => alloc
                .release()
                .map_err(|e| PlatformError::Driver(format!("freeing host buffer {} failed: {}", buf.0, describe(e)))),
            Err(_) => Ok(()),
        }
    }

    fn write_host(&self, buf: HostBufferId, offset: u64, data: &[u8]) -> PlatformResult<()> {
        let host = self.host_entry(buf)?;
        if host.kind() == HostMemoryKind::Mapped {
            return Err(PlatformError::ReadOnly { id: buf.0, what: "a CPU write" });
        }
        let len = data.len() as u64;
        check_range("host buffer write", offset, len, host.len())?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: `offset + len <= host.len()` was checked, so the destination range lies inside the live buffer
        // (kept alive by the `Arc`); `data` is a distinct Rust slice, so the ranges cannot overlap. Concurrent
        // access to the same bytes is excluded by the platform contract.
        unsafe { host_copy::copy_to(data, host.ptr().add(host_usize(offset))) };
        Ok(())
    }

    fn fill_host(
        &self,
        buf: HostBufferId,
        offset: u64,
        len: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> PlatformResult<()>,
    ) -> PlatformResult<()> {
        let host = self.host_entry(buf)?;
        if host.kind() == HostMemoryKind::Mapped {
            return Err(PlatformError::ReadOnly { id: buf.0, what: "a CPU write" });
        }
        check_range("host buffer fill", offset, len, host.len())?;
        if len == 0 {
            return fill(&mut []);
        }
        // SAFETY: `offset + len <= host.len()` was checked, so the range lies inside the live buffer (kept alive by
        // the `Arc` for this call); the platform contract gives the caller that range exclusively (no copy reads or
        // writes it meanwhile, no other CPU access), so this is the only reference to those bytes while `fill` runs.
        let bytes = unsafe { std::slice::from_raw_parts_mut(host.ptr().add(host_usize(offset)), host_usize(len)) };
        fill(bytes)
    }

    fn read_host(&self, buf: HostBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()> {
        let host = self.host_entry(buf)?;
        let len = out.len() as u64;
        check_range("host buffer read", offset, len, host.len())?;
        if len == 0 {
            return Ok(());
        }
        if let Some(region) = host.region() {
            // Never through the mapping: a truncated file is an error here, not a SIGBUS.
            return region.read_at(offset, out).map_err(|reason| PlatformError::MappedReadFailed { id: buf.0, reason });
        }
        // SAFETY: `offset + len <= host.len()` was checked, so the source range lies inside the live buffer (kept
        // alive by the `Arc`); `out` is an exclusive Rust slice, so the ranges cannot overlap.
        unsafe { host_copy::copy_from(host.ptr().add(host_usize(offset)).cast_const(), out) };
        Ok(())
    }

    fn host_buffer_info(&self, buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)> {
        let host = self.host_entry(buf)?;
        Ok((host.len(), host.kind()))
    }

    fn map_host(&self, region: Arc<dyn HostRegion>) -> PlatformResult<HostBufferId> {
        let alloc = HostAlloc::mapped(&self.ctx, region)?;
        let id = self.host.next_handle();
        self.host.insert(id, alloc);
        Ok(HostBufferId(id))
    }

    fn register_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        let host = self.host_entry(buf)?;
        if host.kind() != HostMemoryKind::Mapped {
            return Err(PlatformError::InvalidHandle { what: "mapped host buffer", id: buf.0 });
        }
        self.bind_to_thread()?;
        host.register().map_err(|e| {
            PlatformError::Driver(format!(
                "cuMemHostRegister (read-only) of host buffer {} failed: {}",
                buf.0,
                describe(e)
            ))
        })
    }

    fn create_stream(&self, name: &str) -> PlatformResult<StreamId> {
        self.bind_to_thread()?;
        let id = small_handle(self.streams.next_handle(), "stream")?;
        let stream = StreamEntry::new(&self.ctx, name)
            .map_err(|e| PlatformError::Driver(format!("cannot create stream {name:?}: {}", describe(e))))?;
        self.streams.insert(u64::from(id), stream);
        Ok(StreamId(id))
    }

    fn destroy_stream(&self, stream: StreamId) -> PlatformResult<()> {
        let st = self
            .streams
            .remove(u64::from(stream.0))
            .ok_or(PlatformError::InvalidHandle { what: "stream", id: u64::from(stream.0) })?;
        self.bind_to_thread()?;
        let synced = st.synchronize().map_err(|e| {
            PlatformError::Driver(format!("stream {} ({:?}) failed: {}", stream.0, st.name(), describe(e)))
        });
        // Dropping the entry destroys the stream (`cuStreamDestroy`), once no concurrent call holds it.
        drop(st);
        synced
    }

    fn create_event(&self) -> PlatformResult<EventId> {
        self.bind_to_thread()?;
        let id = small_handle(self.events.next_handle(), "event")?;
        let event = EventEntry::new(&self.ctx)
            .map_err(|e| PlatformError::Driver(format!("cannot create an event: {}", describe(e))))?;
        self.events.insert(u64::from(id), event);
        Ok(EventId(id))
    }

    fn destroy_event(&self, event: EventId) -> PlatformResult<()> {
        let entry = self
            .events
            .remove(u64::from(event.0))
            .ok_or(PlatformError::InvalidHandle { what: "event", id: u64::from(event.0) })?;
        match Arc::try_unwrap(entry) {
            Ok(ev) => ev.release().map_err(|e| PlatformError::EventFailed { event, reason: describe(e) }),
            Err(_) => Ok(()),
        }
    }

    fn record_event(&self, event: EventId, stream: StreamId) -> PlatformResult<()> {
        let ev = self.event_entry(event)?;
        let st = self.stream_entry(stream)?;
        self.bind_to_thread()?;
        // SAFETY: both handles are live (their `Arc`s are held across the call) and belong to this context.
        unsafe { sys::cuEventRecord(ev.raw(), st.raw()) }.result().map_err(|e| PlatformError::EventFailed {
            event,
            reason: format!("record on stream {}: {}", stream.0, describe(e)),
        })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> PlatformResult<()> {
        let st = self.stream_entry(stream)?;
        let ev = self.event_entry(event)?;
        self.bind_to_thread()?;
        let flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as u32;
        // SAFETY: both handles are live (their `Arc`s are held across the call) and belong to this context.
        unsafe { sys::cuStreamWaitEvent(st.raw(), ev.raw(), flags) }.result().map_err(|e| PlatformError::EventFailed {
            event,
            reason: format!("wait on stream {}: {}", stream.0, describe(e)),
        })
    }

    fn event_query(&self, event: EventId) -> PlatformResult<bool> {
        let ev = self.event_entry(event)?;
        self.bind_to_thread()?;
        // SAFETY: the event is live (its `Arc` is held across the call).
        match unsafe { sys::cuEventQuery(ev.raw()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            status => {
                Err(PlatformError::EventFailed { event, reason: describe(cudarc::driver::result::DriverError(status)) })
            }
        }
    }

    fn event_synchronize(&self, event: EventId) -> PlatformResult<()> {
        let ev = self.event_entry(event)?;
        self.bind_to_thread()?;
        // SAFETY: the event is live (its `Arc` is held across the call, so a concurrent destroy cannot free it
        // while this thread waits).
        unsafe { sys::cuEventSynchronize(ev.raw()) }
            .result()
            .map_err(|e| PlatformError::EventFailed { event, reason: describe(e) })
    }

    fn stream_synchronize(&self, stream: StreamId) -> PlatformResult<()> {
        let st = self.stream_entry(stream)?;
        self.bind_to_thread()?;
        st.synchronize().map_err(|e| {
            PlatformError::Driver(format!("stream {} ({:?}) failed: {}", stream.0, st.name(), describe(e)))
        })
    }

    fn copy_h2d(
        &self,
        stream: StreamId,
        src: HostBufferId,
        src_offset: u64,
        dst: DeviceBufferId,
        dst_offset: u64,
        len: u64,
    ) -> PlatformResult<()> {
        let st = self.stream_entry(stream)?;
        let host = self.host_entry(src)?;
        if !host.is_registered() {
            return Err(PlatformError::ReadOnly { id: src.0, what: "a device copy from it before register_host" });
        }
        let dev = self.device_entry(dst)?;
        check_range("host-to-device source (host buffer)", src_offset, len, host.len())?;
        check_range("host-to-device destination (device buffer)", dst_offset, len, dev.len())?;
        if len == 0 {
            return Ok(());
        }
        self.bind_to_thread()?;
        // `timeline_begin` returns at once when disarmed; the label is formatted only when armed.
        let span = if self.timeline.armed() {
            self.timeline_begin(stream, crate::platform::timeline::COPY_LANE, &self.copy_label(src, len))
        } else {
            None
        };
        // SAFETY: both ranges were bounds-checked against live buffers (held by their `Arc`s across the call) and
        // the stream is live. The copy runs asynchronously after this returns: the contract obliges the caller to
        // observe its completion before freeing or rewriting either buffer.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dev.ptr() + dst_offset,
                host.ptr().add(host_usize(src_offset)).cast_const().cast(),
                host_usize(len),
                st.raw(),
            )
        }
        .result()
        .map_err(|e| PlatformError::CopyFailed { direction: H2D, bytes: len, reason: describe(e) });
        self.timeline_end(stream, span);
        r
    }

    fn copy_d2h(
        &self,
        stream: StreamId,
        src: DeviceBufferId,
        src_offset: u64,
        dst: HostBufferId,
        dst_offset: u64,
        len: u64,
    ) -> PlatformResult<()> {
        let st = self.stream_entry(stream)?;
        let dev = self.device_entry(src)?;
        let host = self.host_entry(dst)?;
        if host.kind() == HostMemoryKind::Mapped {
            return Err(PlatformError::ReadOnly { id: dst.0, what: "a device-to-host copy into it" });
        }
        check_range("device-to-host source (device buffer)", src_offset, len, dev.len())?;
        check_range("device-to-host destination (host buffer)", dst_offset, len, host.len())?;
        if len == 0 {
            return Ok(());
        }
        self.bind_to_thread()?;
        // SAFETY: both ranges were bounds-checked against live buffers (held by their `Arc`s across the call) and
        // the stream is live. The copy writes the host buffer asynchronously: the contract obliges the caller to
        // observe its completion before reading, freeing or rewriting it.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                host.ptr().add(host_usize(dst_offset)).cast(),
                dev.ptr() + src_offset,
                host_usize(len),
                st.raw(),
            )
        }
        .result()
        .map_err(|e| PlatformError::CopyFailed { direction: D2H, bytes: len, reason: describe(e) })
    }
}

impl Drop for CudaPlatform {
    fn drop(&mut self) {
        if let Err(e) = self.bind_to_thread() {
            tracing::warn!(target: "weightferry::cuda", "dropping the CUDA platform: {e}");
        }
        for stream in self.streams.snapshot() {
            if let Err(e) = stream.synchronize() {
                tracing::warn!(
                    target: "weightferry::cuda",
                    "stream {:?} failed while dropping the CUDA platform: {}",
                    stream.name(),
                    describe(e)
                );
            }
        }
        self.timeline.destroy_all();
        drop(self.events.drain());
        drop(self.device.drain());
        drop(self.host.drain());
        self.trim_pinned_cache();
        drop(self.streams.drain());
        // The context itself is released when `self.ctx` (the last `Arc`, unless an engine kept a clone) drops.
    }
}
