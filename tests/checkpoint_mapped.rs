//! Masters straight from checkpoint files (`host_masters`), on the simulated device.
//!
//! Covered: a model loaded from a checkpoint holds no copy of the weights (every storage homed in its mapped file);
//! `auto` serves every section whose tensors lie contiguously and aligned in the file from the file itself and pins
//! the rest (exact bytes each way, in the report and in the platform's host counters), and the device receives the
//! file's exact bytes; `pinned` builds every master from the file; `mapped` refuses an unmappable section, and
//! synthetic weights, before anything is allocated; enable/disable cycles give every storage its file home back with
//! identical bytes and no host memory left; a file truncated or rewritten in place under a run is a typed error
//! naming the file at the next read (never a SIGBUS), while one replaced by a rename leaves the run on the bytes it
//! opened; a distributed rank's shards built from the file equal those built from loaded buffers, for groups of 2, 3
//! and 4 (chunked too).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use weightferry::checkpoint::{derive_pipeline, Checkpoint, DeriveOptions};
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::{Home, HostModel};
use weightferry::offload::layout::{align_up, ALIGN};
use weightferry::offload::{get_offload_backend, OffloadError, StreamingBackend, WeightSource};
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry_actors::platform::{Platform, PlatformRef, StreamId};
use weightferry_actors::sim::{FaultPlan, SimConfig, SimPlatform};

use safetensors::Dtype as S;

#[path = "support/safetensors.rs"]
mod st;
use st::{write, T};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

const BLOCKS: usize = 4;
/// The block whose f32 tensors cannot be one file range (a 12-byte tensor first breaks the alignment).
const ODD_BLOCK: usize = 1;

/// A DiT of `BLOCKS` blocks: bf16 and f32 tensors of aligned sizes, plus, in `ODD_BLOCK`, a 12-byte f32 tensor that
/// the file stores first among that block's f32 tensors.
fn tensors(seed: u64) -> BTreeMap<String, T> {
    tensors_with(seed, true)
}

/// [`tensors`], without the odd tensor when `odd` is false (every section then lies in the file as packed).
fn tensors_with(seed: u64, odd: bool) -> BTreeMap<String, T> {
    let mut m = BTreeMap::new();
    let mut k = seed * 1000;
    let mut add = |name: String, dtype: S, shape: &[usize]| {
        k += 1;
        m.insert(name, st::t(dtype, shape, k));
    };
    add("x_embedder.weight".into(), S::BF16, &[16, 8]);
    add("proj_out.weight".into(), S::F32, &[3, 5]);
    for i in 0..BLOCKS {
        add(format!("transformer_blocks.{i}.attn.to_q.weight"), S::BF16, &[16, 16]);
        add(format!("transformer_blocks.{i}.attn.to_q.bias"), S::BF16, &[128]);
        add(format!("transformer_blocks.{i}.norm.weight"), S::F32, &[64]);
        add(format!("transformer_blocks.{i}.norm.bias"), S::F32, &[128]);
        if odd && i == ODD_BLOCK {
            add(format!("transformer_blocks.{i}.a_odd"), S::F32, &[3]);
        }
    }
    m
}

fn dir(name: &str) -> PathBuf {
    st::fresh_dir("mapped", name)
}

fn config(host_masters: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(&format!(
        r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "host_masters": "{host_masters}",
            "layer_options": {{"dit": {{"prefetch_depth": 1}}}}}}}}"#
    ))
    .unwrap()
}

struct Fixture {
    path: PathBuf,
    keys: Vec<String>,
    ck: Checkpoint,
    sim: Arc<SimPlatform>,
    platform: PlatformRef,
    compute: StreamId,
    desc: Arc<PipelineDesc>,
    model: HostModel,
    hooks: HookRegistry,
}

fn fixture(name: &str) -> Fixture {
    fixture_with(name, FaultPlan::none(), true)
}

fn fixture_with(name: &str, faults: FaultPlan, odd: bool) -> Fixture {
    let path = dir(name).join("diffusion_pytorch_model.safetensors");
    let all = tensors_with(1, odd);
    let keys = all.keys().cloned().collect();
    write(&path, &all);
    let ck = Checkpoint::open(&path).unwrap();
    let desc = Arc::new(derive_pipeline(&ck, &DeriveOptions::default()).unwrap().desc);
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, faults, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let model = HostModel::from_checkpoint(platform.clone(), desc.clone(), &ck, "transformer").unwrap();
    Fixture { path, keys, ck, sim, platform, compute, desc, model, hooks: HookRegistry::new() }
}

