//! Simulated memory: capacity-accounted device buffers and pinned/pageable host buffers, each its own byte vector
//! behind its own lock (no unsafe).
//!
//! Invariants: `in_use` is the sum of the lengths of the live device buffers and never exceeds the capacity (and
//! the host table's usage is the sum of the lengths of the live host buffers, pinned ones counted apart); a
//! buffer's bytes are materialised lazily (reads of never-written memory return zeros), so large simulated
//! capacities cost nothing until written; a freed buffer is marked `freed` under its own lock before its bytes are
//! released, so an operation that still holds a reference to it fails cleanly instead of touching stale memory.

use super::stats::SimHostMemory;
use crate::platform::{
    DeviceBufferId, DeviceMemoryStats, HostBufferId, HostMemoryKind, HostRegion, PlatformError, PlatformResult,
};
use crate::sync::atomic::AtomicBool;
use crate::sync::{lock, Arc, Mutex};
use std::collections::HashMap;

/// Why an access to a byte vector failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BytesError {
    /// The range leaves the buffer.
    OutOfBounds { offset: u64, len: u64, size: u64 },
    /// The buffer was freed.
    Freed,
    /// Materialising the bytes failed.
    Alloc(String),
    /// A mapped buffer's region could not be read.
    Region(String),
}

/// Checks that `offset..offset+len` lies within `size` bytes.
pub(crate) fn check_range(what: &'static str, offset: u64, len: u64, size: u64) -> PlatformResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(PlatformError::OutOfBounds { what, offset, len, size }),
    }
}

/// The contents of one buffer: `size` bytes, materialised on first write.
pub(crate) struct Bytes {
    size: u64,
    data: Vec<u8>,
    freed: bool,
}

impl Bytes {
    /// `size` zero bytes (not yet materialised).
    pub(crate) fn new(size: u64) -> Self {
        Bytes { size, data: Vec::new(), freed: false }
    }

    /// Validates a range and returns it as `usize` bounds.
    fn span(&self, offset: u64, len: u64) -> Result<(usize, usize), BytesError> {
        if self.freed {
            return Err(BytesError::Freed);
        }
        let oob = BytesError::OutOfBounds { offset, len, size: self.size };
        let end = offset.checked_add(len).filter(|&e| e <= self.size).ok_or_else(|| oob.clone())?;
        let start = usize::try_from(offset).map_err(|_| oob.clone())?;
        let end = usize::try_from(end).map_err(|_| oob)?;
        Ok((start, end))
    }

