//! Tests of the CUDA platform.
//!
//! `new_reports_unavailable_or_opens` runs everywhere (on a machine without a GPU it checks that opening the
//! platform fails cleanly instead of panicking). The rest need a GPU and are `#[ignore]`d; run them on the GPU
//! machine with
//!
//! ```text
//! cargo test -p weightferry --features cuda --test cuda_platform -- --include-ignored --test-threads=1
//! ```
#![cfg(feature = "cuda")]

use std::sync::Arc;

use weightferry::platform::cuda::CudaPlatform;
use weightferry_actors::platform::{
    DeviceBufferId, EventId, HostBufferId, HostMemoryKind, Platform, PlatformError, StreamId,
};

const MIB: u64 = 1 << 20;

fn gpu() -> CudaPlatform {
    match CudaPlatform::new(0) {
        Ok(p) => p,
        Err(e) => panic!("this test needs a CUDA device: {e}"),
    }
}

/// A byte pattern that differs between neighbouring bytes and between seeds.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

fn read_all(p: &CudaPlatform, buf: HostBufferId) -> Vec<u8> {
    let (len, _) = p.host_buffer_info(buf).expect("host buffer info");
    let mut out = vec![0u8; len as usize];
    p.read_host(buf, 0, &mut out).expect("read host");
    out
}

#[test]
fn new_reports_unavailable_or_opens() {
    let outcome = std::panic::catch_unwind(|| CudaPlatform::new(0).map(|p| p.name()));
    match outcome {
        Err(_) => panic!("CudaPlatform::new panicked"),
        Ok(Ok(name)) => assert_eq!(name, "cuda"),
        Ok(Err(PlatformError::Unavailable(msg))) => {
            assert!(!msg.is_empty());
            eprintln!("CUDA unavailable here (expected without a GPU): {msg}");
        }
        Ok(Err(other)) => panic!("expected Unavailable without a GPU, got {other:?}"),
    }
}

