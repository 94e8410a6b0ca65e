//! The [`Platform`] methods of [`SimPlatform`]: argument validation, fault matching and enqueueing.
//!
//! Invariant: every enqueue validates handles and ranges, and registers its op with the hazard detector, before the
//! op becomes visible to a worker (under the queue's lock); an op that cannot be enqueued leaves no hazard entry or
//! pending event behind.

use super::hazard::{BufferRef, Touch};
use super::lifecycle::shut_down_error;
use super::memory::{check_range, BytesError};
use super::stats::StatCounters;
use super::stream::{CopyOp, Op};
use super::{event::GenStatus, SimPlatform, UNINIT_BYTE};
use crate::platform::{
    DeviceBufferId, DeviceMemoryStats, EventId, HostBufferId, HostMemoryKind, HostRegion, Platform, PlatformError,
    PlatformResult, StreamId,
};
use crate::sync::atomic::Ordering;
use crate::sync::lock;

fn host_bytes_error(what: &'static str, id: HostBufferId, kind: HostMemoryKind, e: BytesError) -> PlatformError {
    match e {
        BytesError::OutOfBounds { offset, len, size } => PlatformError::OutOfBounds { what, offset, len, size },
        BytesError::Freed => PlatformError::InvalidHandle { what: "host buffer", id: id.0 },
        BytesError::Alloc(reason) => PlatformError::HostAllocFailed { requested: 0, kind, reason },
        BytesError::Region(reason) => PlatformError::MappedReadFailed { id: id.0, reason },
    }
}

fn status_result(event: EventId, status: GenStatus) -> PlatformResult<bool> {
    match status {
        GenStatus::Pending => Ok(false),
        GenStatus::Done => Ok(true),
        GenStatus::Failed(reason) => Err(PlatformError::EventFailed { event, reason }),
    }
}

impl Platform for SimPlatform {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_memory(&self) -> DeviceMemoryStats {
        self.shared().memory.stats()
    }

    fn reset_peak(&self) {
        self.shared().memory.reset_peak();
    }

    fn alloc_device(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        let shared = self.shared();
        let n = shared.faults.next_alloc();
        let id = shared.memory.alloc(bytes, shared.config.faults.oom_at_alloc == Some(n))?;
        StatCounters::bump(&shared.stats.allocs, 1);
        Ok(id)
    }

    fn alloc_device_shared(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        let id = self.alloc_device(bytes)?;
        lock(&self.shared().windows).push(id);
        Ok(id)
    }

    fn free_device(&self, buf: DeviceBufferId) -> PlatformResult<()> {
        let shared = self.shared();
        let b = shared.memory.remove(buf)?;
        shared.hazards.free("free_device", BufferRef::Device(buf));
        lock(&b.bytes).release();
        StatCounters::bump(&shared.stats.frees, 1);
        Ok(())
    }

    fn device_buffer_len(&self, buf: DeviceBufferId) -> PlatformResult<u64> {
        Ok(self.shared().memory.get(buf)?.len)
    }

    fn alloc_host(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        if kind == HostMemoryKind::Mapped {
            return Err(PlatformError::HostAllocFailed {
                requested: bytes,
                kind,
                reason: "mapped memory is lent by a region (map_host), not allocated".to_string(),
            });
        }
        let shared = self.shared();
        let n = shared.faults.next_host_alloc();
        if shared.config.faults.fail_host_alloc == Some(n) {
            return Err(PlatformError::HostAllocFailed {
                requested: bytes,
                kind,
                reason: format!("injected failure of host allocation #{n}"),
            });
        }
        shared.host.alloc(bytes, kind)
    }

