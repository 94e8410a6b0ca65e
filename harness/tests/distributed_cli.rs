//! Multi-process distributed runs through the binary: `weightferry launch --nproc N -- run …` starts N processes
//! that find each other through the TCP rendezvous, each runs its rank on the simulated device with the TCP
//! collective, and rank 0 reports every rank bit-exact with the resident run (text and JSON, unchunked and
//! chunked, the rank count from the config's group), each holding only its shards of the DiT on host while it runs
//! and restoring the weights at its end; a rank whose AllGather fails makes launch exit 1 naming it;
//! a bad launch environment or a config whose group does not match `WORLD_SIZE` is an exact one-line error (exit
//! 2) before anything runs. A timed run (`--time-steps LO,HI`) reports per rank and for the group the step time,
//! the bytes per step (one pass of shards), the bounds and their ratios, in JSON and text, and stays bit-exact;
//! bad `--time-steps` values are an exact exit-2 error naming the flag.

mod common;

use serde_json::Value;
use std::process::Output;

fn wf(args: &[&str], env: &[(&str, &str)]) -> Output {
    common::weightferry(args, env)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn temp(name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("weightferry-dist-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

#[test]
fn launch_two_and_four_ranks_reports_every_rank_bit_exact() {
    for world in [2usize, 4] {
        let n = world.to_string();
        let o = wf(&["launch", "--nproc", &n, "--", "run", "--steps", "2"], &[]);
        let (out, err) = (text(&o.stdout), text(&o.stderr));
        assert_eq!(o.status.code(), Some(0), "N={world} stdout: {out}\nstderr: {err}");
        assert!(err.is_empty(), "{err}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), world + 2, "{out}");
        assert!(lines.iter().all(|l| l.starts_with("[rank 0] ")), "only rank 0 reports: {out}");
        let head = format!("[rank 0] weightferry distributed run: flux-tiny on {world} sim ranks");
        assert!(lines[0].starts_with(&head), "{out}");
        for r in 0..world {
            let line = lines[1 + r];
            assert!(line.starts_with(&format!("[rank 0] rank {r}: bit-exact with the resident run")), "{out}");
            assert!(line.contains(" of DiT weights on host while running), "), "{out}");
        }
        let tail = format!("[rank 0] all {world} ranks bit-exact with the resident run");
        assert!(lines[world + 1].starts_with(&tail), "{out}");
    }
}

#[test]
fn launch_three_ranks_from_the_config_group_with_chunks_in_json() {
    let config = temp(
        "sp3-chunked.json",
        r#"{"sequence_parallel_size": 3, "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather", "prefetch_depth": 1,
                                      "allgather_chunk_size": "4KiB"}}}}"#,
    );
    let config = config.to_str().unwrap();
    let args =
        ["launch", "--nproc", "3", "--", "run", "--preset", "wan-tiny", "--steps", "2", "--json", "--config", config];
    let o = wf(&args, &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "stdout: {out}\nstderr: {err}");
    let json: String = out.lines().map(|l| l.strip_prefix("[rank 0] ").expect("rank 0 only")).collect();
    let v: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(v["pipeline"], "wan-tiny");
    assert_eq!(v["world"], 3);
    assert_eq!(v["depth"], 1);
    assert_eq!(v["chunk_bytes"], 4096);
    assert_eq!(v["outputs_match"], true, "one name for one fact, as a single-process run reports it");
    assert_eq!(v["hazard_violations"], 0);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["rank"], r);
        assert_eq!(rank["outputs_match"], true);
        assert_eq!(rank["checksum"], v["resident_checksum"]);
        assert_eq!(rank["hazard_violations"], 0);
        assert_eq!(rank["all_gathers"], ranks[0]["all_gathers"]);
        // The run keeps only the shards of the DiT on host, then restores the weights by gathers of its own.
        let shards = rank["shard_host_bytes"].as_u64().unwrap();
        assert!(shards > 0, "{rank}");
        assert_eq!(rank["dit_host_bytes_while_running"].as_u64(), Some(shards), "{rank}");
        let restore = rank["restore_all_gathers"].as_u64().unwrap();
        assert!(restore > 0 && restore == ranks[0]["restore_all_gathers"].as_u64().unwrap(), "{rank}");
    }
}

