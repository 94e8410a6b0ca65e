//! `weightferry launch --nproc N -- <command>`: runs `N` copies of a program on this machine as the ranks of one
//! distributed run, the way torchrun does for one node. Child `i` gets `RANK = LOCAL_RANK = i`, `WORLD_SIZE = N`,
//! `MASTER_ADDR = 127.0.0.1` (so rank 0 listens on loopback only), `MASTER_PORT` (the given port, or a free one)
//! and a fresh `WEIGHTFERRY_RUN_ID`; every line it prints is forwarded with a `[rank i] ` prefix (stdout to stdout,
//! stderr to stderr).
//!
//! It runs on tokio (the control plane): one current-thread runtime waits on every child, every output pipe and,
//! with [`launch_forwarding_signals`], on SIGINT and SIGTERM, all as events; children are spawned with
//! kill-on-drop, so no rank outlives launch even if it unwinds.
//!
//! Invariant: launch returns only after every child has exited and its output has been forwarded (or, if a
//! grandchild keeps a pipe open, [`OUTPUT_GRACE`] later); when a child fails (non-zero exit or a signal), every
//! other child still running is killed, and the error names the first rank that failed on its own and how. A rank
//! that stopped only because another one failed exits with [`PEER_FAILED_EXIT`]; launch then waits up to
//! [`ROOT_CAUSE_GRACE`] for a rank that failed otherwise and names that one — or, if a rank is stopped, names the
//! stopped rank. A stopped rank (state `T` or `t` in `/proc/<pid>/stat`: SIGSTOP, SIGTSTP or a debugger; Linux) is
//! noticed within [`STOP_POLL`] (at once on SIGCHLD) and said on stderr with its pid, as is its continuing. A SIGINT
//! or SIGTERM to launch is sent to every rank (a stopped rank also gets SIGCONT, so it acts on it); ranks still
//! running [`SIGNAL_GRACE`] later (or at a second signal) are killed.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

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

/// How long ranks have to exit after launch forwarded a SIGINT or SIGTERM to them, before they are killed.
pub const SIGNAL_GRACE: Duration = Duration::from_secs(3);

/// How often launch looks for stopped ranks (besides at every SIGCHLD, which a debugger's stop does not send).
pub const STOP_POLL: Duration = Duration::from_millis(250);

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
    /// A rank was stopped (SIGSTOP, SIGTSTP or a debugger) and the others gave up waiting for it.
    #[error(
        "rank {rank} (pid {pid}) was stopped (SIGSTOP or a debugger) and stopped answering; rank {waiting} gave up \
         waiting for it ({status}); every rank was stopped"
    )]
    Stopped {
        /// The stopped rank.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// The first rank that failed because of it.
        waiting: usize,
        /// How that rank ended.
        status: String,
    },
    /// Launch itself got SIGINT or SIGTERM; it sent it to every rank and waited for them.
    #[error(
        "weightferry launch got {signal}: sent it to every rank and stopped them all ({ended}); exit code {}",
        128 + signal_number(signal)
    )]
    Signalled {
        /// `SIGINT` or `SIGTERM`.
        signal: &'static str,
        /// How the ranks ended, e.g. `rank 0: killed by signal 15 (SIGTERM), rank 1: …`.
        ended: String,
    },
    /// The async runtime of launch could not start.
    #[error("cannot start launch's runtime: {0}")]
    Runtime(String),
    /// Waiting for a child failed.
    #[error("cannot wait for rank {rank}: {reason}")]
    Wait {
        /// The rank.
        rank: usize,
        /// What the OS said.
        reason: String,
    },
}

/// The number of `SIGINT` (2) or `SIGTERM` (15).
pub fn signal_number(name: &str) -> i32 {
    match name {
        "SIGINT" => 2,
        _ => 15,
    }
}

/// The name of a common signal.
fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => return None,
    })
}

