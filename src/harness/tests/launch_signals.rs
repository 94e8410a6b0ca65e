//! `weightferry launch` as a process under signals, with two ranks of a long distributed run on the simulated
//! device (throttled copies): a SIGTERM or SIGINT to launch is sent to every rank, every rank process is gone within
//! 5 s, and launch exits 128 + the signal naming it; a rank killed with SIGKILL makes launch stop the other rank
//! and exit 1 naming the killed one, leaving no rank process behind.

#![cfg(target_os = "linux")]

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Variables of the launch environment; removed so the test's own environment cannot leak in.
const LAUNCH_VARS: [&str; 8] =
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"];

/// Starts `launch --nproc 2` of a run that lasts minutes; returns it and its two rank pids (found through
/// `/proc/*/stat`, once both ranks have been running for a moment).
fn start_long_launch() -> (Child, Vec<u32>) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weightferry"));
    c.args(["launch", "--nproc", "2", "--", "run", "--steps", "100000", "--sim-h2d-gbps", "0.01"]);
    c.env_remove("RUST_LOG").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for v in LAUNCH_VARS {
        c.env_remove(v);
    }
    let mut launch = c.spawn().expect("spawn launch");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = launch.try_wait().unwrap() {
            let mut err = String::new();
            launch.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            panic!("launch ended early ({status}): {err}");
        }
        let ranks = children_of(launch.id());
        if ranks.len() == 2 {
            // Let both ranks get past the rendezvous into the run.
            std::thread::sleep(Duration::from_millis(500));
            return (launch, ranks);
        }
        assert!(Instant::now() < deadline, "launch did not start 2 ranks: {ranks:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out.sort_unstable();
    out
}

fn kill(pid: u32, signal: &str) {
    let ok = Command::new("kill").args([format!("-{signal}"), pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill -{signal} {pid}");
}

/// Waits (at most 5 s) for `launch` to exit; its exit code and stderr.
fn finish_within_5s(mut launch: Child) -> (Option<i32>, String) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = launch.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = launch.kill();
            panic!("launch did not exit within 5 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    launch.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code(), err)
}

/// Every pid in `pids` is gone (reaped, not a zombie) within 5 s.
fn assert_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|p| std::path::Path::new(&format!("/proc/{p}")).exists()) {
        assert!(Instant::now() < deadline, "rank processes left behind: {pids:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal_to_launch(signal: &str, number: i32) {
    let (launch, ranks) = start_long_launch();
    kill(launch.id(), signal);
    let (code, err) = finish_within_5s(launch);
    assert_gone(&ranks);
    assert_eq!(code, Some(128 + number), "{err}");
    assert_eq!(
        err.lines().last(),
        Some(
            format!(
                "error: weightferry launch got SIG{signal}: sent it to every rank and stopped them all (rank 0: killed \
                 by signal {number} (SIG{signal}), rank 1: killed by signal {number} (SIG{signal})); exit code {}",
                128 + number
            )
            .as_str()
        ),
        "{err}"
    );
}

#[test]
fn sigterm_to_launch_reaches_every_rank() {
    signal_to_launch("TERM", 15);
}

#[test]
fn sigint_to_launch_reaches_every_rank() {
    signal_to_launch("INT", 2);
}

#[test]
fn a_rank_killed_with_sigkill_stops_the_others_and_is_named() {
    let (launch, ranks) = start_long_launch();
    // The rank whose RANK is 1.
    let rank1 = *ranks
        .iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default().split(|&b| b == 0).any(|v| v == b"RANK=1")
        })
        .expect("rank 1's process");
    kill(rank1, "KILL");
    let (code, err) = finish_within_5s(launch);
    assert_gone(&ranks);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(
        err.lines().last(),
        Some("error: rank 1 failed (killed by signal 9 (SIGKILL)); the other ranks were stopped"),
        "{err}"
    );
}