#[test]
fn a_failing_rank_fails_the_launch_naming_it() {
    let args = ["launch", "--nproc", "3", "--", "run", "--steps", "2", "--inject-gather-failure", "1:5"];
    let o = wf(&args, &[]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().last(), Some("error: rank 1 failed (exit status 1); the other ranks were stopped"), "{err}");
    let line = err.lines().find(|l| l.starts_with("[rank 1] error: ")).unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.starts_with("[rank 1] error: rank 1: the distributed run failed: rank 1: collective poisoned"),
        "{line}"
    );
    assert!(line.contains("AllGather #5 failed on rank 1: injected AllGather failure"), "{line}");
    assert!(line.ends_with("the pipeline must be reloaded"), "{line}");
}

#[test]
fn the_warm_up_gather_failing_fails_the_launch_too() {
    let args = ["launch", "--nproc", "2", "--", "run", "--steps", "1", "--inject-gather-failure", "0:0"];
    let o = wf(&args, &[]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().last(), Some("error: rank 0 failed (exit status 1); the other ranks were stopped"), "{err}");
}

/// Exit code 2 and exactly `expected` on stderr (one line), nothing on stdout.
fn invalid(args: &[&str], env: &[(&str, &str)], expected: &str) {
    let o = wf(args, env);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?} {env:?}: {err}");
    assert_eq!(err.trim_end(), expected, "{args:?} {env:?}");
    assert!(o.stdout.is_empty(), "{args:?}");
}

#[test]
fn a_bad_launch_environment_is_an_exact_error() {
    invalid(
        &["run"],
        &[("RANK", "5"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")],
        "error: RANK=5 is not below WORLD_SIZE=2; ranks run from 0 to 1, one per process",
    );
    invalid(
        &["run"],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500")],
        "error: MASTER_ADDR is not set but WORLD_SIZE=2 asks for a distributed run; set MASTER_ADDR to the address \
         of the rank-0 host, reachable from every rank",
    );
    invalid(
        &["run"],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "99999")],
        "error: MASTER_PORT=\"99999\" is not a TCP port; use a free port in 1..=65535 (the same on every rank)",
    );
    invalid(
        &["run"],
        &[("WORLD_SIZE", "two")],
        "error: WORLD_SIZE=\"two\" is not a positive integer; set WORLD_SIZE to the number of processes (one per GPU)",
    );
}

#[test]
fn a_config_group_that_does_not_match_world_size_is_an_exact_error() {
    let config = temp(
        "dp4.json",
        r#"{"data_parallel_size": 4, "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather"}}}}"#,
    );
    invalid(
        &["run", "--config", config.to_str().unwrap()],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")],
        "error: the config gathers the DiT across an offload group of 4 rank(s), but WORLD_SIZE=2; set \
         data_parallel_size (or sequence_parallel_size) to 2 with \
         diffusion_offload_config.layer_options.dit.weight_transfer = \"allgather\", or launch 4 process(es)",
    );
    invalid(
        &["run", "--trace", "t.json"],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")],
        "error: --trace in a distributed run needs --platform cuda (it records the GPU's timing events; the \
         simulated device has none): remove --trace, or run on GPUs",
    );
    if cfg!(feature = "nccl") {
        invalid(
            &["run", "--platform", "cuda", "--trace", "t.json"],
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")],
            "error: --trace in a distributed run needs --time-steps LO,HI (it traces one more LO-step execution \
             after the timed ones)",
        );
    }
    invalid(
        &["run", "--inject-gather-failure", "0:1"],
        &[],
        "error: --inject-gather-failure applies only to a distributed run (WORLD_SIZE > 1, e.g. under weightferry \
         launch)",
    );
    for engine in ["kernel", "copy-engine"] {
        invalid(
            &["run", "--allgather-engine", engine],
            &[],
            "error: --allgather-engine applies only to a distributed run on --platform cuda (WORLD_SIZE > 1, e.g. \
             under weightferry launch)",
        );
    }
    invalid(
        &["run", "--allgather-engine", "copy-engine"],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")],
        "error: --allgather-engine copy-engine needs --platform cuda (the simulated device has no NCCL): remove it, \
         or run on GPUs",
    );
}

