//! The collective actor: one per communicator. It owns the communicator and a comm stream on a dedicated thread
//! (an NCCL communicator is not `Send`, so it is built on that thread by a factory), receives [`GatherCmd`]s and
//! issues their AllGathers — comm-stream waits on the shard-copy events, the AllGather, the ready-event record — in
//! the order of their sequence numbers.
//!
//! Sequence numbers come from the plan: every rank numbers its gathers by the same deterministic ring order of
//! (stack, block) loads, so every rank assigns the same number to the same gather. The actor issues number `q` only
//! once the request for `q` has arrived, buffering requests that arrive early; whatever order hook messages arrive
//! in on each rank, every rank therefore issues the same AllGathers in the same order (invariant 4).
//!
//! Invariants: gathers are issued in strictly increasing, gap-free sequence order starting at 0; after any AllGather
//! fails to start, the actor is poisoned and issues no further collective (every later request is answered with
//! [`GatherError::Poisoned`]), so a failure never leads a rank into an unmatched collective (invariant 8); a fence
//! replies only after every gather issued before it has completed on the device, and refuses (rather than waits)
//! while requests are buffered behind a missing sequence number or once the actor is poisoned. Results go to the
//! request's ticket board (in issue order; one stack's tickets must increase with its sequence numbers) and,
//! through a completion watcher, to its
//! notify mailbox.

use crate::collective::Collective;
use crate::messages::{Completion, TicketBoard};
use crate::platform::{DeviceBufferId, EventId, PlatformError, PlatformRef, StreamId};
use crate::slot::Ticket;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::mailbox::{self, Receiver, Sender};
use crate::sync::thread::{self, JoinHandle};
use crate::sync::{lock, Arc, Mutex};
use std::collections::BTreeMap;

/// Capacity of a collective actor's command mailbox.
pub const COMMAND_MAILBOX: usize = 256;

/// Tag of the warm-up AllGather ([`CollectiveHandle::warm_up`]); no block gather uses it.
pub const WARM_UP_TAG: u64 = u64::MAX;

/// Bytes each rank contributes to the warm-up AllGather.
pub const WARM_UP_BYTES: u64 = 256;

/// Errors of the collective actor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GatherError {
    /// The platform or the communicator failed.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// A request for a sequence number that was already issued.
    #[error("gather #{seq} arrived after the actor issued up to #{next} (exclusive)")]
    Stale {
        /// The request's sequence number.
        seq: u64,
        /// The next number the actor will issue.
        next: u64,
    },
    /// Two requests with one sequence number.
    #[error("gather #{seq} was requested twice")]
    Duplicate {
        /// The sequence number.
        seq: u64,
    },
    /// An earlier AllGather failed, so this one was not issued.
    #[error("collective poisoned by an earlier failure ({cause}); the pipeline must be reloaded")]
    Poisoned {
        /// The failure that poisoned the actor.
        cause: PlatformError,
    },
    /// A fence arrived while requests wait behind a missing sequence number.
    #[error("fence while gathers {buffered:?} wait for gather #{next}")]
    Pending {
        /// The sequence number the actor waits for.
        next: u64,
        /// Buffered sequence numbers.
        buffered: Vec<u64>,
    },
    /// The actor stopped before handling the request.
    #[error("the collective actor '{name}' stopped")]
    ActorGone {
        /// The actor's name.
        name: String,
    },
}

impl From<GatherError> for PlatformError {
    fn from(e: GatherError) -> PlatformError {
        e.into_platform()
    }
}

impl From<GatherError> for crate::error::SchedulerError {
    /// A platform failure stays one; every other gather error becomes a platform driver error with its message.
    fn from(e: GatherError) -> crate::error::SchedulerError {
        crate::error::SchedulerError::Platform(e.into_platform())
    }
}

impl GatherError {
    fn into_platform(self) -> PlatformError {
        match self {
            GatherError::Platform(e) => e,
            other => PlatformError::Driver(other.to_string()),
        }
    }
}

/// A request to rebuild one block (or chunk) by AllGather.
#[derive(Debug)]
pub struct GatherCmd {
    /// Position in the global gather order (identical on every rank for the same gather).
    pub seq: u64,
    /// Ticket of the load, published on `board`.
    pub ticket: Ticket,
    /// Slot index it targets, echoed in the completion.
    pub target: usize,
    /// Block index, echoed in the completion.
    pub block: usize,
    /// Events the comm stream waits for first (the H2D of this rank's shard; the output slot's last use).
    pub waits: Vec<EventId>,
    /// This rank's shard: `(buffer, offset, len)`.
    pub input: (DeviceBufferId, u64, u64),
    /// Where the gathered `len · world` bytes go: `(buffer, offset)`.
    pub output: (DeviceBufferId, u64),
    /// Event recorded on the comm stream after the AllGather.
    pub ready: EventId,
    /// What is gathered (equal on every rank for one sequence number).
    pub tag: u64,
    /// Where "issued" (with its result) is published.
    pub board: Option<Arc<TicketBoard>>,
    /// Where "completed" is reported.
    pub notify: Option<Sender<Completion>>,
}

