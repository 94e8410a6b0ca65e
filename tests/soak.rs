//! Soak (issue 17): thousands of enable → steps → disable cycles on the simulated platform leave no thread, stream,
//! device or host memory behind, and the resident set of the process stays flat after a warm-up.
//!
//! One test in its own binary, so the thread counts it asserts (from `/proc/self/task`) are this test's alone; it
//! runs in a child process with a steady allocator (see `in_steady_allocator`).
//! Every step runs a compute kernel per block that reads the block where its `pre_forward` put it, so the slots are
//! really reused (and checked by the sim's order-based hazard detector: no violation is allowed).

use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::get_offload_backend;
use weightferry::offload::units::build_unit_plan;
use weightferry::pipeline::presets::preset;
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::{Platform, PlatformRef};
use weightferry_actors::sim::{Access, SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

/// Enable → steps → disable cycles.
const CYCLES: usize = 2000;
/// Cycles before the resident set is taken as the reference (allocator pools, lazily grown tables).
const WARM_UP: usize = 200;
/// Steps (passes over every block) per cycle.
const STEPS: usize = 2;
/// How much the resident set may grow after the warm-up, over all the remaining 1800 cycles (about 600 bytes a
/// cycle). Before streams could be destroyed, each cycle left two sim workers behind: about 63 KiB resident a cycle.
const RSS_SLACK_KIB: u64 = 1024;

#[path = "support/memory.rs"]
mod memory;
use memory::{in_steady_allocator, rss_kib, threads};

/// Threads of this process once the count reached `expected`, or after 2 s of waiting for it: a thread that was
/// just joined can still be listed for a moment while the kernel finishes its exit; one that leaked stays.
fn threads_settled(expected: usize) -> usize {
    for i in 0..20_000 {
        let n = threads();
        if n == expected {
            return n;
        }
        if i < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
    threads()
}

#[test]
fn enable_steps_disable_cycles_leave_no_thread_stream_or_memory_behind() {
    if !in_steady_allocator("enable_steps_disable_cycles_leave_no_thread_stream_or_memory_behind") {
        return;
    }
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let desc = Arc::new(preset("flux-tiny").unwrap());
    let mut model = HostModel::synthetic(platform.clone(), desc.clone(), 7).unwrap();
    let checksum = model.checksum().unwrap();
    let hooks = HookRegistry::new();
    let config = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"prefetch_depth": 2}}}}"#,
    )
    .unwrap();
    let plan = resolve_offload_plan(&desc, &config).unwrap();
    let units = build_unit_plan(&desc, &config, &plan);
    let mut backend = get_offload_backend(&config, platform.clone(), None).unwrap().expect("offload enabled");

    let idle_threads = threads();
    let host_baseline = sim.host_memory();
    assert_eq!(sim.stream_count(), 1, "only the compute stream");
    let mut warm_rss = 0;
    let mut enabled_threads = None;
    for cycle in 0..CYCLES {
        if cycle == WARM_UP {
            warm_rss = rss_kib();
        }
        backend.enable(&mut model, &hooks, compute).unwrap_or_else(|e| panic!("cycle {cycle}: enable: {e}"));
        // The copy stream and the placement stream (two sim workers), the copy-stream actor and its watcher.
        assert_eq!(sim.stream_count(), 3, "cycle {cycle}: streams while enabled");
        let now = threads_settled(idle_threads + 4);
        assert_eq!(now, idle_threads + 4, "cycle {cycle}: threads while enabled");
        enabled_threads.get_or_insert(now);
        for step in 0..STEPS {
            for stack in &units.stacks {
                for unit in &stack.units {
                    let at = hooks.pre_forward(&unit.path).unwrap().expect("a streamed block has a residency");
                    let read = Access::read(at.buffer, at.base, unit.device_bytes);
                    sim.launch(compute, &format!("step {step} {}", unit.path), vec![read], Box::new(|_| Ok(())))
                        .unwrap();
                    hooks.post_forward(&unit.path).unwrap();
                }
            }
        }
        backend.fence().unwrap();
        backend.disable(&mut model, &hooks).unwrap_or_else(|e| panic!("cycle {cycle}: disable: {e}"));
        assert_eq!(threads_settled(idle_threads), idle_threads, "cycle {cycle}: threads after disable");
        assert_eq!(sim.stream_count(), 1, "cycle {cycle}: streams after disable");
        assert_eq!(sim.device_memory().in_use, 0, "cycle {cycle}: device memory after disable");
        let host = sim.host_memory();
        assert_eq!((host.in_use, host.buffers), (host_baseline.in_use, host_baseline.buffers), "cycle {cycle}");
    }
    platform.stream_synchronize(compute).unwrap();
    let end_rss = rss_kib();
    assert_eq!(model.checksum().unwrap(), checksum, "host weights changed over the cycles");
    assert_eq!(sim.violations(), Vec::new(), "hazards in correct cycles");
    println!(
        "soak: {CYCLES} cycles; threads idle {idle_threads}, enabled {}; RSS after {WARM_UP} cycles {warm_rss} KiB, \
         at the end {end_rss} KiB",
        enabled_threads.unwrap_or(0)
    );
    assert!(
        end_rss <= warm_rss + RSS_SLACK_KIB,
        "resident set grew from {warm_rss} KiB after {WARM_UP} cycles to {end_rss} KiB after {CYCLES}"
    );
}
