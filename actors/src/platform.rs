//! The platform contract: everything the scheduler needs from hardware, and nothing more.
//!
//! Device memory (with a capacity), host buffers (pinned or pageable), in-order streams, events (record, wait,
//! query, host synchronisation) and asynchronous copies. Objects are named by small copyable handles so the trait
//! stays object-safe (`Arc<dyn Platform>`) and the hot path passes integers, not reference-counted objects.
//!
//! Event semantics follow CUDA: `record_event` captures the work enqueued on a stream so far; a later
//! `stream_wait_event` makes the waiting stream wait for the event's *most recent record at the time of the wait
//! call*; `event_query` / `event_synchronize` observe that most recent record. An event never recorded counts as
//! complete.

use std::fmt;

/// A device memory allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceBufferId(pub u64);

/// A host memory allocation owned by the platform (pinned or pageable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostBufferId(pub u64);

/// An in-order queue of device work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u32);

/// A re-recordable marker in a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(pub u32);

/// How a host buffer is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostMemoryKind {
    /// Page-locked memory: the device can copy from it at full link speed, asynchronously.
    Pinned,
    /// Ordinary pageable memory: copies are staged by the driver and much slower.
    Pageable,
    /// Read-only memory lent by a [`HostRegion`] (a checkpoint file's mapping), made a buffer by
    /// [`Platform::map_host`]: the CPU reads it through the region, never by touching the mapping; the device copies
    /// from it only once [`Platform::register_host`] made it copyable (at pinned speed on CUDA).
    Mapped,
}

/// Read-only host memory that its owner lends to a platform: in practice a checkpoint file's mapping.
///
/// The CPU side reads through [`read_at`](HostRegion::read_at) (an ordinary file read), so a file truncated under
/// the mapping gives an error there instead of a SIGBUS; only the device reads the pages at
/// [`as_ptr`](HostRegion::as_ptr), after the platform registered (pinned) them.
pub trait HostRegion: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `out.len()` bytes from `offset` into `out`; fails (never faults) when the bytes are no longer there
    /// or no longer the ones the region was opened with, saying why.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String>;
    /// Start of the region in this process's address space (valid for [`len`](HostRegion::len) bytes while the
    /// region lives), for registering with a driver. Never dereferenced by the CPU.
    fn as_ptr(&self) -> *const u8;
}

/// A checkpoint file the disk tier reads blocks from, on every pass, into its staging buffers.
///
/// Reads go around the page cache where the file system allows (the owner opens the file for direct I/O), so a model
/// larger than host memory does not fill it; a file truncated or rewritten under the reader is an error of the read,
/// never a fault or stale bytes.
pub trait BlockFile: Send + Sync + fmt::Debug {
    /// Copies `out.len()` bytes from `offset` into `out`; fails, saying why, when they are no longer there or no
    /// longer the ones the file was opened with.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String>;

    /// Reads the `len` bytes at `offset` into `window`, which stands for the file from `offset` rounded down to
    /// [`DIRECT_READ_ALIGN`]: the bytes land at `window[offset % DIRECT_READ_ALIGN..][..len]`, and the rest of the
    /// window is left unspecified. `window` holds at least [`read_window_len`]`(offset, len)` bytes; where it also
    /// starts at an aligned address, a file opened for direct I/O reads straight into it (no bounce buffer). By
    /// default: [`read_at`](BlockFile::read_at) into the range.
    fn read_window(&self, offset: u64, len: u64, window: &mut [u8]) -> Result<(), String> {
        let at = (offset % DIRECT_READ_ALIGN) as usize;
        let end = usize::try_from(len).ok().and_then(|l| at.checked_add(l)).filter(|&e| e <= window.len());
        let Some(end) = end else {
            return Err(format!("a read of {len} bytes at {offset} does not fit a window of {} bytes", window.len()));
        };
        self.read_at(offset, &mut window[at..end])
    }
}

