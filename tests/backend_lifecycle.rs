//! Lifecycle contracts of the offload backend on the simulated platform (ARCHITECTURE.md's invariants 5, 6, 7 and
//! 8), driven directly through the hook registry and `locate` — no engine.
//!
//! Covered: enable → disable cycles restore every storage to its own host buffer with bit-identical bytes, remove
//! every hook and the offload owner, and return device memory to its baseline; while enabled every streamed
//! storage exists once in host memory (in a master; its loaded buffer is freed) and every other storage stays in its
//! loaded buffer; enable is transactional under an out-of-memory error at every allocation index and under failed
//! host→device copies (synchronous and asynchronous), and the same backend enables cleanly afterwards; a copy
//! failure while streaming surfaces on a hook naming the failed block; one strategy owns the hooks at a time; the
//! factory returns nothing for a disabled config and refuses AllGather across ranks; a tied attribute streams with
//! its block while other non-block state sits in the fixed placement; `locate` gives exact bytes; model-level
//! offload keeps only the executing component resident; a failed disable keeps its state and a retry finishes it.

use std::collections::BTreeSet;
use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::hooks::{HookError, HookFailure, HookRegistry, LAYERWISE_OFFLOAD_HOOK, SEQUENTIAL_OFFLOAD_HOOK};
use weightferry::model::{Home, HostModel};
use weightferry::offload::units::{build_unit_plan, UnitPlan};
use weightferry::offload::{get_offload_backend, OffloadError, StreamingBackend, WeightSource};
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::{Platform, PlatformError, PlatformRef, StreamId};
use weightferry_actors::sim::{FaultPlan, SimConfig, SimPlatform};
use weightferry_actors::SchedulerError;

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

const PRESETS: [&str; 3] = ["flux-tiny", "wan-tiny", "qwen-tiny"];
const FLUX_DIT_STACK: &str = "transformer[transformer_blocks+single_transformer_blocks]";
const NOT_LOADED: &str = "its block is not loaded (call pre_forward on the module first)";

fn cfg(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).unwrap_or_else(|e| panic!("config {json}: {e}"))
}

/// Layerwise, DiT only, prefetch depth 2 (everything else in the fixed placement).
fn layer_dit() -> OffloadConfig {
    cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"prefetch_depth": 2}}}}"#)
}

/// Layerwise over every component: DiT ring, encoder ring, on-demand VAE.
fn layer_all() -> OffloadConfig {
    cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder", "vae"],
        "layer_options": {"dit": {"prefetch_depth": 3}, "text_encoder": {"prefetch_depth": 1}}}}"#)
}

/// Two resident DiT blocks (distributed layerwise strategy, rank-local transfer, no eager prefetch).
fn resident_two() -> OffloadConfig {
    cfg(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"resident_layers": 2, "prefetch_depth": 1}}}}"#)
}

fn model_level() -> OffloadConfig {
    cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}"#)
}

fn model_keep_dit() -> OffloadConfig {
    cfg(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"],
        "keep_dit_resident": true}}"#)
}

/// A sim platform, a compute stream, a synthetic model and an empty registry.
struct Fx {
    sim: Arc<SimPlatform>,
    platform: PlatformRef,
    compute: StreamId,
    desc: Arc<PipelineDesc>,
    model: HostModel,
    hooks: HookRegistry,
    checksum: u64,
}

