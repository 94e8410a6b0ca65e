//! Staged masters through the session on the simulated device: the engine's writes land in the masters `enable`
//! adopts without a copy, and every way out (a failure at any host or device allocation, disable before enable, a write
//! of the wrong length) leaves each storage in its own buffer with its bytes, and no master behind.

use crate::model::Home;
use crate::pipeline::json::load_pipeline_json;
use crate::pipeline::StorageId;
use crate::session::{load_config, ConfigSource, DeviceSpec, Session, SessionError, SessionOptions};
use weightferry_actors::sim::{FaultPlan, SimConfig};

/// A DiT with a tensor of its own (the fixed placement) and three blocks of two dtypes (two sections each).
const PIPELINE: &str = r#"{"class": "P", "modules": {"transformer": {"class": "D",
    "tensors": {"proj": {"dtype": "f32", "shape": [64]}}, "children": {
    "blocks": {"repeat": 3, "block": {"class": "B", "tensors": {
        "w": {"dtype": "bf16", "shape": [128]}, "b": {"dtype": "f32", "shape": [16]}}}}}}},
    "components": {"dit": ["transformer"]}, "class_block_attrs": {"D": ["blocks"]}}"#;

const LAYER: &str = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
    "layer_options": {"dit": {"prefetch_depth": 1}}}}"#;

fn open(faults: FaultPlan) -> Result<Session, SessionError> {
    let desc = load_pipeline_json(PIPELINE).unwrap();
    let config = load_config(ConfigSource::Json(LAYER))?;
    let sim = DeviceSpec::Sim(SimConfig { tracing: false, faults, ..SimConfig::default() });
    Session::new(desc, config, sim, SessionOptions { name: "p".into(), ..SessionOptions::default() })
}

/// Storage `id`'s bytes: a pattern no other storage has.
fn bytes_of(id: StorageId, len: u64) -> Vec<u8> {
    (0..len).map(|i| (id.0 as u8).wrapping_mul(31).wrapping_add(i as u8)).collect()
}

fn write_all(s: &mut Session) -> Result<(), SessionError> {
    for (id, len, _) in s.storages() {
        s.write_storage(id, &bytes_of(id, len))?;
    }
    Ok(())
}

/// Every storage in its own loaded buffer with its own bytes, and no pinned host memory left.
fn assert_restored(s: &Session) {
    for (id, len, _) in s.storages() {
        assert!(
            matches!(s.model().home(id), Some(Home::Loaded { .. })),
            "storage {} is {:?}",
            id.0,
            s.model().home(id)
        );
        assert_eq!(s.read_storage(id).unwrap(), bytes_of(id, len), "storage {}", id.0);
    }
    assert_eq!(s.device().sim().unwrap().host_memory().pinned, 0, "a master was left behind");
}

#[test]
fn writes_land_in_the_masters_enable_adopts() {
    let mut s = open(FaultPlan::none()).unwrap();
    write_all(&mut s).unwrap();
    let streamed: Vec<(StorageId, u64)> =
        s.storages().into_iter().filter(|(_, _, unit)| unit.is_some()).map(|(id, len, _)| (id, len)).collect();
    assert_eq!(streamed.len(), 6);
    let homes: Vec<_> = streamed.iter().map(|&(id, _)| s.model().home(id)).collect();
    assert!(homes.iter().all(|h| matches!(h, Some(Home::Master { .. }))), "{homes:?}");
    let fixed: u64 = s.storages().iter().filter(|(_, _, unit)| unit.is_none()).map(|(_, len, _)| len).sum();
    assert_eq!(s.model().loaded_bytes(), fixed, "only the fixed placement keeps a loaded buffer");
    let pinned = s.device().sim().unwrap().host_memory().pinned;

    assert_eq!(s.enable(), Ok(true));
    let after: Vec<_> = streamed.iter().map(|&(id, _)| s.model().home(id)).collect();
    assert_eq!(after, homes, "enable adopted the staged masters in place (no copy)");
    assert_eq!(s.device().sim().unwrap().host_memory().pinned, pinned, "enable allocated no other master");
    for (i, block) in ["transformer.blocks.0", "transformer.blocks.1", "transformer.blocks.2"].iter().enumerate() {
        s.pre_forward(block).unwrap().unwrap();
        for &(id, len) in &streamed[2 * i..2 * i + 2] {
            let (buf, off) = s.locate(id).unwrap();
            assert_eq!(s.read_device(buf, off, len).unwrap(), bytes_of(id, len), "storage {} on the device", id.0);
        }
        s.post_forward(block).unwrap();
    }
    s.disable().unwrap();
    assert_restored(&s);
    assert_eq!(s.enable(), Ok(true), "enables again from the loaded buffers");
    s.disable().unwrap();
    assert_restored(&s);
}