/// Alignment of the file offsets, lengths and buffer addresses of direct (`O_DIRECT`) reads: 4 KiB covers the logical
/// block size of every common device (512 B or 4 KiB). The disk tier lays its staging buffers out in windows of it.
pub const DIRECT_READ_ALIGN: u64 = 4096;

/// Bytes of the window a read of `len` bytes at `offset` fills ([`BlockFile::read_window`]): the range rounded out
/// to [`DIRECT_READ_ALIGN`] at both ends.
pub fn read_window_len(offset: u64, len: u64) -> u64 {
    let start = offset - offset % DIRECT_READ_ALIGN;
    (offset + len).next_multiple_of(DIRECT_READ_ALIGN) - start
}

/// Errors a platform reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlatformError {
    /// A device allocation did not fit.
    #[error("device out of memory: requested {requested} bytes with {in_use} of {capacity} bytes in use")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes already allocated.
        in_use: u64,
        /// Device capacity.
        capacity: u64,
    },
    /// A host allocation failed.
    #[error("host allocation of {requested} bytes ({kind:?}) failed: {reason}")]
    HostAllocFailed {
        /// Bytes asked for.
        requested: u64,
        /// Pinned or pageable.
        kind: HostMemoryKind,
        /// What the platform said.
        reason: String,
    },
    /// A copy could not be issued or failed on the device.
    #[error("{direction} copy of {bytes} bytes failed: {reason}")]
    CopyFailed {
        /// `"host-to-device"` or `"device-to-host"`.
        direction: &'static str,
        /// Bytes in the copy.
        bytes: u64,
        /// What the platform said.
        reason: String,
    },
    /// An event operation failed (or the work it marks failed).
    #[error("event {event:?} failed: {reason}")]
    EventFailed {
        /// The event.
        event: EventId,
        /// What the platform said.
        reason: String,
    },
    /// A handle that this platform never issued, or already freed.
    #[error("invalid {what} handle {id}")]
    InvalidHandle {
        /// Kind of handle.
        what: &'static str,
        /// Its numeric value.
        id: u64,
    },
    /// A copy range outside its buffer.
    #[error("{what} range {offset}+{len} exceeds its buffer of {size} bytes")]
    OutOfBounds {
        /// Which side of the copy.
        what: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// A write to read-only (mapped) host memory, or a device copy from mapped memory not yet registered.
    #[error("host buffer {id} is read-only mapped memory: {what}")]
    ReadOnly {
        /// The buffer.
        id: u64,
        /// What was refused.
        what: &'static str,
    },
    /// Reading a mapped host buffer through its region failed (its file was truncated or rewritten, say).
    #[error("reading mapped host buffer {id} failed: {reason}")]
    MappedReadFailed {
        /// The buffer.
        id: u64,
        /// What the region said.
        reason: String,
    },
    /// The disk tier could not read a block's bytes from its checkpoint file.
    #[error("reading {bytes} bytes at offset {offset} of a checkpoint file failed: {reason}")]
    FileReadFailed {
        /// File offset of the read.
        offset: u64,
        /// Bytes asked for.
        bytes: u64,
        /// What the file said.
        reason: String,
    },
    /// The platform cannot be used here (no device, no driver).
    #[error("platform unavailable: {0}")]
    Unavailable(String),
    /// Anything else the driver reported.
    #[error("driver error: {0}")]
    Driver(String),
}

/// Result alias for platform calls.
pub type PlatformResult<T> = Result<T, PlatformError>;

/// Device memory counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemoryStats {
    /// Capacity of the device in bytes.
    pub capacity: u64,
    /// Bytes allocated now.
    pub in_use: u64,
    /// Largest `in_use` since creation or the last `reset_peak`.
    pub peak: u64,
}

