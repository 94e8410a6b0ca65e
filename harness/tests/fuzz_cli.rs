//! Fuzzing the binary's input handling at scale (issue 17): pipeline descriptions and config files (JSON and TOML)
//! mutated from valid ones — numbers swapped for extremes, structure deleted, duplicated or broken, hostile tokens
//! inserted — are handed to `weightferry plan` under a 1 GiB address-space limit. Every case must end in exit 0
//! (accepted: a plan on stdout) or exit 2 with exactly one line on stderr (`error: …`, or one JSON object under
//! `--json`): no panic, no abort, no signal, no allocation beyond the limit. A fixed number of cases per target,
//! so it runs in CI at a fixed cost (each case is one process).

use proptest::prelude::*;
use proptest::test_runner::Config;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use weightferry::dist::LaunchEnv;
use weightferry::pipeline::json::to_pipeline_json;
use weightferry::pipeline::presets::preset;

/// Cases per fuzz target.
const CASES: u32 = 256;
/// Address space the binary may use (`prlimit --as`): a plan of a tiny pipeline needs a small fraction of it; an
/// input that makes it allocate by what it claims rather than by what it is hits the limit and aborts.
const ADDRESS_SPACE_BYTES: u64 = 1 << 30;

/// A small valid description with every feature the format has (blocks, repeat, ties, views, flat storages).
const PIPELINE: &str = r#"{
  "format": "weightferry-pipeline/1",
  "class": "TinyPipeline",
  "modules": {
    "transformer": {"class": "TinyDiT",
      "tensors": {"rope": {"dtype": "f32", "shape": [8, 4], "kind": "non_persistent_buffer"}},
      "children": {
        "blocks": {"repeat": 3, "block": {"class": "TinyBlock",
          "children": {"fc": {"class": "Linear", "tensors": {"weight": {"dtype": "bf16", "shape": [4, 4]}}}}}},
        "proj_out": {"class": "Linear", "tensors": {"weight": {"dtype": "bf16", "shape": [2, 4], "strides": [1, 2]}}},
        "proj_alias": {"class": "Module", "tensors": {
          "weight": {"dtype": "bf16", "shape": [4, 4], "tied_to": "transformer.blocks.1.fc.weight"}}}
      }},
    "text_encoder": {"class": "Enc", "children": {"layers": {"repeat": 2, "block": {"class": "L",
      "tensors": {"w": {"dtype": "f16", "shape": [3, 3]}}}}}},
    "vae": {"class": "TinyVAE", "has_lifecycle": true, "tensors": {
      "enc": {"dtype": "bf16", "shape": [2, 3], "storage": "flat"},
      "dec": {"dtype": "bf16", "shape": [3, 2], "storage": "flat", "storage_offset": 6}}}
  },
  "storages": {"flat": {"dtype": "bf16", "numel": 12}},
  "components": {"dit": ["transformer"], "encoders": ["text_encoder"], "vaes": ["vae"]},
  "offload_plan": {"block_attrs": {"transformer": ["blocks"]}, "encoder_block_attrs": {"text_encoder": ["layers"]},
                   "on_demand_component_paths": ["vae"], "resident_dit_paths": ["transformer"]}
}"#;

const CONFIG_JSON: &str = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder", "vae"],
  "pin_memory": true, "device_budget": "512MiB",
  "layer_options": {"dit": {"prefetch_depth": 2, "resident_layers": 1, "copy_submission": "hook"},
                    "text_encoder": {"prefetch_depth": 1}}}}"#;

const CONFIG_TOML: &str = "[diffusion_offload_config]\nmode = \"layer\"\ncomponents = [\"dit\", \"text_encoder\"]\n\
pin_memory = false\n[diffusion_offload_config.layer_options.dit]\nprefetch_depth = 3\nresident_layers = 1\n";

/// What an edit may insert besides a scalar value ([`VALUES`]): hostile numbers, structure, fragments.
const FRAGMENTS: &[&str] = &[
    "-1e400",
    "1e-400",
    "nan",
    "inf",
    "\"\u{feff}\"",
    "\u{feff}",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "=",
    "\"",
    "\n",
    "[[[[[[[[[[[[[[[[",
    "{\"a\":{\"a\":{\"a\":{\"a\":",
    "\"repeat\": 65536, ",
    "\"repeat\": 4294967296, ",
    "\"shape\": [1099511627776], \"strides\": [0], ",
    "\"shape\": [4294967296, 4294967296], ",
    "\"tied_to\": \"transformer.rope\", ",
    "\"storage\": \"flat\", ",
    "\"storage_offset\": 18446744073709551615, ",
    "\"prefetch_depth\": 18446744073709551615, ",
    "\"device_budget\": \"1e308GiB\", ",
    "\"device_budget\": 18446744073709551615, ",
    "\"group\": {\"size\": 0}, ",
];

