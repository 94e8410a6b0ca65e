//! Tests of the library session on the simulated device.

use super::*;
use crate::pipeline::json::load_pipeline_json;
use weightferry_actors::sim::SimConfig;

const PIPELINE: &str = r#"{"class": "P", "modules": {"transformer": {"class": "D", "children": {
    "blocks": {"repeat": 2, "block": {"class": "B", "tensors": {"w": {"dtype": "bf16", "shape": [128]}}}}}}},
    "components": {"dit": ["transformer"]}, "class_block_attrs": {"D": ["blocks"]}}"#;

const LAYER: &str = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
    "layer_options": {"dit": {"prefetch_depth": 1}}}}"#;

fn sim() -> DeviceSpec {
    DeviceSpec::Sim(SimConfig { tracing: false, ..SimConfig::default() })
}

fn open(config: &str) -> Result<Session, SessionError> {
    let desc = load_pipeline_json(PIPELINE).unwrap();
    let config = load_config(ConfigSource::Json(config))?;
    Session::new(desc, config, sim(), SessionOptions { name: "p".into(), ..SessionOptions::default() })
}

/// A session whose every storage holds `id + 1` in every byte.
fn written(config: &str) -> Session {
    let mut s = open(config).unwrap();
    for (id, len, _) in s.storages() {
        s.write_storage(id, &vec![id.0 as u8 + 1; len as usize]).unwrap();
    }
    s
}

#[test]
fn the_plan_is_resolved_once_and_enable_uses_it() {
    let mut s = written(LAYER);
    let desc = load_pipeline_json(PIPELINE).unwrap();
    let config = load_config(ConfigSource::Json(LAYER)).unwrap();
    assert_eq!(s.plan_report(), &crate::offload::predict::plan_report("p", &desc, &config).unwrap());
    assert_eq!(s.plan(), &resolve_offload_plan(&desc, &config).unwrap());
    assert_eq!(s.enable(), Ok(true));
    assert_eq!(s.backend().and_then(StreamingBackend::plan), Some(s.plan()));
}

#[test]
fn enable_and_disable_give_the_bytes_back_bit_identical() {
    let mut s = written(LAYER);
    let before: Vec<Vec<u8>> = s.storages().iter().map(|(id, _, _)| s.read_storage(*id).unwrap()).collect();
    let blocks = ["transformer.blocks.0", "transformer.blocks.1"];
    assert_eq!(s.enable(), Ok(true));
    assert_eq!(s.hooked_modules(), blocks);
    for _step in 0..2 {
        for (i, block) in blocks.iter().enumerate() {
            let r = s.pre_forward(block).unwrap().unwrap();
            assert_eq!(s.read_device(r.buffer, r.base, 256).unwrap(), vec![i as u8 + 1; 256]);
            assert_eq!(s.locate(StorageId(i as u64)), Ok((r.buffer, r.base)));
            s.post_forward(block).unwrap();
        }
    }
    let retuned = s.retune(load_config(ConfigSource::Json(LAYER)).unwrap(), 0, 0).unwrap().clone();
    assert_eq!(&retuned, s.plan_report());
    assert!(s.hazard_violations().is_empty());
    s.disable().unwrap();
    assert!(s.hooked_modules().is_empty());
    let after: Vec<Vec<u8>> = s.storages().iter().map(|(id, _, _)| s.read_storage(*id).unwrap()).collect();
    assert_eq!(before, after);
    assert_eq!(s.enable(), Ok(true), "a disabled session enables again");
}

#[test]
fn each_failure_has_its_kind() {
    let Err(SessionError::Config(m)) = open(r#"{"x": 1}"#) else { panic!("a bad config was accepted") };
    assert!(m.starts_with("invalid config: "), "{m}");
    let Err(SessionError::Pipeline(m)) = load_pipeline("{}", "p") else { panic!("a bad pipeline was accepted") };
    assert!(m.starts_with("pipeline p: class: required key is missing;"), "{m}");
    let encoders = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["text_encoder"]}}"#;
    let Err(SessionError::Plan(m)) = open(encoders) else { panic!("an unservable config was accepted") };
    assert!(m.starts_with("the config cannot be applied to p: "), "{m}");
    let desc = load_pipeline_json(PIPELINE).unwrap();
    let config = load_config(ConfigSource::Json(LAYER)).unwrap();
    let missing = CheckpointSource {
        path: "/nonexistent/weightferry.safetensors".into(),
        component: "t".into(),
        views: Default::default(),
    };
    let options = SessionOptions { checkpoints: vec![missing], ..SessionOptions::default() };
    let Err(SessionError::Checkpoint(_)) = Session::new(desc, config, sim(), options) else {
        panic!("a missing checkpoint was opened")
    };
    let mut s = open(LAYER).unwrap();
    assert_eq!(
        s.enable(),
        Err(SessionError::Offload("storage 0 was never written; write every storage's bytes before enable".into()))
    );
    #[cfg(not(feature = "cuda"))]
    {
        let desc = load_pipeline_json(PIPELINE).unwrap();
        let config = load_config(ConfigSource::Json(LAYER)).unwrap();
        // SAFETY: the device is never opened (this build has no CUDA), so the stream is never used.
        let cuda = DeviceSpec::Cuda(unsafe { CudaDevice::adopting(0, 0, 0, 0) });
        assert_eq!(
            Session::new(desc, config, cuda, SessionOptions::default()).map(|_| ()),
            Err(SessionError::Device("this build of weightferry has no CUDA support".into()))
        );
    }
}

