//! Tests of the simulated platform: memory, copies, streams, events, the hazard detector, faults, trace, shutdown.
//!
//! Races are made deterministic with gates (a kernel that blocks its stream until the test releases it) rather than
//! timing wherever possible; throttling tests assert only lower bounds on elapsed time.

#![cfg(not(weightferry_loom))]

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weightferry_actors::platform::{
    DeviceBufferId, EventId, HostBufferId, HostMemoryKind, Platform, PlatformError, StreamId,
};
use weightferry_actors::sim::{Access, BufferRef, FaultPlan, HazardKind, KernelFn, SimConfig, SimPlatform, TraceKind};

fn sim(config: SimConfig) -> SimPlatform {
    SimPlatform::new(config).expect("valid config")
}

fn quiet() -> SimConfig {
    SimConfig { tracing: false, ..SimConfig::default() }
}

/// A kernel that blocks its stream until the returned sender sends (or is dropped).
fn gate() -> (mpsc::Sender<()>, KernelFn) {
    let (tx, rx) = mpsc::channel::<()>();
    (tx, Box::new(move |_ctx| rx.recv().map_err(|e| e.to_string())))
}

fn noop() -> KernelFn {
    Box::new(|_ctx| Ok(()))
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A pinned host buffer holding `data`.
fn host_with(p: &SimPlatform, data: &[u8]) -> HostBufferId {
    let h = p.alloc_host(data.len() as u64, HostMemoryKind::Pinned).unwrap();
    p.write_host(h, 0, data).unwrap();
    h
}

/// A kernel that reads `len` bytes of `buf` into the returned cell.
fn reader(buf: DeviceBufferId, len: u64) -> (Arc<Mutex<Vec<u8>>>, KernelFn) {
    let out = Arc::new(Mutex::new(Vec::new()));
    let cell = out.clone();
    let f: KernelFn = Box::new(move |ctx| {
        let mut v = vec![0u8; len as usize];
        ctx.read(buf, 0, &mut v)?;
        *cell.lock().unwrap() = v;
        Ok(())
    });
    (out, f)
}

#[test]
fn name_and_trait_object() {
    let p: Arc<dyn Platform> = Arc::new(sim(quiet()));
    assert_eq!(p.name(), "sim");
}

#[test]
fn invalid_config_is_rejected() {
    let bad = SimConfig { h2d_bytes_per_sec: Some(0.0), ..SimConfig::default() };
    assert!(matches!(SimPlatform::new(bad), Err(PlatformError::Unavailable(_))));
    let bad = SimConfig { pageable_slowdown: f64::NAN, ..SimConfig::default() };
    assert!(matches!(SimPlatform::new(bad), Err(PlatformError::Unavailable(_))));
    assert_eq!(SimConfig::default().device_capacity, 64 << 30);
}

#[test]
fn oom_at_capacity_and_peak_stats() {
    let p = sim(SimConfig { device_capacity: 1000, ..quiet() });
    let a = p.alloc_device(600).unwrap();
    assert_eq!(p.alloc_device(500), Err(PlatformError::OutOfMemory { requested: 500, in_use: 600, capacity: 1000 }));
    let b = p.alloc_device(400).unwrap();
    assert_eq!(p.device_memory().in_use, 1000);
    assert_eq!(p.device_memory().peak, 1000);
    assert_eq!(p.device_buffer_len(a), Ok(600));
    p.free_device(a).unwrap();
    let stats = p.device_memory();
    assert_eq!((stats.capacity, stats.in_use, stats.peak), (1000, 400, 1000));
    p.reset_peak();
    assert_eq!(p.device_memory().peak, 400);
    assert_eq!(p.free_device(a), Err(PlatformError::InvalidHandle { what: "device buffer", id: a.0 }));
    assert_eq!(p.device_buffer_len(a), Err(PlatformError::InvalidHandle { what: "device buffer", id: a.0 }));
    assert_eq!(
        p.free_device(DeviceBufferId(999)),
        Err(PlatformError::InvalidHandle { what: "device buffer", id: 999 })
    );
    assert_eq!(
        p.alloc_device(u64::MAX),
        Err(PlatformError::OutOfMemory { requested: u64::MAX, in_use: 400, capacity: 1000 })
    );
    p.free_device(b).unwrap();
    let s = p.stats();
    assert_eq!((s.allocs, s.frees), (2, 1 + 1));
    assert!(p.take_violations().is_empty());
}

#[test]
fn host_buffers_are_zeroed_and_bounds_checked() {
    let p = sim(quiet());
    let h = p.alloc_host(8, HostMemoryKind::Pageable).unwrap();
    assert_eq!(p.host_buffer_info(h), Ok((8, HostMemoryKind::Pageable)));
    let mut out = [0xffu8; 8];
    p.read_host(h, 0, &mut out).unwrap();
    assert_eq!(out, [0u8; 8]);
    p.write_host(h, 2, &[1, 2, 3]).unwrap();
    p.read_host(h, 0, &mut out).unwrap();
    assert_eq!(out, [0, 0, 1, 2, 3, 0, 0, 0]);
    assert_eq!(
        p.write_host(h, 6, &[1, 2, 3]),
        Err(PlatformError::OutOfBounds { what: "host write", offset: 6, len: 3, size: 8 })
    );
    assert_eq!(
        p.read_host(h, u64::MAX, &mut [0u8; 2]),
        Err(PlatformError::OutOfBounds { what: "host read", offset: u64::MAX, len: 2, size: 8 })
    );
    p.free_host(h).unwrap();
    assert_eq!(p.free_host(h), Err(PlatformError::InvalidHandle { what: "host buffer", id: h.0 }));
    assert_eq!(p.read_host(h, 0, &mut out), Err(PlatformError::InvalidHandle { what: "host buffer", id: h.0 }));
}

#[test]
fn copy_round_trip_is_exact() {
    let p = sim(quiet());
    let s = p.create_stream("copy").unwrap();
    let data = pattern(16, 7);
    let src = host_with(&p, &data);
    let dev = p.alloc_device(32).unwrap();
    let back = p.alloc_host(32, HostMemoryKind::Pinned).unwrap();
    p.copy_h2d(s, src, 0, dev, 4, 16).unwrap();
    p.copy_d2h(s, dev, 0, back, 0, 32).unwrap();
    p.stream_synchronize(s).unwrap();
    let mut out = vec![0u8; 32];
    p.read_host(back, 0, &mut out).unwrap();
    let mut expected = vec![0u8; 32];
    expected[4..20].copy_from_slice(&data);
    assert_eq!(out, expected);
    let mut dev_out = vec![0u8; 16];
    p.read_device(dev, 4, &mut dev_out).unwrap();
    assert_eq!(dev_out, data);
    let st = p.stats();
    assert_eq!((st.h2d_copies, st.h2d_bytes, st.d2h_copies, st.d2h_bytes), (1, 16, 1, 32));
    assert!(p.violations().is_empty());
}

#[test]
fn enqueue_validates_handles_and_ranges() {
    let p = sim(quiet());
    let s = p.create_stream("copy").unwrap();
    let h = p.alloc_host(16, HostMemoryKind::Pinned).unwrap();
    let d = p.alloc_device(8).unwrap();
    assert_eq!(
        p.copy_h2d(s, h, 10, d, 0, 8),
        Err(PlatformError::OutOfBounds { what: "source", offset: 10, len: 8, size: 16 })
    );
    assert_eq!(
        p.copy_h2d(s, h, 0, d, 1, 8),
        Err(PlatformError::OutOfBounds { what: "destination", offset: 1, len: 8, size: 8 })
    );
    assert_eq!(
        p.copy_d2h(s, d, 4, h, 0, 8),
        Err(PlatformError::OutOfBounds { what: "source", offset: 4, len: 8, size: 8 })
    );
    assert_eq!(
        p.copy_d2h(s, d, 0, h, u64::MAX, 8),
        Err(PlatformError::OutOfBounds { what: "destination", offset: u64::MAX, len: 8, size: 16 })
    );
    assert_eq!(p.copy_h2d(StreamId(9), h, 0, d, 0, 8), Err(PlatformError::InvalidHandle { what: "stream", id: 9 }));
    assert_eq!(
        p.copy_h2d(s, HostBufferId(77), 0, d, 0, 8),
        Err(PlatformError::InvalidHandle { what: "host buffer", id: 77 })
    );
    assert_eq!(
        p.launch(s, "k", vec![Access::read(d, 4, 5)], noop()),
        Err(PlatformError::OutOfBounds { what: "kernel access", offset: 4, len: 5, size: 8 })
    );
    assert_eq!(
        p.read_device(d, 8, &mut [0u8; 1]),
        Err(PlatformError::OutOfBounds { what: "device read", offset: 8, len: 1, size: 8 })
    );
    assert_eq!(
        p.write_device(d, 0, &[0u8; 9]),
        Err(PlatformError::OutOfBounds { what: "device write", offset: 0, len: 9, size: 8 })
    );
    let e = p.create_event().unwrap();
    p.destroy_event(e).unwrap();
    let invalid = Err(PlatformError::InvalidHandle { what: "event", id: u64::from(e.0) });
    assert_eq!(p.record_event(e, s), invalid);
    assert_eq!(p.event_query(e).map(|_| ()), invalid);
    assert_eq!(p.event_synchronize(e), invalid);
    assert_eq!(p.stream_wait_event(s, e), invalid);
    assert_eq!(p.stream_synchronize(StreamId(5)), Err(PlatformError::InvalidHandle { what: "stream", id: 5 }));
    p.stream_synchronize(s).unwrap();
    assert_eq!(p.stats().h2d_copies, 0);
}

#[test]
fn stream_executes_in_order() {
    let p = sim(quiet());
    let s = p.create_stream("compute").unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    for i in 0..10u32 {
        let order = order.clone();
        p.launch(
            s,
            &format!("k{i}"),
            vec![],
            Box::new(move |_| {
                if i == 0 {
                    std::thread::sleep(Duration::from_millis(30));
                }
                order.lock().unwrap().push(i);
                Ok(())
            }),
        )
        .unwrap();
    }
    p.stream_synchronize(s).unwrap();
    assert_eq!(*order.lock().unwrap(), (0..10).collect::<Vec<_>>());
    assert_eq!(p.stats().kernels, 10);
}

#[test]
fn never_recorded_event_is_complete() {
    let p = sim(quiet());
    let s = p.create_stream("s").unwrap();
    let e = p.create_event().unwrap();
    assert_eq!(p.event_query(e), Ok(true));
    p.event_synchronize(e).unwrap();
    p.stream_wait_event(s, e).unwrap();
    p.stream_synchronize(s).unwrap();
    assert_eq!(p.stats().wait_time_per_stream, vec![("s".to_string(), Duration::ZERO)]);
}

#[test]
fn event_record_query_synchronize() {
    let p = sim(quiet());
    let s = p.create_stream("s").unwrap();
    let e = p.create_event().unwrap();
    let (release, k) = gate();
    p.launch(s, "gate", vec![], k).unwrap();
    p.record_event(e, s).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(p.event_query(e), Ok(false));
    release.send(()).unwrap();
    p.event_synchronize(e).unwrap();
    assert_eq!(p.event_query(e), Ok(true));
}

#[test]
fn rerecord_on_another_stream_reports_latest_and_waiters_keep_their_generation() {
    let p = sim(quiet());
    let a = p.create_stream("a").unwrap();
    let b = p.create_stream("b").unwrap();
    let c = p.create_stream("c").unwrap();
    let e = p.create_event().unwrap();
    let done_c = p.create_event().unwrap();

    let (release, k) = gate();
    p.launch(a, "gate", vec![], k).unwrap();
    p.record_event(e, a).unwrap(); // generation 1: pending behind the gate
    p.stream_wait_event(c, e).unwrap(); // c captures generation 1
    p.record_event(done_c, c).unwrap();

    p.record_event(e, b).unwrap(); // generation 2 on an idle stream
    p.stream_synchronize(b).unwrap();
    // Query observes the latest record: complete, although generation 1 is still pending on `a`.
    assert_eq!(p.event_query(e), Ok(true));
    p.event_synchronize(e).unwrap();

    // A wait issued now captures generation 2 and does not block.
    let d = p.create_stream("d").unwrap();
    p.stream_wait_event(d, e).unwrap();
    p.stream_synchronize(d).unwrap();

    // But `c` waits for generation 1, which is still gated.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(p.event_query(done_c), Ok(false));
    release.send(()).unwrap();
    p.event_synchronize(done_c).unwrap();
    p.stream_synchronize(c).unwrap();
    let waits = p.stats().wait_time_per_stream;
    assert_eq!(waits.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["a", "b", "c", "d"]);
    assert!(waits[2].1 >= Duration::from_millis(50), "c waited {:?}", waits[2].1);
}

#[test]
fn rerecord_on_same_stream_while_waiter_pending() {
    let p = sim(quiet());
    let a = p.create_stream("a").unwrap();
    let c = p.create_stream("c").unwrap();
    let e = p.create_event().unwrap();
    let (r1, k1) = gate();
    let (r2, k2) = gate();
    p.launch(a, "g1", vec![], k1).unwrap();
    p.record_event(e, a).unwrap(); // gen 1
    p.stream_wait_event(c, e).unwrap(); // c waits for gen 1 only
    let flag = Arc::new(Mutex::new(false));
    let f2 = flag.clone();
    p.launch(
        c,
        "after",
        vec![],
        Box::new(move |_| {
            *f2.lock().unwrap() = true;
            Ok(())
        }),
    )
    .unwrap();
    p.launch(a, "g2", vec![], k2).unwrap();
    p.record_event(e, a).unwrap(); // gen 2, behind the second gate
    r1.send(()).unwrap();
    // c is released by generation 1 even though the latest record (gen 2) is still pending.
    p.stream_synchronize(c).unwrap();
    assert!(*flag.lock().unwrap());
    assert_eq!(p.event_query(e), Ok(false));
    r2.send(()).unwrap();
    p.event_synchronize(e).unwrap();
}

#[test]
fn wait_orders_kernel_after_throttled_copy() {
    let p = sim(SimConfig { h2d_bytes_per_sec: Some(1e6), ..quiet() }); // 50 KB: ~50 ms
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let data = pattern(50_000, 3);
    let h = host_with(&p, &data);
    let slot = p.alloc_device(50_000).unwrap();
    let ready = p.create_event().unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 50_000).unwrap();
    p.record_event(ready, copy).unwrap();
    p.stream_wait_event(compute, ready).unwrap();
    let (out, k) = reader(slot, 50_000);
    p.launch(compute, "consume", vec![Access::read(slot, 0, 50_000)], k).unwrap();
    p.stream_synchronize(compute).unwrap();
    assert_eq!(*out.lock().unwrap(), data);
    assert!(p.violations().is_empty(), "{:?}", p.violations());
    let waits = p.stats().wait_time_per_stream;
    assert_eq!(waits.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["copy", "compute"]);
}

