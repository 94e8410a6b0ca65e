//! A platform wrapper that makes every host→device copy slow by enqueueing a large dummy copy in front of it on the
//! same stream. Used by the GPU tests to prove that a deliberately broken ordering (compute not waiting for a ready
//! event) is caught: with fast copies a race may not show; with slow ones it must.

use std::sync::{Arc, Mutex};
use weightferry::platform::cuda::CudaPlatform;
use weightferry::scheduler::{
    DeviceBufferId, DeviceMemoryStats, EventId, HostBufferId, HostMemoryKind, Platform, PlatformResult, StreamId,
};

/// Bytes of the dummy copy in front of each real copy (≈1 ms at PCIe Gen5 speed).
pub const DUMMY_COPY_BYTES: u64 = 64 << 20;

/// [`CudaPlatform`] with slowed host→device copies.
#[derive(Debug)]
pub struct SlowCopies {
    inner: Arc<CudaPlatform>,
    scratch: Mutex<Option<(HostBufferId, DeviceBufferId)>>,
}

impl SlowCopies {
    /// Wraps `inner`.
    pub fn new(inner: Arc<CudaPlatform>) -> Self {
        SlowCopies { inner, scratch: Mutex::new(None) }
    }
    fn scratch(&self) -> PlatformResult<(HostBufferId, DeviceBufferId)> {
        let mut g = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = *g {
            return Ok(s);
        }
        let h = self.inner.alloc_host(DUMMY_COPY_BYTES, HostMemoryKind::Pinned)?;
        let d = match self.inner.alloc_device(DUMMY_COPY_BYTES) {
            Ok(d) => d,
            Err(e) => {
                let _ = self.inner.free_host(h);
                return Err(e);
            }
        };
        *g = Some((h, d));
        Ok((h, d))
    }
}

impl Drop for SlowCopies {
    fn drop(&mut self) {
        if let Some((h, d)) = self.scratch.lock().ok().and_then(|mut g| g.take()) {
            let _ = self.inner.free_host(h);
            let _ = self.inner.free_device(d);
        }
    }
}

impl Platform for SlowCopies {
    fn name(&self) -> &'static str {
        "cuda-slow-copies"
    }
    fn device_memory(&self) -> DeviceMemoryStats {
        self.inner.device_memory()
    }
    fn reset_peak(&self) {
        self.inner.reset_peak()
    }
    fn alloc_device(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        self.inner.alloc_device(bytes)
    }
    fn alloc_device_shared(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
        self.inner.alloc_device_shared(bytes)
    }
    fn free_device(&self, buf: DeviceBufferId) -> PlatformResult<()> {
        self.inner.free_device(buf)
    }
    fn device_buffer_len(&self, buf: DeviceBufferId) -> PlatformResult<u64> {
        self.inner.device_buffer_len(buf)
    }
    fn alloc_host(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
        self.inner.alloc_host(bytes, kind)
    }
    fn free_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        self.inner.free_host(buf)
    }
    fn write_host(&self, buf: HostBufferId, offset: u64, data: &[u8]) -> PlatformResult<()> {
        self.inner.write_host(buf, offset, data)
    }
    fn read_host(&self, buf: HostBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()> {
        self.inner.read_host(buf, offset, out)
    }
    fn map_host(&self, region: std::sync::Arc<dyn weightferry::scheduler::HostRegion>) -> PlatformResult<HostBufferId> {
        self.inner.map_host(region)
    }
    fn register_host(&self, buf: HostBufferId) -> PlatformResult<()> {
        self.inner.register_host(buf)
    }
    fn host_buffer_info(&self, buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)> {
        self.inner.host_buffer_info(buf)
    }
    fn create_stream(&self, name: &str) -> PlatformResult<StreamId> {
        self.inner.create_stream(name)
    }
    fn destroy_stream(&self, stream: StreamId) -> PlatformResult<()> {
        self.inner.destroy_stream(stream)
    }
    fn create_event(&self) -> PlatformResult<EventId> {
        self.inner.create_event()
    }
    fn destroy_event(&self, event: EventId) -> PlatformResult<()> {
        self.inner.destroy_event(event)
    }
    fn record_event(&self, event: EventId, stream: StreamId) -> PlatformResult<()> {
        self.inner.record_event(event, stream)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> PlatformResult<()> {
        self.inner.stream_wait_event(stream, event)
    }
    fn event_query(&self, event: EventId) -> PlatformResult<bool> {
        self.inner.event_query(event)
    }
    fn event_synchronize(&self, event: EventId) -> PlatformResult<()> {
        self.inner.event_synchronize(event)
    }
    fn stream_synchronize(&self, stream: StreamId) -> PlatformResult<()> {
        self.inner.stream_synchronize(stream)
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
        let (h, d) = self.scratch()?;
        self.inner.copy_h2d(stream, h, 0, d, 0, DUMMY_COPY_BYTES)?;
        self.inner.copy_h2d(stream, src, src_offset, dst, dst_offset, len)
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
        self.inner.copy_d2h(stream, src, src_offset, dst, dst_offset, len)
    }
}
