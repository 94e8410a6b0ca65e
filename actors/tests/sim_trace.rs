//! The simulated platform's trace records name the host buffer of every copy (so a trace writer can name copies by
//! what the buffer holds), and no buffer for kernels and waits.

#![cfg(not(weightferry_loom))]

use weightferry_actors::platform::{HostMemoryKind, Platform};
use weightferry_actors::sim::{SimConfig, SimPlatform, TraceKind};

#[test]
fn copies_record_their_host_buffer_kernels_and_waits_none() {
    let p = SimPlatform::new(SimConfig { tracing: true, ..SimConfig::default() }).expect("valid config");
    let copy = p.create_stream("copy").unwrap();
    let other = p.create_stream("other").unwrap();
    let a = p.alloc_host(64, HostMemoryKind::Pinned).unwrap();
    let b = p.alloc_host(64, HostMemoryKind::Pageable).unwrap();
    let d = p.alloc_device(64).unwrap();
    p.copy_h2d(copy, a, 0, d, 0, 64).unwrap();
    p.copy_d2h(copy, d, 0, b, 0, 32).unwrap();
    p.launch(copy, "k", vec![], Box::new(|_ctx| Ok(()))).unwrap();
    let e = p.create_event().unwrap();
    p.record_event(e, copy).unwrap();
    p.stream_wait_event(other, e).unwrap();
    p.stream_synchronize(copy).unwrap();
    p.stream_synchronize(other).unwrap();
    let got: Vec<_> = p.trace().into_iter().map(|t| (t.stream_name, t.kind, t.bytes, t.host_buffer)).collect();
    let on = |s: &str| got.iter().filter(|g| g.0 == s).map(|g| (g.1, g.2, g.3)).collect::<Vec<_>>();
    assert_eq!(
        on("copy"),
        vec![(TraceKind::H2d, 64, Some(a)), (TraceKind::D2h, 32, Some(b)), (TraceKind::Kernel, 0, None)]
    );
    assert_eq!(on("other"), vec![(TraceKind::Wait, 0, None)]);
}