#[test]
fn hazard_read_before_ready_without_wait() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = host_with(&p, &pattern(64, 1));
    let slot = p.alloc_device(128).unwrap();
    let (release, k) = gate();
    p.launch(copy, "hold", vec![], k).unwrap();
    p.copy_h2d(copy, h, 0, slot, 32, 64).unwrap();
    // No wait on the copy: the kernel runs while the copy is still queued.
    p.launch(compute, "consume", vec![Access::read(slot, 0, 64)], noop()).unwrap();
    p.stream_synchronize(compute).unwrap();
    release.send(()).unwrap();
    p.stream_synchronize(copy).unwrap();
    let v = p.take_violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, HazardKind::ReadBeforeReady);
    assert_eq!(v[0].buffer, BufferRef::Device(slot));
    assert_eq!(v[0].range, 32..64);
    assert_eq!(v[0].earlier.stream, Some(copy));
    assert_eq!(v[0].earlier.stream_name, "copy");
    assert!(v[0].earlier.label.starts_with("h2d"), "{}", v[0].earlier.label);
    assert_eq!(v[0].later.stream, Some(compute));
    assert_eq!(v[0].later.label, "consume");
    assert!(v[0].earlier.seq < v[0].later.seq);
    assert!(p.violations().is_empty());
}