    /// Its contents are unspecified: the sim fills it with [`UNINIT_BYTE`], so a caller that copies or reads bytes
    /// it never wrote shows up in the tests as that pattern, not as the zeros [`Platform::alloc_host`] gives.
    fn alloc_host_uninit(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        let buf = self.alloc_host(bytes, kind)?;
        let chunk = vec![UNINIT_BYTE; bytes.min(1 << 20) as usize];
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(chunk.len() as u64);
            if let Err(e) = self.write_host(buf, at, &chunk[..n as usize]) {
                let _ = self.free_host(buf);
                return Err(e);
            }
            at += n;
        }
        Ok(buf)
    }

    fn free_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        let shared = self.shared();
        let b = shared.host.remove(buf)?;
        shared.hazards.free("free_host", BufferRef::Host(buf));
        lock(&b.bytes).release();
        Ok(())
    }

    fn write_host(&self, buf: HostBufferId, offset: u64, data: &[u8]) -> PlatformResult<()> {
        let shared = self.shared();
        let b = shared.host.get(buf)?;
        if b.kind == HostMemoryKind::Mapped {
            return Err(PlatformError::ReadOnly { id: buf.0, what: "a CPU write" });
        }
        let len = data.len() as u64;
        check_range("host write", offset, len, b.len)?;
        shared.hazards.host_access("write_host", Touch { buffer: BufferRef::Host(buf), offset, len, write: true });
        let res = lock(&b.bytes).write(offset, data);
        res.map_err(|e| match e {
            BytesError::Alloc(reason) => PlatformError::HostAllocFailed { requested: b.len, kind: b.kind, reason },
            other => host_bytes_error("host write", buf, b.kind, other),
        })
    }

    fn read_host(&self, buf: HostBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()> {
        let shared = self.shared();
        let b = shared.host.get(buf)?;
        let len = out.len() as u64;
        check_range("host read", offset, len, b.len)?;
        shared.hazards.host_access("read_host", Touch { buffer: BufferRef::Host(buf), offset, len, write: false });
        let res = b.read(offset, out);
        res.map_err(|e| host_bytes_error("host read", buf, b.kind, e))
    }

    fn host_buffer_info(&self, buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)> {
        let b = self.shared().host.get(buf)?;
        Ok((b.len, b.kind))
    }

    fn map_host(&self, region: std::sync::Arc<dyn HostRegion>) -> PlatformResult<HostBufferId> {
        Ok(self.shared().host.map(region))
    }

    fn register_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        let shared = self.shared();
        let b = shared.host.get(buf)?;
        if b.kind != HostMemoryKind::Mapped {
            return Err(PlatformError::InvalidHandle { what: "mapped host buffer", id: buf.0 });
        }
        if shared.config.faults.fail_register_host {
            return Err(PlatformError::Driver(format!("injected failure registering host buffer {}", buf.0)));
        }
        b.registered.store(true, Ordering::Release);
        Ok(())
    }

    fn create_stream(&self, name: &str) -> PlatformResult<StreamId> {
        self.spawn_stream(name)
    }

    fn destroy_stream(&self, stream: StreamId) -> PlatformResult<()> {
        self.destroy_stream_impl(stream)
    }

    fn create_event(&self) -> PlatformResult<EventId> {
        self.shared().events.create()
    }

    fn destroy_event(&self, event: EventId) -> PlatformResult<()> {
        let shared = self.shared();
        shared.events.destroy(event)?;
        shared.hazards.event_destroyed(event);
        Ok(())
    }

    fn record_event(&self, event: EventId, stream: StreamId) -> PlatformResult<()> {
        let shared = self.shared();
        let queue = self.queue(stream)?;
        self.check_up()?;
        let gen = shared.events.record(event)?;
        let op = || {
            shared.hazards.record(stream, event);
            Op::Record { event, gen }
        };
        queue.push_with(shared, op).inspect_err(|e| {
            shared.events.complete(event, gen, Some(e.to_string()));
        })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> PlatformResult<()> {
        let shared = self.shared();
        let queue = self.queue(stream)?;
        self.check_up()?;
        let gen = shared.events.capture(event)?;
        if gen == 0 {
            // Never recorded: counts as complete, nothing to wait for.
            return Ok(());
        }
        queue.push_with(shared, || {
            shared.hazards.wait(stream, event);
            Op::Wait { event, gen }
        })
    }

    fn event_query(&self, event: EventId) -> PlatformResult<bool> {
        let status = self.shared().events.query(event)?;
        status_result(event, status)
    }

    fn event_synchronize(&self, event: EventId) -> PlatformResult<()> {
        let shared = self.shared();
        // Validate the handle before counting the call against the fault plan.
        shared.events.capture(event)?;
        let n = shared.faults.next_event_sync();
        if shared.config.faults.fail_event_sync == Some(n) {
            return Err(PlatformError::EventFailed {
                event,
                reason: format!("injected failure of event_synchronize call #{n}"),
            });
        }
        let clock = shared.hazards.event_clock(event);
        match shared.events.synchronize(event, &shared.life)? {
            Some(status) => {
                shared.hazards.thread_synchronized(&clock);
                status_result(event, status).map(|_| ())
            }
            None => Err(shut_down_error()),
        }
    }

    fn stream_synchronize(&self, stream: StreamId) -> PlatformResult<()> {
        let shared = self.shared();
        let queue = self.queue(stream)?;
        let clock = shared.hazards.stream_clock(stream);
        let synced = queue.synchronize(shared);
        // A shut-down platform discarded work, and a worker synchronising its own stream waited for nothing.
        if !matches!(synced, Err(PlatformError::Unavailable(_))) && !queue.is_worker_thread() {
            shared.hazards.host_synchronized(&clock);
        }
        synced
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
        let shared = self.shared();
        let queue = self.queue(stream)?;
        self.check_up()?;
        let host = shared.host.get(src)?;
        if host.kind == HostMemoryKind::Mapped && !host.registered.load(Ordering::Acquire) {
            return Err(PlatformError::ReadOnly { id: src.0, what: "a device copy from it before register_host" });
        }
        let dev = shared.memory.get(dst)?;
        check_range("source", src_offset, len, host.len)?;
        check_range("destination", dst_offset, len, dev.len)?;
        let n = shared.faults.next_h2d();
        if shared.config.faults.fail_h2d_copy == Some(n) {
            return Err(PlatformError::CopyFailed {
                direction: "host-to-device",
                bytes: len,
                reason: format!("injected failure of h2d copy #{n}"),
            });
        }
        let label = format!("h2d #{n} host {}+{src_offset} -> dev {}+{dst_offset} ({len} B)", src.0, dst.0);
        let touches = vec![
            Touch { buffer: BufferRef::Host(src), offset: src_offset, len, write: false },
            Touch { buffer: BufferRef::Device(dst), offset: dst_offset, len, write: true },
        ];
        let inject_failure = shared.config.faults.fail_h2d_copy_async == Some(n);
        queue.push_with(shared, || {
            shared.hazards.register(stream, &queue.name, label.clone(), touches);
            Op::H2d(CopyOp { label, host, host_offset: src_offset, dev, dev_offset: dst_offset, len, inject_failure })
        })
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
        let shared = self.shared();
        let queue = self.queue(stream)?;
        self.check_up()?;
        let dev = shared.memory.get(src)?;
        let host = shared.host.get(dst)?;
        if host.kind == HostMemoryKind::Mapped {
            return Err(PlatformError::ReadOnly { id: dst.0, what: "a device-to-host copy into it" });
        }
        check_range("source", src_offset, len, dev.len)?;
        check_range("destination", dst_offset, len, host.len)?;
        let n = shared.faults.next_d2h();
        if shared.config.faults.fail_d2h_copy == Some(n) {
            return Err(PlatformError::CopyFailed {
                direction: "device-to-host",
                bytes: len,
                reason: format!("injected failure of d2h copy #{n}"),
            });
        }
        let label = format!("d2h dev {}+{src_offset} -> host {}+{dst_offset} ({len} B)", src.0, dst.0);
        let touches = vec![
            Touch { buffer: BufferRef::Device(src), offset: src_offset, len, write: false },
            Touch { buffer: BufferRef::Host(dst), offset: dst_offset, len, write: true },
        ];
        queue.push_with(shared, || {
            shared.hazards.register(stream, &queue.name, label.clone(), touches);
            Op::D2h(CopyOp {
                label,
                host,
                host_offset: dst_offset,
                dev,
                dev_offset: src_offset,
                len,
                inject_failure: false,
            })
        })
    }
}