impl GatherCmd {
    fn answer(self, result: Result<(), PlatformError>) {
        if let Some(board) = &self.board {
            board.publish(self.ticket, result.clone());
        }
        if let Some(notify) = &self.notify {
            let _ = notify.send(Completion { ticket: self.ticket, target: self.target, block: self.block, result });
        }
    }
}

enum Cmd {
    Gather(GatherCmd),
    Fence { reply: Sender<Result<(), GatherError>> },
    Shutdown,
}

enum Watch {
    Gather { ticket: Ticket, target: usize, block: usize, event: EventId, notify: Sender<Completion> },
    Fence { reply: Sender<Result<(), GatherError>> },
}

/// Cloneable handle to a collective actor.
#[derive(Clone)]
pub struct CollectiveHandle {
    name: std::sync::Arc<str>,
    platform: PlatformRef,
    stream: StreamId,
    rank: usize,
    world: usize,
    tx: Sender<Cmd>,
    alive: Arc<AtomicBool>,
    issued: Arc<Mutex<Vec<(u64, u64)>>>,
    poison: Arc<Mutex<Option<PlatformError>>>,
    joins: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Mirror of the communicator's [`Collective::windowed_gathers`], updated after each AllGather.
    windowed: Arc<AtomicU64>,
}

impl std::fmt::Debug for CollectiveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectiveHandle")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// Builds the communicator on the actor's thread.
pub type CollectiveFactory = Box<dyn FnOnce() -> Result<Box<dyn Collective>, PlatformError> + Send>;

