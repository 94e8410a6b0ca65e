//! `weightferry launch` as a process under signals, with two ranks of a long distributed run on the simulated
//! device (throttled copies): a SIGTERM or SIGINT to launch is sent to every rank, every rank process is gone within
//! 5 s, and launch exits 128 + the signal naming it; a rank killed with SIGKILL makes launch stop the other rank
//! and exit 1 naming the killed one, leaving no rank process behind; a rank stopped with SIGSTOP is said on stderr
//! within 2 s naming its pid (and its continuing after SIGCONT), and a SIGTERM to launch ends it too.

#![cfg(target_os = "linux")]

use std::io::{BufRead, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Starts `launch --nproc 2` of a run that lasts minutes; returns it and its two rank pids (found through
/// `/proc/*/stat`, once both ranks have been running for a moment).
fn start_long_launch() -> (Child, Vec<u32>) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weightferry"));
    c.args(["launch", "--nproc", "2", "--", "run", "--steps", "100000", "--sim-h2d-gbps", "0.01"]);
    c.env_remove("RUST_LOG").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for v in weightferry::dist::LaunchEnv::VARS {
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

/// Waits (at most 5 s) for `launch` to exit; its exit code.
fn exit_within_5s(launch: &mut Child) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(s) = launch.try_wait().unwrap() {
            return s.code();
        }
        if Instant::now() >= deadline {
            let _ = launch.kill();
            panic!("launch did not exit within 5 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most 5 s) for `launch` to exit; its exit code and stderr.
fn finish_within_5s(mut launch: Child) -> (Option<i32>, String) {
    let code = exit_within_5s(&mut launch);
    let mut err = String::new();
    launch.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (code, err)
}

/// Launch's stderr, line by line as it comes (read by a thread), and the lines seen so far.
struct Stderr(mpsc::Receiver<String>, Vec<String>);

impl Stderr {
    fn of(launch: &mut Child) -> Stderr {
        let err = std::io::BufReader::new(launch.stderr.take().unwrap());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || err.lines().map_while(Result::ok).try_for_each(|l| tx.send(l)));
        Stderr(rx, Vec::new())
    }

    /// The first line (from now on) that starts with `head`, within `within`.
    fn wait_for(&mut self, head: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.0.recv_timeout(left) {
                Ok(line) => {
                    self.1.push(line.clone());
                    if line.starts_with(head) {
                        return line;
                    }
                }
                Err(_) => panic!("no line starting with {head:?} within {within:?}; stderr so far: {:?}", self.1),
            }
        }
    }

    /// Every line, once the pipe closed (launch exited).
    fn all(mut self) -> Vec<String> {
        self.1.extend(self.0.iter());
        self.1
    }
}

/// The pid of the rank whose `RANK` is `rank`, among `ranks`.
fn rank_pid(ranks: &[u32], rank: usize) -> u32 {
    let var = format!("RANK={rank}");
    *ranks
        .iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .unwrap_or_default()
                .split(|&b| b == 0)
                .any(|v| v == var.as_bytes())
        })
        .expect("the rank's process")
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
    kill(rank_pid(&ranks, 1), "KILL");
    let (code, err) = finish_within_5s(launch);
    assert_gone(&ranks);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(
        err.lines().last(),
        Some("error: rank 1 failed (killed by signal 9 (SIGKILL)); the other ranks were stopped"),
        "{err}"
    );
}

/// The line launch prints when rank `rank` (pid `pid`) stopped.
fn stopped_line(rank: usize, pid: u32) -> String {
    format!(
        "weightferry launch: rank {rank} (pid {pid}) is stopped (SIGSTOP or a debugger); the other ranks wait for it \
         until their rendezvous timeout (send it SIGCONT to go on)"
    )
}

const SIGTERM_ENDED_ALL: &str = "error: weightferry launch got SIGTERM: sent it to every rank and stopped them all \
                                 (rank 0: killed by signal 15 (SIGTERM), rank 1: killed by signal 15 (SIGTERM)); exit \
                                 code 143";

/// A rank stopped with SIGSTOP is said within 2 s (not at the other ranks' 60 s rendezvous timeout), naming its
/// pid; after SIGCONT launch says it continues, and a SIGTERM to launch then ends every rank.
#[test]
fn a_stopped_rank_is_said_at_once_and_its_continuing_too() {
    let (mut launch, ranks) = start_long_launch();
    let mut err = Stderr::of(&mut launch);
    let rank1 = rank_pid(&ranks, 1);
    let t = Instant::now();
    kill(rank1, "STOP");
    assert_eq!(err.wait_for("weightferry launch: rank 1", Duration::from_secs(5)), stopped_line(1, rank1));
    assert!(t.elapsed() < Duration::from_secs(2), "launch said it after {:?}", t.elapsed());
    kill(rank1, "CONT");
    assert_eq!(
        err.wait_for("weightferry launch: rank 1", Duration::from_secs(5)),
        format!("weightferry launch: rank 1 (pid {rank1}) continues")
    );
    kill(launch.id(), "TERM");
    let code = exit_within_5s(&mut launch);
    assert_gone(&ranks);
    let lines = err.all();
    assert_eq!(code, Some(143), "{lines:?}");
    assert_eq!(lines.last().map(String::as_str), Some(SIGTERM_ENDED_ALL), "{lines:?}");
}

/// A SIGTERM to launch while a rank is stopped ends that rank too (launch sends it SIGCONT after the SIGTERM, so it
/// acts on it at once), and no rank process is left behind.
#[test]
fn sigterm_to_launch_ends_a_stopped_rank_too() {
    let (mut launch, ranks) = start_long_launch();
    let mut err = Stderr::of(&mut launch);
    let rank1 = rank_pid(&ranks, 1);
    kill(rank1, "STOP");
    assert_eq!(err.wait_for("weightferry launch: rank 1", Duration::from_secs(5)), stopped_line(1, rank1));
    let t = Instant::now();
    kill(launch.id(), "TERM");
    let code = exit_within_5s(&mut launch);
    assert_gone(&ranks);
    assert!(t.elapsed() < Duration::from_secs(2), "the stopped rank was waited for: {:?}", t.elapsed());
    let lines = err.all();
    assert_eq!(code, Some(143), "{lines:?}");
    assert_eq!(lines.last().map(String::as_str), Some(SIGTERM_ENDED_ALL), "{lines:?}");
}