fn fx(name: &str, faults: FaultPlan) -> Fx {
    let sim = Arc::new(SimPlatform::new(SimConfig { faults, tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let desc = Arc::new(preset(name).unwrap_or_else(|| panic!("preset {name}")));
    let model = HostModel::synthetic(platform.clone(), desc.clone(), 7).unwrap();
    let checksum = model.checksum().unwrap();
    Fx { sim, platform, compute, desc, model, hooks: HookRegistry::new(), checksum }
}

fn backend(f: &Fx, config: &OffloadConfig) -> StreamingBackend {
    get_offload_backend(config, f.platform.clone(), None).unwrap().expect("offload is enabled in this config")
}

fn units(f: &Fx, config: &OffloadConfig) -> UnitPlan {
    let plan = resolve_offload_plan(&f.desc, config).unwrap();
    build_unit_plan(&f.desc, config, &plan)
}

fn total_bytes(f: &Fx) -> u64 {
    f.desc.storages.keys().map(|&s| f.model.storage_bytes(s)).sum()
}

/// Every storage placed in a stack unit.
fn streamed(u: &UnitPlan) -> BTreeSet<StorageId> {
    u.stacks.iter().flat_map(|s| s.units.iter().flat_map(|l| l.storages())).collect()
}

/// Host→device copies the fixed placement issues (one per non-empty storage).
fn fixed_copies(f: &Fx, u: &UnitPlan) -> u64 {
    u.fixed.iter().filter(|&&s| f.model.storage_bytes(s) > 0).count() as u64
}

/// `(module, hook name, owner)` the backend must register: every unit path of every stack.
fn expected_hooks(u: &UnitPlan) -> Vec<(String, String, String)> {
    let mut v: Vec<(String, String, String)> = u
        .stacks
        .iter()
        .flat_map(|s| s.units.iter().map(|l| (l.path.clone(), u.hook_name.to_string(), u.hook_name.to_string())))
        .collect();
    v.sort();
    v
}

/// After a disable or a failed enable: no hook, no owner, no device memory, every storage in its own loaded buffer
/// with its original bytes.
fn assert_clean(f: &Fx, what: &str) {
    assert!(f.hooks.hook_names().is_empty(), "{what}: hooks left {:?}", f.hooks.hook_names());
    assert_eq!(f.hooks.offload_owner(), None, "{what}: offload owner left");
    assert_eq!(f.sim.device_memory().in_use, 0, "{what}: device memory left");
    assert!(f.model.mastered().is_empty(), "{what}: storages still homed in masters");
    assert_eq!(f.model.loaded_bytes(), total_bytes(f), "{what}");
    assert_eq!(f.model.checksum().unwrap(), f.checksum, "{what}: host weights changed");
}

/// Runs one pass of pre/post hooks over every unit of every stack through the registry.
fn pass(f: &Fx, u: &UnitPlan) -> Result<(), HookError> {
    for s in &u.stacks {
        for l in &s.units {
            f.hooks.pre_forward(&l.path)?;
            f.hooks.post_forward(&l.path)?;
        }
    }
    Ok(())
}

/// The device bytes at `locate(storage)` equal the storage's host bytes (after the compute stream's waits).
fn assert_located_bytes(f: &Fx, b: &StreamingBackend, storage: StorageId, what: &str) {
    f.platform.stream_synchronize(f.compute).unwrap();
    let (buf, off) = b.locate(storage).unwrap_or_else(|e| panic!("{what}: locate({storage:?}): {e}"));
    let want = f.model.read_storage(storage).unwrap();
    let mut got = vec![0u8; want.len()];
    f.sim.read_device(buf, off, &mut got).unwrap();
    assert!(got == want, "{what}: device bytes of {storage:?} differ from the host");
}

fn not_loaded(s: StorageId) -> OffloadError {
    OffloadError::NotResident { storage: s.0, reason: NOT_LOADED.to_string() }
}

fn is_oom(e: &OffloadError) -> bool {
    matches!(
        e,
        OffloadError::Platform(PlatformError::OutOfMemory { .. })
            | OffloadError::Scheduler(SchedulerError::Platform(PlatformError::OutOfMemory { .. }))
    )
}

#[test]
fn enable_disable_cycles_restore_weights_hooks_and_memory() {
    for name in PRESETS {
        for (label, config) in [
            ("layer_dit", layer_dit()),
            ("layer_all", layer_all()),
            ("resident_two", resident_two()),
            ("model", model_level()),
        ] {
            let mut f = fx(name, FaultPlan::none());
            let u = units(&f, &config);
            assert!(!u.is_empty(), "{name} {label}");
            let mut b = backend(&f, &config);
            for cycle in 0..3 {
                let what = format!("{name} {label} cycle {cycle}");
                b.enable(&mut f.model, &f.hooks, f.compute).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(b.is_enabled(), "{what}");
                assert_eq!(f.hooks.offload_owner().as_deref(), Some(u.hook_name), "{what}");
                assert_eq!(f.hooks.hook_names(), expected_hooks(&u), "{what}");
                assert_eq!(f.hooks.count_owned_by(u.hook_name), expected_hooks(&u).len(), "{what}");
                assert!(f.sim.device_memory().in_use > 0, "{what}");
                // Streaming does not touch the authoritative host bytes.
                pass(&f, &u).unwrap_or_else(|e| panic!("{what}: {e}"));
                b.fence().unwrap();
                assert_eq!(f.model.checksum().unwrap(), f.checksum, "{what}: weights changed while enabled");
                b.disable(&mut f.model, &f.hooks).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(!b.is_enabled(), "{what}");
                assert_clean(&f, &what);
                // Disabling twice is a no-op.
                b.disable(&mut f.model, &f.hooks).unwrap();
                assert_clean(&f, &what);
            }
            assert!(f.sim.violations().is_empty(), "{name} {label}: {:?}", f.sim.violations());
        }
    }
}

#[test]
fn enabling_twice_warns_and_changes_nothing() {
    let mut f = fx("flux-tiny", FaultPlan::none());
    let mut b = backend(&f, &layer_dit());
    b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    let mem = f.sim.device_memory().in_use;
    let hooks = f.hooks.hook_names();
    let allocs = f.sim.stats().allocs;
    b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    assert_eq!(f.sim.device_memory().in_use, mem);
    assert_eq!(f.hooks.hook_names(), hooks);
    assert_eq!(f.sim.stats().allocs, allocs, "a second enable must not allocate");
    b.disable(&mut f.model, &f.hooks).unwrap();
    assert_clean(&f, "after double enable");
}

#[test]
fn exactly_one_host_copy_while_enabled() {
    for name in PRESETS {
        for (label, config) in [("layer_all", layer_all()), ("layer_dit", layer_dit()), ("model", model_level())] {
            let what = format!("{name} {label}");
            let mut f = fx(name, FaultPlan::none());
            let u = units(&f, &config);
            let streamed = streamed(&u);
            let before: Vec<(StorageId, Home)> =
                f.desc.storages.keys().map(|&s| (s, f.model.home(s).unwrap())).collect();
            let mut b = backend(&f, &config);
            b.enable(&mut f.model, &f.hooks, f.compute).unwrap();

            // Every streamed storage is homed in a master, every other storage stays in its loaded buffer.
            assert_eq!(f.model.mastered().into_iter().collect::<BTreeSet<_>>(), streamed, "{what}");
            let streamed_bytes: u64 = streamed.iter().map(|&s| f.model.storage_bytes(s)).sum();
            let fixed_bytes: u64 = u.fixed.iter().map(|&s| f.model.storage_bytes(s)).sum();
            assert_eq!(f.model.loaded_bytes(), fixed_bytes, "{what}: loaded bytes = the non-streamed storages");
            assert_eq!(f.model.loaded_bytes() + streamed_bytes, total_bytes(&f), "{what}");
            // Masters are the unit layouts' sections: the streamed bytes plus alignment padding (< 256 bytes per
            // storage), nothing more.
            let sections: u64 =
                u.stacks.iter().flat_map(|s| s.units.iter().flat_map(|l| l.sections.iter().map(|x| x.len))).sum();
            let report = b.report();
            assert_eq!(report.master_host_bytes, sections, "{what}");
            assert!(report.master_host_bytes >= streamed_bytes, "{what}");
            assert!(report.master_host_bytes - streamed_bytes < 256 * streamed.len() as u64, "{what}");
            // The loaded buffer of a streamed storage is gone: no second host copy.
            for (s, home) in &before {
                let Home::Loaded { buf } = *home else { panic!("{what}: synthetic storages start loaded") };
                let info = f.platform.host_buffer_info(buf);
                if streamed.contains(s) {
                    assert_eq!(info, Err(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 }), "{what}");
                } else {
                    assert!(info.is_ok(), "{what}: a non-streamed storage lost its buffer");
                    assert_eq!(f.model.home(*s), Some(*home), "{what}");
                }
            }
            b.disable(&mut f.model, &f.hooks).unwrap();
            assert_clean(&f, &what);
        }
    }
}

#[test]
fn out_of_memory_at_every_allocation_rolls_back() {
    for (label, config) in [
        ("layer_dit", layer_dit()),
        ("layer_all", layer_all()),
        ("resident_two", resident_two()),
        ("model_keep_dit", model_keep_dit()),
    ] {
        let mut failures = 0;
        let mut k = 0u64;
        loop {
            let what = format!("{label} oom at allocation {k}");
            let mut f = fx("flux-tiny", FaultPlan { oom_at_alloc: Some(k), ..FaultPlan::none() });
            let mut b = backend(&f, &config);
            match b.enable(&mut f.model, &f.hooks, f.compute) {
                Ok(()) => {
                    // The first index that is never reached is exactly the number of allocations enable makes.
                    assert_eq!(f.sim.stats().allocs, k, "{what}");
                    b.disable(&mut f.model, &f.hooks).unwrap();
                    assert_clean(&f, &what);
                    break;
                }
                Err(e) => {
                    failures += 1;
                    assert!(is_oom(&e), "{what}: expected out of memory, got {e:?}");
                    assert!(e.to_string().starts_with("device out of memory: requested "), "{what}: {e}");
                    assert!(!b.is_enabled(), "{what}");
                    assert_clean(&f, &what);
                    // The fault fired once: the same backend on the same platform now enables.
                    b.enable(&mut f.model, &f.hooks, f.compute).unwrap_or_else(|e| panic!("{what}: retry: {e}"));
                    let u = units(&f, &config);
                    pass(&f, &u).unwrap();
                    b.disable(&mut f.model, &f.hooks).unwrap();
                    assert_clean(&f, &format!("{what}, after the retry"));
                }
            }
            k += 1;
            assert!(k < 64, "{label}: enable never succeeded");
        }
        assert!(failures >= 2, "{label}: only {failures} allocation indices failed");
    }
}

#[test]
fn failed_copies_at_enable_roll_back() {
    // Layerwise DiT: the fixed placement copies each non-streamed storage; a failure fails enable.
    let probe = fx("flux-tiny", FaultPlan::none());
    let fixed = fixed_copies(&probe, &units(&probe, &layer_dit()));
    assert!(fixed > 4);
    let mut cases: Vec<(OffloadConfig, FaultPlan, String)> = Vec::new();
    for k in [0, 1, fixed / 2, fixed - 1] {
        cases.push((layer_dit(), FaultPlan { fail_h2d_copy: Some(k), ..FaultPlan::none() }, format!("sync {k}")));
    }
    // Two resident blocks: after the fixed placement, enable loads the head and waits for it.
    let ru = units(&probe, &resident_two());
    let rfixed = fixed_copies(&probe, &ru);
    let head_copies: u64 = ru.stacks[0].units[..2].iter().map(|l| l.sections.len() as u64).sum();
    // A synchronous failure of the last head copy (see the ignored test below for the first one), and an
    // asynchronous failure of the first and of the last.
    let last_head = rfixed + head_copies - 1;
    cases.push((
        resident_two(),
        FaultPlan { fail_h2d_copy: Some(last_head), ..FaultPlan::none() },
        format!("head {last_head}"),
    ));
    for k in [rfixed, last_head] {
        cases.push((
            resident_two(),
            FaultPlan { fail_h2d_copy_async: Some(k), ..FaultPlan::none() },
            format!("async head {k}"),
        ));
    }
    for (config, faults, label) in cases {
        let what = format!("copy failure {label}");
        let mut f = fx("flux-tiny", faults.clone());
        let mut b = backend(&f, &config);
        let e = b.enable(&mut f.model, &f.hooks, f.compute).err().unwrap_or_else(|| panic!("{what}: enable succeeded"));
        let k = faults.fail_h2d_copy.or(faults.fail_h2d_copy_async).unwrap();
        let msg = e.to_string();
        if faults.fail_h2d_copy.is_some() {
            assert!(msg.contains(&format!("failed: injected failure of h2d copy #{k}")), "{what}: {msg}");
            assert!(msg.contains("host-to-device copy of "), "{what}: {msg}");
        } else {
            assert!(
                msg.contains("host-to-device copy of ") && msg.contains("injected asynchronous copy failure"),
                "{msg}"
            );
        }
        if config == layer_dit() {
            // The fixed placement reports the platform error itself.
            assert!(
                matches!(&e, OffloadError::Platform(PlatformError::CopyFailed { direction: "host-to-device", reason, .. })
                    if *reason == format!("injected failure of h2d copy #{k}")),
                "{what}: {e:?}"
            );
        }
        if k >= rfixed && faults.fail_h2d_copy.is_some() {
            let bytes = ru.stacks[0].units[1].sections.last().unwrap().len;
            assert!(
                matches!(&e, OffloadError::Scheduler(SchedulerError::LoadFailed { stack, source, .. })
                if stack == FLUX_DIT_STACK && *source == PlatformError::CopyFailed {
                    direction: "host-to-device",
                    bytes,
                    reason: format!("injected failure of h2d copy #{k}"),
                }),
                "{what}: {e:?}"
            );
        }
        assert!(!b.is_enabled(), "{what}");
        assert_clean(&f, &what);
        b.enable(&mut f.model, &f.hooks, f.compute).unwrap_or_else(|e| panic!("{what}: retry: {e}"));
        if config == resident_two() {
            // Copies 0..k succeeded before the fault; the retry copies exactly the fixed placement and the resident
            // head (no eager prefetch in this strategy).
            assert_eq!(f.sim.stats().h2d_copies, k + rfixed + head_copies, "{what}");
        }
        pass(&f, &units(&f, &config)).unwrap();
        b.disable(&mut f.model, &f.hooks).unwrap();
        assert_clean(&f, &format!("{what}, after the retry"));
        assert!(f.sim.violations().is_empty(), "{what}: {:?}", f.sim.violations());
    }
}

#[test]
fn a_copy_failure_while_streaming_names_the_block() {
    let probe = fx("flux-tiny", FaultPlan::none());
    let u = units(&probe, &layer_dit());
    let ring = &u.stacks[0];
    assert_eq!(ring.name, FLUX_DIT_STACK);
    assert_eq!((ring.depth, ring.resident_head), (2, 0));
    // Copies: the fixed placement, then loads in block order (blocks 0 and 1 at enable, block j + 2 at
    // pre_forward(j)). Fail the load of block 4, issued by pre_forward(2).
    let first_of =
        |j: usize| fixed_copies(&probe, &u) + ring.units[..j].iter().map(|l| l.sections.len() as u64).sum::<u64>();
    let k = first_of(4);
    let mut f = fx("flux-tiny", FaultPlan { fail_h2d_copy: Some(k), ..FaultPlan::none() });
    let mut b = backend(&f, &layer_dit());
    b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    let bytes = ring.units[4].sections[0].len;
    let expect = format!(
        "loading block 4 of stack '{FLUX_DIT_STACK}' failed: host-to-device copy of {bytes} bytes failed: injected \
         failure of h2d copy #{k}"
    );
    // The failure reaches the stack asynchronously: the first hook to fail is one of post_forward(2) ..
    // pre_forward(4), and it names block 4 whichever it is.
    let mut first_err = None;
    'outer: for (j, l) in ring.units.iter().enumerate().take(6) {
        for phase in ["pre", "post"] {
            let r =
                if phase == "pre" { f.hooks.pre_forward(&l.path).map(|_| ()) } else { f.hooks.post_forward(&l.path) };
            if let Err(e) = r {
                first_err = Some((j, phase, e));
                break 'outer;
            }
        }
    }
    let (j, phase, e) = first_err.expect("a hook must fail");
    assert!((2..=4).contains(&j) && !(j == 2 && phase == "pre") && !(j == 4 && phase == "post"), "{j} {phase}: {e}");
    // The scheduler's error reaches the engine typed, not as text.
    let HookError::Failed { module, name, source } = &e else { panic!("expected a hook failure, got {e:?}") };
    let HookFailure::Scheduler(SchedulerError::LoadFailed { stack, block, .. }) = source.as_ref() else {
        panic!("expected a typed load failure, got {e:?}");
    };
    assert_eq!(
        (module, name.as_str(), stack.as_str(), *block),
        (&ring.units[j].path, LAYERWISE_OFFLOAD_HOOK, FLUX_DIT_STACK, 4)
    );
    assert_eq!(
        e.to_string(),
        format!("hook '{LAYERWISE_OFFLOAD_HOOK}' failed on module '{}': {expect}", ring.units[j].path)
    );
    // Once a fence has observed every completion, the stack stays failed: fence and every later hook report the
    // copy failure (which block they name is not stable, see the ignored test below).
    let fenced = b.fence().unwrap_err().to_string();
    assert!(fenced.ends_with(&format!("failed: injected failure of h2d copy #{k}")), "{fenced}");
    let again = f.hooks.pre_forward(&ring.units[5].path).unwrap_err().to_string();
    assert!(
        again.starts_with(&format!(
            "hook 'layerwise_offload' failed on module '{}': loading block ",
            ring.units[5].path
        )),
        "{again}"
    );
    assert!(again.ends_with(&format!("failed: injected failure of h2d copy #{k}")), "{again}");
    // Disable still restores the weights, and the backend enables and streams again.
    b.disable(&mut f.model, &f.hooks).unwrap();
    assert_clean(&f, "after a failed copy");
    b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    pass(&f, &u).unwrap();
    pass(&f, &u).unwrap();
    b.disable(&mut f.model, &f.hooks).unwrap();
    assert_clean(&f, "after the re-enable");
    assert!(f.sim.violations().is_empty(), "{:?}", f.sim.violations());
}

#[test]
fn one_strategy_owns_the_hooks() {
    let mut f = fx("flux-tiny", FaultPlan::none());
    let mut layer = backend(&f, &layer_all());
    let mut module = backend(&f, &model_level());
    layer.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    let hooks = f.hooks.hook_names();
    let mastered = f.model.mastered();
    let mem = f.sim.device_memory().in_use;
    let e = module.enable(&mut f.model, &f.hooks, f.compute).unwrap_err();
    assert_eq!(
        e,
        OffloadError::Hook(HookError::OffloadOwned {
            owner: LAYERWISE_OFFLOAD_HOOK.to_string(),
            requested: SEQUENTIAL_OFFLOAD_HOOK.to_string()
        })
    );
    assert!(!module.is_enabled());
    // The first backend is intact.
    assert_eq!(f.hooks.hook_names(), hooks);
    assert_eq!(f.hooks.offload_owner().as_deref(), Some(LAYERWISE_OFFLOAD_HOOK));
    assert_eq!(f.model.mastered(), mastered);
    assert_eq!(f.sim.device_memory().in_use, mem);
    pass(&f, &units(&f, &layer_all())).unwrap();
    // Disabling the backend that never enabled touches nothing of the other one.
    module.disable(&mut f.model, &f.hooks).unwrap();
    assert_eq!(f.hooks.hook_names(), hooks);
    layer.disable(&mut f.model, &f.hooks).unwrap();
    assert_clean(&f, "after the owner disabled");
    module.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    assert_eq!(f.hooks.offload_owner().as_deref(), Some(SEQUENTIAL_OFFLOAD_HOOK));
    module.disable(&mut f.model, &f.hooks).unwrap();
    assert_clean(&f, "after the second strategy");
}

#[test]
fn the_factory_creates_one_backend_or_none() {
    let f = fx("flux-tiny", FaultPlan::none());
    assert!(get_offload_backend(&OffloadConfig::disabled(), f.platform.clone(), None).unwrap().is_none());
    assert!(get_offload_backend(&cfg("{}"), f.platform.clone(), None).unwrap().is_none());
    let allgather = cfg(r#"{"data_parallel_size": 2, "diffusion_offload_config": {"mode": "layer",
        "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}}"#);
    assert_eq!(allgather.group.size, 2);
    let e = get_offload_backend(&allgather, f.platform.clone(), None).unwrap_err();
    assert_eq!(
        e,
        OffloadError::Unsupported(
            "weight_transfer = \"allgather\" across an offload group of 2 ranks needs this rank's collective; pass \
             one to get_offload_backend (weightferry::dist builds one from the torchrun/SLURM environment), or set \
             layer_options.<component>.weight_transfer = \"rank-local\""
                .to_string()
        )
    );
    // Nothing was touched.
    assert!(f.hooks.hook_names().is_empty());
    assert_eq!(f.sim.stats().allocs, 0);
    let b = get_offload_backend(&layer_dit(), f.platform.clone(), None).unwrap().unwrap();
    assert!(!b.is_enabled());
    assert_eq!(b.report().master_host_bytes, 0);
    assert_eq!(f.sim.stats().allocs, 0, "creating a backend allocates nothing");
}

#[test]
fn a_tied_attribute_streams_with_its_block() {
    let mut f = fx("flux-tiny", FaultPlan::none());
    let alias = f.desc.tensor("transformer.proj_alias.weight").unwrap().storage;
    let target = f.desc.tensor("transformer.single_transformer_blocks.0.linear2.weight").unwrap().storage;
    let embed = f.desc.tensor("transformer.x_embedder.weight").unwrap().storage;
    assert_eq!(alias, target, "the preset ties the two");
    let u = units(&f, &layer_dit());
    assert!(!u.fixed.contains(&alias), "the alias must not be in the fixed placement");
    assert!(u.fixed.contains(&embed));
    let ring = &u.stacks[0];
    let blk = ring.units.iter().position(|l| l.path == "transformer.single_transformer_blocks.0").unwrap();
    let mut b = backend(&f, &layer_dit());
    assert_eq!(
        b.locate(alias),
        Err(OffloadError::NotResident { storage: alias.0, reason: "offload is not enabled".into() })
    );
    b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    assert_eq!(b.locate(alias), Err(not_loaded(alias)));
    assert_located_bytes(&f, &b, embed, "x_embedder at enable");
    let embed_at = b.locate(embed).unwrap();
    f.hooks.pre_forward(&ring.units[0].path).unwrap();
    assert_eq!(b.locate(alias), Err(not_loaded(alias)), "before pre_forward of its block");
    f.hooks.post_forward(&ring.units[0].path).unwrap();
    for l in &ring.units[1..blk] {
        f.hooks.pre_forward(&l.path).unwrap();
        f.hooks.post_forward(&l.path).unwrap();
    }
    f.hooks.pre_forward(&ring.units[blk].path).unwrap();
    // The alias is the block's own storage: same buffer, same offset, exact bytes.
    let at = b.locate(alias).unwrap();
    let other = f.desc.tensor("transformer.single_transformer_blocks.0.linear1.weight").unwrap().storage;
    assert_eq!(at.0, b.locate(other).unwrap().0, "same device buffer as the block");
    assert_ne!(at.0, embed_at.0);
    assert_located_bytes(&f, &b, alias, "proj_alias in its block");
    assert_eq!(b.locate(embed).unwrap(), embed_at, "fixed placement never moves");
    f.hooks.post_forward(&ring.units[blk].path).unwrap();
    for l in &ring.units[blk + 1..] {
        f.hooks.pre_forward(&l.path).unwrap();
        f.hooks.post_forward(&l.path).unwrap();
    }
    // The ring moved on: the block's slot holds other blocks now.
    assert_eq!(b.locate(alias), Err(not_loaded(alias)), "after the pass");
    assert_located_bytes(&f, &b, embed, "x_embedder after the pass");
    b.disable(&mut f.model, &f.hooks).unwrap();
    assert_clean(&f, "alias");
}

#[test]
fn locate_gives_exact_bytes_for_every_storage_of_every_unit() {
    for name in PRESETS {
        let mut f = fx(name, FaultPlan::none());
        let config = layer_all();
        let u = units(&f, &config);
        let mut b = backend(&f, &config);
        b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
        assert_eq!(f.hooks.hook_names(), expected_hooks(&u), "{name}");
        for &s in &u.fixed {
            assert_located_bytes(&f, &b, s, &format!("{name} fixed"));
        }
        for s in &u.stacks {
            // The end of each ring is never prefetched at enable.
            let last = s.units.last().unwrap();
            for st in last.storages() {
                assert_eq!(b.locate(st), Err(not_loaded(st)), "{name} {}", last.path);
            }
        }
        for (si, s) in u.stacks.iter().enumerate() {
            for l in &s.units {
                f.hooks.pre_forward(&l.path).unwrap();
                for st in l.storages() {
                    assert_located_bytes(&f, &b, st, &format!("{name} {}", l.path));
                }
                f.hooks.post_forward(&l.path).unwrap();
            }
            let r = &b.report().stacks[si];
            assert_eq!((r.name.as_str(), r.units), (s.name.as_str(), s.units.len()), "{name}");
            if s.depth > 0 {
                // Every block of a ring pass was found prefetched.
                assert_eq!((r.prefetch_hits, r.sync_fetches, r.reuse_hits), (s.units.len() as u64, 0, 0), "{name}");
            } else {
                assert_eq!((r.prefetch_hits, r.sync_fetches), (0, s.units.len() as u64), "{name} {}", s.name);
            }
        }
        b.disable(&mut f.model, &f.hooks).unwrap();
        assert_clean(&f, name);
        assert!(f.sim.violations().is_empty(), "{name}: {:?}", f.sim.violations());
    }
}

#[test]
fn model_level_keeps_only_the_executing_component_resident() {
    for name in PRESETS {
        let mut f = fx(name, FaultPlan::none());
        let u = units(&f, &model_level());
        assert_eq!(u.stacks.len(), 1);
        let paths: Vec<&str> = u.stacks[0].units.iter().map(|l| l.path.as_str()).collect();
        assert_eq!(paths, ["transformer", "text_encoder", "vae"], "{name}");
        let first = |p: &str| u.stacks[0].units.iter().find(|l| l.path == p).unwrap().storages().next().unwrap();
        let (dit, te, vae) = (first("transformer"), first("text_encoder"), first("vae"));
        let mut b = backend(&f, &model_level());
        b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
        for s in [dit, te, vae] {
            assert_eq!(b.locate(s), Err(not_loaded(s)), "{name}: nothing resident at enable");
        }
        f.hooks.pre_forward("text_encoder").unwrap();
        assert_located_bytes(&f, &b, te, name);
        assert_eq!(b.locate(dit), Err(not_loaded(dit)), "{name}: the DiT is not resident while the encoder runs");
        assert_eq!(b.locate(vae), Err(not_loaded(vae)), "{name}");
        f.hooks.post_forward("text_encoder").unwrap();
        let loads = b.report().stacks[0].loads;
        for step in 0..3u64 {
            f.hooks.pre_forward("transformer").unwrap();
            assert_located_bytes(&f, &b, dit, name);
            assert_eq!(b.locate(te), Err(not_loaded(te)), "{name}: the encoder was swapped out");
            f.hooks.post_forward("transformer").unwrap();
            // Steps after the first find the DiT still in its released slot: no copy.
            let r = &b.report().stacks[0];
            assert_eq!((r.loads, r.reuse_hits), (loads + 1, step), "{name} step {step}");
        }
        f.hooks.pre_forward("vae").unwrap();
        assert_located_bytes(&f, &b, vae, name);
        assert_eq!(b.locate(dit), Err(not_loaded(dit)), "{name}");
        f.hooks.post_forward("vae").unwrap();
        // One slot the size of the largest component.
        let largest = u.stacks[0].units.iter().map(|l| l.device_bytes).max().unwrap();
        assert_eq!(b.report().stacks[0].device_bytes, largest, "{name}");
        assert_eq!(f.sim.device_memory().peak, largest, "{name}");
        b.disable(&mut f.model, &f.hooks).unwrap();
        assert_clean(&f, name);

        // keep_dit_resident: the DiT is locatable throughout, the others swap through one slot.
        let mut f = fx(name, FaultPlan::none());
        let mut b = backend(&f, &model_keep_dit());
        b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
        let dit_at = b.locate(dit).unwrap();
        assert_located_bytes(&f, &b, dit, name);
        for p in ["text_encoder", "transformer", "transformer", "vae"] {
            f.hooks.pre_forward(p).unwrap();
            assert_eq!(b.locate(dit).unwrap(), dit_at, "{name} during {p}");
            f.hooks.post_forward(p).unwrap();
        }
        assert_eq!(b.report().stacks[0].resident, 1);
        b.disable(&mut f.model, &f.hooks).unwrap();
        assert_clean(&f, name);
    }
}

#[test]
fn a_failed_disable_keeps_its_state_and_a_retry_finishes() {
    let mut incomplete = 0;
    for k in 0..24u64 {
        let what = format!("event sync failure #{k}");
        let mut f = fx("flux-tiny", FaultPlan { fail_event_sync: Some(k), ..FaultPlan::none() });
        let mut b = backend(&f, &layer_dit());
        b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
        match b.disable(&mut f.model, &f.hooks) {
            Ok(()) => {}
            Err(OffloadError::DisableIncomplete { strategy, cause }) => {
                incomplete += 1;
                assert_eq!(strategy, "layer", "{what}");
                assert!(
                    cause.ends_with(&format!("failed: injected failure of event_synchronize call #{k}")),
                    "{cause}"
                );
                // The state was kept: still enabled and owning offload until the retry.
                assert!(b.is_enabled(), "{what}");
                assert_eq!(f.hooks.offload_owner().as_deref(), Some(LAYERWISE_OFFLOAD_HOOK), "{what}");
                assert_eq!(f.model.checksum().unwrap(), f.checksum, "{what}");
                b.disable(&mut f.model, &f.hooks).unwrap_or_else(|e| panic!("{what}: retry: {e}"));
            }
            Err(e) => panic!("{what}: expected DisableIncomplete, got {e:?}"),
        }
        assert!(!b.is_enabled(), "{what}");
        assert_clean(&f, &what);
    }
    assert!(incomplete > 0, "no event synchronisation in disable was hit");
}

// Regression tests of two scheduler bugs found by this suite (a failed early resident-head copy went unnoticed;
// failed loads were reported as block usize::MAX).

#[test]
fn a_failed_copy_of_an_early_resident_block_fails_enable() {
    let probe = fx("flux-tiny", FaultPlan::none());
    let u = units(&probe, &resident_two());
    let k = fixed_copies(&probe, &u); // the first copy of resident block 0
    let mut f = fx("flux-tiny", FaultPlan { fail_h2d_copy: Some(k), ..FaultPlan::none() });
    let mut b = backend(&f, &resident_two());
    let r = b.enable(&mut f.model, &f.hooks, f.compute);
    if r.is_ok() {
        // Enable claimed success, yet resident block 0 was never copied: its device bytes are not the weights.
        let s = u.stacks[0].units[0].storages().next().unwrap();
        f.platform.stream_synchronize(f.compute).unwrap();
        let (buf, off) = b.locate(s).unwrap();
        let want = f.model.read_storage(s).unwrap();
        let mut got = vec![0u8; want.len()];
        f.sim.read_device(buf, off, &mut got).unwrap();
        panic!("enable succeeded after resident block 0's copy failed; device bytes match host: {}", got == want);
    }
    assert!(matches!(r, Err(OffloadError::Scheduler(SchedulerError::LoadFailed { block: 0, .. }))), "{r:?}");
    assert_clean(&f, "failed head copy");
}

#[test]
fn load_errors_name_the_failed_block() {
    let probe = fx("flux-tiny", FaultPlan::none());
    let u = units(&probe, &layer_dit());
    let ring = &u.stacks[0];
    let k = fixed_copies(&probe, &u) + ring.units[..4].iter().map(|l| l.sections.len() as u64).sum::<u64>();
    let mut f = fx("flux-tiny", FaultPlan { fail_h2d_copy: Some(k), ..FaultPlan::none() });
    let mut b = backend(&f, &layer_dit());
    b.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    for l in &ring.units[..2] {
        f.hooks.pre_forward(&l.path).unwrap();
        f.hooks.post_forward(&l.path).unwrap();
    }
    // pre_forward(2) issues the failing load of block 4; the fence is the first to observe its completion.
    f.hooks.pre_forward(&ring.units[2].path).unwrap();
    let e = b.fence().unwrap_err();
    assert!(matches!(e, OffloadError::Scheduler(SchedulerError::LoadFailed { block: 4, .. })), "fence: {e}");
    b.disable(&mut f.model, &f.hooks).unwrap();

    // The last resident head block's failed copy names that block.
    let ru = units(&probe, &resident_two());
    let last =
        fixed_copies(&probe, &ru) + ru.stacks[0].units[..2].iter().map(|l| l.sections.len() as u64).sum::<u64>() - 1;
    let mut f = fx("flux-tiny", FaultPlan { fail_h2d_copy: Some(last), ..FaultPlan::none() });
    let mut b = backend(&f, &resident_two());
    let e = b.enable(&mut f.model, &f.hooks, f.compute).unwrap_err();
    assert!(matches!(e, OffloadError::Scheduler(SchedulerError::LoadFailed { block: 1, .. })), "head: {e}");
}