const WITH_FIXED: &str = r#"{"class": "P", "modules": {"transformer": {"class": "D", "tensors": {"proj": {"dtype": "bf16",
    "shape": [64]}}, "children": {"blocks": {"repeat": 3, "block": {"class": "B", "tensors": {"w": {"dtype": "bf16",
    "shape": [128]}}}}}}}, "components": {"dit": ["transformer"]}, "class_block_attrs": {"D": ["blocks"]},
    "offload_plan": {"resident_dit_paths": ["transformer"]}}"#;

/// Runs one pass over the three blocks and returns each block's device bytes during its forward.
fn pass(s: &Session) -> Vec<Vec<u8>> {
    ["transformer.blocks.0", "transformer.blocks.1", "transformer.blocks.2"]
        .iter()
        .map(|b| {
            let r = s.pre_forward(b).unwrap().unwrap();
            let bytes = s.read_device(r.buffer, r.base, 256).unwrap();
            s.post_forward(b).unwrap();
            bytes
        })
        .collect()
}

#[test]
fn writes_while_enabled_reach_every_device_copy_and_disable() {
    for resident in [0, 1] {
        let config = format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
            "layer_options": {{"dit": {{"prefetch_depth": 1, "resident_layers": {resident}}}}}}}}}"#
        );
        let desc = load_pipeline_json(WITH_FIXED).unwrap();
        let cfg = load_config(ConfigSource::Json(&config)).unwrap();
        let mut s = Session::new(desc, cfg, sim(), SessionOptions { name: "p".into(), ..Default::default() }).unwrap();
        let ids: BTreeMap<String, StorageId> = s.tensor_storages().into_iter().collect();
        let (proj, w0, w1) = (ids["transformer.proj"], ids["transformer.blocks.0.w"], ids["transformer.blocks.1.w"]);
        for (id, len, _) in s.storages() {
            s.write_storage(id, &vec![1; len as usize]).unwrap();
        }
        assert_eq!(s.enable(), Ok(true));
        assert_eq!(pass(&s), vec![vec![1; 256]; 3], "resident {resident}");
        // A wrong length is refused before anything changes, the other writes of the batch included.
        let Err(SessionError::Offload(m)) = s.write_weights(&[(w0, &[7; 256]), (w1, &[7; 3])]) else {
            panic!("a short write was accepted")
        };
        assert_eq!(m, format!("storage {} holds 256 bytes; the write has 3", w1.0));
        assert_eq!(pass(&s), vec![vec![1; 256]; 3]);
        s.write_weights(&[(w0, &[7; 256]), (proj, &[9; 128])]).unwrap();
        assert_eq!(pass(&s), vec![vec![7; 256], vec![1; 256], vec![1; 256]], "resident {resident}: the written block");
        let (buf, off) = s.locate(proj).unwrap();
        assert_eq!(s.read_device(buf, off, 128).unwrap(), vec![9; 128], "the fixed placement");
        assert!(s.hazard_violations().is_empty(), "{:?}", s.hazard_violations());
        s.disable().unwrap();
        assert_eq!(s.read_storage(w0).unwrap(), vec![7; 256]);
        assert_eq!(s.read_storage(proj).unwrap(), vec![9; 128]);
        assert_eq!(s.read_storage(w1).unwrap(), vec![1; 256]);
        // Disabled: the same call writes the host buffers.
        s.write_weights(&[(w1, &[5; 256])]).unwrap();
        assert_eq!(s.read_storage(w1).unwrap(), vec![5; 256]);
    }
}