#[test]
fn hazard_read_before_ready_with_throttled_copy() {
    let p = sim(SimConfig { h2d_bytes_per_sec: Some(5e5), ..quiet() }); // 200 KB: ~400 ms
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = p.alloc_host(200_000, HostMemoryKind::Pinned).unwrap();
    let slot = p.alloc_device(200_000).unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 200_000).unwrap();
    p.launch(compute, "consume", vec![Access::read(slot, 0, 16)], noop()).unwrap();
    p.stream_synchronize(copy).unwrap();
    p.stream_synchronize(compute).unwrap();
    let kinds: Vec<HazardKind> = p.violations().iter().map(|v| v.kind).collect();
    assert_eq!(kinds, vec![HazardKind::ReadBeforeReady]);
}

#[test]
fn no_hazard_when_kernel_waits_on_copy() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let data = pattern(64, 9);
    let h = host_with(&p, &data);
    let slot = p.alloc_device(64).unwrap();
    let ready = p.create_event().unwrap();
    let (release, k) = gate();
    p.launch(copy, "hold", vec![], k).unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 64).unwrap();
    p.record_event(ready, copy).unwrap();
    p.stream_wait_event(compute, ready).unwrap();
    let (out, kr) = reader(slot, 64);
    p.launch(compute, "consume", vec![Access::read(slot, 0, 64)], kr).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    release.send(()).unwrap();
    p.stream_synchronize(compute).unwrap();
    assert_eq!(*out.lock().unwrap(), data);
    assert!(p.violations().is_empty(), "{:?}", p.violations());
}

#[test]
fn hazard_overwrite_before_last_use() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = host_with(&p, &pattern(64, 2));
    let slot = p.alloc_device(64).unwrap();
    // The reader is slow (gated); the next block's copy overwrites its slot without waiting.
    let (rx_release, rx) = mpsc::channel::<()>();
    p.launch(
        compute,
        "reader",
        vec![Access::read(slot, 0, 64)],
        Box::new(move |_| rx.recv().map_err(|e| e.to_string())),
    )
    .unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 64).unwrap();
    p.stream_synchronize(copy).unwrap();
    rx_release.send(()).unwrap();
    p.stream_synchronize(compute).unwrap();
    let v = p.take_violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, HazardKind::OverwriteBeforeLastUse);
    assert_eq!(v[0].earlier.label, "reader");
    assert_eq!(v[0].later.stream_name, "copy");
    assert_eq!(v[0].range, 0..64);
}