/// The tokens a scalar may become (well-formed values, hostile ones among them).
const VALUES: &[&str] = &[
    "-1",
    "0",
    "1",
    "2",
    "3",
    "64",
    "65",
    "65536",
    "65537",
    "1e400",
    "1.5",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "1099511627776",
    "null",
    "true",
    "\"\"",
    "\"bf16\"",
    "\"f32\"",
    "\"module\"",
    "\"layer\"",
    "\"group\"",
    "\"hook\"",
    "\"1e308GiB\"",
    "\"0B\"",
    "\"transformer.blocks.0.fc.weight\"",
    "\"transformer\"",
    "\"vae\"",
];

#[derive(Debug, Clone)]
enum Edit {
    /// Replaces the `nth` scalar (a number or a string literal, counted modulo how many there are): keeps the
    /// document well formed more often than not, so the checks behind the parser are reached.
    Scalar {
        nth: usize,
        token: usize,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Insert {
        at: usize,
        token: usize,
    },
    Replace {
        at: usize,
        len: usize,
        token: usize,
    },
    Duplicate {
        at: usize,
        len: usize,
    },
}

/// Token `i` of everything an edit may insert: the scalar values, then the fragments.
fn token_of(i: usize) -> &'static str {
    VALUES.get(i).copied().unwrap_or_else(|| FRAGMENTS[(i - VALUES.len()) % FRAGMENTS.len()])
}

fn edit() -> impl Strategy<Value = Edit> {
    let tokens = VALUES.len() + FRAGMENTS.len();
    prop_oneof![
        4 => (any::<usize>(), 0..VALUES.len()).prop_map(|(nth, token)| Edit::Scalar { nth, token }),
        1 => (any::<usize>(), 1usize..12).prop_map(|(at, len)| Edit::Delete { at, len }),
        1 => (any::<usize>(), 0..tokens).prop_map(|(at, token)| Edit::Insert { at, token }),
        1 => (any::<usize>(), 1usize..8, 0..tokens).prop_map(|(at, len, token)| Edit::Replace { at, len, token }),
        1 => (any::<usize>(), 1usize..64).prop_map(|(at, len)| Edit::Duplicate { at, len }),
    ]
}

/// The nearest char boundary at or before `at`.
fn boundary(s: &str, at: usize) -> usize {
    let mut a = at.min(s.len());
    while !s.is_char_boundary(a) {
        a -= 1;
    }
    a
}

/// Byte ranges of the scalars of `s`: string literals (quotes included) and runs of number characters outside them.
fn scalars(s: &str) -> Vec<std::ops::Range<usize>> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
            // A key (followed by `:`) is not a value.
            let mut j = i;
            while j < b.len() && b[j].is_ascii_whitespace() {
                j += 1;
            }
            if b.get(j) != Some(&b':') {
                out.push(start..i);
            }
        } else if b[i].is_ascii_digit() || b[i] == b'-' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b"+-.".contains(&b[i])) {
                i += 1;
            }
            out.push(start..i);
        } else {
            i += 1;
        }
    }
    out
}

fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut s = text.to_string();
    for e in edits {
        let n = s.len().max(1);
        match *e {
            Edit::Scalar { nth, token } => {
                let spans = scalars(&s);
                if let Some(r) = spans.get(nth % spans.len().max(1)).cloned() {
                    let (a, b) = (boundary(&s, r.start), boundary(&s, r.end));
                    s.replace_range(a..b, VALUES[token]);
                }
            }
            Edit::Delete { at, len } => {
                let a = boundary(&s, at % n);
                let b = boundary(&s, a + len);
                s.replace_range(a..b, "");
            }
            Edit::Insert { at, token } => {
                let a = boundary(&s, at % n);
                s.insert_str(a, token_of(token));
            }
            Edit::Replace { at, len, token } => {
                let a = boundary(&s, at % n);
                let b = boundary(&s, a + len);
                s.replace_range(a..b, token_of(token));
            }
            Edit::Duplicate { at, len } => {
                let a = boundary(&s, at % n);
                let b = boundary(&s, a + len);
                let span = s[a..b].to_string();
                s.insert_str(b, &span);
            }
        }
    }
    s
}