#[test]
fn missing_device_ordinal_is_unavailable() {
    match CudaPlatform::new(1_000_000) {
        Err(PlatformError::Unavailable(_)) => {}
        other => panic!("expected Unavailable for a device that cannot exist, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn alloc_free_and_oom_with_capacity_limit() {
    let p = gpu().with_capacity_limit(64 * MIB);
    assert_eq!(p.name(), "cuda");
    let stats = p.device_memory();
    assert_eq!((stats.capacity, stats.in_use, stats.peak), (64 * MIB, 0, 0));

    let a = p.alloc_device(32 * MIB).expect("first half");
    let b = p.alloc_device(32 * MIB).expect("second half");
    assert_eq!(p.device_buffer_len(a).unwrap(), 32 * MIB);
    let (ptr_a, len_a) = p.device_ptr(a).expect("device ptr");
    assert!(ptr_a != 0 && len_a == 32 * MIB);
    match p.alloc_device(1) {
        Err(PlatformError::OutOfMemory { requested: 1, in_use, capacity }) => {
            assert_eq!((in_use, capacity), (64 * MIB, 64 * MIB));
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(p.device_memory().in_use, 64 * MIB);
    assert_eq!(p.device_memory().peak, 64 * MIB);

    p.free_device(a).expect("free a");
    assert_eq!(p.device_memory().in_use, 32 * MIB);
    assert_eq!(p.device_memory().peak, 64 * MIB);
    p.reset_peak();
    assert_eq!(p.device_memory().peak, 32 * MIB);
    let c = p.alloc_device(16 * MIB).expect("fits again after free");
    assert_eq!(p.device_memory().peak, 48 * MIB);

    let empty = p.alloc_device(0).expect("zero-length buffer");
    assert_eq!(p.device_buffer_len(empty).unwrap(), 0);
    p.free_device(empty).unwrap();

    p.free_device(b).unwrap();
    p.free_device(c).unwrap();
    assert_eq!(p.device_memory().in_use, 0);
    assert!(matches!(p.free_device(a), Err(PlatformError::InvalidHandle { what: "device buffer", .. })));
    assert!(matches!(p.device_buffer_len(b), Err(PlatformError::InvalidHandle { .. })));
    assert!(p.device_ptr(a).is_none());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn uncapped_capacity_is_device_memory() {
    let p = gpu();
    let stats = p.device_memory();
    assert_eq!(stats.capacity, p.total_memory());
    assert!(stats.capacity > 1 << 30, "capacity {} looks too small", stats.capacity);
    eprintln!("device {}: {} bytes", p.device_name(), stats.capacity);
    // A request beyond the whole device fails cleanly.
    assert!(matches!(p.alloc_device(stats.capacity + 1), Err(PlatformError::OutOfMemory { .. })));
}

fn round_trip(kind: HostMemoryKind) {
    let p = gpu();
    let len = 64 * MIB;
    let data = pattern(len as usize, 7);
    let src = p.alloc_host(len, kind).unwrap();
    let dst = p.alloc_host(len, kind).unwrap();
    assert_eq!(p.host_buffer_info(src).unwrap(), (len, kind));
    assert!(read_all(&p, dst).iter().all(|&b| b == 0), "fresh host buffers are zeroed");
    p.write_host(src, 0, &data).unwrap();
    let dev = p.alloc_device(len).unwrap();
    let s = p.create_stream("copy").unwrap();
    p.copy_h2d(s, src, 0, dev, 0, len).unwrap();
    p.copy_d2h(s, dev, 0, dst, 0, len).unwrap();
    p.stream_synchronize(s).unwrap();
    assert!(read_all(&p, dst) == data, "{kind:?} round trip changed the bytes");

    // Partial copies at offsets: move the first MiB of the source to 3 MiB into the device buffer, then back to
    // 5 MiB into the destination.
    p.copy_h2d(s, src, 0, dev, 3 * MIB, MIB).unwrap();
    p.copy_d2h(s, dev, 3 * MIB, dst, 5 * MIB, MIB).unwrap();
    p.stream_synchronize(s).unwrap();
    let mut window = vec![0u8; MIB as usize];
    p.read_host(dst, 5 * MIB, &mut window).unwrap();
    assert!(window[..] == data[..MIB as usize]);

    p.free_device(dev).unwrap();
    p.free_host(src).unwrap();
    p.free_host(dst).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trip_pinned_64mib() {
    round_trip(HostMemoryKind::Pinned);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trip_pageable_64mib() {
    round_trip(HostMemoryKind::Pageable);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn event_orders_work_across_streams() {
    let p = gpu();
    let len = 256 * MIB;
    let src = p.alloc_host(len, HostMemoryKind::Pinned).unwrap();
    let dst = p.alloc_host(len, HostMemoryKind::Pinned).unwrap();
    let dev = p.alloc_device(len).unwrap();
    let a = p.create_stream("a").unwrap();
    let b = p.create_stream("b").unwrap();
    let ready = p.create_event().unwrap();
    let done = p.create_event().unwrap();
    // New bytes every round: if stream B read the device buffer before stream A's copy finished, it would see
    // the previous round's bytes.
    for round in 0..4u64 {
        let data = pattern(len as usize, 11 + round);
        p.write_host(src, 0, &data).unwrap();
        // Copy in 16 chunks on stream A so the tail is still running when B starts waiting.
        for i in 0..16 {
            let off = i * (len / 16);
            p.copy_h2d(a, src, off, dev, off, len / 16).unwrap();
        }
        p.record_event(ready, a).unwrap();
        p.stream_wait_event(b, ready).unwrap();
        p.copy_d2h(b, dev, 0, dst, 0, len).unwrap();
        p.record_event(done, b).unwrap();
        let early = p.event_query(done).unwrap();
        if round % 2 == 0 {
            p.event_synchronize(done).unwrap();
        } else {
            while !p.event_query(done).unwrap() {
                std::hint::spin_loop();
            }
        }
        assert!(p.event_query(done).unwrap(), "event complete after synchronize");
        assert!(p.event_query(ready).unwrap(), "the awaited event is complete too");
        assert!(read_all(&p, dst) == data, "round {round}: stream B read before stream A's copy finished");
        eprintln!("round {round}: done event already complete right after enqueue: {early}");
    }
    p.destroy_event(ready).unwrap();
    p.destroy_event(done).unwrap();
    assert!(matches!(p.event_query(ready), Err(PlatformError::InvalidHandle { what: "event", .. })));
    p.free_device(dev).unwrap();
    p.free_host(src).unwrap();
    p.free_host(dst).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn never_recorded_event_counts_complete() {
    let p = gpu();
    let e = p.create_event().unwrap();
    let s = p.create_stream("s").unwrap();
    assert!(p.event_query(e).unwrap());
    p.event_synchronize(e).unwrap();
    p.stream_wait_event(s, e).unwrap();
    p.stream_synchronize(s).unwrap();
    assert!(p.raw_event(e).is_some());
    assert!(p.raw_stream(s).is_some());
    p.destroy_event(e).unwrap();
    assert!(p.raw_event(e).is_none());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn invalid_handles_and_ranges_are_errors() {
    let p = gpu();
    let s = p.create_stream("s").unwrap();
    let e = p.create_event().unwrap();
    let host = p.alloc_host(MIB, HostMemoryKind::Pinned).unwrap();
    let dev = p.alloc_device(MIB).unwrap();
    let bad_stream = StreamId(u32::MAX);
    let bad_event = EventId(u32::MAX);
    let bad_host = HostBufferId(u64::MAX);
    let bad_dev = DeviceBufferId(u64::MAX);

    let invalid = |r: Result<(), PlatformError>, what: &str| match r {
        Err(PlatformError::InvalidHandle { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected an invalid {what} handle, got {other:?}"),
    };
    invalid(p.copy_h2d(bad_stream, host, 0, dev, 0, 16), "stream");
    invalid(p.copy_h2d(s, bad_host, 0, dev, 0, 16), "host buffer");
    invalid(p.copy_h2d(s, host, 0, bad_dev, 0, 16), "device buffer");
    invalid(p.copy_d2h(s, bad_dev, 0, host, 0, 16), "device buffer");
    invalid(p.record_event(bad_event, s), "event");
    invalid(p.record_event(e, bad_stream), "stream");
    invalid(p.stream_wait_event(s, bad_event), "event");
    invalid(p.event_synchronize(bad_event), "event");
    invalid(p.stream_synchronize(bad_stream), "stream");
    invalid(p.destroy_event(bad_event), "event");
    invalid(p.free_host(bad_host), "host buffer");
    invalid(p.free_device(bad_dev), "device buffer");
    invalid(p.write_host(bad_host, 0, &[1]), "host buffer");
    assert!(matches!(p.event_query(bad_event), Err(PlatformError::InvalidHandle { .. })));

    let oob = |r: Result<(), PlatformError>| assert!(matches!(r, Err(PlatformError::OutOfBounds { .. })), "{r:?}");
    oob(p.copy_h2d(s, host, MIB - 8, dev, 0, 16));
    oob(p.copy_h2d(s, host, 0, dev, MIB - 8, 16));
    oob(p.copy_d2h(s, dev, u64::MAX, host, 0, 16));
    oob(p.copy_d2h(s, dev, 0, host, MIB, 1));
    oob(p.write_host(host, MIB - 1, &[1, 2]));
    oob(p.read_host(host, u64::MAX, &mut [0u8; 2]));
    // Zero-length copies at the very end are in bounds.
    p.copy_h2d(s, host, MIB, dev, MIB, 0).unwrap();
    p.stream_synchronize(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_from_other_threads_bind_the_context() {
    let p = Arc::new(gpu());
    let len = 8 * MIB;
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                let data = pattern(len as usize, 1000 + t);
                let s = p.create_stream("worker").unwrap();
                let e = p.create_event().unwrap();
                let src = p.alloc_host(len, HostMemoryKind::Pinned).unwrap();
                let dst = p.alloc_host(len, HostMemoryKind::Pinned).unwrap();
                let dev = p.alloc_device(len).unwrap();
                p.write_host(src, 0, &data).unwrap();
                p.copy_h2d(s, src, 0, dev, 0, len).unwrap();
                p.copy_d2h(s, dev, 0, dst, 0, len).unwrap();
                p.record_event(e, s).unwrap();
                p.event_synchronize(e).unwrap();
                assert!(read_all(&p, dst) == data);
                p.free_device(dev).unwrap();
                p.free_host(src).unwrap();
                p.free_host(dst).unwrap();
                p.destroy_event(e).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().expect("worker thread");
    }
    assert_eq!(p.device_memory().in_use, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn drop_with_live_objects_and_pending_work() {
    let p = gpu();
    let len = 128 * MIB;
    let src = p.alloc_host(len, HostMemoryKind::Pinned).unwrap();
    let dev = p.alloc_device(len).unwrap();
    let s = p.create_stream("s").unwrap();
    let e = p.create_event().unwrap();
    p.copy_h2d(s, src, 0, dev, 0, len).unwrap();
    p.record_event(e, s).unwrap();
    drop(p); // synchronises the stream, then frees everything
             // A fresh platform on the same device still works.
    let q = gpu();
    let d = q.alloc_device(MIB).unwrap();
    q.free_device(d).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_h2d_bandwidth_above_10_gbps() {
    let p = gpu();
    let rate = p.measure_h2d_bandwidth(256 * MIB, 8).expect("bandwidth probe");
    eprintln!("pinned H2D: {:.1} GB/s on {}", rate / 1e9, p.device_name());
    assert!(rate > 10e9, "pinned H2D only {:.2} GB/s", rate / 1e9);
    assert_eq!(p.device_memory().in_use, 0, "the probe frees its buffers");
    assert!(p.measure_h2d_bandwidth(0, 1).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_timeline_times_copies_in_order_and_disarms() {
    let p = gpu();
    let s = p.create_stream("timeline").unwrap();
    let host = p.alloc_host(64 * MIB, HostMemoryKind::Pinned).unwrap();
    let dev = p.alloc_device(64 * MIB).unwrap();
    // Not armed: nothing is recorded and collecting says so.
    p.copy_h2d(s, host, 0, dev, 0, MIB).unwrap();
    assert!(p.timeline_collect().is_err());
    p.timeline_arm(s, 8).unwrap();
    p.copy_h2d(s, host, 0, dev, 0, 32 * MIB).unwrap();
    p.copy_h2d(s, host, 0, dev, 0, 64 * MIB).unwrap();
    let k = p.timeline_begin(s, "compute", "marker");
    p.timeline_end(s, k);
    let (spans, dropped) = p.timeline_collect().unwrap();
    assert_eq!(dropped, 0);
    let labels: Vec<(&str, &str)> = spans.iter().map(|x| (x.lane.as_str(), x.label.as_str())).collect();
    assert_eq!(labels, [("copy", "h2d 33554432"), ("copy", "h2d 67108864"), ("compute", "marker")]);
    for w in spans.windows(2) {
        assert!(w[0].end_us <= w[1].start_us + 1.0, "spans on one stream overlap: {spans:?}");
    }
    // 64 MiB at tens of GB/s takes more than 100 µs; twice the bytes take longer.
    let d: Vec<f64> = spans.iter().map(|x| x.end_us - x.start_us).collect();
    assert!(d[1] > 100.0 && d[1] > d[0], "{spans:?}");
    // Disarmed again: a copy records nothing.
    p.copy_h2d(s, host, 0, dev, 0, MIB).unwrap();
    assert!(p.timeline_collect().is_err());
    // A pool of one event drops the second span's end (counted), never blocks.
    p.timeline_arm(s, 1).unwrap();
    p.copy_h2d(s, host, 0, dev, 0, MIB).unwrap();
    let (spans, dropped) = p.timeline_collect().unwrap();
    assert!(spans.is_empty());
    assert_eq!(dropped, 1);
    p.stream_synchronize(s).unwrap();
}
