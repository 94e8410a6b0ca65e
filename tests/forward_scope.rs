//! The scoped guard for non-forward entry points under model-level offload: a scope on the VAE (as a host engine
//! would open around `decode`) swaps it in, and once the DiT's scope opens the VAE is swapped out again — only the
//! executing component is resident.

use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::{get_offload_backend, WeightSource};
use weightferry::pipeline::presets::preset;
use weightferry_actors::platform::PlatformRef;
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

#[test]
fn a_vae_scope_swaps_the_vae_in_and_the_dit_scope_swaps_it_out() {
    let desc = preset("flux-tiny").unwrap();
    let sim = Arc::new(SimPlatform::new(SimConfig::default()).unwrap());
    let platform: PlatformRef = sim.clone();
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), 1).unwrap();
    let before = model.checksum().unwrap();
    let compute = platform.create_stream("compute").unwrap();
    let c = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}"#,
    )
    .unwrap();
    let hooks = HookRegistry::new();
    let mut b = get_offload_backend(&c, platform.clone(), None).unwrap().unwrap();
    b.enable(&mut model, &hooks, compute).unwrap();
    let vae_storage = desc.subtree_storages("vae")[0];
    let dit_storage = desc.subtree_storages("transformer.x_embedder")[0];
    assert!(b.locate(vae_storage).is_err(), "the VAE starts on the host");
    {
        let scope = hooks.scope("vae").unwrap();
        assert_eq!(scope.module(), "vae");
        b.locate(vae_storage).expect("the VAE is on the device inside its scope");
        assert!(b.locate(dit_storage).is_err(), "only the executing component is resident");
    }
    {
        let _dit = hooks.scope("transformer").unwrap();
        b.locate(dit_storage).expect("the DiT is on the device inside its scope");
        assert!(b.locate(vae_storage).is_err(), "the DiT took the VAE's place");
    }
    b.disable(&mut model, &hooks).unwrap();
    assert_eq!(model.checksum().unwrap(), before);
    assert!(sim.violations().is_empty());
}
