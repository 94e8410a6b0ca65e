//! Shared helpers of the CPU benchmarks: a block stack on the simulated platform with zero-cost copies, and
//! percentile summaries.

use std::sync::Arc;
use std::time::Duration;
use weightferry_actors::platform::{HostMemoryKind, PlatformRef, StreamId};
use weightferry_actors::sim::{SimConfig, SimPlatform};
use weightferry_actors::{
    BlockSpec, BlockStack, OrderingFault, Segment, StackSpec, StreamHandle, StreamOptions, Submission,
};

/// A stack of `n` blocks of `bytes` each on a fresh sim platform.
pub(crate) fn stack(
    n: usize,
    bytes: u64,
    head: usize,
    depth: usize,
) -> (Arc<SimPlatform>, StreamId, StreamHandle, Arc<BlockStack>) {
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).expect("sim"));
    let p: PlatformRef = sim.clone();
    let compute = p.create_stream("compute").expect("stream");
    let stream = StreamHandle::spawn(p.clone(), "copy", StreamOptions::default()).expect("actor");
    let blocks = (0..n)
        .map(|_| {
            let h = p.alloc_host(bytes, HostMemoryKind::Pinned).expect("host");
            BlockSpec {
                segments: vec![Segment { host: h, host_offset: 0, len: bytes, device_offset: 0 }],
                reads: Vec::new(),
                device_bytes: bytes,
            }
        })
        .collect();
    let spec = StackSpec {
        name: "bench".into(),
        blocks,
        resident_head: head,
        prefetch_depth: depth,
        static_slots: false,
        eager_prefetch: true,
        ordering_fault: OrderingFault::None,
        submission: Submission::Actor,
    };
    let st = Arc::new(BlockStack::new(p, spec, compute, stream.clone()).expect("stack"));
    (sim, compute, stream, st)
}

/// `(p50, p99, max)` of samples.
#[allow(dead_code)] // used by hook_latency, not by every bench including this module
pub(crate) fn percentiles(mut v: Vec<Duration>) -> (Duration, Duration, Duration) {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), *v.last().unwrap_or(&Duration::ZERO))
}

/// A platform on which every device operation completes the moment it is enqueued: copies move no bytes, events are
/// always complete. Benchmarks use it to measure the scheduler's own cost (slot bookkeeping, messages to the stream
/// actor, its thread hand-off) without any simulated device work.
#[derive(Debug, Default)]
pub(crate) struct NullPlatform {
    next: std::sync::atomic::AtomicU64,
}

#[allow(dead_code)] // used by hook_latency, not by every bench including this module
impl NullPlatform {
    fn id(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }
}

mod null_impl {
    use super::NullPlatform;
    use weightferry_actors::platform::*;

    impl Platform for NullPlatform {
        fn name(&self) -> &'static str {
            "null"
        }
        fn device_memory(&self) -> DeviceMemoryStats {
            DeviceMemoryStats { capacity: u64::MAX, in_use: 0, peak: 0 }
        }
        fn reset_peak(&self) {}
        fn alloc_device(&self, _bytes: u64) -> PlatformResult<DeviceBufferId> {
            Ok(DeviceBufferId(self.id()))
        }
        fn free_device(&self, _buf: DeviceBufferId) -> PlatformResult<()> {
            Ok(())
        }
        fn device_buffer_len(&self, _buf: DeviceBufferId) -> PlatformResult<u64> {
            Ok(0)
        }
        fn alloc_host(&self, _bytes: u64, _kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
            Ok(HostBufferId(self.id()))
        }
        fn free_host(&self, _buf: HostBufferId) -> PlatformResult<()> {
            Ok(())
        }
        fn write_host(&self, _buf: HostBufferId, _offset: u64, _data: &[u8]) -> PlatformResult<()> {
            Ok(())
        }
        fn read_host(&self, _buf: HostBufferId, _offset: u64, _out: &mut [u8]) -> PlatformResult<()> {
            Ok(())
        }
        fn host_buffer_info(&self, _buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)> {
            Ok((0, HostMemoryKind::Pinned))
        }
        fn create_stream(&self, _name: &str) -> PlatformResult<StreamId> {
            Ok(StreamId(self.id() as u32))
        }
        fn destroy_stream(&self, _stream: StreamId) -> PlatformResult<()> {
            Ok(())
        }
        fn create_event(&self) -> PlatformResult<EventId> {
            Ok(EventId(self.id() as u32))
        }
        fn destroy_event(&self, _event: EventId) -> PlatformResult<()> {
            Ok(())
        }
        fn record_event(&self, _event: EventId, _stream: StreamId) -> PlatformResult<()> {
            Ok(())
        }
        fn stream_wait_event(&self, _stream: StreamId, _event: EventId) -> PlatformResult<()> {
            Ok(())
        }
        fn event_query(&self, _event: EventId) -> PlatformResult<bool> {
            Ok(true)
        }
        fn event_synchronize(&self, _event: EventId) -> PlatformResult<()> {
            Ok(())
        }
        fn stream_synchronize(&self, _stream: StreamId) -> PlatformResult<()> {
            Ok(())
        }
        fn copy_h2d(
            &self,
            _: StreamId,
            _: HostBufferId,
            _: u64,
            _: DeviceBufferId,
            _: u64,
            _: u64,
        ) -> PlatformResult<()> {
            Ok(())
        }
        fn copy_d2h(
            &self,
            _: StreamId,
            _: DeviceBufferId,
            _: u64,
            _: HostBufferId,
            _: u64,
            _: u64,
        ) -> PlatformResult<()> {
            Ok(())
        }
    }
}

/// A stack of `n` blocks on a [`NullPlatform`], its streamed loads enqueued as `submission` says.
#[allow(dead_code)] // used by hook_latency, not by every bench including this module
pub(crate) fn null_stack(n: usize, depth: usize, submission: Submission) -> (StreamHandle, Arc<BlockStack>) {
    let p: PlatformRef = Arc::new(NullPlatform::default());
    let compute = p.create_stream("compute").expect("stream");
    let stream = StreamHandle::spawn(p.clone(), "copy", StreamOptions::default()).expect("actor");
    let blocks = (0..n)
        .map(|_| {
            let h = p.alloc_host(4096, HostMemoryKind::Pinned).expect("host");
            BlockSpec {
                segments: vec![Segment { host: h, host_offset: 0, len: 4096, device_offset: 0 }],
                reads: Vec::new(),
                device_bytes: 4096,
            }
        })
        .collect();
    let spec = StackSpec {
        name: "null".into(),
        blocks,
        resident_head: 0,
        prefetch_depth: depth,
        static_slots: false,
        eager_prefetch: true,
        ordering_fault: OrderingFault::None,
        submission,
    };
    let st = Arc::new(BlockStack::new(p, spec, compute, stream.clone()).expect("stack"));
    (stream, st)
}
