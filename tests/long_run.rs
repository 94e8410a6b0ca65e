//! Long run (issue 17): 50 000 steps of a tiny preset (wan-tiny's DiT: 40 blocks, 36 kept resident so every step
//! streams the other 4 through 3 slots) through one enabled backend on the simulated platform, every
//! block read by a compute kernel where its `pre_forward` put it, keep memory flat: the resident set after the
//! run stays within a small bound of the resident set after a warm-up, and the device and host memory, streams
//! and threads never change while it runs. No engine compute (the reference engine's arithmetic would take hours
//! here); what a step costs the library — hooks, loads, events, the sim's queues and its hazard detector — is all
//! there. The host runs at most [`AHEAD`] steps ahead of the device, as an engine bounds its run-ahead.

use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::get_offload_backend;
use weightferry::offload::units::build_unit_plan;
use weightferry::plan::presets::preset;
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::{Platform, PlatformRef};
use weightferry_actors::sim::{Access, SimConfig, SimPlatform};

/// Steps (passes over every streamed block).
const STEPS: usize = 50_000;
/// Steps before the resident set is taken as the reference.
const WARM_UP: usize = 2_000;
/// Steps the host may enqueue before it waits for the device.
const AHEAD: usize = 16;
/// How much the resident set may grow after the warm-up, over the remaining 48 000 steps: a growth of 22 bytes a
/// step would exceed it.
const RSS_SLACK_KIB: u64 = 1024;

/// Resident set of this process now, in KiB, after the allocator returned its free memory to the system (glibc
/// keeps freed memory in per-thread arenas; which arena a cycle's buffers land in would otherwise move the figure by
/// megabytes either way).
fn rss_kib() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: glibc's `malloc_trim` takes a byte count and only releases free memory of the allocator's arenas
        // back to the system; it touches no live allocation and is safe to call from any thread at any time.
        unsafe {
            malloc_trim(0);
        }
    }
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS line");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS value")
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("/proc/self/task").count()
}

/// Set in the child process that runs the measured body (see [`in_steady_allocator`]).
const CHILD_ENV: &str = "WEIGHTFERRY_MEMORY_TEST_CHILD";

/// Runs this test again in a child process whose allocator keeps no per-thread arenas and no cache of exited threads'
/// stacks (glibc tunables), so its resident set reflects live memory and not which arena or cached stack a cycle's
/// allocations happened to land in (that moves it by megabytes either way); returns `true` in the child, which then
/// runs the body. The parent passes or fails with the child.
fn in_steady_allocator(test: &str) -> bool {
    if std::env::var_os(CHILD_ENV).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("GLIBC_TUNABLES", "glibc.malloc.arena_max=1:glibc.pthread.stack_cache_size=0")
        .output()
        .expect("run the test in a child process");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "the child run failed: {text}");
    assert!(text.contains("1 passed"), "the child ran no test: {text}");
    false
}

#[test]
fn fifty_thousand_steps_keep_memory_flat() {
    if !in_steady_allocator("fifty_thousand_steps_keep_memory_flat") {
        return;
    }
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let desc = Arc::new(preset("wan-tiny").unwrap());
    let mut model = HostModel::synthetic(platform.clone(), desc.clone(), 3).unwrap();
    let checksum = model.checksum().unwrap();
    let hooks = HookRegistry::new();
    let config = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"prefetch_depth": 2, "resident_layers": 36}}}}"#,
    )
    .unwrap();
    let plan = resolve_offload_plan(&desc, &config).unwrap();
    let units = build_unit_plan(&desc, &config, &plan);
    let mut backend = get_offload_backend(&config, platform.clone(), None).unwrap().expect("offload enabled");
    backend.enable(&mut model, &hooks, compute).unwrap();
    let blocks: usize = units.stacks.iter().map(|s| s.units.len()).sum();
    let (device, host, streams, threads_then) =
        (sim.device_memory().in_use, sim.host_memory(), sim.stream_count(), threads());
    let mut warm_rss = 0;
    for step in 0..STEPS {
        if step == WARM_UP {
            warm_rss = rss_kib();
        }
        for stack in &units.stacks {
            for unit in &stack.units {
                let at = hooks.pre_forward(&unit.path).unwrap().expect("a streamed block has a residency");
                let read = Access::read(at.buffer, at.base, unit.device_bytes);
                sim.launch(compute, "block", vec![read], Box::new(|_| Ok(()))).unwrap();
                hooks.post_forward(&unit.path).unwrap();
            }
        }
        if step % AHEAD == AHEAD - 1 {
            platform.stream_synchronize(compute).unwrap();
            if step % 1000 == 999 {
                assert_eq!(sim.device_memory().in_use, device, "step {step}: device memory");
                let h = sim.host_memory();
                assert_eq!((h.in_use, h.buffers), (host.in_use, host.buffers), "step {step}: host memory");
                assert_eq!(sim.stream_count(), streams, "step {step}: streams");
                assert_eq!(threads(), threads_then, "step {step}: threads");
            }
        }
    }
    backend.fence().unwrap();
    let end_rss = rss_kib();
    let report = backend.report();
    let loads: u64 = report.stacks.iter().map(|s| s.loads).sum();
    backend.disable(&mut model, &hooks).unwrap();
    assert_eq!(model.checksum().unwrap(), checksum, "host weights changed");
    assert_eq!(sim.violations(), Vec::new(), "hazards in a correct run");
    assert_eq!(sim.device_memory().in_use, 0);
    println!(
        "long run: {STEPS} steps of {blocks} blocks, {loads} loads; RSS after {WARM_UP} steps {warm_rss} KiB, at \
         the end {end_rss} KiB"
    );
    // Every step streams the blocks that are not kept (a ring smaller than the stack reloads them all).
    assert!(loads >= STEPS as u64, "{loads} loads");
    assert!(
        end_rss <= warm_rss + RSS_SLACK_KIB,
        "resident set grew from {warm_rss} KiB after {WARM_UP} steps to {end_rss} KiB after {STEPS}"
    );
}