/// A fresh file holding `text`, named `name` in a directory of its own.
fn write_case(name: &str, text: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("wf-fuzz-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)));
    std::fs::create_dir_all(&dir).expect("case directory");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("case file");
    path
}

/// Runs `weightferry plan` with `args` under the address-space limit (and a clean launch environment).
fn plan(args: &[&str]) -> Output {
    let mut c = Command::new("prlimit");
    c.arg(format!("--as={ADDRESS_SPACE_BYTES}")).arg(env!("CARGO_BIN_EXE_weightferry")).arg("plan").args(args);
    c.env_remove("RUST_LOG");
    for v in LaunchEnv::VARS {
        c.env_remove(v);
    }
    c.output().expect("spawn prlimit")
}

/// Exit 0 with a plan, or exit 2 with one line on stderr (a JSON object under `--json`); anything else fails.
fn check(o: &Output, json: bool, what: &str) -> Result<(), TestCaseError> {
    let err = String::from_utf8_lossy(&o.stderr);
    match o.status.code() {
        Some(0) => prop_assert!(!o.stdout.is_empty(), "{what}: accepted without a plan"),
        Some(2) => {
            prop_assert_eq!(err.lines().count(), 1, "{}: stderr {:?}", what, err);
            prop_assert!(err.ends_with('\n'), "{}: stderr {:?}", what, err);
            if json {
                let v: serde_json::Value = serde_json::from_str(err.trim_end())
                    .map_err(|e| TestCaseError::fail(format!("{what}: {e}: {err:?}")))?;
                prop_assert_eq!(&v["exit_code"], 2, "{}: {}", what, v);
            } else {
                prop_assert!(err.starts_with("error: "), "{}: stderr {:?}", what, err);
            }
        }
        code => prop_assert!(false, "{}: exit {:?} (signal or failure), stderr {:?}", what, code, err),
    }
    Ok(())
}

proptest! {
    #![proptest_config(Config { cases: CASES, failure_persistence: None, ..Config::default() })]

    #[test]
    fn mutated_pipeline_descriptions_are_planned_or_refused_in_one_line(
        seed in 0usize..2,
        edits in prop::collection::vec(edit(), 1..4),
        json in any::<bool>(),
    ) {
        let base = if seed == 0 {
            PIPELINE.to_string()
        } else {
            to_pipeline_json(&preset("flux-tiny").expect("preset"))
        };
        let text = mutate(&base, &edits);
        let path = write_case("p.json", &text);
        let p = path.to_str().expect("utf-8 path");
        let mut args = vec!["--pipeline", p];
        if json {
            args.push("--json");
        }
        let o = plan(&args);
        let _ = std::fs::remove_dir_all(path.parent().expect("case directory"));
        check(&o, json, &format!("pipeline {edits:?}"))?;
    }

    #[test]
    fn mutated_config_files_are_planned_or_refused_in_one_line(
        toml in any::<bool>(),
        edits in prop::collection::vec(edit(), 1..4),
        json in any::<bool>(),
    ) {
        let (name, base) = if toml { ("c.toml", CONFIG_TOML) } else { ("c.json", CONFIG_JSON) };
        let text = mutate(base, &edits);
        let cpath = write_case(name, &text);
        let ppath = write_case("p.json", PIPELINE);
        let (c, p) = (cpath.to_str().expect("utf-8 path"), ppath.to_str().expect("utf-8 path"));
        let mut args = vec!["--pipeline", p, "--config", c];
        if json {
            args.push("--json");
        }
        let o = plan(&args);
        for path in [&cpath, &ppath] {
            let _ = std::fs::remove_dir_all(path.parent().expect("case directory"));
        }
        check(&o, json, &format!("config {name} {edits:?}"))?;
    }
}

/// The seeds themselves are accepted (so the mutations start from valid input), and the limit leaves room for them.
#[test]
fn the_unmutated_seeds_are_planned_under_the_limit() {
    let p = write_case("p.json", PIPELINE);
    let f = write_case("f.json", &to_pipeline_json(&preset("flux-tiny").expect("preset")));
    let cj = write_case("c.json", CONFIG_JSON);
    let ct = write_case("c.toml", CONFIG_TOML);
    let s = |p: &PathBuf| p.to_str().expect("utf-8 path").to_string();
    for args in [
        vec!["--pipeline".to_string(), s(&p)],
        vec!["--pipeline".to_string(), s(&f)],
        vec!["--pipeline".to_string(), s(&p), "--config".to_string(), s(&cj)],
        vec!["--pipeline".to_string(), s(&p), "--config".to_string(), s(&ct)],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = plan(&args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    for path in [&p, &f, &cj, &ct] {
        let _ = std::fs::remove_dir_all(path.parent().expect("case directory"));
    }
}
