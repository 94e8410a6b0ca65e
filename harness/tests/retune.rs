//! Retuning an enabled backend: prefetch depth, resident layers and budget change without rebuilding host masters;
//! outputs stay bit-identical to the resident run after every retune; a config that changes what is streamed is
//! refused before anything is touched; weights are bit-identical after disable.

use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::{get_offload_backend, OffloadError, ResidentPlacement};
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::StorageId;
use weightferry::scheduler::{Platform, PlatformRef, SimConfig, SimPlatform};
use weightferry_harness::engine::compute::SimCompute;
use weightferry_harness::engine::synthetic::SyntheticWeights;
use weightferry_harness::engine::{Engine, ExecOptions};

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap()
}

#[test]
fn retune_changes_depth_and_residency_and_stays_bit_exact() {
    let desc = preset("flux-tiny").unwrap();
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), 3).unwrap();
    let before = model.checksum().unwrap();
    let engine = Engine::new(Arc::new(SimCompute::new(sim.clone())), &desc).unwrap();
    let opts = ExecOptions { steps: 2, input_seed: 3, skip_seed: None, span_epoch: None, max_blocks_ahead: None };
    let all: Vec<StorageId> = desc.storages.keys().copied().collect();
    let up = platform.create_stream("up").unwrap();
    let mut placement = ResidentPlacement::upload(&platform, &model, &all, up).unwrap();
    let resident = engine.execute(&placement, &HookRegistry::new(), &opts, &mut |_| {}).unwrap();
    placement.release().unwrap();

    let hooks = HookRegistry::new();
    let d1 = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"prefetch_depth": 1}}}}"#);
    let mut b = get_offload_backend(&d1, platform.clone(), None).unwrap().unwrap();
    b.enable(&mut model, &hooks, engine.stream()).unwrap();
    let masters = b.report().master_host_bytes;
    let out = engine.execute(&b, &hooks, &opts, &mut |_| {}).unwrap();
    assert_eq!(out.output, resident.output);

    let d3 = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"prefetch_depth": 3}}}}"#);
    b.retune(d3, &model, &hooks, engine.stream()).unwrap();
    assert_eq!(b.report().stacks[0].depth, 3);
    assert_eq!(b.report().master_host_bytes, masters, "masters are kept");
    let out = engine.execute(&b, &hooks, &opts, &mut |_| {}).unwrap();
    assert_eq!(out.output, resident.output);

    // A budget that fits several resident blocks.
    let plan = b.plan().unwrap().clone();
    let budget = plan.budget.device_weight_bytes + 3 * plan.dits[0].stacks[0].block_bytes[0];
    let bud = cfg(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "device_budget": {budget},
            "layer_options": {{"dit": {{"prefetch_depth": 3}}}}}}}}"#
    ));
    b.retune(bud, &model, &hooks, engine.stream()).unwrap();
    assert!(b.report().stacks[0].resident >= 2, "{:?}", b.report());
    sim.reset_peak();
    let base = sim.device_memory().in_use - b.report().fixed_device_bytes - b.report().stacks[0].device_bytes;
    let out = engine.execute(&b, &hooks, &opts, &mut |_| {}).unwrap();
    assert_eq!(out.output, resident.output);
    assert!(sim.device_memory().peak - base <= budget);

    // Changing what is streamed is refused, and the backend keeps working.
    let other = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}"#);
    let e = b.retune(other, &model, &hooks, engine.stream()).unwrap_err();
    assert!(matches!(e, OffloadError::Unsupported(ref m) if m.starts_with("retune can change prefetch depths")), "{e}");
    let out = engine.execute(&b, &hooks, &opts, &mut |_| {}).unwrap();
    assert_eq!(out.output, resident.output);

    b.disable(&mut model, &hooks).unwrap();
    assert!(hooks.hook_names().is_empty());
    assert_eq!(model.checksum().unwrap(), before);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn retune_before_enable_is_an_error() {
    let sim = Arc::new(SimPlatform::new(SimConfig::default()).unwrap());
    let platform: PlatformRef = sim.clone();
    let desc = preset("flux-tiny").unwrap();
    let model = HostModel::synthetic(platform.clone(), Arc::new(desc), 0).unwrap();
    let c = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#);
    let mut b = get_offload_backend(&c, platform.clone(), None).unwrap().unwrap();
    let s = platform.create_stream("compute").unwrap();
    let e = b.retune(c, &model, &HookRegistry::new(), s).unwrap_err();
    assert_eq!(e.to_string(), "retune needs an enabled backend; call enable first");
}