    /// Allocates the backing vector if it is not there yet.
    fn materialise(&mut self) -> Result<(), BytesError> {
        if self.freed {
            return Err(BytesError::Freed);
        }
        if self.size == 0 || !self.data.is_empty() {
            return Ok(());
        }
        let n =
            usize::try_from(self.size).map_err(|_| BytesError::Alloc(format!("{} bytes exceed usize", self.size)))?;
        self.data.try_reserve_exact(n).map_err(|e| BytesError::Alloc(e.to_string()))?;
        self.data.resize(n, 0);
        Ok(())
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BytesError> {
        let (start, end) = self.span(offset, out.len() as u64)?;
        if self.data.is_empty() {
            out.fill(0);
        } else {
            out.copy_from_slice(&self.data[start..end]);
        }
        Ok(())
    }

    /// Copies `data` into the buffer at `offset`.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), BytesError> {
        let (start, end) = self.span(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        self.materialise()?;
        self.data[start..end].copy_from_slice(data);
        Ok(())
    }

    /// Runs `f` over the range `offset..offset+len` (materialising the buffer).
    pub(crate) fn with_slice<R>(&mut self, offset: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R, BytesError> {
        let (start, end) = self.span(offset, len)?;
        if len == 0 {
            return Ok(f(&[]));
        }
        self.materialise()?;
        Ok(f(&self.data[start..end]))
    }

    /// Runs `f` over the range `offset..offset+len` mutably (materialising the buffer).
    pub(crate) fn with_slice_mut<R>(
        &mut self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, BytesError> {
        let (start, end) = self.span(offset, len)?;
        if len == 0 {
            return Ok(f(&mut []));
        }
        self.materialise()?;
        Ok(f(&mut self.data[start..end]))
    }

    /// Copies `len` bytes from `self` at `src_offset` into `dst` at `dst_offset`.
    pub(crate) fn copy_to(
        &self,
        src_offset: u64,
        dst: &mut Bytes,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), BytesError> {
        let (s0, s1) = self.span(src_offset, len)?;
        let (d0, d1) = dst.span(dst_offset, len)?;
        if len == 0 || (self.data.is_empty() && dst.data.is_empty()) {
            // Both sides read as zeros: nothing changes.
            return Ok(());
        }
        dst.materialise()?;
        if self.data.is_empty() {
            dst.data[d0..d1].fill(0);
        } else {
            dst.data[d0..d1].copy_from_slice(&self.data[s0..s1]);
        }
        Ok(())
    }

    /// Marks the buffer freed and releases its bytes.
    pub(crate) fn release(&mut self) {
        self.freed = true;
        self.data = Vec::new();
    }
}

/// One device allocation.
pub(crate) struct DeviceBuffer {
    /// Its handle.
    pub(crate) id: DeviceBufferId,
    /// Its size in bytes.
    pub(crate) len: u64,
    /// Its contents.
    pub(crate) bytes: Mutex<Bytes>,
}

struct DeviceTable {
    buffers: HashMap<u64, Arc<DeviceBuffer>>,
    next_id: u64,
    in_use: u64,
    peak: u64,
}

/// The device allocator: live buffers and the capacity accounting.
pub(crate) struct DeviceMemory {
    capacity: u64,
    table: Mutex<DeviceTable>,
}

impl DeviceMemory {
    /// An empty device of `capacity` bytes.
    pub(crate) fn new(capacity: u64) -> Self {
        DeviceMemory {
            capacity,
            table: Mutex::new(DeviceTable { buffers: HashMap::new(), next_id: 1, in_use: 0, peak: 0 }),
        }
    }

    /// Capacity, use and peak.
    pub(crate) fn stats(&self) -> DeviceMemoryStats {
        let t = lock(&self.table);
        DeviceMemoryStats { capacity: self.capacity, in_use: t.in_use, peak: t.peak }
    }

    /// Resets the peak to the current use.
    pub(crate) fn reset_peak(&self) {
        let mut t = lock(&self.table);
        t.peak = t.in_use;
    }

    /// Allocates `bytes`; `inject_oom` makes it fail as if the device were full.
    pub(crate) fn alloc(&self, bytes: u64, inject_oom: bool) -> PlatformResult<DeviceBufferId> {
        let mut t = lock(&self.table);
        let oom = PlatformError::OutOfMemory { requested: bytes, in_use: t.in_use, capacity: self.capacity };
        if inject_oom {
            return Err(oom);
        }
        let in_use = t.in_use.checked_add(bytes).filter(|&u| u <= self.capacity).ok_or(oom)?;
        let id = DeviceBufferId(t.next_id);
        t.next_id += 1;
        t.in_use = in_use;
        t.peak = t.peak.max(in_use);
        t.buffers.insert(id.0, Arc::new(DeviceBuffer { id, len: bytes, bytes: Mutex::new(Bytes::new(bytes)) }));
        Ok(id)
    }

    /// The live buffer `id`.
    pub(crate) fn get(&self, id: DeviceBufferId) -> PlatformResult<Arc<DeviceBuffer>> {
        lock(&self.table)
            .buffers
            .get(&id.0)
            .cloned()
            .ok_or(PlatformError::InvalidHandle { what: "device buffer", id: id.0 })
    }

    /// Removes `id` from the table and the accounting. The caller releases its bytes.
    pub(crate) fn remove(&self, id: DeviceBufferId) -> PlatformResult<Arc<DeviceBuffer>> {
        let mut t = lock(&self.table);
        let buf = t.buffers.remove(&id.0).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: id.0 })?;
        t.in_use -= buf.len;
        Ok(buf)
    }
}

/// One host allocation.
pub(crate) struct HostBuffer {
    /// Its handle.
    pub(crate) id: HostBufferId,
    /// Its size in bytes.
    pub(crate) len: u64,
    /// Pinned, pageable or mapped.
    pub(crate) kind: HostMemoryKind,
    /// Its contents (unused for a mapped buffer, whose bytes are the region's).
    pub(crate) bytes: Mutex<Bytes>,
    /// A mapped buffer's region.
    pub(crate) region: Option<std::sync::Arc<dyn HostRegion>>,
    /// A mapped buffer was registered for device copies.
    pub(crate) registered: AtomicBool,
}

impl HostBuffer {
    /// Copies `out.len()` bytes at `offset` out of the buffer (through the region for a mapped one).
    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BytesError> {
        match &self.region {
            Some(r) => {
                lock(&self.bytes).span(0, 0)?;
                check_range("mapped read", offset, out.len() as u64, self.len)
                    .map_err(|_| BytesError::OutOfBounds { offset, len: out.len() as u64, size: self.len })?;
                r.read_at(offset, out).map_err(BytesError::Region)
            }
            None => lock(&self.bytes).read(offset, out),
        }
    }
}

struct HostTable {
    buffers: HashMap<u64, Arc<HostBuffer>>,
    next_id: u64,
    /// What the live buffers add up to (kept with the table, under its lock).
    usage: SimHostMemory,
}

/// The host allocator.
pub(crate) struct HostMemory {
    table: Mutex<HostTable>,
}

impl HostMemory {
    /// No buffers.
    pub(crate) fn new() -> Self {
        HostMemory {
            table: Mutex::new(HostTable { buffers: HashMap::new(), next_id: 1, usage: SimHostMemory::default() }),
        }
    }

