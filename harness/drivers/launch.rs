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

/// The signals launch waits on: SIGINT and SIGTERM when it forwards them, and SIGCHLD, which also arrives when a
/// child stops or continues (the moment to look for stopped ranks).
struct Signals {
    int: SignalStream,
    term: SignalStream,
    chld: SignalStream,
}

impl Signals {
    fn new(forward_signals: bool) -> Signals {
        use tokio::signal::unix::SignalKind;
        Signals {
            int: SignalStream::new(forward_signals, SignalKind::interrupt()),
            term: SignalStream::new(forward_signals, SignalKind::terminate()),
            chld: SignalStream::new(true, SignalKind::child()),
        }
    }
}

/// The spawned ranks: the channels to the tasks that own them (`None` once reaped), their pids (likewise), the
/// tasks forwarding their output, and the channel their owners report exits on.
struct Ranks {
    orders: Vec<Option<mpsc::UnboundedSender<Order>>>,
    pids: Vec<Option<u32>>,
    output: tokio::task::JoinSet<()>,
    done: mpsc::UnboundedReceiver<(usize, std::io::Result<ExitStatus>)>,
    /// Ranks not reaped yet.
    live: usize,
    /// How each rank ended, once it did.
    statuses: Vec<Option<String>>,
}

impl Ranks {
    /// Sends `o` to the owner of every rank not reaped yet.
    fn order_all(&self, o: Order) {
        for tx in self.orders.iter().flatten() {
            let _ = tx.send(o);
        }
    }
}