#[test]
fn no_overwrite_hazard_when_copy_waits_for_last_use() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let new = pattern(64, 5);
    let h = host_with(&p, &new);
    let slot = p.alloc_device(64).unwrap();
    p.write_device(slot, 0, &[7u8; 64]).unwrap();
    let last_use = p.create_event().unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    p.launch(
        compute,
        "reader",
        vec![Access::read(slot, 0, 64)],
        Box::new(move |ctx| {
            rx.recv().map_err(|e| e.to_string())?;
            let mut v = vec![0u8; 64];
            ctx.read(slot, 0, &mut v)?;
            *seen2.lock().unwrap() = v;
            Ok(())
        }),
    )
    .unwrap();
    p.record_event(last_use, compute).unwrap();
    p.stream_wait_event(copy, last_use).unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 64).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    tx.send(()).unwrap();
    p.stream_synchronize(copy).unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![7u8; 64]);
    let mut now = vec![0u8; 64];
    p.read_device(slot, 0, &mut now).unwrap();
    assert_eq!(now, new);
    assert!(p.violations().is_empty(), "{:?}", p.violations());
}

#[test]
fn hazard_write_write_race_and_same_stream_is_ordered() {
    let p = sim(quiet());
    let s1 = p.create_stream("s1").unwrap();
    let s2 = p.create_stream("s2").unwrap();
    let h = host_with(&p, &pattern(32, 0));
    let slot = p.alloc_device(32).unwrap();
    // Same stream: a copy then a kernel reading it is ordered, no violation.
    p.copy_h2d(s1, h, 0, slot, 0, 32).unwrap();
    p.launch(s1, "same-stream", vec![Access::read(slot, 0, 32)], noop()).unwrap();
    p.stream_synchronize(s1).unwrap();
    assert!(p.violations().is_empty());

    let (release, k) = gate();
    p.launch(s1, "hold", vec![], k).unwrap();
    p.copy_h2d(s1, h, 0, slot, 0, 16).unwrap();
    p.copy_h2d(s2, h, 0, slot, 8, 16).unwrap();
    p.stream_synchronize(s2).unwrap();
    release.send(()).unwrap();
    p.stream_synchronize(s1).unwrap();
    let v = p.take_violations();
    // The two copies conflict on the device (write/write); both only read the host buffer.
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, HazardKind::WriteWriteRace);
    assert_eq!(v[0].range, 8..16);
}

#[test]
fn hazard_free_before_last_use_does_not_panic() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let h = host_with(&p, &pattern(64, 4));
    let slot = p.alloc_device(64).unwrap();
    let (release, k) = gate();
    p.launch(copy, "hold", vec![], k).unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 64).unwrap();
    p.free_device(slot).unwrap();
    assert_eq!(p.device_memory().in_use, 0);
    release.send(()).unwrap();
    let err = p.stream_synchronize(copy).unwrap_err();
    assert!(matches!(err, PlatformError::CopyFailed { direction: "host-to-device", bytes: 64, .. }), "{err:?}");
    let v = p.take_violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, HazardKind::FreeBeforeLastUse);
    assert_eq!(v[0].buffer, BufferRef::Device(slot));
    assert_eq!(v[0].later.label, "free_device");
    assert_eq!(v[0].later.stream, None);
    assert_eq!(v[0].range, 0..64);
}

#[test]
fn host_side_accesses_are_checked() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let h = host_with(&p, &pattern(64, 4));
    let slot = p.alloc_device(64).unwrap();
    let (release, k) = gate();
    p.launch(copy, "hold", vec![], k).unwrap();
    p.copy_h2d(copy, h, 0, slot, 0, 64).unwrap();
    p.write_host(h, 60, &[0u8; 8][..4]).unwrap(); // overwrites the staging bytes before the copy read them
    let mut out = [0u8; 4];
    p.read_device(slot, 0, &mut out).unwrap(); // reads the slot before the copy landed
    release.send(()).unwrap();
    p.stream_synchronize(copy).unwrap();
    p.write_host(h, 0, &[1]).unwrap(); // after the sync: fine
    let kinds: Vec<(HazardKind, BufferRef, std::ops::Range<u64>)> =
        p.take_violations().into_iter().map(|v| (v.kind, v.buffer, v.range)).collect();
    assert_eq!(
        kinds,
        vec![
            (HazardKind::OverwriteBeforeLastUse, BufferRef::Host(h), 60..64),
            (HazardKind::ReadBeforeReady, BufferRef::Device(slot), 0..4),
        ]
    );
}