#[test]
fn launch_needs_a_command() {
    let o = wf(&["launch", "--nproc", "2"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o.stderr).trim_end(),
        "error: launch needs the command every rank runs, after `--`: e.g. weightferry launch --nproc 2 -- run \
         --preset flux-tiny"
    );
    // A rank named by the failure injection must be in the run.
    let o = wf(&["launch", "--nproc", "2", "--", "run", "--steps", "1", "--inject-gather-failure", "5:1"], &[]);
    assert_ne!(o.status.code(), Some(0));
    let err = text(&o.stderr);
    assert!(
        err.contains(
            "error: --inject-gather-failure 5:…: rank 5 is not in this run of 2 ranks (0..1); name a rank below 2"
        ),
        "{err}"
    );
    let o = wf(&["launch", "--nproc", "0", "--", "run"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
}

/// The JSON object rank 0 printed (every line prefixed `[rank 0] `).
fn rank0_json(out: &str) -> Value {
    let json: String = out.lines().map(|l| l.strip_prefix("[rank 0] ").expect("rank 0 only")).collect();
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"))
}

#[test]
fn a_timed_launch_reports_step_time_bytes_per_step_and_bounds_in_json() {
    let args = ["launch", "--nproc", "2", "--", "run", "--time-steps", "1,3", "--sim-h2d-gbps", "0.05", "--json"];
    let o = wf(&args, &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "stdout: {out}\nstderr: {err}");
    let v = rank0_json(&out);
    assert_eq!(v["steps"], 3, "the HI run is the one compared");
    assert_eq!(v["outputs_match"], true);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let f = |x: &Value, k: &str| x[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {x}"));
    let u = |x: &Value, k: &str| x[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {x}"));
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["outputs_match"], true, "rank {r}");
        assert_eq!(rank["checksum"], v["resident_checksum"], "rank {r}");
        // Every block AllGather went between the stacks' shared buffers; the warm-up and the restore did not.
        assert_eq!(u(rank, "windowed_all_gathers"), u(rank, "all_gathers") - 1, "rank {r}: {rank}");
        assert!(u(rank, "restore_all_gathers") > 0, "rank {r}: {rank}");
        let t = &rank["timing"];
        assert!(f(t, "step_s") > 0.0, "rank {r}: {t}");
        assert!(f(t, "hi_s") > f(t, "lo_s"), "rank {r}: {t}");
        assert!((f(t, "step_s") - (f(t, "hi_s") - f(t, "lo_s")) / 2.0).abs() < 1e-9, "rank {r}: {t}");
        assert!(f(t, "resident_step_s").is_finite(), "rank {r}: {t}");
        assert_eq!(f(t, "h2d_bytes_per_s"), 5e7, "rank {r}");
        // One step copies every block's shard once: the shard bytes of one pass.
        let shard = u(t, "shard_bytes_per_step");
        assert_eq!(shard, u(rank, "shard_host_bytes"), "rank {r}: {t}");
        // What it measured held only the shards of the DiT on host.
        assert_eq!(u(rank, "dit_host_bytes_while_running"), shard, "rank {r}: {rank}");
        assert_eq!(u(t, "gathered_bytes_per_step"), 2 * shard, "rank {r}");
        let full = u(t, "full_bytes_per_step");
        assert!(full <= 2 * shard && full + 4096 > 2 * shard, "rank {r}: full {full}, shard {shard}");
        // The simulated copies are throttled to 0.05 GB/s, so a step cannot be much faster than its shards' copies.
        assert!(f(t, "step_s") > 0.25 * shard as f64 / 5e7, "rank {r}: {t}");
        let bound = f(t, "resident_step_s").max(shard as f64 / 5e7);
        assert!((f(t, "bound_s") - bound).abs() < 1e-12, "rank {r}: {t}");
        assert!((f(t, "ratio") - f(t, "step_s") / bound).abs() < 1e-9, "rank {r}: {t}");
        let single = f(t, "resident_step_s").max(full as f64 / 5e7);
        assert!((f(t, "single_gpu_bound_s") - single).abs() < 1e-12, "rank {r}: {t}");
        assert!(f(t, "single_gpu_bound_s") >= f(t, "bound_s"), "rank {r}: {t}");
    }
    let g = &v["timing"];
    assert_eq!(g["steps"], serde_json::json!([1, 3]));
    let slowest = ranks.iter().map(|r| f(&r["timing"], "step_s")).fold(0.0, f64::max);
    assert_eq!(f(g, "step_s"), slowest);
    assert_eq!(u(g, "shard_bytes_per_step"), u(&ranks[0]["timing"], "shard_bytes_per_step"));
    assert_eq!(u(g, "full_bytes_per_step"), u(&ranks[0]["timing"], "full_bytes_per_step"));
    assert!(f(g, "bound_s") > 0.0 && f(g, "ratio") > 0.0, "{g}");
    assert!((f(g, "ratio_to_single_gpu_bound") - f(g, "step_s") / f(g, "single_gpu_bound_s")).abs() < 1e-9);
    assert_eq!(g["single_gpu_command"], "weightferry bench --preset flux-tiny --steps 1,3 --depths 2 --budgets none");
}

#[test]
fn a_timed_launch_prints_a_timing_line_per_rank_the_group_and_the_single_gpu_command() {
    let args = ["launch", "--nproc", "2", "--", "run", "--preset", "wan-tiny", "--time-steps", "1,2"];
    let o = wf(&args, &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "stdout: {out}\nstderr: {err}");
    let lines: Vec<&str> = out.lines().map(|l| l.strip_prefix("[rank 0] ").expect("rank 0 only")).collect();
    assert_eq!(lines.len(), 8, "{out}");
    assert!(
        lines[0].starts_with(
            "weightferry distributed run: wan-tiny on 2 sim ranks (one process each), timed steps 1,2 after a warm-up \
             step, depth 2"
        ),
        "{out}"
    );
    assert!(lines[3].starts_with("rank 0 timing: ") && lines[3].contains(" s/step (LO "), "{out}");
    assert!(lines[3].contains("pinned H2D") && lines[3].contains(", bound "), "{out}");
    assert!(lines[4].starts_with("rank 1 timing: "), "{out}");
    assert!(lines[5].starts_with("all 2 ranks bit-exact with the resident run"), "{out}");
    assert!(lines[6].starts_with("group: ") && lines[6].contains("single-GPU bound"), "{out}");
    assert_eq!(
        lines[7],
        "single-GPU layerwise of the same preset: weightferry bench --preset wan-tiny --steps 1,2 --depths 2 \
         --budgets none (its depth=2 row)"
    );
}

#[test]
fn timed_rounds_report_the_median_round_and_the_range_in_json_and_text() {
    let args = ["launch", "--nproc", "2", "--", "run", "--time-steps", "1,2", "--time-rounds", "3", "--json"];
    let o = wf(&args, &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "stdout: {out}\nstderr: {err}");
    let v = rank0_json(&out);
    assert_eq!(v["outputs_match"], true);
    for (r, rank) in v["ranks"].as_array().unwrap().iter().enumerate() {
        let t = &rank["timing"];
        assert_eq!(t["rounds"], 3, "rank {r}: {t}");
        let (min, step, max) =
            (t["step_min_s"].as_f64().unwrap(), t["step_s"].as_f64().unwrap(), t["step_max_s"].as_f64().unwrap());
        assert!(min <= step && step <= max, "rank {r}: {t}");
        // The reported LO / HI pair is the median round's: its step is the reported step.
        assert!((step - (t["hi_s"].as_f64().unwrap() - t["lo_s"].as_f64().unwrap())).abs() < 1e-9, "rank {r}: {t}");
    }
    let o = wf(&["launch", "--nproc", "2", "--", "run", "--time-steps", "1,2", "--time-rounds", "2"], &[]);
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}");
    let line = out.lines().find(|l| l.starts_with("[rank 0] rank 1 timing: ")).expect("rank 1's timing line");
    assert!(line.contains("; median of 2 rounds, ") && line.contains(" s/step), resident "), "{line}");
    let env = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    invalid(
        &["run", "--time-rounds", "2"],
        &env,
        "error: --time-rounds repeats the timed executions of --time-steps LO,HI: add --time-steps, or remove \
         --time-rounds",
    );
    invalid(
        &["run", "--time-rounds", "2"],
        &[],
        "error: --time-rounds applies only to a distributed run with --time-steps (WORLD_SIZE > 1, e.g. under \
         weightferry launch); on one GPU, weightferry bench --rounds repeats configurations",
    );
}

#[test]
fn bad_time_steps_are_an_exact_error_naming_the_flag() {
    let env = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    for bad in ["3,1", "2,2", "0,2", "1", "a,3", "1,2,3", ""] {
        invalid(
            &["run", "--time-steps", bad],
            &env,
            &format!(
                "error: --time-steps {bad:?}: expected two step counts LO,HI with 1 <= LO < HI <= 100000, e.g. 1,3"
            ),
        );
    }
    invalid(
        &["run", "--time-steps", "1,3"],
        &[],
        "error: --time-steps applies only to a distributed run (WORLD_SIZE > 1, e.g. under weightferry launch); on \
         one GPU, weightferry bench times layerwise offload",
    );
}

/// `WORLD_SIZE` past the rendezvous' limit, or `MASTER_ADDR` with a port, is an exact exit-2 error at once (no
/// allocation for the world, no 60 s of retries).
#[test]
fn a_huge_world_size_or_a_master_addr_with_a_port_is_an_exact_error_at_once() {
    let t = std::time::Instant::now();
    for world in ["4000000000", "100000000"] {
        invalid(
            &["run"],
            &[("RANK", "1"), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")],
            &format!(
                "error: WORLD_SIZE={world} is more ranks than a weightferry run supports (at most 16384: rank 0's \
                 rendezvous holds one connection per rank); set WORLD_SIZE to the number of processes (one per GPU)"
            ),
        );
    }
    invalid(
        &["run"],
        &[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1:5"), ("MASTER_PORT", "29500")],
        "error: MASTER_ADDR=\"127.0.0.1:5\" is not a host name or IP address (it has a ':', but a port belongs in \
         MASTER_PORT); set MASTER_ADDR to the rank-0 host alone (e.g. 10.0.0.1, node0 or ::1) and its port in \
         MASTER_PORT",
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t.elapsed());
}

/// Two ranks started by hand (no launcher), each running `pipe.json` from its own directory, with widths 32 and 16
/// (same name, other content); `run_id`: their `WEIGHTFERRY_RUN_ID`.
fn ranks_with_differing_pipelines(tag: &str, run_id: Option<&str>) -> Vec<std::process::Child> {
    let pipeline = |width: u32| {
        format!(
            r#"{{"class": "P", "modules": {{"transformer": {{"class": "DiT", "children": {{
                "blocks": {{"repeat": 2, "block": {{"class": "Block", "children": {{"fc": {{"class": "Linear",
                    "tensors": {{"weight": {{"dtype": "bf16", "shape": [32, {width}]}}}}}}}}}}}}}}}}}}}}"#
        )
    };
    let base = std::env::temp_dir().join(format!("weightferry-dist-cli-{}-{tag}", std::process::id()));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    [32u32, 16]
        .iter()
        .enumerate()
        .map(|(rank, &width)| {
            let dir = base.join(format!("rank{rank}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("pipe.json"), pipeline(width)).unwrap();
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_weightferry"));
            c.args(["run", "--pipeline", "pipe.json", "--steps", "1"]).current_dir(&dir).env_remove("RUST_LOG");
            for v in weightferry::dist::LaunchEnv::VARS {
                c.env_remove(v);
            }
            let rank = rank.to_string();
            c.envs([("RANK", rank.as_str()), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")]);
            if let Some(id) = run_id {
                c.env("WEIGHTFERRY_RUN_ID", id);
            }
            c.env("MASTER_PORT", &port).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            c.spawn().unwrap()
        })
        .collect()
}

/// A pipeline file named alike on both ranks (`pipe.json` in each rank's own directory) whose content differs
/// fails the rank check at the rendezvous, naming the field, before any AllGather (the ranks share a run id).
#[test]
fn pipeline_files_that_share_a_name_but_differ_fail_the_rank_check() {
    let children = ranks_with_differing_pipelines("fp", Some("run-fp"));
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for (rank, o) in outs.iter().enumerate() {
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "rank {rank}: {err}");
        let line = err.lines().last().unwrap_or_default();
        assert!(
            line.starts_with("error: rank 1 does not run what rank 0 runs: pipeline_content differs (rank 1: \""),
            "rank {rank}: {err}"
        );
        assert!(
            line.ends_with("; launch every rank with the same arguments and the same pipeline and config files"),
            "rank {rank}: {err}"
        );
        assert!(!line.contains("pipeline differs") && !line.contains("steps differs"), "{line}");
    }
}

/// Without a run id, rank 0 cannot tell a rank that runs something else from a stranger: rank 1's hello carries
/// another rank-check fingerprint, so rank 0 refuses it at once (rank 1 exits 1 saying why) and keeps waiting for
/// a rank 1 that runs its pipeline (the test stops it).
#[test]
fn without_a_run_id_a_rank_of_another_pipeline_is_refused_at_its_hello() {
    let t = std::time::Instant::now();
    let mut children = ranks_with_differing_pipelines("fp-none", None);
    let rank1 = children.pop().unwrap().wait_with_output().unwrap();
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "rank 1 took {:?}", t.elapsed());
    let err = text(&rank1.stderr);
    assert_eq!(rank1.status.code(), Some(1), "{err}");
    let line = err.lines().last().unwrap_or_default();
    assert!(
        line.starts_with("error: rank 1: rendezvous: rank 0 refused the hello of this rank 1: rank 1 has fingerprint "),
        "{err}"
    );
    assert!(
        line.ends_with(
            " (they run different things), and without a run id rank 0 takes it for a stranger; launch every rank \
             with the same arguments and files, and every rank of one run with the same WEIGHTFERRY_RUN_ID"
        ),
        "{err}"
    );
    let mut rank0 = children.pop().unwrap();
    assert!(rank0.try_wait().unwrap().is_none(), "rank 0 failed because of a refused hello");
    rank0.kill().unwrap();
    rank0.wait().unwrap();
}
