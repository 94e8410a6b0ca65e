//! `weightferry inspect`, `plan --checkpoint` and `run --checkpoint` on checkpoints written here with the
//! `safetensors` crate: exact `inspect --json` figures, the plan of the derived pipeline, a bit-exact run over the
//! file's bytes (one changed byte changes the output), and one-line exit-2 errors for malformed input.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

mod common;

fn wf(args: &[&str]) -> Output {
    common::weightferry(args, &[])
}

fn ok_json(args: &[&str]) -> Value {
    let o = wf(args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// Exit code 2, nothing on stdout and one `error: ` line on stderr; returns the line.
fn invalid(args: &[&str]) -> String {
    let o = wf(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: ") && o.stdout.is_empty(), "{err}");
    err.trim_end().to_string()
}

struct T(safetensors::Dtype, Vec<usize>, Vec<u8>);

impl safetensors::View for &T {
    fn dtype(&self) -> safetensors::Dtype {
        self.0
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.2)
    }
    fn data_len(&self) -> usize {
        self.2.len()
    }
}

use safetensors::Dtype as S;

/// Small, finite values of every supported dtype (floats as bit patterns of moderate magnitude).
fn tensor(dtype: S, shape: &[usize], seed: u32) -> T {
    let n: usize = shape.iter().product();
    let mut data = Vec::new();
    for i in 0..n as u32 {
        let v = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 8;
        let x = (v % 2000) as f32 / 20_000.0 - 0.05;
        match dtype {
            S::F32 => data.extend_from_slice(&x.to_le_bytes()),
            S::BF16 => data.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
            S::F16 => data.extend_from_slice(&(0x2000u16 | (v as u16 & 0x0FFF)).to_le_bytes()),
            S::F8_E4M3 => data.push(0x20 | (v as u8 & 0x3F)),
            S::I64 => data.extend_from_slice(&((v % 1024) as i64).to_le_bytes()),
            S::I32 => data.extend_from_slice(&((v % 1024) as i32).to_le_bytes()),
            _ => data.push(v as u8),
        }
    }
    T(dtype, shape.to_vec(), data)
}

fn tensors() -> BTreeMap<String, T> {
    let mut m = BTreeMap::new();
    for i in 0..2u32 {
        m.insert(format!("transformer_blocks.{i}.attn.to_q.weight"), tensor(S::BF16, &[32, 32], i));
        m.insert(format!("transformer_blocks.{i}.norm.bias"), tensor(S::F32, &[32], 10 + i));
    }
    for i in 0..3u32 {
        m.insert(format!("single_transformer_blocks.{i}.proj.weight"), tensor(S::F16, &[32, 32], 20 + i));
        m.insert(format!("single_transformer_blocks.{i}.scale"), tensor(S::F8_E4M3, &[32], 30 + i));
    }
    m.insert("x_embedder.weight".into(), tensor(S::BF16, &[32, 16], 40));
    m.insert("pos_ids".into(), tensor(S::I64, &[4], 41));
    m.insert("offsets".into(), tensor(S::I32, &[3], 42));
    m.insert("packed".into(), tensor(S::U8, &[7], 43));
    m
}

fn write(path: &Path, m: &BTreeMap<String, &T>) {
    std::fs::write(path, safetensors::serialize(m.iter().map(|(k, v)| (k.clone(), *v)), None).unwrap()).unwrap();
}

/// A fresh folder; with `shards`, a two-shard checkpoint with its index (block 1 split across the shards),
/// otherwise one file `model.safetensors`.
fn checkpoint(name: &str, shards: bool) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("checkpoint-cli-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let all = tensors();
    if !shards {
        write(&d.join("model.safetensors"), &all.iter().map(|(k, v)| (k.clone(), v)).collect());
        return d.join("model.safetensors");
    }
    let first = |k: &str| k.starts_with("transformer_blocks.0.") || k == "transformer_blocks.1.attn.to_q.weight";
    let (a, b): (BTreeMap<_, _>, BTreeMap<_, _>) = all.iter().map(|(k, v)| (k.clone(), v)).partition(|(k, _)| first(k));
    write(&d.join("model-00001-of-00002.safetensors"), &a);
    write(&d.join("model-00002-of-00002.safetensors"), &b);
    let map: BTreeMap<&String, &str> = all
        .keys()
        .map(|k| (k, if first(k) { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" }))
        .collect();
    std::fs::write(d.join("model.safetensors.index.json"), json!({"weight_map": map}).to_string()).unwrap();
    d
}

fn len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn inspect_json_reports_exact_figures() {
    let d = checkpoint("inspect", true);
    let (s1, s2) = (d.join("model-00001-of-00002.safetensors"), d.join("model-00002-of-00002.safetensors"));
    let v = ok_json(&["inspect", "--json", d.to_str().unwrap()]);
    let expected = json!({
        "path": d.display().to_string(),
        "index": d.join("model.safetensors.index.json").display().to_string(),
        "files": [
            {"path": s1.display().to_string(), "bytes": len(&s1), "tensors": 3, "tensor_bytes": 2048 + 128 + 2048},
            {"path": s2.display().to_string(), "bytes": len(&s2), "tensors": 11,
             "tensor_bytes": 128 + 3 * (2048 + 32) + 1024 + 32 + 12 + 7},
        ],
        "tensors": 14,
        "tensor_bytes": 2 * (2048 + 128) + 3 * (2048 + 32) + 1024 + 32 + 12 + 7,
        "dtypes": {
            "bf16": {"tensors": 3, "bytes": 2 * 2048 + 1024},
            "f16": {"tensors": 3, "bytes": 3 * 2048},
            "f32": {"tensors": 2, "bytes": 2 * 128},
            "f8e4m3": {"tensors": 3, "bytes": 3 * 32},
            "i32": {"tensors": 1, "bytes": 12},
            "i64": {"tensors": 1, "bytes": 32},
            "u8": {"tensors": 1, "bytes": 7},
        },
        "component": "transformer",
        "block_lists": [
            {"attr": "transformer_blocks", "blocks": 2, "tensors": 4, "bytes": 2 * (2048 + 128)},
            {"attr": "single_transformer_blocks", "blocks": 3, "tensors": 6, "bytes": 3 * (2048 + 32)},
        ],
        "outside_blocks": {"tensors": 4, "bytes": 1024 + 32 + 12 + 7},
        // Every block's sections lie in their file as packed (block 1 is split across the shards by dtype only).
        "served_from_file": [2 * (2048 + 128), 3 * (2048 + 32)],
    });
    assert_eq!(v, expected);
    // Text names the same block lists.
    let o = wf(&["inspect", d.to_str().unwrap(), "--component", "dit"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0));
    assert!(text.contains("component: dit (one DiT)"), "{text}");
    let served = "; served from the file (host_masters = auto):";
    let line = format!("  transformer_blocks  2 blocks, 4 tensors, 4.25 KiB (4352 B){served} 4.25 KiB (4352 B)\n");
    assert!(text.contains(&line), "{text}");
    let line =
        format!("  single_transformer_blocks  3 blocks, 6 tensors, 6.09 KiB (6240 B){served} 6.09 KiB (6240 B)\n");
    assert!(text.contains(&line), "{text}");
}

/// `inspect` predicts from the headers alone what `host_masters = "auto"` serves from the file: here every block
/// but one, whose f32 tensors cannot be one file range (a 12-byte tensor the file stores first breaks the
/// alignment), so that section gets a pinned master.
#[test]
fn inspect_predicts_what_auto_serves_from_the_file() {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("checkpoint-cli-predict");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let mut all = BTreeMap::new();
    for i in 0..4u32 {
        all.insert(format!("transformer_blocks.{i}.attn.to_q.weight"), tensor(S::BF16, &[16, 16], i));
        all.insert(format!("transformer_blocks.{i}.norm.bias"), tensor(S::F32, &[128], 10 + i));
    }
    all.insert("transformer_blocks.1.a_odd".into(), tensor(S::F32, &[3], 20));
    all.insert("x_embedder.weight".into(), tensor(S::BF16, &[16, 8], 21));
    let f = d.join("model.safetensors");
    write(&f, &all.iter().map(|(k, v)| (k.clone(), v)).collect());
    let v = ok_json(&["inspect", "--json", f.to_str().unwrap()]);
    let served: u64 = v["served_from_file"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
    // Every block's bf16 section (512 bytes each) and the f32 sections of blocks 0, 2 and 3 (512 bytes each).
    assert_eq!(served, 4 * 512 + 3 * 512);
    let c = d.join("auto.json");
    let cfg = json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "host_masters": "auto"}});
    std::fs::write(&c, cfg.to_string()).unwrap();
    let r = ok_json(&[
        "run",
        "--json",
        "--steps",
        "1",
        "--checkpoint",
        f.to_str().unwrap(),
        "--config",
        c.to_str().unwrap(),
    ]);
    assert_eq!(r["mapped_host_bytes"], served);
    assert!(r["master_host_bytes"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["outputs_match"], true);
}

#[test]
fn plan_checkpoint_streams_the_derived_block_lists() {
    let f = checkpoint("plan", false);
    let v = ok_json(&["plan", "--json", "--checkpoint", f.to_str().unwrap()]);
    assert_eq!(v["pipeline"], f.display().to_string());
    assert_eq!(v["strategy"], "layer");
    let c = &v["components"][0];
    assert_eq!((&c["path"], &c["kind"], &c["class"]), (&json!("transformer"), &json!("dit"), &json!("CheckpointDiT")));
    let stack = &c["stacks"][0];
    assert_eq!(stack["name"], "transformer[transformer_blocks+single_transformer_blocks]");
    assert_eq!((&stack["blocks"], &stack["streaming"]), (&json!(5), &json!(5)));
    // Blocks are their storages aligned to 256 bytes: 2 × (2048 + 256) + 3 × (2048 + 256).
    assert_eq!(stack["bytes"], 5 * (2048 + 256));
    assert_eq!(v["total_weight_bytes"], 2 * (2048 + 128) + 3 * (2048 + 32) + 1024 + 32 + 12 + 7);
}

#[test]
fn module_mode_without_a_pair_is_one_skip_on_a_preset_and_a_checkpoint() {
    let f = checkpoint("module_lone", false);
    let c = f.with_file_name("module_lone.json");
    let cfg = json!({"diffusion_offload_config": {"mode": "module", "components": ["dit"]}});
    std::fs::write(&c, cfg.to_string()).unwrap();
    let (f, c) = (f.to_str().unwrap(), c.to_str().unwrap());
    let mut reasons = Vec::new();
    for source in [["--preset", "flux-tiny"], ["--checkpoint", f]] {
        let plan = ok_json(&["plan", "--json", "--config", c, source[0], source[1]]);
        let run = ok_json(&["run", "--json", "--steps", "1", "--config", c, source[0], source[1]]);
        assert_eq!(run["offload_enabled"], false, "{source:?}");
        assert_eq!(run["skip_reason"], plan["skip_reason"], "{source:?}");
        reasons.push(run["skip_reason"].clone());
        let human = wf(&["run", "--steps", "1", "--config", c, source[0], source[1]]);
        let out = String::from_utf8_lossy(&human.stdout);
        assert_eq!(human.status.code(), Some(0), "{source:?}: {}", String::from_utf8_lossy(&human.stderr));
        assert!(out.contains("not offloaded: nothing was streamed"), "{source:?}: {out}");
        assert!(out.contains("set diffusion_offload_config.mode = \"layer\""), "{source:?}: {out}");
    }
    assert_eq!(reasons[0], reasons[1], "the preset and the checkpoint give one reason");
}

#[test]
fn run_checkpoint_is_bit_exact_over_the_file_bytes() {
    let mut sums = Vec::new();
    for (name, shards) in [("run_one", false), ("run_sharded", true)] {
        let p = checkpoint(name, shards);
        let v = ok_json(&["run", "--json", "--steps", "2", "--checkpoint", p.to_str().unwrap()]);
        assert_eq!(v["outputs_match"], true);
        assert_eq!(v["weights_match"], true);
        assert_eq!(v["hazard_violations"], 0);
        assert_eq!(v["resident_checksum"], v["offloaded_checksum"]);
        sums.push(v["resident_checksum"].clone());
    }
    // Sharding does not change the weights, so not the output.
    assert_eq!(sums[0], sums[1]);
    // Nor does a distributed run: each rank maps the file and builds only its shards from it; the storages stay
    // homed in the file, so nothing is released or gathered back to host.
    let p = checkpoint("run_launch", false);
    let o = wf(&["launch", "--nproc", "2", "--", "run", "--steps", "2", "--checkpoint", p.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let sum = sums[0].as_str().unwrap();
    assert!(out.contains(&format!("all 2 ranks bit-exact with the resident run (checksum {sum})")), "{out}");
    assert!(out.contains("(+0 restoring the weights to host;"), "{out}");
    // Where the host masters live does not either. `auto` and `mapped` serve every block from the file (their
    // tensors' unpadded bytes: 2 × (2048 + 128) + 3 × (2048 + 32)); `pinned` builds masters of the packed size.
    let p = checkpoint("run_masters", false);
    for (mode, masters, mapped) in [("auto", 0, 10592), ("mapped", 0, 10592), ("pinned", 11520, 0)] {
        let c = p.with_file_name(format!("{mode}.json"));
        let cfg = json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "host_masters": mode}});
        std::fs::write(&c, cfg.to_string()).unwrap();
        let v = ok_json(&[
            "run",
            "--json",
            "--steps",
            "2",
            "--checkpoint",
            p.to_str().unwrap(),
            "--config",
            c.to_str().unwrap(),
        ]);
        assert_eq!((&v["master_host_bytes"], &v["mapped_host_bytes"]), (&json!(masters), &json!(mapped)), "{mode}");
        assert_eq!((&v["outputs_match"], &v["resident_checksum"]), (&json!(true), &sums[0]), "{mode}");
        if mode == "mapped" {
            // Synthetic weights have no file to serve from.
            let e = invalid(&["run", "--preset", "flux-tiny", "--config", c.to_str().unwrap(), "--steps", "1"]);
            assert_eq!(
                e,
                "error: host_masters = \"mapped\" needs weights read from a checkpoint (run --checkpoint, or \
                 enable(..., checkpoint=PATH)); use host_masters = \"auto\" or \"pinned\""
            );
        }
    }
    // The run computes over the file's bytes: one changed weight byte changes the output.
    let f = checkpoint("run_changed", false);
    let bytes = std::fs::read(&f).unwrap();
    let mut changed = bytes.clone();
    let last = changed.len() - 1;
    changed[last] ^= 0x01;
    std::fs::write(&f, &changed).unwrap();
    let v = ok_json(&["run", "--json", "--steps", "2", "--checkpoint", f.to_str().unwrap()]);
    assert_eq!(v["outputs_match"], true);
    assert_ne!(v["resident_checksum"], sums[0]);
}

#[test]
fn malformed_checkpoints_are_one_line_exit_2() {
    let f = checkpoint("bad", false);
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 3]).unwrap();
    let fs = f.to_str().unwrap();
    let expected = format!(
        "error: checkpoint {fs}: truncated: the header declares {} bytes, the file has {} (tensor `{}` is cut); the \
         file is incomplete (re-download or re-save it)",
        bytes.len(),
        bytes.len() - 3,
        "packed"
    );
    assert_eq!(invalid(&["inspect", fs]), expected);
    assert_eq!(invalid(&["plan", "--checkpoint", fs]), expected);
    assert_eq!(invalid(&["run", "--checkpoint", fs]), expected);
    let d = checkpoint("missing_shard", true);
    std::fs::remove_file(d.join("model-00001-of-00002.safetensors")).unwrap();
    let e = invalid(&["inspect", d.to_str().unwrap()]);
    assert!(
        e.contains(
            "shard `model-00001-of-00002.safetensors` (holding `transformer_blocks.0.attn.to_q.weight`) is missing"
        ),
        "{e}"
    );
    // No block list: nothing to stream, and the error says so.
    let one = tensor(S::F32, &[4, 4], 1);
    let blockless = checkpoint("blockless", false).with_file_name("blockless.safetensors");
    write(&blockless, &BTreeMap::from([("proj.weight".to_string(), &one)]));
    for cmd in ["plan", "run"] {
        let e = invalid(&[cmd, "--checkpoint", blockless.to_str().unwrap()]);
        let want =
            format!("error: checkpoint {}: no block list found (no top-level `name.N.` keys", blockless.display());
        assert!(e.starts_with(&want), "{e}");
    }
    let e = invalid(&["run", "--checkpoint", fs, "--preset", "flux-tiny"]);
    assert!(e.contains("cannot be used with"), "{e}");
}

/// A checkpoint of eight 128 KiB blocks (`blocks.N.w`, bf16) and an embedder: blocks well above the 4 KiB of a
/// direct read's alignment, so a disk tier costs less host memory than the masters it replaces.
fn large_blocks(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("checkpoint-cli-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let mut m: BTreeMap<String, T> =
        (0..8u32).map(|i| (format!("blocks.{i}.w"), tensor(S::BF16, &[256, 256], 50 + i))).collect();
    m.insert("x_embedder.weight".into(), tensor(S::BF16, &[256, 16], 60));
    write(&d.join("model.safetensors"), &m.iter().map(|(k, v)| (k.clone(), v)).collect());
    d.join("model.safetensors")
}

#[test]
fn plan_checkpoint_predicts_the_disk_tier_the_run_then_holds() {
    let p = large_blocks("disk_tier");
    let c = p.with_file_name("disk.json");
    for budget in [700u64 << 10, 900 << 10] {
        let cfg = json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "host_masters": "pinned", "host_budget": budget}});
        std::fs::write(&c, cfg.to_string()).unwrap();
        let (p, c) = (p.to_str().unwrap(), c.to_str().unwrap());
        let plan = ok_json(&["plan", "--json", "--checkpoint", p, "--config", c]);
        let run = ok_json(&["run", "--json", "--steps", "2", "--checkpoint", p, "--config", c]);
        let host = &plan["host"];
        assert!(host["disk_bytes"].as_u64().unwrap() > 0, "{budget}: {host}");
        assert_eq!(
            (&run["master_host_bytes"], &run["disk_bytes"], &run["staging_host_bytes"]),
            (&host["master_bytes"], &host["disk_bytes"], &host["staging_bytes"]),
            "{budget}: the run holds what the plan predicted"
        );
        let held = host["master_bytes"].as_u64().unwrap() + host["staging_bytes"].as_u64().unwrap();
        assert!(held <= budget, "{budget}: {host}");
        assert_eq!(run["outputs_match"], true);
        let text = String::from_utf8_lossy(&wf(&["plan", "--checkpoint", p, "--config", c]).stdout).to_string();
        let line = format!(
            "  disk tier        {} read on every pass\n",
            weightferry::plan::bytes::human_bytes(host["disk_bytes"].as_u64().unwrap())
        );
        assert!(text.contains(&line), "{text}");
    }
}