impl Fixture {
    fn storage(&self, key: &str) -> StorageId {
        self.desc.tensor(&format!("transformer.{key}")).unwrap().storage
    }
    fn file_bytes(&self, key: &str) -> Vec<u8> {
        self.ck.read_tensor(key).unwrap().unwrap()
    }
    fn backend(&self, host_masters: &str) -> StreamingBackend {
        get_offload_backend(&config(host_masters), self.platform.clone(), None).unwrap().unwrap()
    }
    fn blocks(&self) -> Vec<String> {
        (0..BLOCKS).map(|i| format!("transformer.transformer_blocks.{i}")).collect()
    }
    /// One pass over every block; the first hook error, if any.
    fn pass(&self) -> Result<(), String> {
        for b in self.blocks() {
            self.hooks.pre_forward(&b).map_err(|e| e.to_string())?;
            self.platform.stream_synchronize(self.compute).map_err(|e| e.to_string())?;
            self.hooks.post_forward(&b).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
    /// One pass checking that the device holds each block's exact file bytes.
    fn pass_checking(&self, backend: &StreamingBackend) {
        for (i, b) in self.blocks().iter().enumerate() {
            self.hooks.pre_forward(b).unwrap();
            self.platform.stream_synchronize(self.compute).unwrap();
            for key in block_keys(i).into_iter().filter(|k| self.keys.contains(k)) {
                let (buf, off) = backend.locate(self.storage(&key)).unwrap();
                let want = self.file_bytes(&key);
                let mut got = vec![0u8; want.len()];
                self.sim.read_device(buf, off, &mut got).unwrap();
                assert!(got == want, "{key}: the device does not hold the file's bytes");
            }
            self.hooks.post_forward(b).unwrap();
        }
    }
    /// Every storage is homed in its file, with the file's bytes, and the process holds no host memory.
    fn assert_all_in_files(&self) {
        for k in &self.keys {
            let s = self.storage(k);
            assert!(matches!(self.model.home(s), Some(Home::File { .. })), "{k}: {:?}", self.model.home(s));
            assert_eq!(self.model.read_storage(s).unwrap(), self.file_bytes(k), "{k}");
        }
        assert_eq!(self.model.loaded_bytes(), 0);
        let host = self.sim.host_memory();
        assert_eq!((host.in_use, host.pinned), (0, 0), "host memory beyond the mapping: {host:?}");
        assert_eq!(host.mapped, std::fs::metadata(&self.path).unwrap().len());
    }
}

fn block_keys(i: usize) -> Vec<String> {
    let mut k = vec![
        format!("transformer_blocks.{i}.attn.to_q.weight"),
        format!("transformer_blocks.{i}.attn.to_q.bias"),
        format!("transformer_blocks.{i}.norm.weight"),
        format!("transformer_blocks.{i}.norm.bias"),
    ];
    if i == ODD_BLOCK {
        k.push(format!("transformer_blocks.{i}.a_odd"));
    }
    k
}

/// Bytes of block `i`'s sections: (bf16, f32), as packed (each tensor at its aligned size) and as copied from a file
/// (the last tensor unpadded).
fn sections(i: usize) -> ((u64, u64), (u64, u64)) {
    let bf16 = 512 + 256;
    let f32 = 256 + 512;
    if i == ODD_BLOCK {
        ((bf16, bf16), (align_up(12) + f32, 12 + f32))
    } else {
        ((bf16, bf16), (f32, f32))
    }
}

#[test]
fn a_model_from_a_checkpoint_holds_no_copy_of_the_weights() {
    let f = fixture("no-copy");
    f.assert_all_in_files();
    assert_eq!(f.model.file_bytes(), f.ck.tensor_bytes());
    f.model.release();
    assert_eq!(f.sim.host_memory().mapped, 0, "release unmaps the file");
}

#[test]
fn auto_serves_contiguous_aligned_sections_from_the_file_and_pins_the_rest() {
    let mut f = fixture("auto");
    let checksum = f.model.checksum().unwrap();
    let mut backend = f.backend("auto");
    for cycle in 0..3 {
        backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
        let r = backend.report();
        let mapped: u64 =
            (0..BLOCKS).map(|i| sections(i).0 .1 + if i == ODD_BLOCK { 0 } else { sections(i).1 .1 }).sum();
        assert_eq!(r.mapped_host_bytes, mapped, "cycle {cycle}");
        assert_eq!(r.master_host_bytes, sections(ODD_BLOCK).1 .0, "cycle {cycle}: only the odd f32 section is pinned");
        let host = f.sim.host_memory();
        assert_eq!((host.in_use, host.pinned), (r.master_host_bytes, r.master_host_bytes), "cycle {cycle}");
        for i in 0..BLOCKS {
            for key in block_keys(i) {
                let home = f.model.home(f.storage(&key));
                let pinned = i == ODD_BLOCK && !key.contains("attn");
                match home {
                    Some(Home::Master { .. }) => assert!(pinned, "{key} was given a master"),
                    Some(Home::File { .. }) => assert!(!pinned, "{key} is served from the file"),
                    other => panic!("{key}: {other:?}"),
                }
            }
        }
        f.pass_checking(&backend);
        f.pass_checking(&backend);
        backend.disable(&mut f.model, &f.hooks).unwrap();
        f.assert_all_in_files();
        assert_eq!(f.model.checksum().unwrap(), checksum, "cycle {cycle}");
    }
    assert_eq!(ALIGN, 256, "the sizes above assume 256-byte alignment");
}

#[test]
fn pinned_builds_every_master_from_the_file() {
    let mut f = fixture("pinned");
    let mut backend = f.backend("pinned");
    backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    let r = backend.report();
    assert_eq!(r.mapped_host_bytes, 0);
    assert_eq!(r.master_host_bytes, (0..BLOCKS).map(|i| sections(i).0 .0 + sections(i).1 .0).sum::<u64>());
    assert_eq!(f.sim.host_memory().pinned, r.master_host_bytes);
    f.pass_checking(&backend);
    backend.disable(&mut f.model, &f.hooks).unwrap();
    f.assert_all_in_files();
}

#[test]
fn mapped_refuses_an_unmappable_section_and_synthetic_weights_before_anything_moves() {
    let mut f = fixture("strict");
    let mut backend = f.backend("mapped");
    let e = backend.enable(&mut f.model, &f.hooks, f.compute).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "host_masters = \"mapped\": the f32 tensors of `transformer.transformer_blocks.{ODD_BLOCK}` cannot be \
             served from the checkpoint file: storage "
        )) && e.ends_with(
            "is not where the packed section needs it (its tensors are not contiguous in the file, or a tensor's \
             size is not a multiple of the device alignment); use host_masters = \"auto\" (pinned where the file's \
             layout does not allow) or \"pinned\""
        ),
        "{e}"
    );
    assert!(!backend.is_enabled());
    assert!(f.hooks.hook_names().is_empty());
    assert_eq!(f.sim.device_memory().in_use, 0);
    f.assert_all_in_files();

    let synthetic = HostModel::synthetic(f.platform.clone(), f.desc.clone(), 3).unwrap();
    let mut synthetic = synthetic;
    let e = backend.enable(&mut synthetic, &f.hooks, f.compute).unwrap_err().to_string();
    assert_eq!(
        e,
        "host_masters = \"mapped\" needs weights read from a checkpoint (run --checkpoint, or enable(..., \
         checkpoint=PATH)); use host_masters = \"auto\" or \"pinned\""
    );
    assert_eq!(f.sim.device_memory().in_use, 0);
}