#[test]
fn kernel_accesses_are_limited_to_declared_ranges() {
    let p = sim(quiet());
    let s = p.create_stream("compute").unwrap();
    let buf = p.alloc_device(16).unwrap();
    p.launch(
        s,
        "fill",
        vec![Access::write(buf, 0, 8), Access::read(buf, 8, 8)],
        Box::new(move |ctx| {
            ctx.with_write(buf, 0, 8, |b| b.copy_from_slice(&[9u8; 8]))?;
            let sum: u32 = ctx.with_read(buf, 0, 8, |b| b.iter().map(|&x| u32::from(x)).sum())?;
            if sum != 72 {
                return Err(format!("sum {sum}"));
            }
            assert_eq!(ctx.label(), "fill");
            assert_eq!(ctx.accesses().len(), 2);
            Ok(())
        }),
    )
    .unwrap();
    p.stream_synchronize(s).unwrap();
    let mut out = [0u8; 16];
    p.read_device(buf, 0, &mut out).unwrap();
    assert_eq!(out, [9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0]);

    // Writing a read-only range is refused and fails the stream (sticky).
    let s2 = p.create_stream("bad").unwrap();
    p.launch(s2, "bad-write", vec![Access::read(buf, 8, 8)], Box::new(move |ctx| Ok(ctx.write(buf, 8, &[1])?)))
        .unwrap();
    let ran = Arc::new(Mutex::new(false));
    let ran2 = ran.clone();
    p.launch(
        s2,
        "skipped",
        vec![],
        Box::new(move |_| {
            *ran2.lock().unwrap() = true;
            Ok(())
        }),
    )
    .unwrap();
    let err = p.stream_synchronize(s2).unwrap_err();
    match &err {
        PlatformError::Driver(msg) => {
            assert!(msg.contains("bad-write") && msg.contains("undeclared write"), "{msg}")
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(!*ran.lock().unwrap());
    // Sticky: the same error again.
    assert_eq!(p.stream_synchronize(s2), Err(err));
    p.read_device(buf, 8, &mut out[..1]).unwrap();
    assert_eq!(out[0], 0);
}

#[test]
fn kernel_panic_becomes_stream_error() {
    let p = sim(quiet());
    let s = p.create_stream("compute").unwrap();
    p.launch(s, "boom", vec![], Box::new(|_| panic!("kernel bug"))).unwrap();
    assert_eq!(
        p.stream_synchronize(s),
        Err(PlatformError::Driver("kernel 'boom' failed: kernel panicked".to_string()))
    );
}

#[test]
fn fault_sync_h2d_failure_at_nth_copy() {
    let p = sim(SimConfig { faults: FaultPlan { fail_h2d_copy: Some(1), ..FaultPlan::none() }, ..quiet() });
    let s = p.create_stream("copy").unwrap();
    let h = host_with(&p, &[1u8; 8]);
    let d = p.alloc_device(8).unwrap();
    // An invalid call does not count.
    assert!(p.copy_h2d(s, h, 4, d, 0, 8).is_err());
    p.copy_h2d(s, h, 0, d, 0, 8).unwrap();
    assert_eq!(
        p.copy_h2d(s, h, 0, d, 0, 8),
        Err(PlatformError::CopyFailed {
            direction: "host-to-device",
            bytes: 8,
            reason: "injected failure of h2d copy #1".to_string()
        })
    );
    p.copy_h2d(s, h, 0, d, 0, 8).unwrap();
    p.stream_synchronize(s).unwrap();
    assert_eq!(p.stats().h2d_copies, 2);
}

#[test]
fn fault_async_h2d_failure_poisons_later_events() {
    let p = sim(SimConfig { faults: FaultPlan { fail_h2d_copy_async: Some(1), ..FaultPlan::none() }, ..quiet() });
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = host_with(&p, &[5u8; 8]);
    let d = p.alloc_device(16).unwrap();
    let before = p.create_event().unwrap();
    let after = p.create_event().unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 8).unwrap();
    p.record_event(before, copy).unwrap();
    p.copy_h2d(copy, h, 0, d, 8, 8).unwrap(); // copy #1: fails when executed
    p.record_event(after, copy).unwrap();
    p.stream_wait_event(compute, after).unwrap();
    p.event_synchronize(before).unwrap();
    assert_eq!(p.event_query(before), Ok(true));
    assert!(matches!(p.event_synchronize(after), Err(PlatformError::EventFailed { event, .. }) if event == after));
    assert!(matches!(p.event_query(after), Err(PlatformError::EventFailed { event, .. }) if event == after));
    assert_eq!(
        p.stream_synchronize(copy),
        Err(PlatformError::CopyFailed {
            direction: "host-to-device",
            bytes: 8,
            reason: "injected asynchronous copy failure".to_string()
        })
    );
    // The stream that waited on the failed record inherits the failure.
    assert!(matches!(p.stream_synchronize(compute), Err(PlatformError::EventFailed { event, .. }) if event == after));
    let mut out = [0u8; 16];
    p.read_device(d, 0, &mut out).unwrap();
    assert_eq!(out, [5, 5, 5, 5, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(p.stats().h2d_copies, 1);
}

#[test]
fn fault_oom_at_nth_alloc() {
    let p = sim(SimConfig { faults: FaultPlan { oom_at_alloc: Some(2), ..FaultPlan::none() }, ..quiet() });
    p.alloc_device(10).unwrap();
    p.alloc_device(20).unwrap();
    assert_eq!(p.alloc_device(5), Err(PlatformError::OutOfMemory { requested: 5, in_use: 30, capacity: 64 << 30 }));
    p.alloc_device(5).unwrap();
    assert_eq!(p.device_memory().in_use, 35);
    assert_eq!(p.stats().allocs, 3);
}

#[test]
fn fault_slow_stream() {
    let extra = Duration::from_millis(150);
    let p = sim(SimConfig {
        faults: FaultPlan { slow_stream: Some(("copy".to_string(), extra)), ..FaultPlan::none() },
        tracing: true,
        ..SimConfig::default()
    });
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = host_with(&p, &[1u8; 4]);
    let d = p.alloc_device(4).unwrap();
    let t0 = Instant::now();
    p.copy_h2d(copy, h, 0, d, 0, 4).unwrap();
    p.launch(copy, "slow-kernel", vec![], noop()).unwrap();
    p.stream_synchronize(copy).unwrap();
    assert!(t0.elapsed() >= extra * 2);
    p.launch(compute, "fast-kernel", vec![], noop()).unwrap();
    p.stream_synchronize(compute).unwrap();
    let trace = p.trace();
    let dur = |label: &str| trace.iter().find(|t| t.label == label).map(|t| t.duration).unwrap();
    assert!(dur("slow-kernel") >= extra);
    assert!(trace.iter().any(|t| t.kind == TraceKind::H2d && t.stream_name == "copy" && t.duration >= extra));
    assert!(dur("fast-kernel") < extra);
}

#[test]
fn fault_event_synchronize_nth_call() {
    let p = sim(SimConfig { faults: FaultPlan { fail_event_sync: Some(1), ..FaultPlan::none() }, ..quiet() });
    let e = p.create_event().unwrap();
    assert!(p.event_synchronize(EventId(999)).is_err()); // invalid handle: not counted
    p.event_synchronize(e).unwrap();
    assert_eq!(
        p.event_synchronize(e),
        Err(PlatformError::EventFailed {
            event: e,
            reason: "injected failure of event_synchronize call #1".to_string()
        })
    );
    p.event_synchronize(e).unwrap();
}

#[test]
fn fault_sync_d2h_failure_at_nth_copy() {
    let p = sim(SimConfig { faults: FaultPlan { fail_d2h_copy: Some(1), ..FaultPlan::none() }, ..quiet() });
    let s = p.create_stream("copy").unwrap();
    let d = p.alloc_device(8).unwrap();
    p.write_device(d, 0, &[7u8; 8]).unwrap();
    let h = p.alloc_host(8, HostMemoryKind::Pageable).unwrap();
    // An invalid call does not count.
    assert!(p.copy_d2h(s, d, 4, h, 0, 8).is_err());
    p.copy_d2h(s, d, 0, h, 0, 8).unwrap();
    let other = p.alloc_host(8, HostMemoryKind::Pageable).unwrap();
    assert_eq!(
        p.copy_d2h(s, d, 0, other, 0, 8),
        Err(PlatformError::CopyFailed {
            direction: "device-to-host",
            bytes: 8,
            reason: "injected failure of d2h copy #1".to_string()
        })
    );
    // Nothing was enqueued: the stream is healthy, the target untouched, the next copy works.
    p.stream_synchronize(s).unwrap();
    let mut out = [1u8; 8];
    p.read_host(other, 0, &mut out).unwrap();
    assert_eq!(out, [0u8; 8]);
    p.copy_d2h(s, d, 0, other, 0, 8).unwrap();
    p.stream_synchronize(s).unwrap();
    p.read_host(other, 0, &mut out).unwrap();
    assert_eq!(out, [7u8; 8]);
    assert_eq!(p.stats().d2h_copies, 2);
}

#[test]
fn fault_host_alloc_at_nth_call_and_host_memory_accounting() {
    let p = sim(SimConfig { faults: FaultPlan { fail_host_alloc: Some(2), ..FaultPlan::none() }, ..quiet() });
    assert_eq!(p.host_memory(), Default::default());
    let a = p.alloc_host(100, HostMemoryKind::Pinned).unwrap();
    let b = p.alloc_host(30, HostMemoryKind::Pageable).unwrap();
    assert_eq!(
        p.alloc_host(7, HostMemoryKind::Pageable),
        Err(PlatformError::HostAllocFailed {
            requested: 7,
            kind: HostMemoryKind::Pageable,
            reason: "injected failure of host allocation #2".to_string()
        })
    );
    let m = p.host_memory();
    assert_eq!((m.in_use, m.pinned, m.buffers, m.peak), (130, 100, 2, 130), "{m:?}");
    let c = p.alloc_host(5, HostMemoryKind::Pageable).unwrap();
    p.free_host(a).unwrap();
    let m = p.host_memory();
    assert_eq!((m.in_use, m.pinned, m.buffers, m.peak), (35, 0, 2, 135), "{m:?}");
    // A failed free changes nothing.
    assert!(p.free_host(a).is_err());
    p.free_host(b).unwrap();
    p.free_host(c).unwrap();
    let m = p.host_memory();
    assert_eq!((m.in_use, m.pinned, m.buffers, m.peak), (0, 0, 0, 135), "{m:?}");
}

#[test]
fn fault_plan_from_seed_is_deterministic() {
    for seed in 0..64 {
        let a = FaultPlan::from_seed(seed, 10);
        assert_eq!(a, FaultPlan::from_seed(seed, 10));
        let set: Vec<u64> =
            [a.fail_h2d_copy, a.fail_h2d_copy_async, a.oom_at_alloc, a.fail_event_sync].into_iter().flatten().collect();
        assert_eq!(set.len(), 1, "{a:?}");
        assert!(set[0] < 10);
        assert_eq!(a.slow_stream, None);
        assert!(!a.is_empty());
    }
    let kinds: std::collections::HashSet<usize> = (0..64)
        .map(|seed| {
            let a = FaultPlan::from_seed(seed, 10);
            [a.fail_h2d_copy, a.fail_h2d_copy_async, a.oom_at_alloc, a.fail_event_sync]
                .iter()
                .position(Option::is_some)
                .unwrap()
        })
        .collect();
    assert_eq!(kinds.len(), 4);
    let zero = FaultPlan::from_seed(42, 0);
    assert_eq!(
        [zero.fail_h2d_copy, zero.fail_h2d_copy_async, zero.oom_at_alloc, zero.fail_event_sync].iter().flatten().next(),
        Some(&0)
    );
    assert!(FaultPlan::none().is_empty());
}

#[test]
fn throttled_copies_take_at_least_bytes_over_bandwidth() {
    let p = sim(SimConfig {
        h2d_bytes_per_sec: Some(1e6),
        d2h_bytes_per_sec: Some(2e6),
        pageable_slowdown: 4.0,
        copy_latency: Duration::from_millis(10),
        ..SimConfig::default()
    });
    let s = p.create_stream("copy").unwrap();
    let pinned = p.alloc_host(100_000, HostMemoryKind::Pinned).unwrap();
    let pageable = p.alloc_host(25_000, HostMemoryKind::Pageable).unwrap();
    let d = p.alloc_device(100_000).unwrap();
    let t0 = Instant::now();
    p.copy_h2d(s, pinned, 0, d, 0, 100_000).unwrap(); // 10 ms + 100 ms
    p.stream_synchronize(s).unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(110), "{:?}", t0.elapsed());
    let t1 = Instant::now();
    p.copy_h2d(s, pageable, 0, d, 0, 25_000).unwrap(); // 10 ms + 25 KB at 0.25 MB/s = 110 ms
    p.stream_synchronize(s).unwrap();
    assert!(t1.elapsed() >= Duration::from_millis(110), "{:?}", t1.elapsed());
    let t2 = Instant::now();
    p.copy_d2h(s, d, 0, pinned, 0, 100_000).unwrap(); // 10 ms + 50 ms
    p.stream_synchronize(s).unwrap();
    assert!(t2.elapsed() >= Duration::from_millis(60), "{:?}", t2.elapsed());
    let trace = p.trace();
    assert_eq!(
        trace.iter().map(|t| (t.kind, t.bytes)).collect::<Vec<_>>(),
        vec![(TraceKind::H2d, 100_000), (TraceKind::H2d, 25_000), (TraceKind::D2h, 100_000)]
    );
    assert!(trace[0].duration >= Duration::from_millis(110));
    assert!(trace[1].start >= trace[0].start + trace[0].duration);
    assert!(trace.iter().all(|t| t.stream_name == "copy"));
}

#[test]
fn tracing_toggle_and_wait_records() {
    let p = sim(quiet());
    let a = p.create_stream("a").unwrap();
    let b = p.create_stream("b").unwrap();
    p.launch(a, "untraced", vec![], noop()).unwrap();
    p.stream_synchronize(a).unwrap();
    assert!(p.trace().is_empty());
    p.set_tracing(true);
    let e = p.create_event().unwrap();
    p.launch(a, "k", vec![], noop()).unwrap();
    p.record_event(e, a).unwrap();
    p.stream_wait_event(b, e).unwrap();
    p.stream_synchronize(b).unwrap();
    p.stream_synchronize(a).unwrap();
    let mut got: Vec<(String, TraceKind)> = p.trace().into_iter().map(|t| (t.stream_name, t.kind)).collect();
    got.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(got, vec![("a".to_string(), TraceKind::Kernel), ("b".to_string(), TraceKind::Wait)]);
    p.clear_trace();
    p.set_tracing(false);
    p.launch(a, "k2", vec![], noop()).unwrap();
    p.stream_synchronize(a).unwrap();
    assert!(p.trace().is_empty());
}

#[test]
fn drop_joins_workers_blocked_in_waits_and_throttles() {
    // A copy that would take 100 s, an event behind it, and a stream waiting on that event.
    let p = sim(SimConfig { h2d_bytes_per_sec: Some(1.0), ..quiet() });
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = p.alloc_host(100, HostMemoryKind::Pinned).unwrap();
    let d = p.alloc_device(100).unwrap();
    let e = p.create_event().unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 100).unwrap();
    p.record_event(e, copy).unwrap();
    p.stream_wait_event(compute, e).unwrap();
    let token = Arc::new(());
    let held = token.clone();
    p.launch(
        compute,
        "never",
        vec![],
        Box::new(move |_| {
            drop(held);
            Ok(())
        }),
    )
    .unwrap();
    assert_eq!(Arc::strong_count(&token), 2);
    std::thread::sleep(Duration::from_millis(20));
    let t0 = Instant::now();
    drop(p);
    assert!(t0.elapsed() < Duration::from_secs(5));
    // The queued kernel was discarded and every worker (which held the queues) has exited.
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
fn shutdown_releases_blocked_callers_and_refuses_new_work() {
    let p = Arc::new(sim(SimConfig { h2d_bytes_per_sec: Some(1.0), ..quiet() }));
    let copy = p.create_stream("copy").unwrap();
    let h = p.alloc_host(100, HostMemoryKind::Pinned).unwrap();
    let d = p.alloc_device(100).unwrap();
    let e = p.create_event().unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 100).unwrap();
    p.record_event(e, copy).unwrap();
    let p2 = p.clone();
    let waiter = std::thread::spawn(move || (p2.event_synchronize(e), p2.stream_synchronize(copy)));
    std::thread::sleep(Duration::from_millis(30));
    p.shutdown();
    let (ev, st) = waiter.join().unwrap();
    assert!(matches!(ev, Err(PlatformError::Unavailable(_))), "{ev:?}");
    assert!(matches!(st, Err(PlatformError::Unavailable(_))), "{st:?}");
    assert!(matches!(p.copy_h2d(copy, h, 0, d, 0, 1), Err(PlatformError::Unavailable(_))));
    assert!(matches!(p.create_stream("late"), Err(PlatformError::Unavailable(_))));
    assert!(matches!(p.launch(copy, "late", vec![], noop()), Err(PlatformError::Unavailable(_))));
    p.shutdown(); // idempotent
}

#[test]
fn destroyed_event_still_orders_waiters() {
    let p = sim(quiet());
    let a = p.create_stream("a").unwrap();
    let c = p.create_stream("c").unwrap();
    let e = p.create_event().unwrap();
    let done = p.create_event().unwrap();
    let (release, k) = gate();
    p.launch(a, "hold", vec![], k).unwrap();
    p.record_event(e, a).unwrap();
    p.stream_wait_event(c, e).unwrap();
    p.record_event(done, c).unwrap();
    p.destroy_event(e).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(p.event_query(done), Ok(false));
    release.send(()).unwrap();
    p.event_synchronize(done).unwrap();
}

/// Threads of this process whose name starts with `prefix` (the sim names its workers `wf-sim-<stream>`), once
/// their count is `want` or after 2 s: a new thread names itself when it starts, and a joined one is listed until the
/// kernel has finished its exit.
fn threads_named(prefix: &str, want: usize) -> usize {
    let count = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim_end().starts_with(prefix))
            .count()
    };
    for _ in 0..2000 {
        if count() == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    count()
}

