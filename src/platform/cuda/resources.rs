//! Owned driver objects (device memory, host memory, streams, events) and the handle tables that name them.
//!
//! Each object holds an `Arc` of the context it belongs to, so the context outlives it, and frees itself on drop
//! after making that context current on the dropping thread. Tables hand out `Arc` clones: a lookup keeps the
//! object alive for the few hundred nanoseconds the call needs, so a concurrent free can never release memory a
//! CPU-side copy is still touching (the last holder frees it).

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext};
use weightferry_actors::platform::{HostMemoryKind, HostRegion, PlatformError, PlatformResult};

use super::driver::{bind, describe};

/// Alignment of pageable host buffers: a page, so the driver's staging copies start aligned.
const PAGEABLE_ALIGN: usize = 4096;

/// Pageable buffers from this size up are anonymous mappings of their own (zero-filled by the kernel, page
/// aligned); smaller ones come from the global allocator.
const MAPPED_PAGEABLE_BYTES: usize = 1 << 20;

/// A table of live objects named by increasing integers (never reused).
pub(crate) struct HandleTable<T> {
    next: AtomicU64,
    entries: RwLock<HashMap<u64, Arc<T>>>,
}

impl<T> HandleTable<T> {
    /// An empty table whose first handle is 1 (0 is never valid, which catches zero-initialised handles).
    pub(crate) fn new() -> Self {
        HandleTable { next: AtomicU64::new(1), entries: RwLock::new(HashMap::new()) }
    }