    /// The live buffers' bytes and count.
    pub(crate) fn usage(&self) -> SimHostMemory {
        lock(&self.table).usage
    }

    /// Allocates `bytes` zero bytes of `kind`.
    pub(crate) fn alloc(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        if usize::try_from(bytes).is_err() {
            return Err(PlatformError::HostAllocFailed {
                requested: bytes,
                kind,
                reason: "size exceeds the address space".to_string(),
            });
        }
        let mut t = lock(&self.table);
        let id = HostBufferId(t.next_id);
        t.next_id += 1;
        let buf = HostBuffer {
            id,
            len: bytes,
            kind,
            bytes: Mutex::new(Bytes::new(bytes)),
            region: None,
            registered: AtomicBool::new(false),
        };
        t.buffers.insert(id.0, Arc::new(buf));
        let u = &mut t.usage;
        u.in_use = u.in_use.saturating_add(bytes);
        if kind == HostMemoryKind::Pinned {
            u.pinned = u.pinned.saturating_add(bytes);
        }
        u.buffers += 1;
        u.peak = u.peak.max(u.in_use);
        Ok(id)
    }

    /// Makes `region` a mapped buffer (not counted in `in_use`: the process does not own its bytes).
    pub(crate) fn map(&self, region: std::sync::Arc<dyn HostRegion>) -> HostBufferId {
        let mut t = lock(&self.table);
        let id = HostBufferId(t.next_id);
        t.next_id += 1;
        let len = region.len();
        let buf = HostBuffer {
            id,
            len,
            kind: HostMemoryKind::Mapped,
            bytes: Mutex::new(Bytes::new(0)),
            region: Some(region),
            registered: AtomicBool::new(false),
        };
        t.buffers.insert(id.0, Arc::new(buf));
        t.usage.mapped = t.usage.mapped.saturating_add(len);
        t.usage.buffers += 1;
        id
    }

    /// The live buffer `id`.
    pub(crate) fn get(&self, id: HostBufferId) -> PlatformResult<Arc<HostBuffer>> {
        lock(&self.table)
            .buffers
            .get(&id.0)
            .cloned()
            .ok_or(PlatformError::InvalidHandle { what: "host buffer", id: id.0 })
    }

    /// Removes `id` from the table. The caller releases its bytes.
    pub(crate) fn remove(&self, id: HostBufferId) -> PlatformResult<Arc<HostBuffer>> {
        let mut t = lock(&self.table);
        let buf = t.buffers.remove(&id.0).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: id.0 })?;
        let u = &mut t.usage;
        match buf.kind {
            HostMemoryKind::Mapped => u.mapped -= buf.len,
            HostMemoryKind::Pinned => {
                u.in_use -= buf.len;
                u.pinned -= buf.len;
            }
            HostMemoryKind::Pageable => u.in_use -= buf.len,
        }
        u.buffers -= 1;
        Ok(buf)
    }
}