#[test]
fn a_truncated_checkpoint_is_an_error_naming_the_file_never_a_sigbus() {
    let mut f = fixture("truncated");
    let mut backend = f.backend("auto");
    backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    f.pass().unwrap();
    let len = std::fs::metadata(&f.path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f.path).unwrap().set_len(len / 2).unwrap();
    let want = format!("the checkpoint was truncated from {len} to {} bytes while weightferry used it", len / 2);
    // Streaming on reads the file for the next copies (the simulated device reads mapped memory through the file).
    let mut failed = None;
    for _ in 0..3 {
        if let Err(e) = f.pass() {
            failed = Some(e);
            break;
        }
    }
    let e = failed.expect("a pass over a truncated checkpoint fails");
    assert!(e.contains(&want) && e.contains(&f.path.display().to_string()), "{e}");
    if let Err(e) = backend.disable(&mut f.model, &f.hooks) {
        assert!(e.to_string().contains(&want), "{e}");
        backend.disable(&mut f.model, &f.hooks).unwrap();
    }
    assert!(!backend.is_enabled());
    let s = f.storage("transformer_blocks.0.attn.to_q.weight");
    let e = f.model.read_storage(s).unwrap_err().to_string();
    assert!(e.contains(&want), "{e}");
}

#[test]
fn a_checkpoint_rewritten_in_place_is_an_error_and_one_replaced_by_rename_is_not() {
    let mut f = fixture("rewritten");
    let key = "transformer_blocks.2.attn.to_q.weight";
    let before = f.file_bytes(key);
    let mut backend = f.backend("auto");
    backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    // Replaced: a new file renamed over the path. The run keeps the bytes it opened.
    let fresh = f.path.with_extension("new");
    write(&fresh, &tensors(2));
    std::fs::rename(&fresh, &f.path).unwrap();
    f.pass_checking(&backend);
    assert_eq!(f.model.read_storage(f.storage(key)).unwrap(), before);
    backend.disable(&mut f.model, &f.hooks).unwrap();
    f.model.release();

    // Rewritten in place, same length: the next read names the change.
    let mut f = fixture("rewritten-in-place");
    let mut backend = f.backend("auto");
    backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    backend.fence().unwrap();
    let bytes = std::fs::read(&f.path).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&f.path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &vec![0x5Au8; bytes.len() / 2], (bytes.len() / 4) as u64).unwrap();
    file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(10)).unwrap();
    drop(file);
    let want = format!(
        "{}: the checkpoint was rewritten in place while weightferry used it; its weights are no longer the ones \
         enabled. Reload the model, and replace checkpoints by writing a new file and renaming it over the old one",
        f.path.display()
    );
    let e = f.pass().unwrap_err();
    assert!(e.contains(&want), "{e}");
    // The failed copy is reported once more by the first disable; a second finishes it.
    let first = backend.disable(&mut f.model, &f.hooks).unwrap_err();
    assert!(matches!(&first, OffloadError::DisableIncomplete { cause, .. } if cause.contains(&want)), "{first}");
    backend.disable(&mut f.model, &f.hooks).unwrap();
    assert!(!backend.is_enabled());
    let e = f.model.read_storage(f.storage(key)).unwrap_err().to_string();
    assert!(e.contains(&want), "{e}");
}