    /// The next handle value, without inserting anything. Handles are unique even if never used.
    pub(crate) fn next_handle(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Stores `value` under `id`.
    pub(crate) fn insert(&self, id: u64, value: T) {
        self.entries.write().unwrap_or_else(PoisonError::into_inner).insert(id, Arc::new(value));
    }

    /// The object named `id`, if live.
    pub(crate) fn get(&self, id: u64) -> Option<Arc<T>> {
        self.entries.read().unwrap_or_else(PoisonError::into_inner).get(&id).cloned()
    }

    /// Removes and returns the object named `id`.
    pub(crate) fn remove(&self, id: u64) -> Option<Arc<T>> {
        self.entries.write().unwrap_or_else(PoisonError::into_inner).remove(&id)
    }

    /// Removes and returns every object.
    pub(crate) fn drain(&self) -> Vec<Arc<T>> {
        self.entries.write().unwrap_or_else(PoisonError::into_inner).drain().map(|(_, v)| v).collect()
    }

    /// Every live object (cloned handles).
    pub(crate) fn snapshot(&self) -> Vec<Arc<T>> {
        self.entries.read().unwrap_or_else(PoisonError::into_inner).values().cloned().collect()
    }

    /// Number of live objects.
    pub(crate) fn len(&self) -> usize {
        self.entries.read().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// Logs a failure to release a driver object (drops cannot return errors).
fn warn_release(what: &str, e: DriverError) {
    tracing::warn!(target: "weightferry::cuda", "releasing {what} failed: {}", describe(e));
}

/// Device memory from an allocator other than `cuMemAlloc` (NCCL's `ncclMemAlloc`, for symmetric windows),
/// installed with `CudaPlatform::set_shared_device_memory`.
pub trait ExternalDeviceMemory: Send + Sync {
    /// Allocates `len > 0` bytes on the device whose context is current; returns the device address.
    fn alloc(&self, len: u64) -> Result<sys::CUdeviceptr, String>;
    /// Gives back an allocation made by [`ExternalDeviceMemory::alloc`]; the device's context is current and every
    /// device operation touching it has completed. The allocator may defer the release (while a communicator still
    /// maps the memory).
    fn free(&self, ptr: sys::CUdeviceptr) -> Result<(), String>;
}

/// A device allocation: from `cuMemAlloc`, or from an [`ExternalDeviceMemory`] (or an empty one, which owns
/// nothing).
pub(crate) struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: u64,
    external: Option<Arc<dyn ExternalDeviceMemory>>,
}

// SAFETY: the allocation is a plain device address owned by this value; the driver allows freeing and using it
// from any thread that has the context current, which `release` arranges.
unsafe impl Send for DeviceAlloc {}
// SAFETY: shared access only reads the address and length; nothing is mutated through `&DeviceAlloc`.
unsafe impl Sync for DeviceAlloc {}

impl DeviceAlloc {
    /// Allocates `len` bytes of device memory (nothing for `len == 0`). The caller made the context current.
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: u64) -> Result<Self, DriverError> {
        let mut ptr: sys::CUdeviceptr = 0;
        if len > 0 {
            let bytes = usize::try_from(len).map_err(|_| DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
            // SAFETY: `ptr` is a valid out-pointer; the context is current on this thread (caller's duty, and a
            // wrong context only makes the call fail).
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }.result()?;
        }
        Ok(DeviceAlloc { ctx: Arc::clone(ctx), ptr, len, external: None })
    }

    /// Allocates `len` bytes through `external` (nothing for `len == 0`). The caller made the context current.
    pub(crate) fn new_external(
        ctx: &Arc<CudaContext>,
        len: u64,
        external: Arc<dyn ExternalDeviceMemory>,
    ) -> Result<Self, String> {
        let ptr = if len > 0 { external.alloc(len)? } else { 0 };
        Ok(DeviceAlloc { ctx: Arc::clone(ctx), ptr, len, external: Some(external) })
    }

    /// Device address.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Frees the memory now, reporting failure (drop only logs it).
    pub(crate) fn release(mut self) -> Result<(), String> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<(), String> {
        let ptr = std::mem::replace(&mut self.ptr, 0);
        if ptr == 0 {
            return Ok(());
        }
        bind(self.ctx.cu_ctx()).map_err(describe)?;
        match &self.external {
            Some(external) => external.free(ptr),
            // SAFETY: `ptr` came from `cuMemAlloc` in this context and is freed exactly once (it was swapped out
            // above). Completion of device work touching it is the caller's contract (`Platform::free_device`).
            None => unsafe { sys::cuMemFree_v2(ptr) }.result().map_err(describe),
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let Err(e) = self.release_inner() {
            tracing::warn!(target: "weightferry::cuda", "releasing device memory failed: {e}");
        }
    }
}

/// How a host buffer's memory was obtained.
enum HostBacking {
    /// `cuMemHostAlloc` with flags 0 (page-locked, cached; not write-combined).
    Pinned,
    /// The Rust global allocator with this layout (buffers below [`MAPPED_PAGEABLE_BYTES`]).
    Heap(Layout),
    /// An anonymous private mapping (large pageable buffers): unmapped on release, so its pages go back to the
    /// system at once, whatever the allocator's heap looks like (a host model freed batch by batch while its
    /// masters are built would otherwise stay resident inside the heap).
    Mapped(memmap2::MmapMut),
    /// A lent region (a checkpoint's mapping), read-only; the region owns the memory and unmaps it when the last
    /// reference goes.
    Region(std::sync::Arc<dyn HostRegion>),
    /// Zero bytes: nothing to free.
    Empty,
}

/// A host buffer: page-locked or ordinary memory the platform owns.
pub(crate) struct HostAlloc {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
    kind: HostMemoryKind,
    backing: HostBacking,
    /// A region registered with `cuMemHostRegister` (unregistered on release).
    registered: std::sync::Mutex<bool>,
}

// SAFETY: the buffer is heap memory owned by this value and reachable only through it; pinned memory may be
// freed from any thread with the context current, which `release` arranges.
unsafe impl Send for HostAlloc {}
// SAFETY: `&HostAlloc` exposes the pointer only to the platform, which reads and writes the bytes with raw copies
// (no Rust references into the buffer are ever created). Callers of the platform contract must not access
// overlapping ranges concurrently (the same rule that governs the device's own DMA into the buffer).
unsafe impl Sync for HostAlloc {}

impl HostAlloc {
    /// Allocates `len` bytes of the given kind, zeroed when `zeroed` (else a pinned buffer keeps what the driver
    /// gave; pageable memory is zeroed either way, at no extra pass). For pinned memory the caller made the context
    /// current.
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: u64, kind: HostMemoryKind, zeroed: bool) -> PlatformResult<Self> {
        let fail = |reason: String| PlatformError::HostAllocFailed { requested: len, kind, reason };
        let size = usize::try_from(len).map_err(|_| fail("size does not fit the address space".to_string()))?;
        if size == 0 {
            return Ok(HostAlloc::with(ctx, ptr::null_mut(), 0, kind, HostBacking::Empty));
        }
        match kind {
            HostMemoryKind::Pinned => {
                let mut raw: *mut std::ffi::c_void = ptr::null_mut();
                // SAFETY: `raw` is a valid out-pointer; flags 0 asks for ordinary cached page-locked memory.
                unsafe { sys::cuMemHostAlloc(&mut raw, size, 0) }.result().map_err(|e| fail(describe(e)))?;
                if raw.is_null() {
                    return Err(fail("cuMemHostAlloc returned a null pointer".to_string()));
                }
                let ptr = raw.cast::<u8>();
                if zeroed {
                    // SAFETY: `ptr` points to `size` freshly allocated bytes that nothing else references yet.
                    unsafe { ptr::write_bytes(ptr, 0, size) };
                }
                Ok(HostAlloc::with(ctx, ptr, size, kind, HostBacking::Pinned))
            }
            HostMemoryKind::Pageable if size >= MAPPED_PAGEABLE_BYTES => {
                let mut map = memmap2::MmapMut::map_anon(size).map_err(|e| fail(format!("mmap: {e}")))?;
                let ptr = map.as_mut_ptr();
                Ok(HostAlloc::with(ctx, ptr, size, kind, HostBacking::Mapped(map)))
            }
            HostMemoryKind::Pageable => {
                let layout = Layout::from_size_align(size, PAGEABLE_ALIGN).map_err(|e| fail(e.to_string()))?;
                // SAFETY: `layout` has a non-zero size (checked above).
                let ptr = unsafe { alloc::alloc_zeroed(layout) };
                if ptr.is_null() {
                    return Err(fail("the system allocator is out of memory".to_string()));
                }
                Ok(HostAlloc::with(ctx, ptr, size, kind, HostBacking::Heap(layout)))
            }
            HostMemoryKind::Mapped => Err(fail("mapped memory is lent by a region (map_host), not allocated".into())),
        }
    }

    fn with(ctx: &Arc<CudaContext>, ptr: *mut u8, len: usize, kind: HostMemoryKind, backing: HostBacking) -> Self {
        HostAlloc { ctx: Arc::clone(ctx), ptr, len, kind, backing, registered: std::sync::Mutex::new(false) }
    }

    /// A mapped buffer over `region` (not yet registered).
    pub(crate) fn mapped(ctx: &Arc<CudaContext>, region: std::sync::Arc<dyn HostRegion>) -> PlatformResult<Self> {
        let len = usize::try_from(region.len()).map_err(|_| PlatformError::HostAllocFailed {
            requested: region.len(),
            kind: HostMemoryKind::Mapped,
            reason: "the region does not fit the address space".into(),
        })?;
        let ptr = if len == 0 { ptr::null_mut() } else { region.as_ptr().cast_mut() };
        Ok(HostAlloc::with(ctx, ptr, len, HostMemoryKind::Mapped, HostBacking::Region(region)))
    }

    /// The region of a mapped buffer.
    pub(crate) fn region(&self) -> Option<&dyn HostRegion> {
        match &self.backing {
            HostBacking::Region(r) => Some(r.as_ref()),
            _ => None,
        }
    }

    /// Whether a mapped buffer is registered (always true of the other kinds, which need no registration).
    pub(crate) fn is_registered(&self) -> bool {
        self.region().is_none() || *self.registered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a mapped buffer's pages with the driver, read-only (idempotent). The caller made the context
    /// current.
    pub(crate) fn register(&self) -> Result<(), DriverError> {
        let mut done = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        if *done || self.ptr.is_null() || self.region().is_none() {
            *done = true;
            return Ok(());
        }
        // SAFETY: `ptr..ptr+len` is the region's mapping, alive for as long as this value holds the region; the
        // read-only flag matches a mapping the process may not write. Unregistered exactly once, in `release_inner`.
        unsafe { sys::cuMemHostRegister_v2(self.ptr.cast(), self.len, sys::CU_MEMHOSTREGISTER_READ_ONLY) }.result()?;
        *done = true;
        Ok(())
    }

    /// Start of the buffer (null when empty).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    /// Pinned or pageable.
    pub(crate) fn kind(&self) -> HostMemoryKind {
        self.kind
    }

    /// Frees the memory now, reporting failure (drop only logs it).
    pub(crate) fn release(mut self) -> Result<(), DriverError> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<(), DriverError> {
        let ptr = std::mem::replace(&mut self.ptr, ptr::null_mut());
        let backing = std::mem::replace(&mut self.backing, HostBacking::Empty);
        if ptr.is_null() {
            return Ok(());
        }
        match backing {
            HostBacking::Pinned => {
                bind(self.ctx.cu_ctx())?;
                // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed exactly once (swapped out above).
                unsafe { sys::cuMemFreeHost(ptr.cast()) }.result()
            }
            HostBacking::Heap(layout) => {
                // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed exactly once (swapped out above).
                unsafe { alloc::dealloc(ptr, layout) };
                Ok(())
            }
            HostBacking::Mapped(map) => {
                drop(map);
                Ok(())
            }
            HostBacking::Region(region) => {
                let registered = std::mem::take(&mut *self.registered.lock().unwrap_or_else(|e| e.into_inner()));
                let r = if registered {
                    bind(self.ctx.cu_ctx())?;
                    // SAFETY: `ptr` was registered by `register` and is unregistered once (the flag was taken);
                    // the region (and so the mapping) is dropped only after this call.
                    unsafe { sys::cuMemHostUnregister(ptr.cast()) }.result()
                } else {
                    Ok(())
                };
                drop(region);
                r
            }
            HostBacking::Empty => Ok(()),
        }
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        if let Err(e) = self.release_inner() {
            warn_release("pinned host memory", e);
        }
    }
}

/// A non-blocking stream.
pub(crate) struct StreamEntry {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
    name: String,
    /// Created by other code (torch's stream, adopted): never destroyed here.
    borrowed: bool,
}

// SAFETY: CUDA streams may be used and destroyed from any thread that has their context current; the handle is
// owned by this value and destroyed once, in drop.
unsafe impl Send for StreamEntry {}
// SAFETY: shared access only passes the handle to thread-safe driver calls.
unsafe impl Sync for StreamEntry {}

impl StreamEntry {
    /// Creates a `CU_STREAM_NON_BLOCKING` stream. The caller made the context current.
    pub(crate) fn new(ctx: &Arc<CudaContext>, name: &str) -> Result<Self, DriverError> {
        let mut raw: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `raw` is a valid out-pointer for one stream handle.
        unsafe { sys::cuStreamCreate(&mut raw, flags) }.result()?;
        Ok(StreamEntry { ctx: Arc::clone(ctx), raw, name: name.to_string(), borrowed: false })
    }

    /// Names a stream that other code created on `ctx` and destroys (null is the legacy default stream); dropping
    /// the entry leaves the stream alone.
    pub(crate) fn borrowed(ctx: &Arc<CudaContext>, raw: sys::CUstream, name: &str) -> Self {
        StreamEntry { ctx: Arc::clone(ctx), raw, name: name.to_string(), borrowed: true }
    }

    /// The driver handle.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The name given at creation.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Blocks until the work enqueued so far completed.
    pub(crate) fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: `raw` is a live stream owned by `self` (destroyed only in drop).
        unsafe { sys::cuStreamSynchronize(self.raw) }.result()
    }
}

impl Drop for StreamEntry {
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        if raw.is_null() || self.borrowed {
            return;
        }
        let outcome = bind(self.ctx.cu_ctx()).and_then(|()| {
            // SAFETY: `raw` was created by `cuStreamCreate` and is destroyed exactly once (swapped out above).
            // Pending work still completes: the driver releases the stream's resources afterwards.
            unsafe { sys::cuStreamDestroy_v2(raw) }.result()
        });
        if let Err(e) = outcome {
            warn_release("a stream", e);
        }
    }
}