/// `exit status N` or `killed by signal N (SIGNAME)`.
pub fn describe_status(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit status {code}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return match signal_name(sig) {
                Some(name) => format!("killed by signal {sig} ({name})"),
                None => format!("killed by signal {sig}"),
            };
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

/// Forwards every line of `from` to stdout (`to_stderr` false) or stderr with `prefix` (bytes pass through).
async fn forward(from: impl AsyncRead + Unpin, prefix: String, to_stderr: bool) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let write = |out: &mut dyn Write| {
                    let _ =
                        out.write_all(prefix.as_bytes()).and_then(|()| out.write_all(&line)).and_then(|()| out.flush());
                };
                if to_stderr {
                    write(&mut std::io::stderr().lock());
                } else {
                    write(&mut std::io::stdout().lock());
                }
            }
        }
    }
}

/// What launch asks of the task that owns one child.
#[derive(Debug, Clone, Copy)]
enum Order {
    /// Send this signal (SIGINT, SIGTERM).
    Signal(i32),
    /// SIGKILL.
    Kill,
}

/// Owns one child: waits for it, and carries out launch's orders while it runs (a signal goes only to a child
/// not yet reaped, so never to a recycled pid). Reports `(rank, status)`.
async fn own(
    rank: usize,
    mut child: Child,
    mut orders: mpsc::UnboundedReceiver<Order>,
    done: mpsc::UnboundedSender<(usize, std::io::Result<ExitStatus>)>,
) {
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            order = orders.recv() => match order {
                Some(Order::Signal(sig)) => {
                    send_signal(&child, sig);
                    // A stopped process acts on nothing but SIGKILL until it continues.
                    if child.id().is_some_and(is_stopped) {
                        send_signal(&child, libc::SIGCONT);
                    }
                }
                Some(Order::Kill) | None => {
                    let _ = child.start_kill();
                    break child.wait().await;
                }
            },
        }
    };
    let _ = done.send((rank, status));
}

/// Sends `sig` to `child` if it has not been reaped.
fn send_signal(child: &Child, sig: i32) {
    #[cfg(unix)]
    if let Some(pid) = child.id().and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: kill(2) takes plain integers and touches no memory of this process; `pid` is a child that has
        // not been reaped yet (tokio's `Child::id` is `None` once it has), so it cannot be a recycled pid.
        unsafe {
            libc::kill(pid, sig);
        }
    }
    #[cfg(not(unix))]
    let _ = (child, sig);
}

/// Whether process `pid` is stopped: state `T` (by a signal) or `t` (by a debugger) in `/proc/<pid>/stat`; Linux
/// only, else never.
fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    stat_is_stopped(&stat)
}

/// Whether a `/proc/<pid>/stat` line has state `T` or `t` (the field after the command name, which may itself hold
/// spaces and parentheses).
fn stat_is_stopped(stat: &str) -> bool {
    matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('T' | 't'))
}

/// Looks at every live rank (`pids`) and says on stderr which ones stopped or continued since the last look
/// (`stopped`, updated).
fn watch_stopped(pids: &[Option<u32>], stopped: &mut [bool]) {
    for (rank, pid) in pids.iter().enumerate() {
        let Some(pid) = *pid else {
            stopped[rank] = false;
            continue;
        };
        let now = is_stopped(pid);
        if now && !stopped[rank] {
            eprintln!(
                "weightferry launch: rank {rank} (pid {pid}) is stopped (SIGSTOP or a debugger); the other ranks wait \
                 for it until their rendezvous timeout (send it SIGCONT to go on)"
            );
        } else if !now && stopped[rank] {
            eprintln!("weightferry launch: rank {rank} (pid {pid}) continues");
        }
        stopped[rank] = now;
    }
}

/// Runs the ranks of `spec` and waits for them; see the module docs. SIGINT and SIGTERM keep their usual effect on
/// this process (use [`launch_forwarding_signals`] to forward them to the ranks).
pub fn launch(spec: &LaunchSpec) -> Result<(), LaunchError> {
    launch_with(spec, false)
}