/// The hardware contract. Implementations: the simulated device (`sim`) and, in the root crate, CUDA.
///
/// All methods may be called from any thread. Enqueue methods (`copy_*`, `record_event`, `stream_wait_event`) do
/// not wait for the device.
pub trait Platform: Send + Sync + fmt::Debug {
    /// Short name (`"sim"`, `"cuda"`).
    fn name(&self) -> &'static str;

    /// Device memory counters.
    fn device_memory(&self) -> DeviceMemoryStats;
    /// Resets the peak counter to the current use.
    fn reset_peak(&self);

    /// Allocates device memory. Fails with [`PlatformError::OutOfMemory`] beyond the capacity.
    fn alloc_device(&self, bytes: u64) -> PlatformResult<DeviceBufferId>;
    /// Allocates device memory that a collective may map into its peers' address space (the gather stacks' slot and
    /// shard buffers: NCCL's copy-engine AllGather needs them in symmetric windows). Freed with
    /// [`Platform::free_device`]. By default (and on platforms without such memory) the same as
    /// [`Platform::alloc_device`].
    fn alloc_device_shared(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        self.alloc_device(bytes)
    }
    /// Returns device memory to the allocator. The caller must have *observed* completion of all work touching it.
    fn free_device(&self, buf: DeviceBufferId) -> PlatformResult<()>;
    /// Size of a device buffer.
    fn device_buffer_len(&self, buf: DeviceBufferId) -> PlatformResult<u64>;

