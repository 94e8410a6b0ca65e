//! What a streaming backend tells observers: `set_progress` sees master building at `enable` as `(done, total)`
//! bytes, once before the first batch and after every batch; `master_units` names the unit of every host master
//! while enabled, and nothing after `disable`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::{Home, HostModel};
use weightferry::offload::backend::{master_batches, EnableProgress, MASTER_BATCH_BYTES, MASTER_BATCH_UNITS};
use weightferry::offload::get_offload_backend;
use weightferry::offload::units::build_unit_plan;
use weightferry::pipeline::presets::preset;
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::{HostBufferId, PlatformRef};
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

#[test]
fn enable_reports_master_bytes_per_batch_and_names_every_master() {
    let desc = Arc::new(preset("flux-tiny").expect("preset"));
    let config =
        OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#)
            .expect("config");
    let plan = resolve_offload_plan(&desc, &config).expect("plan");
    let units = build_unit_plan(&desc, &config, &plan);
    let sizes: Vec<u64> = units.stacks[0].units.iter().map(|u| u.sections.iter().map(|s| s.len).sum()).collect();
    let total: u64 = sizes.iter().sum();
    let mut want = vec![(0, total)];
    for r in master_batches(&sizes, MASTER_BATCH_BYTES, MASTER_BATCH_UNITS) {
        want.push((want[want.len() - 1].0 + sizes[r].iter().sum::<u64>(), total));
    }
    assert_eq!(units.stacks.len(), 1);
    assert!(want.len() > 2, "several batches: {want:?}");

    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).expect("sim"));
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").expect("stream");
    let mut model = HostModel::synthetic(platform.clone(), desc.clone(), 3).expect("model");
    let hooks = HookRegistry::new();
    let mut backend = get_offload_backend(&config, platform.clone(), None).expect("backend").expect("enabled");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    backend.set_progress(Some(EnableProgress::new(move |done, total| log.lock().unwrap().push((done, total)))));
    assert!(backend.master_units().is_empty());
    backend.enable(&mut model, &hooks, compute).expect("enable");
    assert_eq!(*seen.lock().unwrap(), want);
    assert_eq!(backend.report().master_host_bytes, total);

    // Every section's master, named by its unit, and nothing else.
    let mut homes: BTreeSet<(HostBufferId, String)> = BTreeSet::new();
    for unit in &units.stacks[0].units {
        for sec in &unit.sections {
            let (s, _) = sec.storages[0];
            match model.home(s) {
                Some(Home::Master { buf, .. }) => homes.insert((buf, unit.path.clone())),
                other => panic!("{}: {s:?} homed at {other:?}", unit.path),
            };
        }
    }
    let named = backend.master_units();
    assert_eq!(named.len(), homes.len(), "one entry per master");
    assert_eq!(named.into_iter().collect::<BTreeSet<_>>(), homes);
    assert!(homes.iter().any(|(_, p)| p == "transformer.single_transformer_blocks.37"));

    backend.disable(&mut model, &hooks).expect("disable");
    assert!(backend.master_units().is_empty());
    // A later enable without an observer reports nothing.
    backend.set_progress(None);
    backend.enable(&mut model, &hooks, compute).expect("enable");
    assert_eq!(seen.lock().unwrap().len(), want.len());
    backend.disable(&mut model, &hooks).expect("disable");
}