#[test]
fn a_storage_written_twice_before_enable_keeps_the_last_bytes() {
    let mut s = open(FaultPlan::none()).unwrap();
    write_all(&mut s).unwrap();
    let (id, len, _) = s.storages().into_iter().find(|(_, _, unit)| unit.is_some()).unwrap();
    s.write_storage(id, &vec![7; len as usize]).unwrap();
    assert_eq!(s.enable(), Ok(true));
    s.disable().unwrap();
    assert_eq!(s.read_storage(id).unwrap(), vec![7; len as usize]);
}

#[test]
fn a_write_of_the_wrong_length_changes_nothing() {
    let mut s = open(FaultPlan::none()).unwrap();
    let (id, len, _) = s.storages().into_iter().find(|(_, _, unit)| unit.is_some()).unwrap();
    let err = s.write_storage(id, &vec![1; len as usize + 1]).unwrap_err();
    assert!(err.to_string().contains(&format!("storage {}", id.0)), "{err}");
    assert!(matches!(s.model().home(id), Some(Home::Loaded { .. })));
    assert_eq!(s.device().sim().unwrap().host_memory().pinned, 0, "no master was allocated");
}

#[test]
fn disable_before_enable_gives_every_storage_its_buffer_back() {
    let mut s = open(FaultPlan::none()).unwrap();
    write_all(&mut s).unwrap();
    s.disable().unwrap();
    assert_restored(&s);
}

#[test]
fn a_failure_at_any_host_or_device_allocation_leaves_every_storage_as_written() {
    let mut enable_failures = 0;
    let host = (1..=64).map(|n| FaultPlan { fail_host_alloc: Some(n), ..FaultPlan::none() });
    let device = (1..=16).map(|n| FaultPlan { oom_at_alloc: Some(n), ..FaultPlan::none() });
    for faults in host.chain(device) {
        let Ok(mut s) = open(faults) else { continue };
        if write_all(&mut s).is_err() {
            continue; // the fault hit a staged master: the write failed before the storage changed home
        }
        match s.enable() {
            Ok(enabled) => assert!(enabled),
            Err(_) => enable_failures += 1,
        }
        // A disable the fault hit (or a rollback that could not restore) keeps what a second disable needs.
        if s.disable().is_err() {
            s.disable().unwrap();
        }
        assert_restored(&s);
    }
    assert!(enable_failures > 0, "no injected fault hit enable");
}

#[test]
fn a_staged_master_is_written_once_its_padding_zeroed_not_left_as_allocated() {
    use std::collections::BTreeMap;
    use weightferry_actors::platform::Platform;
    use weightferry_actors::sim::UNINIT_BYTE;
    let mut s = open(FaultPlan::none()).unwrap();
    write_all(&mut s).unwrap();
    // Each master's bytes as the storages homed in it say they must be: theirs where they lie, zeros elsewhere.
    let mut want: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let sim = s.device().sim().unwrap();
    for (id, len, unit) in s.storages() {
        if unit.is_none() {
            continue;
        }
        let Some(Home::Master { buf, offset }) = s.model().home(id) else { panic!("storage {} not staged", id.0) };
        let bytes = want.entry(buf.0).or_insert_with(|| vec![0; sim.host_buffer_info(buf).unwrap().0 as usize]);
        bytes[offset as usize..(offset + len) as usize].copy_from_slice(&bytes_of(id, len));
    }
    assert_eq!(want.len(), 6, "a master per section");
    let mut padded = 0;
    for (&buf, bytes) in &want {
        let mut got = vec![UNINIT_BYTE; bytes.len()];
        sim.read_host(weightferry_actors::platform::HostBufferId(buf), 0, &mut got).unwrap();
        assert_eq!(&got, bytes, "master {buf}");
        padded += bytes.len() as u64;
    }
    let stored: u64 = s.storages().iter().filter(|(_, _, u)| u.is_some()).map(|(_, len, _)| len).sum();
    assert!(padded > stored, "the layout pads some section ({padded} bytes in masters, {stored} stored)");
}
