//! `weightferry launch --nproc N -- <command>`: runs `N` copies of a program on this machine as the ranks of one
//! distributed run, the way torchrun does for one node. Child `i` gets `RANK = LOCAL_RANK = i`, `WORLD_SIZE = N`,
//! `MASTER_ADDR = 127.0.0.1` and `MASTER_PORT` (the given port, or a free one); every line it prints is forwarded
//! with a `[rank i] ` prefix (stdout to stdout, stderr to stderr).
//!
//! Invariant: launch returns only after every child has exited and its output has been forwarded (or, if a
//! grandchild keeps a pipe open, [`OUTPUT_GRACE`] later); when a child fails (non-zero exit or a signal), every
//! other child still running is killed, and the error names the first rank that failed on its own and how. A rank
//! that stopped only because another one failed exits with [`PEER_FAILED_EXIT`]; launch then waits up to
//! [`ROOT_CAUSE_GRACE`] for a rank that failed otherwise and names that one.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// NCCL settings each rank gets unless the launching environment sets them: NVLink multicast stays off (it can
/// take a shared host's GPUs out of service), and NCCL uses at most 4 channels. Measured on 2×H200
/// (benches/RESULTS.md): 4 channels still move 102 GB/s of full blocks per GPU (the host's H2D is the limit) while
/// the AllGather's extra slowdown of GEMMs beside it drops from +6.8% (NCCL's default) to +1.9%.
pub const NCCL_DEFAULTS: [(&str, &str); 2] = [("NCCL_NVLS_ENABLE", "0"), ("NCCL_MAX_NCHANNELS", "4")];

/// Exit code of a rank that stopped because another rank failed (its rendezvous or collective broke).
pub const PEER_FAILED_EXIT: i32 = 3;

/// How long launch waits, after a rank exited with [`PEER_FAILED_EXIT`], for the rank that failed first.
pub const ROOT_CAUSE_GRACE: Duration = Duration::from_secs(3);

/// How long launch keeps forwarding output after every child exited (their pipes normally close at once).
pub const OUTPUT_GRACE: Duration = Duration::from_secs(2);

/// What to launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Processes (ranks).
    pub nproc: usize,
    /// Rendezvous port; `None` picks a free one.
    pub master_port: Option<u16>,
    /// The program every rank runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

/// Why a launch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// Zero processes asked for.
    #[error("--nproc 0: launch at least one process")]
    NoProcesses,
    /// Nothing to run.
    #[error("no command after `--`; e.g. `weightferry launch --nproc 2 -- run --preset flux-tiny`")]
    NoCommand,
    /// No free port could be found.
    #[error("cannot find a free TCP port for the rendezvous ({0}); pass --master-port")]
    NoPort(String),
    /// A child could not be started.
    #[error("cannot start rank {rank} ({program}): {reason}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: String,
        /// What the OS said.
        reason: String,
    },
    /// A child failed; the others were stopped.
    #[error("rank {rank} failed ({status}); the other ranks were stopped")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// How it ended (`exit status 1`, `killed by signal 9`).
        status: String,
    },
    /// Waiting for a child failed.
    #[error("cannot wait for rank {rank}: {reason}")]
    Wait {
        /// The rank.
        rank: usize,
        /// What the OS said.
        reason: String,
    },
}

/// `exit status N` or `killed by signal N`.
pub fn describe_status(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit status {code}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    status.to_string()
}

/// A free TCP port on the loopback interface (bound and released; another process could take it in between).
pub fn free_port() -> Result<u16, LaunchError> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| LaunchError::NoPort(e.to_string()))
}

/// Forwards every line of `from` to `to` with `prefix` (lossy UTF-8 is not needed: bytes pass through).
fn forward(from: impl Read, prefix: String, to: fn() -> Box<dyn Write>) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut out = to();
                let _ = out.write_all(prefix.as_bytes()).and_then(|()| out.write_all(&line)).and_then(|()| out.flush());
            }
        }
    }
}

fn stdout_sink() -> Box<dyn Write> {
    Box::new(std::io::stdout().lock())
}

fn stderr_sink() -> Box<dyn Write> {
    Box::new(std::io::stderr().lock())
}

/// Kills and reaps every child still running.
fn stop(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
    }
    for c in children.iter_mut() {
        if let Some(mut child) = c.take() {
            let _ = child.wait();
        }
    }
}

/// Runs the ranks of `spec` and waits for them; see the module docs.
pub fn launch(spec: &LaunchSpec) -> Result<(), LaunchError> {
    if spec.nproc == 0 {
        return Err(LaunchError::NoProcesses);
    }
    if spec.args.is_empty() {
        return Err(LaunchError::NoCommand);
    }
    let port = match spec.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let mut children: Vec<Option<Child>> = Vec::with_capacity(spec.nproc);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let mut forwarders = 0usize;
    for rank in 0..spec.nproc {
        let mut cmd = Command::new(&spec.program);
        for (k, v) in NCCL_DEFAULTS {
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
        let spawned = cmd
            .args(&spec.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", spec.nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(LaunchError::Spawn {
                    rank,
                    program: spec.program.display().to_string(),
                    reason: e.to_string(),
                });
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            let (p, done) = (prefix.clone(), done_tx.clone());
            std::thread::spawn(move || {
                forward(out, p, stdout_sink);
                let _ = done.send(());
            });
            forwarders += 1;
        }
        if let Some(err) = child.stderr.take() {
            let done = done_tx.clone();
            std::thread::spawn(move || {
                forward(err, prefix, stderr_sink);
                let _ = done.send(());
            });
            forwarders += 1;
        }
        children.push(Some(child));
    }
    // The first failure of a rank on its own, else the first rank that failed because of another.
    let mut failure: Option<LaunchError> = None;
    let mut secondary: Option<(LaunchError, Instant)> = None;
    while failure.is_none() && children.iter().any(Option::is_some) {
        let mut progressed = false;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            match child.try_wait() {
                Ok(None) => {}
                Ok(Some(status)) => {
                    progressed = true;
                    *slot = None;
                    if status.success() {
                        continue;
                    }
                    let e = LaunchError::RankFailed { rank, status: describe_status(status) };
                    if status.code() == Some(PEER_FAILED_EXIT) {
                        secondary.get_or_insert((e, Instant::now()));
                    } else {
                        failure = Some(e);
                        break;
                    }
                }
                Err(e) => {
                    failure = Some(LaunchError::Wait { rank, reason: e.to_string() });
                    break;
                }
            }
        }
        if secondary.as_ref().is_some_and(|(_, since)| since.elapsed() >= ROOT_CAUSE_GRACE) {
            break;
        }
        if !progressed && failure.is_none() {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let failure = failure.or(secondary.map(|(e, _)| e));
    stop(&mut children);
    // Every child has exited; its output ends when its pipes close. A grandchild it left behind may hold them
    // open: forwarding stops waiting after a grace period (the forwarding threads end with this process).
    let deadline = Instant::now() + OUTPUT_GRACE;
    for _ in 0..forwarders {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
