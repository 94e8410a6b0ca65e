//! Shared helpers of the CPU benchmarks: a block stack on the simulated platform with zero-cost copies, and
//! percentile summaries.

use std::sync::Arc;
use std::time::Duration;
use weightferry_actors::platform::{HostMemoryKind, PlatformRef, StreamId};
use weightferry_actors::sim::{SimConfig, SimPlatform};
use weightferry_actors::{BlockSpec, BlockStack, OrderingFault, Segment, StackSpec, StreamHandle, StreamOptions};

/// A stack of `n` blocks of `bytes` each on a fresh sim platform.
pub fn stack(
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
                device_bytes: bytes,
            }
        })
        .collect();
    let spec = StackSpec {
        name: "bench".into(),
        blocks,
        resident_head: head,
        prefetch_depth: depth,
        eager_prefetch: true,
        ordering_fault: OrderingFault::None,
    };
    let st = Arc::new(BlockStack::new(p, spec, compute, stream.clone()).expect("stack"));
    (sim, compute, stream, st)
}

/// `(p50, p99, max)` of samples.
#[allow(dead_code)] // used by hook_latency, not by every bench including this module
pub fn percentiles(mut v: Vec<Duration>) -> (Duration, Duration, Duration) {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), *v.last().unwrap_or(&Duration::ZERO))
}
