//! GPU tests (run on the GPU machine with `--include-ignored`; CI has no GPU): the GPU reference engine's output
//! with offload is bit-identical to the fully resident run for every strategy and prefetch depth 1–4 on the tiny
//! presets, host weights are bit-identical afterwards, and a deliberately broken ordering (compute not waiting for
//! the ready event, with copies slowed down so the race must show) is detected by the same comparison; the same with
//! the hooks enqueueing the copies themselves (`copy_submission = "hook"`). The broken-ordering tests need a build
//! with `RUSTFLAGS="--cfg weightferry_broken"` as well.
#![cfg(feature = "cuda")]

use weightferry::config::OffloadConfig;
use weightferry::pipeline::presets::preset;
#[cfg(weightferry_broken)]
use weightferry::scheduler::OrderingFault;
use weightferry_harness::drivers::gpu::{gpu_run, GpuRunSpec};
use weightferry_harness::engine::cuda::GpuShape;

const SHAPE: GpuShape = GpuShape { tokens: 256, context_tokens: 64 };

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
}

fn configs() -> Vec<(String, OffloadConfig)> {
    let mut v = Vec::new();
    for d in 1..=4 {
        v.push((
            format!("layer depth {d}"),
            cfg(&format!(
                r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit", "text_encoder"],
                    "layer_options": {{"dit": {{"prefetch_depth": {d}}}, "text_encoder": {{"prefetch_depth": {d}}}}}}}}}"#
            )),
        ));
    }
    for d in [1, 2, 4] {
        v.push((
            format!("layer depth {d}, hook submission"),
            cfg(&format!(
                r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit", "text_encoder"],
                    "layer_options": {{"dit": {{"prefetch_depth": {d}, "copy_submission": "hook"}},
                    "text_encoder": {{"prefetch_depth": {d}, "copy_submission": "hook"}}}}}}}}"#
            )),
        ));
    }
    v.push((
        "rank-local, 3 resident layers, hook submission".into(),
        cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"resident_layers": 3, "copy_submission": "hook"}}}}"#),
    ));
    v.push((
        "distributed layerwise, rank-local, 3 resident layers".into(),
        cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"resident_layers": 3, "weight_transfer": "rank-local"}}}}"#),
    ));
    v.push((
        "layer with the VAE staged".into(),
        cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder", "vae"]}}"#),
    ));
    v.push((
        "model-level".into(),
        cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}"#),
    ));
    v.push(("legacy layerwise flag".into(), cfg(r#"{"enable_layerwise_offload": true}"#)));
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_strategy_and_depth_is_bit_exact_on_the_gpu() {
    for name in ["flux-tiny", "wan-tiny", "qwen-tiny"] {
        let desc = preset(name).unwrap();
        for (label, c) in configs() {
            for skip in [None, Some(7)] {
                let r = gpu_run(GpuRunSpec { skip_seed: skip, ..GpuRunSpec::new(&desc, &c, 3, SHAPE) })
                    .unwrap_or_else(|e| panic!("{name} {label}: {e}"));
                let what = format!("{name} {label} skip {skip:?}: {r:?}");
                assert!(r.outputs_match, "{what}");
                assert!(r.weights_match, "{what}");
                assert!(r.h2d_bytes > 0, "{what}");
                assert!(r.peak_device_weight_bytes <= r.planned_device_weight_bytes, "{what}");
            }
        }
    }
}

#[test]
#[cfg(weightferry_broken)] // the broken orderings: RUSTFLAGS="--cfg weightferry_broken"
#[ignore = "needs a CUDA GPU"]
fn a_broken_ordering_is_detected_on_the_gpu() {
    let desc = preset("flux-tiny").unwrap();
    let c = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"prefetch_depth": 1}}}}"#);
    // The correct ordering with the same slowed copies still matches…
    let ok = gpu_run(GpuRunSpec { slow_copies: true, ..GpuRunSpec::new(&desc, &c, 2, SHAPE) }).unwrap();
    assert!(ok.outputs_match, "{ok:?}");
    // …and skipping the wait on the ready event does not.
    let broken = gpu_run(GpuRunSpec {
        ordering_fault: OrderingFault::SkipReadyWait,
        slow_copies: true,
        ..GpuRunSpec::new(&desc, &c, 2, SHAPE)
    })
    .unwrap();
    assert!(!broken.outputs_match, "the broken ordering went unnoticed: {broken:?}");
    assert!(broken.weights_match, "host weights must survive even a broken schedule");
}

#[test]
#[ignore = "needs a CUDA GPU (and ~35 GB of device memory)"]
fn an_execution_does_not_depend_on_earlier_executions() {
    use std::sync::Arc;
    use weightferry::hooks::HookRegistry;
    use weightferry::model::HostModel;
    use weightferry::offload::ResidentPlacement;
    use weightferry::platform::cuda::CudaPlatform;
    use weightferry::scheduler::PlatformRef;
    use weightferry_harness::engine::cuda::CudaCompute;
    use weightferry_harness::engine::synthetic::SyntheticWeights;
    use weightferry_harness::engine::{Engine, ExecOptions};
    // flux-dev's VAE has products wider than any activation: they must not read what an earlier run left behind.
    let desc = preset("flux-dev").unwrap();
    let cuda = Arc::new(CudaPlatform::new(0).unwrap());
    let platform: PlatformRef = cuda.clone();
    let model = HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), 0).unwrap();
    let shape = GpuShape { tokens: 128, context_tokens: 32 };
    let engine = Engine::new(Arc::new(CudaCompute::new(cuda.clone(), &desc, shape).unwrap()), &desc).unwrap();
    let all: Vec<_> = desc.storages.keys().copied().collect();
    let up = platform.create_stream("up").unwrap();
    let mut placement = ResidentPlacement::upload(&platform, &model, &all, up).unwrap();
    let run = |steps: u32| {
        let opts = ExecOptions { steps, input_seed: 0, skip_seed: None, span_epoch: None, max_blocks_ahead: None };
        engine.execute(&placement, &HookRegistry::new(), &opts, &mut |_| {}).unwrap().output
    };
    let first = run(3);
    let _ = run(1);
    let again = run(3);
    placement.release().unwrap();
    assert!(first == again, "the same execution gave a different output after another execution");
}

#[test]
#[cfg(weightferry_broken)] // the broken orderings: RUSTFLAGS="--cfg weightferry_broken"
#[ignore = "needs a CUDA GPU"]
fn a_broken_ordering_is_detected_on_the_gpu_with_hook_submission() {
    let desc = preset("flux-tiny").unwrap();
    let c = cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"prefetch_depth": 1, "copy_submission": "hook"}}}}"#);
    let ok = gpu_run(GpuRunSpec { slow_copies: true, ..GpuRunSpec::new(&desc, &c, 2, SHAPE) }).unwrap();
    assert!(ok.outputs_match, "{ok:?}");
    let broken = gpu_run(GpuRunSpec {
        ordering_fault: OrderingFault::SkipReadyWait,
        slow_copies: true,
        ..GpuRunSpec::new(&desc, &c, 2, SHAPE)
    })
    .unwrap();
    assert!(!broken.outputs_match, "the broken ordering went unnoticed: {broken:?}");
    assert!(broken.weights_match, "host weights must survive even a broken schedule");
}