#[test]
fn pinned_modules_stay_in_the_fixed_placement_and_round_trip() {
    let json = r#"{"class": "P", "modules": {"transformer": {"class": "D", "children": {"blocks": {"repeat": 3,
        "block": {"class": "B", "tensors": {"w": {"dtype": "bf16", "shape": [128]}}, "children": {"lora": {"class": "L",
        "tensors": {"a": {"dtype": "bf16", "shape": [16]}}}}}}}}}, "components": {"dit": ["transformer"]},
        "class_block_attrs": {"D": ["blocks"]},
        "pinned": ["transformer.blocks.0.lora", "transformer.blocks.1.lora", "transformer.blocks.2.lora"]}"#;
    let desc = load_pipeline_json(json).unwrap();
    let round = load_pipeline_json(&crate::pipeline::json::to_pipeline_json(&desc)).unwrap();
    assert_eq!(round.pinned, desc.pinned);
    let config = load_config(ConfigSource::Json(LAYER)).unwrap();
    let mut s = Session::new(desc, config, sim(), SessionOptions { name: "p".into(), ..Default::default() }).unwrap();
    let ids: BTreeMap<String, StorageId> = s.tensor_storages().into_iter().collect();
    for (id, len, unit) in s.storages() {
        let lora = ids.iter().any(|(p, s)| *s == id && p.ends_with(".lora.a"));
        assert_eq!(unit.is_none(), lora, "storage {}: streamed unless pinned", id.0);
        s.write_storage(id, &vec![2; len as usize]).unwrap();
    }
    assert_eq!(s.plan_report().budget.always_resident_bytes, 3 * 256, "each pinned 32-byte tensor, aligned");
    assert_eq!(s.enable(), Ok(true));
    let a1 = ids["transformer.blocks.1.lora.a"];
    s.write_weights(&[(a1, &[4; 32])]).unwrap();
    let (buf, off) = s.locate(a1).unwrap();
    assert_eq!(s.read_device(buf, off, 32).unwrap(), vec![4; 32]);
    let bad = json.replace("transformer.blocks.2.lora\"", "transformer.blocks.9.lora\"");
    let Err(e) = load_pipeline_json(&bad) else { panic!("an unknown pinned module was accepted") };
    assert_eq!(
        e.to_string(),
        "pinned[2]: module `transformer.blocks.9.lora` does not exist in this pipeline; name a module of its tree \
         by its dotted path"
    );
}

/// A safetensors file holding `tensors` (`(name, bf16 bytes)`, each 1-D), written by hand (header length, JSON
/// header, data).
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, Vec<u8>)]) {
    let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
    for (name, bytes) in tensors {
        let entry = serde_json::json!({"dtype": "BF16", "shape": [bytes.len() / 2],
            "data_offsets": [data.len(), data.len() + bytes.len()]});
        header.insert(name.to_string(), entry);
        data.extend_from_slice(bytes);
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(data);
    std::fs::write(path, file).unwrap();
}

#[test]
fn a_write_to_weights_from_a_checkpoint_is_what_disable_gives_back() {
    let dir = std::env::temp_dir().join(format!("wf-session-write-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("transformer.safetensors");
    let file = [
        ("proj", vec![1; 128]),
        ("blocks.0.w", vec![2; 256]),
        ("blocks.1.w", vec![3; 256]),
        ("blocks.2.w", vec![4; 256]),
    ];
    write_safetensors(&path, &file.iter().map(|(n, b)| (*n, b.clone())).collect::<Vec<_>>());
    for masters in ["pinned", "auto"] {
        let config = format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "host_masters": "{masters}",
            "layer_options": {{"dit": {{"prefetch_depth": 1}}}}}}}}"#
        );
        let desc = load_pipeline_json(WITH_FIXED).unwrap();
        let ckpt = CheckpointSource { path: path.clone(), component: "transformer".into(), views: Default::default() };
        let options = SessionOptions { name: "p".into(), checkpoints: vec![ckpt], ..Default::default() };
        let cfg = load_config(ConfigSource::Json(&config)).unwrap();
        let mut s = Session::new(desc, cfg, sim(), options).unwrap_or_else(|e| panic!("{e}"));
        let ids: BTreeMap<String, StorageId> = s.tensor_storages().into_iter().collect();
        let (proj, w0, w1) = (ids["transformer.proj"], ids["transformer.blocks.0.w"], ids["transformer.blocks.1.w"]);
        // Before enable the session holds the file's bytes; the caller's bytes are compared with them.
        let same: &[u8] = &[2; 256];
        assert_eq!(s.storages_differing(&[(w0, same), (w1, same), (proj, &[1; 127])]).unwrap(), vec![w1, proj]);
        assert_eq!(s.enable(), Ok(true));
        // The fixed placement leaves the file for a buffer of its own; a pinned master takes the write.
        s.write_weights(&[(proj, &[9; 128])]).unwrap();
        let streamed = s.write_weights(&[(w0, &[7; 256])]);
        s.disable().unwrap();
        assert_eq!(s.read_storage(proj).unwrap(), vec![9; 128], "{masters}");
        if masters == "pinned" {
            streamed.unwrap();
            assert_eq!(s.read_storage(w0).unwrap(), vec![7; 256]);
        } else {
            let Err(SessionError::Offload(m)) = streamed else { panic!("a write into the file was accepted") };
            assert!(m.starts_with(&format!("storage {} is streamed read-only from its checkpoint file", w0.0)), "{m}");
            assert_eq!(s.read_storage(w0).unwrap(), vec![2; 256]);
        }
        assert_eq!(s.read_storage(w1).unwrap(), vec![3; 256]);
        assert_eq!(s.storages_differing(&[(w1, &[3; 256])]).unwrap(), Vec::<StorageId>::new());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
