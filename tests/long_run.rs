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
use weightferry::pipeline::presets::preset;
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::{Platform, PlatformRef};
use weightferry_actors::sim::{Access, SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

/// Steps (passes over every streamed block).
const STEPS: usize = 50_000;
/// Steps before the resident set is taken as the reference.
const WARM_UP: usize = 2_000;
/// Steps the host may enqueue before it waits for the device.
const AHEAD: usize = 16;
/// How much the resident set may grow after the warm-up, over the remaining 48 000 steps: a growth of 22 bytes a
/// step would exceed it.
const RSS_SLACK_KIB: u64 = 1024;

#[path = "support/memory.rs"]
mod memory;
use memory::{in_steady_allocator, rss_kib, threads};

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