    /// Allocates a host buffer, zero-filled.
    fn alloc_host(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId>;
    /// Allocates a host buffer whose contents are unspecified until written: for a caller that writes every byte
    /// it will read or copy (a master filled storage by storage, its gaps zeroed), sparing the pass that zeroes a
    /// buffer the caller overwrites anyway. By default [`Platform::alloc_host`] (zero-filled).
    fn alloc_host_uninit(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        self.alloc_host(bytes, kind)
    }
    /// Frees a host buffer. The caller must have observed completion of all copies touching it.
    fn free_host(&self, buf: HostBufferId) -> PlatformResult<()>;
    /// Fills part of a host buffer from the CPU.
    fn write_host(&self, buf: HostBufferId, offset: u64, data: &[u8]) -> PlatformResult<()>;
    /// Fills `len` bytes of a host buffer at `offset` with `fill`, which is handed those bytes (their contents
    /// unspecified) to write: the disk tier reads a file straight into its staging buffer this way. The caller must
    /// hold the range exclusively, as for [`Platform::write_host`]. By default `fill` writes a temporary buffer,
    /// copied in with [`Platform::write_host`]; a platform whose host buffers the CPU can address lends the bytes
    /// themselves.
    fn fill_host(
        &self,
        buf: HostBufferId,
        offset: u64,
        len: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> PlatformResult<()>,
    ) -> PlatformResult<()> {
        let n = usize::try_from(len).map_err(|_| PlatformError::HostAllocFailed {
            requested: len,
            kind: HostMemoryKind::Pageable,
            reason: "larger than this host's address space".into(),
        })?;
        let mut bytes = vec![0u8; n];
        fill(&mut bytes)?;
        self.write_host(buf, offset, &bytes)
    }
    /// Reads part of a host buffer into `out`.
    fn read_host(&self, buf: HostBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()>;
    /// Size and kind of a host buffer.
    fn host_buffer_info(&self, buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)>;

    /// Makes `region` a host buffer of kind [`HostMemoryKind::Mapped`]; the platform holds the region until
    /// [`Platform::free_host`]. [`Platform::read_host`] reads through the region; writes to it
    /// ([`Platform::write_host`], a device-to-host copy into it) fail with [`PlatformError::ReadOnly`]; a
    /// host-to-device copy from it fails with [`PlatformError::ReadOnly`] too until [`Platform::register_host`].
    /// By default: [`PlatformError::Unavailable`].
    fn map_host(&self, region: std::sync::Arc<dyn HostRegion>) -> PlatformResult<HostBufferId> {
        let _ = region;
        Err(PlatformError::Unavailable(format!(
            "the {} platform cannot lend mapped host memory to the device",
            self.name()
        )))
    }
    /// Makes a [`HostMemoryKind::Mapped`] buffer a source of host-to-device copies (CUDA: `cuMemHostRegister`,
    /// read-only, so copies run at the pinned rate and the pages stay resident until the buffer is freed).
    /// Idempotent; any other kind of buffer is [`PlatformError::InvalidHandle`]. By default:
    /// [`PlatformError::Unavailable`].
    fn register_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        let _ = buf;
        Err(PlatformError::Unavailable(format!("the {} platform cannot register mapped host memory", self.name())))
    }

    /// Creates a stream. It lives until [`Platform::destroy_stream`] (or until the platform itself goes away): whoever
    /// creates a stream destroys it, so an enable → disable cycle leaves no stream (and, on the simulated device, no
    /// worker thread) behind.
    fn create_stream(&self, name: &str) -> PlatformResult<StreamId>;
    /// Destroys a stream. **Pending work completes first, and the call waits for it**: it blocks until everything
    /// enqueued on `stream` before the call has completed (as [`Platform::stream_synchronize`] does), then releases
    /// the stream and everything the platform holds for it (the simulated device joins the stream's worker thread).
    /// Events recorded on the stream stay valid (their records have completed); streams waiting on them are
    /// unaffected.
    ///
    /// The stream is destroyed whatever the outcome of its work: a stream in the error state is destroyed too, and
    /// the call then returns that error (as `stream_synchronize` would). Afterwards the handle is invalid: every
    /// call naming it, a second `destroy_stream` included, fails with [`PlatformError::InvalidHandle`]. The caller
    /// must not enqueue on the stream concurrently with this call (an enqueue racing it either lands before the wait
    /// or fails with `InvalidHandle`). Calling it from work running on the stream itself (a simulated kernel) fails
    /// with [`PlatformError::Driver`] and destroys nothing.
    fn destroy_stream(&self, stream: StreamId) -> PlatformResult<()>;
    /// Creates an event (never recorded: counts as complete).
    fn create_event(&self) -> PlatformResult<EventId>;
    /// Destroys an event.
    fn destroy_event(&self, event: EventId) -> PlatformResult<()>;

    /// Records `event` at the current end of `stream`.
    fn record_event(&self, event: EventId, stream: StreamId) -> PlatformResult<()>;
    /// Makes work enqueued on `stream` from now on wait for `event`'s most recent record.
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> PlatformResult<()>;
    /// Whether the most recent record of `event` has completed. Errors if that work failed.
    fn event_query(&self, event: EventId) -> PlatformResult<bool>;
    /// Blocks the calling thread until the most recent record of `event` completed.
    fn event_synchronize(&self, event: EventId) -> PlatformResult<()>;
    /// Blocks until all work enqueued on `stream` so far completed.
    fn stream_synchronize(&self, stream: StreamId) -> PlatformResult<()>;

    /// Enqueues an asynchronous host→device copy on `stream`.
    fn copy_h2d(
        &self,
        stream: StreamId,
        src: HostBufferId,
        src_offset: u64,
        dst: DeviceBufferId,
        dst_offset: u64,
        len: u64,
    ) -> PlatformResult<()>;
    /// Enqueues an asynchronous device→host copy on `stream`.
    fn copy_d2h(
        &self,
        stream: StreamId,
        src: DeviceBufferId,
        src_offset: u64,
        dst: HostBufferId,
        dst_offset: u64,
        len: u64,
    ) -> PlatformResult<()>;
}

/// A shared platform. (A plain `std` `Arc`: reference counting of the platform object is not part of any protocol
/// the loom models check, and loom's `Arc` cannot hold a trait object.)
pub type PlatformRef = std::sync::Arc<dyn Platform>;