impl CollectiveHandle {
    /// Creates the comm stream `name` on `platform`, spawns the actor (and its completion watcher), and builds the
    /// communicator with `make` on the actor's thread. Returns once the communicator exists; if `make` fails, the
    /// threads are joined and the stream is destroyed before the error returns.
    pub fn spawn(platform: PlatformRef, name: &str, make: CollectiveFactory) -> Result<CollectiveHandle, GatherError> {
        let stream = platform.create_stream(name)?;
        let (tx, rx) = mailbox::bounded::<Cmd>(COMMAND_MAILBOX);
        let (wtx, wrx) = mailbox::unbounded::<Watch>();
        let (ready_tx, ready_rx) = mailbox::unbounded::<Result<(usize, usize), PlatformError>>();
        let spawn_err = |e: std::io::Error| GatherError::Platform(PlatformError::Driver(format!("spawn: {e}")));
        let handle_platform = platform.clone();
        let p = platform.clone();
        let watcher = thread::spawn_named(&format!("wf-watch-{name}"), move || watcher_loop(p, stream, wrx))
            .map_err(spawn_err)?;
        let alive = Arc::new(AtomicBool::new(true));
        let issued = Arc::new(Mutex::new(Vec::new()));
        let poison = Arc::new(Mutex::new(None));
        let (a, log, actor_name, shared_poison) = (alive.clone(), issued.clone(), name.to_string(), poison.clone());
        let windowed = Arc::new(AtomicU64::new(0));
        let shared_windowed = windowed.clone();
        let actor = thread::spawn_named(&format!("wf-comm-{name}"), move || {
            match make() {
                Ok(comm) => {
                    let _ = ready_tx.send(Ok((comm.rank(), comm.world())));
                    let mut actor = Actor {
                        platform,
                        stream,
                        comm,
                        watch: wtx,
                        issued: log,
                        next: 0,
                        poison: None,
                        shared_poison,
                        windowed: shared_windowed,
                    };
                    actor.run(&rx, &actor_name);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
            a.store(false, Ordering::Release);
        })
        .map_err(spawn_err)?;
        let joins = Arc::new(Mutex::new(vec![actor, watcher]));
        let (rank, world) = match ready_rx.recv() {
            Ok(Ok(rw)) => rw,
            Ok(Err(e)) => {
                join_all(&joins);
                let _ = handle_platform.destroy_stream(stream);
                return Err(GatherError::Platform(e));
            }
            Err(_) => {
                join_all(&joins);
                let _ = handle_platform.destroy_stream(stream);
                return Err(GatherError::ActorGone { name: name.to_string() });
            }
        };
        Ok(CollectiveHandle {
            name: std::sync::Arc::from(name),
            platform: handle_platform,
            stream,
            rank,
            world,
            tx,
            alive,
            issued,
            poison,
            joins,
            windowed,
        })
    }

    /// AllGathers the communicator ran between symmetric windows so far ([`Collective::windowed_gathers`]).
    pub fn windowed_gathers(&self) -> u64 {
        self.windowed.load(Ordering::Acquire)
    }

    /// The comm stream the actor owns.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Ranks in the communicator.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Whether the actor thread is still running.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
    /// `(sequence number, tag)` of every AllGather the actor started (including one that failed to start), in
    /// issue order.
    pub fn issued(&self) -> Vec<(u64, u64)> {
        lock(&self.issued).clone()
    }

    /// The failure that poisoned the actor, if an AllGather failed to start: the actor issues no further
    /// collective and the pipeline must be reloaded.
    pub fn poisoned(&self) -> Option<PlatformError> {
        lock(&self.poison).clone()
    }

    fn gone(&self) -> GatherError {
        GatherError::ActorGone { name: self.name.to_string() }
    }

    /// Sends a gather request (blocks while the mailbox is full). Its result arrives on its board / notify.
    pub fn gather(&self, cmd: GatherCmd) -> Result<(), GatherError> {
        self.tx.send(Cmd::Gather(cmd)).map_err(|_| self.gone())
    }

    /// Returns once every gather issued before it has completed on the device; refuses while requests are
    /// buffered behind a missing sequence number, and with [`GatherError::Poisoned`] once a gather failed to start.
    pub fn fence(&self) -> Result<(), GatherError> {
        let (rtx, rrx) = mailbox::unbounded();
        self.tx.send(Cmd::Fence { reply: rtx }).map_err(|_| self.gone())?;
        rrx.recv().map_err(|_| self.gone())?
    }

    /// Warms the communicator up: one AllGather of [`WARM_UP_BYTES`] per rank (tag [`WARM_UP_TAG`], sequence
    /// number `seq`, which every rank must pass alike), waited for on the host. NCCL sets up its connections on
    /// the first AllGather of a new communicator (about 2.5 s measured on 2×H200), so a run calls this once when
    /// it enables offload, never inside its first step. Allocates and frees its own small device buffers. A
    /// failure to start poisons the actor like any other gather.
    pub fn warm_up(&self, seq: u64) -> Result<(), GatherError> {
        let p = &self.platform;
        let out_len = WARM_UP_BYTES * self.world as u64;
        let input = p.alloc_device(WARM_UP_BYTES)?;
        let output = match p.alloc_device(out_len) {
            Ok(b) => b,
            Err(e) => {
                let _ = p.free_device(input);
                return Err(e.into());
            }
        };
        let ready = match p.create_event() {
            Ok(e) => e,
            Err(e) => {
                let _ = p.free_device(input);
                let _ = p.free_device(output);
                return Err(e.into());
            }
        };
        let board = Arc::new(TicketBoard::new());
        let cmd = GatherCmd {
            seq,
            ticket: 1,
            target: usize::MAX,
            block: usize::MAX,
            waits: Vec::new(),
            input: (input, 0, WARM_UP_BYTES),
            output: (output, 0),
            ready,
            tag: WARM_UP_TAG,
            board: Some(board.clone()),
            notify: None,
        };
        let result = self.gather(cmd).and_then(|()| {
            let alive = self.alive.clone();
            match board.wait(1, &move || alive.load(Ordering::Acquire)) {
                Some(Ok(())) => p.event_synchronize(ready).map_err(GatherError::from),
                Some(Err(e)) => Err(GatherError::Platform(e)),
                None => Err(self.gone()),
            }
        });
        // Nothing is pending on the buffers now: the gather either never started or its completion was observed.
        let _ = p.destroy_event(ready);
        let _ = p.free_device(input);
        let _ = p.free_device(output);
        result
    }

    /// Stops the actor (answering buffered requests with [`GatherError::ActorGone`]), drops the communicator and
    /// joins the threads. Idempotent. The comm stream stays (see [`CollectiveHandle::destroy`]).
    pub fn shutdown(&self) {
        let _ = self.tx.send(Cmd::Shutdown);
        join_all(&self.joins);
    }

    /// [`CollectiveHandle::shutdown`], then destroys the comm stream the actor owned (the platform waits for the
    /// work on it first). Calling it again fails with the platform's `InvalidHandle`.
    pub fn destroy(&self) -> Result<(), GatherError> {
        self.shutdown();
        self.platform.destroy_stream(self.stream).map_err(GatherError::from)
    }
}

fn join_all(joins: &Mutex<Vec<JoinHandle<()>>>) {
    let joins: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(joins));
    for j in joins {
        let _ = j.join();
    }
}

struct Actor {
    platform: PlatformRef,
    stream: StreamId,
    comm: Box<dyn Collective>,
    watch: Sender<Watch>,
    issued: Arc<Mutex<Vec<(u64, u64)>>>,
    next: u64,
    poison: Option<PlatformError>,
    /// Mirror of `poison` readable through the handle.
    shared_poison: Arc<Mutex<Option<PlatformError>>>,
    /// Mirror of the communicator's windowed count, readable through the handle.
    windowed: Arc<AtomicU64>,
}

impl Actor {
    fn run(&mut self, rx: &Receiver<Cmd>, name: &str) {
        let mut buffered: BTreeMap<u64, GatherCmd> = BTreeMap::new();
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Cmd::Gather(g) => {
                    if g.seq < self.next {
                        let e = GatherError::Stale { seq: g.seq, next: self.next };
                        g.answer(Err(e.into_platform()));
                        continue;
                    }
                    if buffered.contains_key(&g.seq) {
                        let e = GatherError::Duplicate { seq: g.seq };
                        g.answer(Err(e.into_platform()));
                        continue;
                    }
                    buffered.insert(g.seq, g);
                    while let Some(g) = buffered.remove(&self.next) {
                        self.next += 1;
                        self.issue(g);
                    }
                }
                Cmd::Fence { reply } => {
                    if let Some(cause) = &self.poison {
                        let _ = reply.send(Err(GatherError::Poisoned { cause: cause.clone() }));
                    } else if buffered.is_empty() {
                        if let Err(mailbox::Disconnected) = self.watch.send(Watch::Fence { reply: reply.clone() }) {
                            let _ = reply.send(self.platform.stream_synchronize(self.stream).map_err(Into::into));
                        }
                    } else {
                        let e = GatherError::Pending { next: self.next, buffered: buffered.keys().copied().collect() };
                        let _ = reply.send(Err(e));
                    }
                }
                Cmd::Shutdown => break,
            }
        }
        for (_, g) in std::mem::take(&mut buffered) {
            g.answer(Err(GatherError::ActorGone { name: name.to_string() }.into_platform()));
        }
    }

    fn enqueue(&self, g: &GatherCmd) -> Result<(), PlatformError> {
        for &w in &g.waits {
            self.platform.stream_wait_event(self.stream, w)?;
        }
        lock(&self.issued).push((g.seq, g.tag));
        self.comm.all_gather(self.stream, g.input, g.output, g.tag)?;
        self.windowed.store(self.comm.windowed_gathers(), Ordering::Release);
        self.platform.record_event(g.ready, self.stream)
    }

    fn issue(&mut self, mut g: GatherCmd) {
        if let Some(cause) = &self.poison {
            g.answer(Err(GatherError::Poisoned { cause: cause.clone() }.into_platform()));
            return;
        }
        let result = self.enqueue(&g);
        if let Err(e) = &result {
            self.poison = Some(e.clone());
            lock(&self.shared_poison).get_or_insert_with(|| e.clone());
        }
        if let Some(board) = &g.board {
            board.publish(g.ticket, result.clone());
        }
        if let Some(notify) = g.notify.take() {
            match result {
                Ok(()) => {
                    let (ticket, target, block, event) = (g.ticket, g.target, g.block, g.ready);
                    let w = Watch::Gather { ticket, target, block, event, notify: notify.clone() };
                    if let Err(mailbox::Disconnected) = self.watch.send(w) {
                        // The watcher died (it cannot stop while the actor holds its mailbox): observe on this thread.
                        let result = self.platform.event_synchronize(event);
                        let _ = notify.send(Completion { ticket, target, block, result });
                    }
                }
                Err(e) => {
                    let _ =
                        notify.send(Completion { ticket: g.ticket, target: g.target, block: g.block, result: Err(e) });
                }
            }
        }
    }
}

fn watcher_loop(platform: PlatformRef, stream: StreamId, rx: Receiver<Watch>) {
    while let Ok(w) = rx.recv() {
        match w {
            Watch::Gather { ticket, target, block, event, notify } => {
                let result = platform.event_synchronize(event);
                let _ = notify.send(Completion { ticket, target, block, result });
            }
            Watch::Fence { reply } => {
                let _ = reply.send(platform.stream_synchronize(stream).map_err(Into::into));
            }
        }
    }
}