#[test]
fn each_rank_builds_its_shards_from_the_file_equal_to_the_reference_shards() {
    use weightferry::offload::distributed::build_sharded_masters;
    use weightferry::offload::layout::UnitLayout;
    use weightferry::offload::units::build_unit_plan;
    use weightferry::plan::resolve_offload_plan;
    use weightferry_actors::platform::HostMemoryKind;
    let f = fixture("shards");
    let cfg = config("auto");
    let plan = resolve_offload_plan(&f.desc, &cfg).unwrap();
    let units: Vec<UnitLayout> =
        build_unit_plan(&f.desc, &cfg, &plan).stacks.into_iter().flat_map(|s| s.units).collect();
    assert_eq!(units.len(), BLOCKS);
    // The reference: the same bytes in ordinary loaded buffers.
    let mut loaded = HostModel::zeroed(f.platform.clone(), f.desc.clone()).unwrap();
    for (k, _) in tensors(1) {
        loaded.write_storage(f.storage(&k), &f.file_bytes(&k)).unwrap();
    }
    for (world, chunk) in [(2, None), (3, None), (4, Some(100))] {
        for rank in 0..world {
            let from_file =
                build_sharded_masters(&f.model, &units, world, rank, HostMemoryKind::Pinned, chunk).unwrap();
            let reference = build_sharded_masters(&loaded, &units, world, rank, HostMemoryKind::Pinned, chunk).unwrap();
            assert_eq!(from_file.host_bytes(), reference.host_bytes());
            for (u, unit) in units.iter().enumerate() {
                for s in 0..unit.sections.len() {
                    let got = from_file.read_shard(&f.platform, u, s).unwrap();
                    assert_eq!(got, reference.read_shard(&f.platform, u, s).unwrap(), "N={world} rank {rank} {u}/{s}");
                }
            }
            from_file.free(&f.platform).unwrap();
            reference.free(&f.platform).unwrap();
        }
    }
    loaded.release();
    f.assert_all_in_files();
}

#[test]
fn a_file_the_platform_will_not_register_falls_back_to_pinned_masters_under_auto() {
    let faults = FaultPlan { fail_register_host: true, ..FaultPlan::none() };
    let mut f = fixture_with("no-register", faults.clone(), true);
    let mut backend = f.backend("auto");
    backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    let r = backend.report();
    assert_eq!(r.mapped_host_bytes, 0);
    assert_eq!(r.master_host_bytes, (0..BLOCKS).map(|i| sections(i).0 .0 + sections(i).1 .0).sum::<u64>());
    f.pass_checking(&backend);
    backend.disable(&mut f.model, &f.hooks).unwrap();
    f.assert_all_in_files();

    // Without the odd tensor every section can be served from the file, so `mapped` gets as far as registering it.
    let mut f = fixture_with("no-register-strict", faults, false);
    let mut backend = f.backend("mapped");
    let e = backend.enable(&mut f.model, &f.hooks, f.compute).unwrap_err().to_string();
    assert_eq!(
        e,
        "host_masters = \"mapped\": the platform cannot register the checkpoint file for device copies (driver \
         error: injected failure registering host buffer 1); use host_masters = \"auto\" or \"pinned\""
    );
    assert!(!backend.is_enabled());
    assert_eq!(f.sim.device_memory().in_use, 0);
    f.assert_all_in_files();
    // With a platform that registers, the same file is served entirely from itself.
    let mut f = fixture_with("aligned", FaultPlan::none(), false);
    let mut backend = f.backend("mapped");
    backend.enable(&mut f.model, &f.hooks, f.compute).unwrap();
    assert_eq!(backend.report().master_host_bytes, 0);
    f.pass_checking(&backend);
    backend.disable(&mut f.model, &f.hooks).unwrap();
    f.assert_all_in_files();
}