#[test]
fn destroy_stream_waits_for_pending_work_then_joins_the_worker_and_invalidates_the_handle() {
    let p = Arc::new(sim(quiet()));
    // A name no other test of this binary uses (and short: the kernel keeps 15 bytes of a thread's name): the
    // worker thread is counted by it.
    let s = p.create_stream("doomed").unwrap();
    let other = p.create_stream("other").unwrap();
    assert_eq!(threads_named("wf-sim-doomed", 1), 1);
    let h = host_with(&p, &pattern(64, 3));
    let d = p.alloc_device(64).unwrap();
    let e = p.create_event().unwrap();
    let (release, k) = gate();
    p.launch(s, "hold", vec![], k).unwrap();
    p.copy_h2d(s, h, 0, d, 0, 64).unwrap();
    p.record_event(e, s).unwrap();
    let p2 = p.clone();
    let destroyer = std::thread::spawn(move || p2.destroy_stream(s));
    std::thread::sleep(Duration::from_millis(20));
    // Pending work completes first: the call is still waiting behind the gate.
    assert!(!destroyer.is_finished());
    assert_eq!(p.event_query(e), Ok(false));
    release.send(()).unwrap();
    assert_eq!(destroyer.join().unwrap(), Ok(()));
    // Everything enqueued before the call ran; the event recorded on it stays valid and complete.
    assert_eq!(p.event_query(e), Ok(true));
    let mut out = vec![0; 64];
    p.read_device(d, 0, &mut out).unwrap();
    assert_eq!(out, pattern(64, 3));
    assert_eq!(p.stream_count(), 1);
    assert_eq!(threads_named("wf-sim-doomed", 0), 0, "the worker was joined");
    // The handle is invalid for every call, a second destroy included; other streams are unaffected.
    let invalid = Err(PlatformError::InvalidHandle { what: "stream", id: u64::from(s.0) });
    assert_eq!(p.copy_h2d(s, h, 0, d, 0, 64), invalid);
    assert_eq!(p.record_event(e, s), invalid);
    assert_eq!(p.stream_synchronize(s), invalid);
    assert_eq!(p.destroy_stream(s), invalid);
    p.stream_wait_event(other, e).unwrap();
    p.copy_h2d(other, h, 0, d, 0, 64).unwrap();
    p.stream_synchronize(other).unwrap();
    // Handles are not reused.
    let next = p.create_stream("next").unwrap();
    assert!(next.0 > other.0, "{next:?}");
    assert_eq!(p.violations(), vec![]);
}

