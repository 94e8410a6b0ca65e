//! vLLM-Omni parity (issue 18), run bit-exact on the reference engine: the tiny presets with their text encoder made
//! pipeline-managed (lifecycle, listed among the on-demand components) stay bit-identical when that encoder is
//! staged on demand *and* streams its blocks, and when it keeps resident leading layers (the compact key and the
//! legacy `dlo_encoder_resident_layers`, every block resident, or a single streamed block left).

use weightferry::config::OffloadConfig;
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::PipelineDesc;
use weightferry_harness::drivers::run::{run, RunSpec};
use weightferry_harness::report::RunReport;

const PRESETS: [&str; 3] = ["flux-tiny", "wan-tiny", "qwen-tiny"];

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("config {json}: {e}"))
}

/// The preset with its text encoder pipeline-managed and its block list eligible for resident layers; returns the
/// pipeline and the encoder stack's name and block count.
fn staged_encoder(name: &str) -> (PipelineDesc, String, usize) {
    let mut p = preset(name).unwrap_or_else(|| panic!("preset {name}"));
    let te = p.root.children.iter_mut().find(|(n, _)| n == "text_encoder").expect("a text encoder");
    te.1.has_lifecycle = true;
    let plan = p.offload_plan.as_mut().expect("the presets declare a plan");
    let attr = plan.encoder_block_attrs["text_encoder"][0].clone();
    plan.on_demand_component_paths.push("text_encoder".into());
    plan.resident_encoder_block_paths = vec![format!("text_encoder.{attr}")];
    let blocks = p.module(&format!("text_encoder.{attr}")).expect("the block list").children.len();
    (p, format!("text_encoder[{attr}]"), blocks)
}

fn go(name: &str, p: &PipelineDesc, config: &OffloadConfig) -> RunReport {
    let mut spec = RunSpec::new(name, p.clone(), config.clone());
    spec.steps = 3;
    let r = run(&spec, &mut |_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}")).report;
    let what = format!("{name} {}: {r}", r.strategy);
    assert!(r.offload_enabled, "{what}");
    assert!(r.outputs_match, "{what}");
    assert_eq!(r.resident_checksum, r.offloaded_checksum, "{what}");
    assert!(r.weights_match, "{what}");
    assert_eq!(r.hazard_violations, 0, "{what}");
    assert!(r.within_plan, "{what}");
    assert!(r.peak_device_weight_bytes <= r.planned_device_weight_bytes, "{what}");
    r
}

#[test]
fn a_staged_encoder_that_streams_blocks_is_bit_exact() {
    for name in PRESETS {
        let (p, stack, blocks) = staged_encoder(name);
        for depth in [1u32, 2] {
            let c = cfg(&format!(
                r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit", "text_encoder", "vae"],
                    "layer_options": {{"text_encoder": {{"prefetch_depth": {depth}}}}}}}}}"#
            ));
            let r = go(name, &p, &c);
            let enc = r.stacks.iter().find(|s| s.name == stack).unwrap_or_else(|| panic!("{name}: {r}"));
            assert_eq!((enc.units, enc.resident, enc.depth), (blocks, 0, depth as usize), "{name}");
            assert!(enc.loads >= blocks as u64, "{name}: every block streamed: {r}");
            // The encoder's non-block weights and the VAE share the staged slot, each loaded for its own phase.
            let staged = r.stacks.iter().find(|s| s.name == "on-demand").unwrap_or_else(|| panic!("{name}: {r}"));
            assert_eq!((staged.units, staged.depth), (2, 0), "{name}: {r}");
            assert!(staged.loads >= 2, "{name}: {r}");
        }
    }
}

#[test]
fn encoder_resident_layers_are_bit_exact() {
    for name in PRESETS {
        let (p, stack, blocks) = staged_encoder(name);
        let compact = |n: usize| {
            cfg(&format!(
                r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit", "text_encoder"],
                    "layer_options": {{"text_encoder": {{"resident_layers": {n}, "prefetch_depth": 1}}}}}}}}"#
            ))
        };
        let legacy = cfg(r#"{"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false,
                "dlo_encoder_resident_layers": 2}"#);
        // Two resident, one streamed block left, every block resident, and the legacy spelling.
        for (c, resident) in
            [(compact(2), 2), (compact(blocks - 1), blocks - 1), (compact(blocks), blocks), (legacy, 2)]
        {
            let r = go(name, &p, &c);
            assert_eq!(r.strategy, "distributed_layer", "{name}");
            let enc = r.stacks.iter().find(|s| s.name == stack).unwrap_or_else(|| panic!("{name}: {r}"));
            assert_eq!((enc.units, enc.resident), (blocks, resident), "{name}: {r}");
            if resident < blocks {
                assert!(enc.loads > 0, "{name}: the tail streams: {r}");
            }
        }
    }
}