/// [`launch()`], and a SIGINT or SIGTERM to this process is sent to every rank; launch then waits up to
/// [`SIGNAL_GRACE`] for them (killing the rest), and fails with [`LaunchError::Signalled`]. It installs
/// tokio's handlers for both signals for the rest of the process's life: meant for the `weightferry launch`
/// command, not for a host engine's process.
pub fn launch_forwarding_signals(spec: &LaunchSpec) -> Result<(), LaunchError> {
    launch_with(spec, true)
}

fn launch_with(spec: &LaunchSpec, forward_signals: bool) -> Result<(), LaunchError> {
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
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| LaunchError::Runtime(e.to_string()))?;
    rt.block_on(run(spec, port, forward_signals))
}

/// A fresh run id for one launch (its pid, the port and the time): rank 0 drops hellos of any other run.
fn run_id(port: u16) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("launch-{}-{port}-{nanos:x}", std::process::id())
}

/// A stream of one signal, or one that never fires (not forwarding, or the handler could not be installed).
struct SignalStream(Option<tokio::signal::unix::Signal>);

impl SignalStream {
    fn new(on: bool, kind: tokio::signal::unix::SignalKind) -> SignalStream {
        SignalStream(if on { tokio::signal::unix::signal(kind).ok() } else { None })
    }