/// The command rank `rank` runs: the program and its arguments with the launch environment (and NCCL's defaults
/// where the launching environment sets none), no input, output piped, killed if launch drops it.
fn rank_command(spec: &LaunchSpec, rank: usize, port: u16, run_id: &str) -> Command {
    let mut cmd = Command::new(&spec.program);
    for (k, v) in NCCL_DEFAULTS {
        if std::env::var_os(k).is_none() {
            cmd.env(k, v);
        }
    }
    cmd.args(&spec.args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", spec.nproc.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("WEIGHTFERRY_RUN_ID", run_id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Spawns the ranks in order, each owned by a task of its own and its output forwarded, up to the first that
/// cannot be spawned (whose error comes back beside the ranks already running). Runs inside the runtime.
fn spawn_ranks(spec: &LaunchSpec, port: u16) -> (Ranks, Option<LaunchError>) {
    let run_id = run_id(port);
    let (done_tx, done) = mpsc::unbounded_channel();
    let mut ranks = Ranks {
        orders: Vec::with_capacity(spec.nproc),
        pids: Vec::with_capacity(spec.nproc),
        output: tokio::task::JoinSet::new(),
        done,
        live: 0,
        statuses: Vec::new(),
    };
    let mut spawn_error = None;
    for rank in 0..spec.nproc {
        let mut child = match rank_command(spec, rank, port, &run_id).spawn() {
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
            ranks.output.spawn(forward(out, prefix.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            ranks.output.spawn(forward(err, prefix, true));
        }
        ranks.pids.push(child.id());
        let (tx, rx) = mpsc::unbounded_channel();
        ranks.orders.push(Some(tx));
        tokio::spawn(own(rank, child, rx, done_tx.clone()));
    }
    ranks.live = ranks.orders.len();
    ranks.statuses = vec![None; ranks.orders.len()];
    (ranks, spawn_error)
}

/// What launch has seen of the running ranks.
struct Watch {
    /// The first failure of a rank on its own (or of spawning or waiting for one).
    failure: Option<LaunchError>,
    /// The first rank that failed because another did ([`PEER_FAILED_EXIT`]), and how it ended.
    secondary: Option<(usize, String)>,
    /// The signal launch got and forwarded to the ranks.
    signalled: Option<&'static str>,
    /// Which ranks are stopped.
    stopped: Vec<bool>,
    /// When launch stops waiting for the rank that failed first ([`ROOT_CAUSE_GRACE`] after a secondary failure).
    grace_end: tokio::time::Instant,
    /// When the ranks still running after a forwarded signal are killed.
    kill_at: tokio::time::Instant,
    /// A time that never comes.
    far: tokio::time::Instant,
}

impl Watch {
    fn new(ranks: &Ranks, spawn_error: Option<LaunchError>) -> Watch {
        let far = tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);
        Watch {
            failure: spawn_error,
            secondary: None,
            signalled: None,
            stopped: vec![false; ranks.orders.len()],
            grace_end: far,
            kill_at: far,
            far,
        }
    }

    /// Rank `rank` was reaped. Returns whether its end may be a failure (not a success, nor after a signal).
    fn on_exit(&mut self, ranks: &mut Ranks, rank: usize, status: std::io::Result<ExitStatus>) -> bool {
        ranks.live -= 1;
        ranks.orders[rank] = None;
        ranks.pids[rank] = None;
        match status {
            Ok(status) => {
                let text = describe_status(status);
                ranks.statuses[rank] = Some(text.clone());
                if status.success() || self.signalled.is_some() {
                    return false;
                }
                if status.code() == Some(PEER_FAILED_EXIT) {
                    if self.secondary.is_none() {
                        self.secondary = Some((rank, text));
                        self.grace_end = tokio::time::Instant::now() + ROOT_CAUSE_GRACE;
                    }
                } else {
                    self.failure = Some(LaunchError::RankFailed { rank, status: text });
                }
            }
            Err(e) => self.failure = Some(LaunchError::Wait { rank, reason: e.to_string() }),
        }
        true
    }

    /// Launch got `name` (signal number `sig`): the first one is sent on to every rank, which then have
    /// [`SIGNAL_GRACE`]; a second kills them.
    fn on_signal(&mut self, ranks: &Ranks, name: &'static str, sig: i32) {
        if self.signalled.is_some() {
            ranks.order_all(Order::Kill)
        } else {
            self.signalled = Some(name);
            ranks.order_all(Order::Signal(sig));
            self.kill_at = tokio::time::Instant::now() + SIGNAL_GRACE;
        }
    }

    /// A rank that gave up on its peers while one of them is stopped: the stopped one is the cause.
    fn blame_stopped(&mut self, pids: &[Option<u32>]) {
        if let (Some((waiting, status)), Some(rank)) = (&self.secondary, self.stopped.iter().position(|&s| s)) {
            if let (None, Some(pid)) = (&self.failure, pids[rank]) {
                self.failure = Some(LaunchError::Stopped { rank, pid, waiting: *waiting, status: status.clone() });
            }
        }
    }
}

/// Waits on the ranks, the signals and the timers until a rank failed on its own, every rank was reaped, or the
/// grace for the root cause of a secondary failure ran out.
async fn supervise(ranks: &mut Ranks, watch: &mut Watch, signals: &mut Signals, poll: &mut tokio::time::Interval) {
    while watch.failure.is_none() && ranks.live > 0 {
        tokio::select! {
            done = ranks.done.recv() => {
                let Some((rank, status)) = done else { break };
                if !watch.on_exit(ranks, rank, status) {
                    continue;
                }
            }
            () = signals.int.recv() => watch.on_signal(ranks, "SIGINT", 2),
            () = signals.term.recv() => watch.on_signal(ranks, "SIGTERM", 15),
            () = signals.chld.recv() => watch_stopped(&ranks.pids, &mut watch.stopped),
            _ = poll.tick() => watch_stopped(&ranks.pids, &mut watch.stopped),
            () = tokio::time::sleep_until(watch.grace_end) => break,
            () = tokio::time::sleep_until(watch.kill_at) => {
                ranks.order_all(Order::Kill);
                watch.kill_at = watch.far;
            }
        }
        watch.blame_stopped(&ranks.pids);
    }
}

/// Kills every rank still running (SIGKILL also ends a stopped process), reaps them, lets their output drain, and
/// says how the launch ended.
async fn finish(mut ranks: Ranks, watch: Watch) -> Result<(), LaunchError> {
    let failure = watch.failure.or(watch.secondary.map(|(rank, status)| LaunchError::RankFailed { rank, status }));
    ranks.order_all(Order::Kill);
    while ranks.live > 0 {
        match tokio::time::timeout(Duration::from_secs(10), ranks.done.recv()).await {
            Ok(Some((rank, status))) => {
                ranks.live -= 1;
                if let Ok(s) = status {
                    ranks.statuses[rank].get_or_insert(describe_status(s));
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    // Every child has exited; its output ends when its pipes close. A grandchild it left behind may hold them
    // open: forwarding stops waiting after a grace period (its tasks end with the runtime).
    let output = &mut ranks.output;
    let _ = tokio::time::timeout(OUTPUT_GRACE, async { while output.join_next().await.is_some() {} }).await;
    if let Some(signal) = watch.signalled {
        let ended = ranks
            .statuses
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

/// Spawns the ranks and supervises them; see the module docs. The signal handlers and the stop poll exist before
/// the first child does.
async fn run(spec: &LaunchSpec, port: u16, forward_signals: bool) -> Result<(), LaunchError> {
    let mut signals = Signals::new(forward_signals);
    // A debugger's stop sends no SIGCHLD, so launch also looks for stopped ranks every STOP_POLL.
    let mut poll = tokio::time::interval(STOP_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut ranks, spawn_error) = spawn_ranks(spec, port);
    let mut watch = Watch::new(&ranks, spawn_error);
    supervise(&mut ranks, &mut watch, &mut signals, &mut poll).await;
    finish(ranks, watch).await
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