/// An event created with `CU_EVENT_DISABLE_TIMING`.
pub(crate) struct EventEntry {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
}

// SAFETY: CUDA events may be used and destroyed from any thread that has their context current; the handle is
// owned by this value and destroyed once.
unsafe impl Send for EventEntry {}
// SAFETY: shared access only passes the handle to thread-safe driver calls.
unsafe impl Sync for EventEntry {}

impl EventEntry {
    /// Creates an event without timing (the cheapest kind to record and query). The caller made the context
    /// current.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let mut raw: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `raw` is a valid out-pointer for one event handle.
        unsafe { sys::cuEventCreate(&mut raw, flags) }.result()?;
        Ok(EventEntry { ctx: Arc::clone(ctx), raw })
    }

    /// The driver handle.
    pub(crate) fn raw(&self) -> sys::CUevent {
        self.raw
    }

    /// Destroys the event now, reporting failure (drop only logs it).
    pub(crate) fn release(mut self) -> Result<(), DriverError> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<(), DriverError> {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        if raw.is_null() {
            return Ok(());
        }
        bind(self.ctx.cu_ctx())?;
        // SAFETY: `raw` was created by `cuEventCreate` and is destroyed exactly once (swapped out above). The
        // driver allows destroying an event whose recorded work is still pending.
        unsafe { sys::cuEventDestroy_v2(raw) }.result()
    }
}

impl Drop for EventEntry {
    fn drop(&mut self) {
        if let Err(e) = self.release_inner() {
            warn_release("an event", e);
        }
    }
}