#[test]
fn destroy_stream_returns_its_error_and_destroys_it_anyway() {
    let p = sim(SimConfig { faults: FaultPlan { fail_h2d_copy_async: Some(0), ..FaultPlan::none() }, ..quiet() });
    let s = p.create_stream("failing").unwrap();
    let h = host_with(&p, &[1; 8]);
    let d = p.alloc_device(8).unwrap();
    p.copy_h2d(s, h, 0, d, 0, 8).unwrap();
    match p.destroy_stream(s) {
        Err(PlatformError::CopyFailed { direction: "host-to-device", bytes: 8, reason }) => {
            assert_eq!(reason, "injected asynchronous copy failure");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.stream_count(), 0);
    assert_eq!(p.destroy_stream(s), Err(PlatformError::InvalidHandle { what: "stream", id: u64::from(s.0) }));
}

#[test]
fn a_kernel_cannot_destroy_its_own_stream() {
    let p = Arc::new(sim(quiet()));
    let s = p.create_stream("self").unwrap();
    let (tx, rx) = mpsc::channel();
    let p2 = p.clone();
    p.launch(s, "destroy self", vec![], Box::new(move |_| tx.send(p2.destroy_stream(s)).map_err(|e| e.to_string())))
        .unwrap();
    p.stream_synchronize(s).unwrap();
    assert_eq!(
        rx.recv().unwrap(),
        Err(PlatformError::Driver("stream 'self' destroyed from its own worker".to_string()))
    );
    assert_eq!(p.stream_count(), 1);
    p.destroy_stream(s).unwrap();
}

/// The detector goes by order: compute that reads a slot without waiting for the copy's event is reported even
/// when the copy finished long before (the old, timing-based check saw nothing pending and missed it), and the
/// same read behind `stream_wait_event` is not.
#[test]
fn a_read_without_its_wait_is_reported_even_when_the_copy_finished_first() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let compute = p.create_stream("compute").unwrap();
    let h = host_with(&p, &[7; 32]);
    let d = p.alloc_device(32).unwrap();
    let ready = p.create_event().unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 32).unwrap();
    p.record_event(ready, copy).unwrap();
    // The copy has completed (observed through a poll, which orders nothing) before the read is even enqueued.
    while !p.event_query(ready).unwrap() {
        std::thread::yield_now();
    }
    p.launch(compute, "read", vec![Access::read(d, 0, 32)], noop()).unwrap();
    p.stream_synchronize(compute).unwrap();
    let v = p.take_violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, HazardKind::ReadBeforeReady);
    assert_eq!((v[0].earlier.stream_name.as_str(), v[0].later.label.as_str()), ("copy", "read"));
    assert_eq!((v[0].buffer, v[0].range.clone()), (BufferRef::Device(d), 0..32));
    p.stream_wait_event(compute, ready).unwrap();
    p.launch(compute, "read after the wait", vec![Access::read(d, 0, 32)], noop()).unwrap();
    // An overwrite not ordered after that read (no last-use event waited on) is reported too, and one that is, not.
    let last_use = p.create_event().unwrap();
    p.record_event(last_use, compute).unwrap();
    p.stream_synchronize(compute).unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 32).unwrap();
    // `stream_synchronize(compute)` above orders every later enqueue after the read: no violation.
    assert_eq!(p.take_violations(), vec![]);
    p.launch(compute, "read 3", vec![Access::read(d, 0, 32)], noop()).unwrap();
    let v = p.take_violations();
    assert_eq!(v.iter().map(|v| v.kind).collect::<Vec<_>>(), vec![HazardKind::ReadBeforeReady], "{v:?}");
    p.copy_h2d(copy, h, 0, d, 0, 32).unwrap();
    let v = p.take_violations();
    assert_eq!(v.iter().map(|v| v.kind).collect::<Vec<_>>(), vec![HazardKind::OverwriteBeforeLastUse], "{v:?}");
    p.record_event(last_use, compute).unwrap();
    p.stream_wait_event(copy, last_use).unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 32).unwrap();
    assert_eq!(p.take_violations(), vec![]);
}