    async fn recv(&mut self) {
        match &mut self.0 {
            Some(s) => {
                if s.recv().await.is_none() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }
}

async fn run(spec: &LaunchSpec, port: u16, forward_signals: bool) -> Result<(), LaunchError> {
    use tokio::signal::unix::SignalKind;
    let mut sigint = SignalStream::new(forward_signals, SignalKind::interrupt());
    let mut sigterm = SignalStream::new(forward_signals, SignalKind::terminate());
    // SIGCHLD also arrives when a child stops or continues: the moment to look for stopped ranks; a debugger's stop
    // sends none, so launch looks every STOP_POLL too.
    let mut sigchld = SignalStream::new(true, SignalKind::child());
    let mut poll = tokio::time::interval(STOP_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let run_id = run_id(port);
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let mut orders: Vec<Option<mpsc::UnboundedSender<Order>>> = Vec::with_capacity(spec.nproc);
    let mut pids: Vec<Option<u32>> = Vec::with_capacity(spec.nproc);
    let mut output = tokio::task::JoinSet::new();
    let mut spawn_error = None;
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
            .env("WEIGHTFERRY_RUN_ID", &run_id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                spawn_error = Some(LaunchError::Spawn {
                    rank,
                    program: spec.program.display().to_string(),
                    reason: e.to_string(),
                });
                break;
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            output.spawn(forward(out, prefix.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            output.spawn(forward(err, prefix, true));
        }
        pids.push(child.id());
        let (tx, rx) = mpsc::unbounded_channel();
        orders.push(Some(tx));
        tokio::spawn(own(rank, child, rx, done_tx.clone()));
    }
    drop(done_tx);
    let mut live = orders.len();
    let mut statuses: Vec<Option<String>> = vec![None; orders.len()];
    let order_all = |orders: &mut Vec<Option<mpsc::UnboundedSender<Order>>>, o: Order| {
        for tx in orders.iter().flatten() {
            let _ = tx.send(o);
        }
    };
    // The first failure of a rank on its own, else the first rank that failed because of another.
    let mut failure: Option<LaunchError> = spawn_error;
    let mut secondary: Option<(usize, String)> = None;
    let mut signalled: Option<&'static str> = None;
    let mut stopped: Vec<bool> = vec![false; orders.len()];
    let far = tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);
    let mut grace_end = far;
    let mut kill_at = far;
    while failure.is_none() && live > 0 {
        tokio::select! {
            done = done_rx.recv() => {
                let Some((rank, status)) = done else { break };
                live -= 1;
                orders[rank] = None;
                pids[rank] = None;
                match status {
                    Ok(status) => {
                        let text = describe_status(status);
                        statuses[rank] = Some(text.clone());
                        if status.success() || signalled.is_some() {
                            continue;
                        }
                        if status.code() == Some(PEER_FAILED_EXIT) {
                            if secondary.is_none() {
                                secondary = Some((rank, text));
                                grace_end = tokio::time::Instant::now() + ROOT_CAUSE_GRACE;
                            }
                        } else {
                            failure = Some(LaunchError::RankFailed { rank, status: text });
                        }
                    }
                    Err(e) => failure = Some(LaunchError::Wait { rank, reason: e.to_string() }),
                }
            }
            () = sigint.recv() => {
                if signalled.is_some() { order_all(&mut orders, Order::Kill) } else {
                    signalled = Some("SIGINT");
                    order_all(&mut orders, Order::Signal(2));
                    kill_at = tokio::time::Instant::now() + SIGNAL_GRACE;
                }
            }
            () = sigterm.recv() => {
                if signalled.is_some() { order_all(&mut orders, Order::Kill) } else {
                    signalled = Some("SIGTERM");
                    order_all(&mut orders, Order::Signal(15));
                    kill_at = tokio::time::Instant::now() + SIGNAL_GRACE;
                }
            }
            () = sigchld.recv() => watch_stopped(&pids, &mut stopped),
            _ = poll.tick() => watch_stopped(&pids, &mut stopped),
            () = tokio::time::sleep_until(grace_end) => break,
            () = tokio::time::sleep_until(kill_at) => {
                order_all(&mut orders, Order::Kill);
                kill_at = far;
            }
        }
        // A rank that gave up on its peers while one of them is stopped: the stopped one is the cause.
        if let (Some((waiting, status)), Some(rank)) = (&secondary, stopped.iter().position(|&s| s)) {
            if let (None, Some(pid)) = (&failure, pids[rank]) {
                failure = Some(LaunchError::Stopped { rank, pid, waiting: *waiting, status: status.clone() });
            }
        }
    }
    let failure = failure.or(secondary.map(|(rank, status)| LaunchError::RankFailed { rank, status }));
    // Stop every child still running and reap it (SIGKILL also ends a stopped process).
    order_all(&mut orders, Order::Kill);
    while live > 0 {
        match tokio::time::timeout(Duration::from_secs(10), done_rx.recv()).await {
            Ok(Some((rank, status))) => {
                live -= 1;
                if let Ok(s) = status {
                    statuses[rank].get_or_insert(describe_status(s));
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    // Every child has exited; its output ends when its pipes close. A grandchild it left behind may hold them
    // open: forwarding stops waiting after a grace period (its tasks end with the runtime).
    let _ = tokio::time::timeout(OUTPUT_GRACE, async { while output.join_next().await.is_some() {} }).await;
    if let Some(signal) = signalled {
        let ended = statuses
            .iter()
            .enumerate()
            .map(|(r, s)| format!("rank {r}: {}", s.as_deref().unwrap_or("not reaped")))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(LaunchError::Signalled { signal, ended });
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_is_stopped_in_state_t_or_t_after_the_command_name() {
        assert!(stat_is_stopped("4242 (weightferry) T 1 4242 4242 0 -1"));
        assert!(stat_is_stopped("4242 (gdb target) t 1 4242"));
        // The command name may hold ") T" itself: the state is after the last parenthesis.
        assert!(!stat_is_stopped("4242 (a) T (b) S 1 4242"));
        assert!(!stat_is_stopped("4242 (weightferry) S 1 4242"));
        assert!(!stat_is_stopped("4242 (weightferry) R 1"));
        assert!(!stat_is_stopped(""));
        assert!(!is_stopped(u32::MAX));
    }
}
