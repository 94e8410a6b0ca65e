//! The `weightferry` binary: exit codes, the JSON contract of `run --json` and `plan --json`, and one-line errors on
//! invalid input.

mod common;

use serde_json::Value;
use std::process::Output;

fn wf(args: &[&str]) -> Output {
    common::weightferry(args, &[])
}

fn stdout_json(o: &Output) -> Value {
    let text = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not one JSON object ({e}): {text}"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit code 2 and exactly one line on stderr, starting with `error: `; returns the line.
fn invalid(args: &[&str]) -> String {
    let o = wf(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(!err.contains("panicked") && !err.contains("backtrace"), "{err}");
    assert!(o.stdout.is_empty(), "{args:?}");
    err.trim_end().to_string()
}

fn temp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("weightferry-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn run_json_defaults_to_flux_tiny_layerwise_and_matches() {
    let o = wf(&["run", "--json", "--steps", "2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(o.stderr.is_empty(), "{}", stderr(&o));
    let v = stdout_json(&o);
    assert_eq!(v["pipeline"], "flux-tiny");
    assert_eq!(v["platform"], "sim");
    assert_eq!(v["steps"], 2);
    assert_eq!(v["strategy"], "layer");
    assert_eq!(v["outputs_match"], true);
    assert_eq!(v["weights_match"], true);
    assert_eq!(v["hazard_violations"], 0);
    assert_eq!(v["sync_fetches"], 0);
    assert_eq!(v["resident_checksum"], v["offloaded_checksum"]);
    assert!(v["h2d_bytes"].as_u64().unwrap() > 0);
    assert!(v["peak_device_weight_bytes"].as_u64().unwrap() > 0);
    assert!(v["planned_device_weight_bytes"].as_u64().unwrap() > 0);
    let stacks = v["stacks"].as_array().unwrap();
    let names: Vec<&str> = stacks.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["transformer[transformer_blocks+single_transformer_blocks]", "text_encoder[encoder.block]"]);
    assert_eq!(stacks[0]["units"], 57);
    assert_eq!(stacks[0]["depth"], 2);
}

#[test]
fn run_with_config_skips_and_trace() {
    let cfg = temp(
        "model.toml",
        "[diffusion_offload_config]\nmode = \"module\"\ncomponents = [\"dit\", \"text_encoder\", \"vae\"]\n",
    );
    let trace = cfg.with_file_name("trace.json");
    let o = wf(&[
        "run",
        "--preset",
        "wan-tiny",
        "--config",
        cfg.to_str().unwrap(),
        "--steps",
        "3",
        "--skip-seed",
        "9",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("weightferry run: wan-tiny on sim, 3 steps, seed 0\n"), "{text}");
    assert!(text.contains("\nstrategy: model\n"), "{text}");
    assert!(text.contains("\noutputs match: yes"), "{text}");
    assert!(text.contains("\nweights match: yes"), "{text}");
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let cat = |c: &str| events.iter().filter(|e| e["ph"] == "X" && e["cat"] == c).count();
    assert!(cat("kernel") > 0 && cat("h2d") > 0 && cat("hook") > 0);
    let threads: Vec<&str> =
        events.iter().filter(|e| e["name"] == "thread_name").map(|e| e["args"]["name"].as_str().unwrap()).collect();
    assert_eq!(threads[0], "host engine (hooks)");
    assert_eq!(threads[1], "stream compute");
    assert!(threads.contains(&"stream copy"), "{threads:?}");
    // Model-level units are whole components: their copies are named by the component.
    let mut named: Vec<&str> = events
        .iter()
        .filter(|e| e["cat"] == "h2d" && e["args"]["unit"].is_string())
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    named.sort();
    named.dedup();
    assert_eq!(named, vec!["h2d text_encoder", "h2d transformer", "h2d vae"]);
}

/// The copies of a `run --trace` named by a master's unit: `(name, unit, bytes)`.
fn unit_copies(trace: &Value) -> Vec<(String, String, u64)> {
    let events = trace["traceEvents"].as_array().unwrap();
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["args"]["unit"].is_string())
        .map(|e| {
            let unit = e["args"]["unit"].as_str().unwrap().to_string();
            (e["name"].as_str().unwrap().to_string(), unit, e["args"]["bytes"].as_u64().unwrap())
        })
        .collect()
}

#[test]
fn run_trace_names_every_streamed_copy_by_its_block() {
    let trace = temp("blocks.json", "");
    let o = wf(&["run", "--json", "--steps", "2", "--trace", trace.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // One clean JSON object on stdout, nothing on stderr (no progress bar without a terminal).
    assert!(o.stderr.is_empty(), "{}", stderr(&o));
    let v = stdout_json(&o);
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let copies = unit_copies(&t);
    for (name, unit, _) in &copies {
        assert_eq!(name, &format!("h2d {unit}"));
    }
    let mut units: Vec<&str> = copies.iter().map(|c| c.1.as_str()).collect();
    units.sort();
    units.dedup();
    // Every streamed unit of flux-tiny's two stacks (19 double, 38 single blocks; 24 encoder blocks), nothing else.
    let mut want: Vec<String> = (0..19)
        .map(|i| format!("transformer.transformer_blocks.{i}"))
        .chain((0..38).map(|i| format!("transformer.single_transformer_blocks.{i}")))
        .chain((0..24).map(|i| format!("text_encoder.encoder.block.{i}")))
        .collect();
    want.sort();
    assert_eq!(units, want);
    // The named copies are exactly the stacks' loads: one copy per load (one dtype per block), the same bytes.
    let stacks = v["stacks"].as_array().unwrap();
    let loads: u64 = stacks.iter().map(|s| s["loads"].as_u64().unwrap()).sum();
    let bytes: u64 = stacks.iter().map(|s| s["h2d_bytes"].as_u64().unwrap()).sum();
    assert_eq!(copies.len() as u64, loads);
    assert_eq!(copies.iter().map(|c| c.2).sum::<u64>(), bytes);
}

#[test]
fn plan_json_fields() {
    let o = wf(&["plan", "--pipeline", "qwen-tiny", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = stdout_json(&o);
    assert_eq!(v["strategy"], "layer");
    assert_eq!(v["skip_reason"], Value::Null);
    assert!(v["device_weight_bytes"].as_u64().unwrap() > 0);
    let comps = v["components"].as_array().unwrap();
    let summary: Vec<(String, String, bool)> = comps
        .iter()
        .map(|c| (c["path"].as_str().unwrap().into(), c["kind"].as_str().unwrap().into(), c["selected"] == true))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("transformer".into(), "dit".into(), true),
            ("text_encoder".into(), "text_encoder".into(), true),
            ("vae".into(), "vae".into(), false),
        ]
    );
    let dit = &comps[0]["stacks"][0];
    assert_eq!(
        (dit["blocks"].as_u64(), dit["resident"].as_u64(), dit["streaming"].as_u64()),
        (Some(60), Some(0), Some(60))
    );
    let enc = &comps[1]["stacks"][0];
    assert_eq!(
        (enc["blocks"].as_u64(), enc["resident"].as_u64(), enc["streaming"].as_u64()),
        (Some(28), Some(0), Some(28))
    );
}

#[test]
fn plan_with_resident_layers_and_model_level() {
    let cfg = temp(
        "dlo.json",
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"resident_layers": 3, "prefetch_depth": 1}}}}"#,
    );
    let v = stdout_json(&wf(&["plan", "--pipeline", "flux-tiny", "--config", cfg.to_str().unwrap(), "--json"]));
    assert_eq!(v["strategy"], "distributed_layer");
    let dit = &v["components"][0]["stacks"][0];
    assert_eq!(
        (dit["blocks"].as_u64(), dit["resident"].as_u64(), dit["streaming"].as_u64()),
        (Some(57), Some(3), Some(54))
    );
    assert_eq!(v["components"][1]["selected"], false);

    let cfg = temp(
        "module.json",
        r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}"#,
    );
    let o = wf(&["plan", "--pipeline", "flux-tiny", "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("weightferry plan: flux-tiny\nstrategy: model\n"), "{text}");
    assert!(text.contains("-> swapped onto the device for its phase, then released (model-level)"), "{text}");
}

#[test]
fn plan_predicts_the_host_masters_and_run_refuses_a_host_budget_below_them() {
    let v = stdout_json(&wf(&["plan", "--pipeline", "flux-tiny", "--json"]));
    let bytes =
        |c: &Value| -> u64 { c["stacks"].as_array().unwrap().iter().map(|s| s["bytes"].as_u64().unwrap()).sum() };
    let components = v["components"].as_array().unwrap();
    let all: u64 = components.iter().map(bytes).sum();
    assert_eq!(v["host"]["master_bytes"].as_u64(), Some(all), "layerwise: one master per streamed block");
    let stacks = bytes(&components[0]); // the DiT's, all the config below offloads
    assert_eq!((v["host"]["budget"].clone(), v["host"]["pinned"].clone()), (Value::Null, Value::Bool(true)));
    let cfg = temp(
        "host.json",
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "host_budget": 1024}}"#,
    );
    let need = format!(
        "host_budget: the host masters of the offloaded weights need {}, over the budget of 1.00 KiB (1024 B); \
         raise host_budget, offload fewer components, or bind the weights from a checkpoint (its file then serves \
         the blocks beyond the budget, read from disk on every pass)",
        weightferry::plan::bytes::human_bytes(stacks)
    );
    let o = wf(&["plan", "--pipeline", "flux-tiny", "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains(&format!("warning: enable will refuse this plan: {need}\n")), "{text}");
    let o = wf(&["run", "--preset", "flux-tiny", "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(stderr(&o).trim_end(), format!("error: the config cannot be applied to flux-tiny: {need}"));
}

#[test]
fn invalid_input_exits_2_with_one_line() {
    let e = invalid(&["run", "--config", "/definitely/not/here.json"]);
    assert!(e.starts_with("error: invalid config: /definitely/not/here.json: cannot read the config file"), "{e}");
    assert_eq!(
        invalid(&["run", "--preset", "flux-giant"]),
        "error: unknown preset 'flux-giant'; choose one of flux-dev, flux-tiny, wan-14b, wan-tiny, qwen-image, \
         qwen-tiny or pass a pipeline .json file"
    );
    assert!(invalid(&["plan", "--pipeline", "nope"]).starts_with("error: unknown preset 'nope'"));
    let bad = temp("bad.json", r#"{"diffusion_offload_config": {"mode": "layer", "components": ["unet"]}}"#);
    let e = invalid(&["plan", "--config", bad.to_str().unwrap()]);
    assert!(e.starts_with("error: invalid config: diffusion_offload_config.components"), "{e}");
    let badp = temp("pipe.json", "{\"class\": 3}");
    assert!(invalid(&["run", "--pipeline", badp.to_str().unwrap()]).starts_with("error: pipeline "));
    assert!(invalid(&["run", "--steps", "zero"]).starts_with("error: invalid value 'zero' for '--steps <N>'"));
    assert!(invalid(&["run", "--frobnicate"]).starts_with("error: unexpected argument '--frobnicate'"));
    assert!(invalid(&[]).starts_with("error: no command given"));
    assert!(invalid(&["run", "--preset", "flux-dev"]).starts_with("error: pipeline flux-dev has "));
    let e = invalid(&["run", "--platform", "cuda"]);
    assert!(e.contains("--platform sim"), "{e}");
    if cfg!(feature = "cuda") {
        // A build with CUDA support on a machine without a driver (this test does not run on GPU machines).
        assert!(e.contains("no CUDA driver found"), "{e}");
    }
    assert!(invalid(&["run", "--platform", "tpu"]).starts_with("error: invalid value 'tpu' for '--platform"));
}

#[test]
fn help_exits_0() {
    let o = wf(&["run", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("--preset <P>") && text.contains("--json") && text.contains("--trace <FILE>"), "{text}");
}

#[test]
#[cfg(weightferry_broken)] // the broken orderings: RUSTFLAGS="--cfg weightferry_broken" (tests/all.sh runs it so)
fn failed_checks_exit_1() {
    let o = wf(&[
        "run",
        "--json",
        "--steps",
        "1",
        "--sim-copy-latency-us",
        "500",
        "--inject-ordering-fault",
        "skip-ready-wait",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let v = stdout_json(&o);
    assert!(v["hazard_violations"].as_u64().unwrap() > 0);
    assert_eq!(err.lines().count(), 1, "{err}");
    // With --json the error is one JSON object too.
    let e: serde_json::Value = serde_json::from_str(err.trim_end()).unwrap_or_else(|x| panic!("{x}: {err}"));
    assert_eq!(e["exit_code"], 1, "{err}");
    assert!(e["error"].as_str().is_some_and(|m| !m.is_empty()), "{err}");
}

/// Both injectable orderings are caught with instant copies too (no `--sim-copy-latency-us`: the copy has long
/// finished when the compute that skipped its wait runs), on every run: the detector goes by order, not timing.
#[test]
#[cfg(weightferry_broken)] // the broken orderings: RUSTFLAGS="--cfg weightferry_broken" (tests/all.sh runs it so)
fn failed_checks_exit_1_for_every_fault_with_instant_copies() {
    for (fault, kind) in [("skip-ready-wait", "ReadBeforeReady"), ("skip-last-use-wait", "OverwriteBeforeLastUse")] {
        for attempt in 0..3 {
            let o = wf(&["run", "--json", "--steps", "1", "--inject-ordering-fault", fault]);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{fault} attempt {attempt}: {err}");
            let v = stdout_json(&o);
            assert!(v["hazard_violations"].as_u64().unwrap() > 0, "{fault} attempt {attempt}: {v}");
            let first = v["first_violation"].as_str().unwrap_or("");
            assert!(first.starts_with(kind), "{fault} attempt {attempt}: {first}");
        }
    }
}

/// A build without the broken orderings refuses to inject one: exit 1, one line naming the build it needs.
#[test]
#[cfg(not(weightferry_broken))]
fn an_ordering_fault_needs_the_broken_build() {
    let o = wf(&["run", "--steps", "1", "--inject-ordering-fault", "skip-ready-wait"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains("ordering fault SkipReadyWait needs a build with RUSTFLAGS=\"--cfg weightferry_broken\""),
        "{err}"
    );
    // With --json the same error is one JSON object.
    let o = wf(&["run", "--json", "--steps", "1", "--inject-ordering-fault", "skip-ready-wait"]);
    let v: serde_json::Value = serde_json::from_str(stderr(&o).trim_end()).expect("one JSON object");
    assert_eq!(v["exit_code"], 1);
    assert!(v["error"].as_str().unwrap().contains("needs a build with RUSTFLAGS"), "{v}");
    assert!(o.stdout.is_empty());
}

#[test]
fn bench_gather_rejects_bad_arguments_in_one_line() {
    let e = invalid(&["bench-gather", "--modes", "teleport"]);
    assert!(e.contains("teleport"), "{e}");
    if cfg!(feature = "nccl") {
        let e = invalid(&["bench-gather", "--gemm", "1,2"]);
        assert!(e.contains("--gemm takes three positive sizes"), "{e}");
    } else {
        let e = invalid(&["bench-gather"]);
        assert!(e.contains("--features nccl"), "{e}");
    }
}

#[test]
fn counts_and_modes_out_of_range_are_refused_by_the_parser() {
    // Checked while parsing, whatever the build's GPU support: one line naming the flag, exit 2.
    for (args, flag) in [
        (&["bench", "--rounds", "0"][..], "'--rounds <R>'"),
        (&["bench-gather", "--blocks", "0"], "'--blocks <N>'"),
        (&["bench-gather", "--repeats", "0"], "'--repeats <N>'"),
        (&["bench-gather", "--gemm-iters", "0"], "'--gemm-iters <N>'"),
        (&["bench-gather", "--compute-mode", "h2d-only"], "'--compute-mode <MODE>'"),
    ] {
        let e = invalid(args);
        assert!(e.starts_with("error: invalid value ") && e.contains(flag), "{args:?}: {e}");
    }
}

#[test]
fn bench_budgets_take_fractions_or_none() {
    assert_eq!(
        invalid(&["bench", "--preset", "flux-tiny", "--budgets", "0"]),
        "error: --budgets \"0\": expected fractions in (0, 1] separated by commas, e.g. 0.25,0.5,0.75, or none for \
         no budget rows"
    );
    assert_eq!(
        invalid(&["bench", "--preset", "flux-tiny", "--budgets", ""]),
        "error: --budgets \"\": expected fractions in (0, 1] separated by commas, e.g. 0.25,0.5,0.75, or none for \
         no budget rows"
    );
    // `none` passes the argument checks: only the depth rows are measured.
    let args = ["bench", "--preset", "flux-tiny", "--steps", "1,2", "--depths", "1", "--budgets", "none"];
    if cfg!(feature = "cuda") {
        // A GPU may or may not be present: the arguments are accepted either way.
        let o = wf(&args);
        assert_ne!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(!stderr(&o).contains("--budgets"), "{}", stderr(&o));
    } else {
        assert_eq!(
            invalid(&args),
            "error: bench measures a GPU: rebuild with --features cuda and run it on a machine with a GPU"
        );
    }
}

#[test]
fn run_with_hook_copy_submission_is_bit_exact_and_reports_it() {
    let cfg = temp(
        "hook.toml",
        "[diffusion_offload_config]\nmode = \"layer\"\ncomponents = [\"dit\", \"text_encoder\"]\n\
         [diffusion_offload_config.layer_options.dit]\nprefetch_depth = 3\ncopy_submission = \"hook\"\n",
    );
    let o = wf(&["run", "--preset", "flux-tiny", "--config", cfg.to_str().unwrap(), "--steps", "2", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = stdout_json(&o);
    assert_eq!(v["outputs_match"], true, "{v}");
    let stacks = v["stacks"].as_array().unwrap();
    let dit = stacks.iter().find(|s| s["name"].as_str().unwrap().starts_with("transformer")).unwrap();
    assert_eq!(dit["submission"], "hook", "{v}");
    assert!(stacks.iter().any(|s| s["submission"] == "actor"), "the text encoder keeps the actor: {v}");
    // A wrong value is a one-line error naming the key and the choices.
    let bad = temp(
        "bad_hook.toml",
        "[diffusion_offload_config]\nmode = \"layer\"\ncomponents = [\"dit\"]\n\
         [diffusion_offload_config.layer_options.dit]\ncopy_submission = \"gpu\"\n",
    );
    let line = invalid(&["run", "--preset", "flux-tiny", "--config", bad.to_str().unwrap()]);
    assert!(
        line.contains("diffusion_offload_config.layer_options.dit.copy_submission: unknown copy submission \"gpu\"")
            && line.contains("choose \"actor\" or \"hook\""),
        "{line}"
    );
}

#[test]
fn bench_takes_a_copy_submission_for_every_configuration() {
    let e = invalid(&["bench", "--preset", "flux-tiny", "--copy-submission", "gpu"]);
    assert!(e.contains("invalid value 'gpu' for '--copy-submission <MODES>'"), "{e}");
    let e = invalid(&["bench", "--preset", "flux-tiny", "--depths", "1", "--copy-submission", "hook,actor,hook"]);
    assert_eq!(e, "error: --copy-submission names `hook` twice; give each mode once, e.g. actor,hook");
    for mode in ["hook", "actor", "actor,hook"] {
        let args = ["bench", "--preset", "flux-tiny", "--depths", "1", "--budgets", "none", "--copy-submission", mode];
        if cfg!(feature = "cuda") {
            // A GPU may or may not be present: the arguments are accepted either way.
            let o = wf(&args);
            assert_ne!(o.status.code(), Some(2), "{}", stderr(&o));
        } else {
            assert_eq!(
                invalid(&args),
                "error: bench measures a GPU: rebuild with --features cuda and run it on a machine with a GPU"
            );
        }
    }
}

#[test]
fn a_misspelt_flag_keeps_clap_s_suggestion() {
    let o = wf(&["run", "--step", "3"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines,
        [
            "error: unexpected argument '--step' found (see weightferry --help)",
            "  tip: a similar argument exists: '--steps'"
        ],
        "{err}"
    );
}

#[test]
fn version_names_the_git_revision() {
    let o = wf(&["--version"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out.trim();
    let rest =
        line.strip_prefix(concat!("weightferry ", env!("CARGO_PKG_VERSION"), " (")).unwrap_or_else(|| panic!("{line}"));
    let rev = rest.strip_suffix(')').unwrap_or_else(|| panic!("{line}"));
    let hex = rev.strip_suffix("-dirty").unwrap_or(rev);
    assert!(rev == "unknown" || (hex.len() == 12 && hex.chars().all(|c| c.is_ascii_hexdigit())), "{line}");
}

#[test]
fn completions_cover_every_subcommand_and_refuse_an_unknown_shell() {
    let o = wf(&["completions", "bash"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let script = String::from_utf8_lossy(&o.stdout);
    assert!(script.contains("_weightferry()"), "not a bash completion script");
    for sub in ["run", "plan", "bench", "launch", "bench-gather", "completions"] {
        assert!(script.contains(sub), "{sub} missing");
    }
    assert!(script.contains("--steps"), "run's flags missing");
    let bad = wf(&["completions", "cmd"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).starts_with("error: invalid value 'cmd' for '<SHELL>'"));
}

#[test]
fn run_refuses_a_trace_over_its_inputs_and_throttles_it_could_never_finish_with() {
    let dir = std::env::temp_dir().join(format!("wf-cli-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("c.json");
    let text = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
    std::fs::write(&config, text).unwrap();
    let alias = dir.join("alias.json");
    let _ = std::fs::remove_file(&alias);
    std::os::unix::fs::symlink(&config, &alias).unwrap();
    for trace in [&config, &alias] {
        let o = wf(&["run", "--config", config.to_str().unwrap(), "--trace", trace.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2));
        assert_eq!(
            String::from_utf8_lossy(&o.stderr).trim_end(),
            format!(
                "error: --trace {} is the --config file; writing the trace would destroy it: choose another trace path",
                trace.display()
            )
        );
        assert_eq!(std::fs::read_to_string(&config).unwrap(), text, "the config is untouched");
    }
    let cases = [
        ["--sim-h2d-gbps", "1e-300"],
        ["--sim-h2d-gbps", "1e308"],
        ["--sim-h2d-gbps", "0"],
        ["--sim-copy-latency-us", "18446744073709551615"],
    ];
    for args in &cases {
        let mut all = vec!["run", "--steps", "1"];
        all.extend(args.iter().copied());
        let t = std::time::Instant::now();
        let o = wf(&all);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{args:?}");
        if args[0] == "--sim-copy-latency-us" {
            assert_eq!(
                err.trim_end(),
                "error: --sim-copy-latency-us 18446744073709551615: choose at most 10000000 µs (10 s) per copy"
            );
        } else {
            assert!(
                err.trim_end().ends_with(
                    ": choose a rate from 0.001 to 100000 GB/s, or leave the flag out for unthrottled copies"
                ),
                "{args:?}: {err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plan_and_run_agree_on_what_model_level_offload_does() {
    let dir = std::env::temp_dir().join(format!("wf-cli-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (components, swaps) in [
        (r#"["vae"]"#, false),
        (r#"["dit"]"#, false),
        (r#"["text_encoder"]"#, false),
        (r#"["dit", "vae"]"#, false),
        (r#"["dit", "text_encoder"]"#, true),
        (r#"["dit", "text_encoder", "vae"]"#, true),
    ] {
        let config = dir.join("c.json");
        std::fs::write(
            &config,
            format!(r#"{{"diffusion_offload_config": {{"mode": "module", "components": {components}}}}}"#),
        )
        .unwrap();
        let c = config.to_str().unwrap();
        let plan = wf(&["plan", "--config", c, "--json"]);
        assert_eq!(plan.status.code(), Some(0), "{components}: {}", String::from_utf8_lossy(&plan.stderr));
        let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
        let run = wf(&["run", "--config", c, "--json", "--steps", "1"]);
        assert_eq!(run.status.code(), Some(0), "{components}: {}", String::from_utf8_lossy(&run.stderr));
        let run: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
        assert_eq!(run["offload_enabled"], swaps, "{components}");
        assert_eq!(plan["skip_reason"].is_null(), swaps, "{components}: {}", plan["skip_reason"]);
        assert_eq!(run["skip_reason"], plan["skip_reason"], "{components}: plan and run give one reason");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_trace_that_cannot_be_written_does_not_cost_the_report() {
    let o = wf(&["run", "--steps", "1", "--json", "--trace", "/dev/full"]);
    assert_eq!(o.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).expect("the report is still printed");
    assert_eq!(report["outputs_match"], true);
    let err: serde_json::Value = serde_json::from_slice(&o.stderr).expect("with --json the error is JSON too");
    assert_eq!(
        err,
        serde_json::json!({"error": "cannot write trace file `/dev/full`: No space left on device (os error 28)",
                           "exit_code": 1})
    );
}

#[test]
fn a_missing_required_argument_is_named_on_the_error_line() {
    let o = wf(&["completions"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim_end(),
        "error: the following required arguments were not provided: <SHELL> (see weightferry --help)"
    );
}