/// Host calls go by order too: reading device bytes, or freeing a buffer, after its copy finished but without
/// synchronising with it is reported (the copy's completion was only seen through a poll); after an
/// `event_synchronize` on this thread, or a `stream_synchronize`, it is not.
#[test]
fn host_reads_and_frees_without_synchronising_are_reported_even_when_the_copy_finished() {
    let p = sim(quiet());
    let copy = p.create_stream("copy").unwrap();
    let h = host_with(&p, &[5; 16]);
    let d = p.alloc_device(16).unwrap();
    let ready = p.create_event().unwrap();
    p.copy_h2d(copy, h, 0, d, 0, 16).unwrap();
    p.record_event(ready, copy).unwrap();
    while !p.event_query(ready).unwrap() {
        std::thread::yield_now();
    }
    let mut out = vec![0; 16];
    p.read_device(d, 0, &mut out).unwrap();
    let v = p.take_violations();
    assert_eq!(
        v.iter().map(|v| (v.kind, v.later.label.as_str())).collect::<Vec<_>>(),
        vec![(HazardKind::ReadBeforeReady, "read_device")]
    );
    p.event_synchronize(ready).unwrap();
    p.read_device(d, 0, &mut out).unwrap();
    assert_eq!(out, vec![5; 16]);
    assert_eq!(p.take_violations(), vec![]);
    // A second buffer, freed after a poll: reported; a third, freed after synchronising the stream: not.
    let d2 = p.alloc_device(16).unwrap();
    p.copy_h2d(copy, h, 0, d2, 0, 16).unwrap();
    p.record_event(ready, copy).unwrap();
    while !p.event_query(ready).unwrap() {
        std::thread::yield_now();
    }
    p.free_device(d2).unwrap();
    let v = p.take_violations();
    assert_eq!(
        v.iter().map(|v| (v.kind, v.range.clone())).collect::<Vec<_>>(),
        vec![(HazardKind::FreeBeforeLastUse, 0..16)]
    );
    let d3 = p.alloc_device(16).unwrap();
    p.copy_h2d(copy, h, 0, d3, 0, 16).unwrap();
    p.stream_synchronize(copy).unwrap();
    p.free_device(d3).unwrap();
    assert_eq!(p.take_violations(), vec![]);
}
