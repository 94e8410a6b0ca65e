//! The stream actor: one per device stream. It owns the stream, executes load commands in mailbox order (GPU-side
//! waits, flat copies, ready-event record), publishes "recorded" on the sender's ticket board, and hands each
//! recorded event to its completion watcher, which observes completion on the host and reports it back as a
//! [`Completion`] message.
//!
//! Invariants: commands execute in FIFO order on one thread, so tickets of one board are published in increasing
//! order; a fence reply is sent only after every command received before it has completed on the device; the
//! command mailbox is bounded (back-pressure) while replies and completions go through unbounded mailboxes, so no
//! cycle of bounded channels exists.

use crate::error::SchedulerError;
use crate::messages::{Completion, CopyDirection, LoadCmd, StreamCmd};
use crate::platform::{EventId, PlatformError, PlatformRef, StreamId};
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::mailbox::{self, Receiver, Sender};
use crate::sync::thread::{self, JoinHandle};
use crate::sync::{lock, Arc, Mutex};

/// Capacity of a stream actor's command mailbox.
pub const COMMAND_MAILBOX: usize = 256;

enum Watch {
    Load { ticket: u64, target: usize, block: usize, event: EventId, notify: Sender<Completion> },
    Fence { reply: Sender<Result<(), PlatformError>> },
}

/// Cloneable handle to a stream actor.
#[derive(Clone)]
pub struct StreamHandle {
    name: std::sync::Arc<str>,
    platform: PlatformRef,
    stream: StreamId,
    tx: Sender<StreamCmd>,
    alive: Arc<AtomicBool>,
    joins: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl std::fmt::Debug for StreamHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamHandle").field("name", &self.name).field("stream", &self.stream).finish()
    }
}

/// Options of a stream actor.
#[derive(Debug, Clone, Copy)]
pub struct StreamOptions {
    /// Run a completion watcher thread (observes ready events and reports completions). Without it, completions
    /// are not reported (fences still work); loom models turn it off to keep the thread count small.
    pub watch_completions: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions { watch_completions: true }
    }
}

impl StreamHandle {
    /// Creates a stream on `platform` and spawns its actor (and watcher). If a thread cannot be spawned, the ones
    /// spawned are joined and the stream is destroyed again.
    pub fn spawn(platform: PlatformRef, name: &str, options: StreamOptions) -> Result<StreamHandle, SchedulerError> {
        let stream = platform.create_stream(name)?;
        // Undoes a partial spawn: the watcher exits once its sender (moved into the thread that failed) is gone.
        let undo = |joins: Vec<JoinHandle<()>>, e: SchedulerError| {
            for j in joins {
                let _ = j.join();
            }
            let _ = platform.destroy_stream(stream);
            e
        };
        let (tx, rx) = mailbox::bounded::<StreamCmd>(COMMAND_MAILBOX);
        let alive = Arc::new(AtomicBool::new(true));
        let mut joins = Vec::new();
        let watch_tx = if options.watch_completions {
            let (wtx, wrx) = mailbox::unbounded::<Watch>();
            let p = platform.clone();
            let j = thread::spawn_named(&format!("wf-watch-{name}"), move || watcher_loop(p, stream, wrx)).map_err(
                |e| undo(Vec::new(), SchedulerError::Platform(PlatformError::Driver(format!("spawn watcher: {e}")))),
            )?;
            joins.push(j);
            Some(wtx)
        } else {
            None
        };
        let a = alive.clone();
        let p = platform.clone();
        let handle_platform = platform.clone();
        let spawned = thread::spawn_named(&format!("wf-stream-{name}"), move || {
            actor_loop(p, stream, &rx, watch_tx);
            a.store(false, Ordering::Release);
            // Loads sent after Shutdown are never executed: wake their waiters, which then see the actor stopped
            // (a waiter that checked `is_alive` before the store above would otherwise park forever).
            while let Ok(Some(cmd)) = rx.try_recv() {
                if let StreamCmd::Load(cmd) = cmd {
                    cmd.board.wake_all();
                }
            }
        });
        let j = match spawned {
            Ok(j) => j,
            Err(e) => {
                let e = SchedulerError::Platform(PlatformError::Driver(format!("spawn stream actor: {e}")));
                return Err(undo(joins, e));
            }
        };
        joins.push(j);
        Ok(StreamHandle {
            name: std::sync::Arc::from(name),
            platform: handle_platform,
            stream,
            tx,
            alive,
            joins: Arc::new(Mutex::new(joins)),
        })
    }

    /// The stream this actor owns.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Whether the actor thread is still running.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Sends a command (blocks while the mailbox is full).
    pub fn send(&self, cmd: StreamCmd) -> Result<(), SchedulerError> {
        self.tx.send(cmd).map_err(|_| SchedulerError::ActorGone { actor: format!("stream '{}'", self.name) })
    }

    /// Enqueues a load.
    pub fn load(&self, cmd: LoadCmd) -> Result<(), SchedulerError> {
        self.send(StreamCmd::Load(cmd))
    }

    /// Returns once every command sent before it has completed on the device.
    pub fn fence(&self) -> Result<(), SchedulerError> {
        let (rtx, rrx) = mailbox::unbounded();
        self.send(StreamCmd::Fence { reply: rtx })?;
        match rrx.recv() {
            Ok(r) => r.map_err(SchedulerError::from),
            Err(_) => Err(SchedulerError::ActorGone { actor: format!("stream '{}'", self.name) }),
        }
    }

    /// Stops the actor after it drains its mailbox and joins its threads. Idempotent. The stream stays (see
    /// [`StreamHandle::destroy`]).
    pub fn shutdown(&self) {
        let _ = self.tx.send(StreamCmd::Shutdown);
        let joins: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.joins));
        for j in joins {
            let _ = j.join();
        }
    }

    /// [`StreamHandle::shutdown`], then destroys the stream the actor owned (the platform waits for the work on it
    /// first): what the owner of the actor calls when it is done with it. Calling it again fails with the
    /// platform's `InvalidHandle` (the stream is already gone); the threads are joined either way.
    pub fn destroy(&self) -> Result<(), SchedulerError> {
        self.shutdown();
        self.platform.destroy_stream(self.stream).map_err(SchedulerError::from)
    }
}

fn execute(platform: &PlatformRef, stream: StreamId, cmd: &LoadCmd) -> Result<(), PlatformError> {
    for &w in &cmd.waits {
        platform.stream_wait_event(stream, w)?;
    }
    for c in &cmd.copies {
        match c.direction {
            CopyDirection::HostToDevice => {
                platform.copy_h2d(stream, c.host, c.host_offset, c.device, c.device_offset, c.len)?
            }
            CopyDirection::DeviceToHost => {
                platform.copy_d2h(stream, c.device, c.device_offset, c.host, c.host_offset, c.len)?
            }
        }
    }
    platform.record_event(cmd.ready, stream)?;
    match cmd.staged {
        Some(staged) => platform.record_event(staged, stream),
        None => Ok(()),
    }
}

fn actor_loop(platform: PlatformRef, stream: StreamId, rx: &Receiver<StreamCmd>, watch: Option<Sender<Watch>>) {
    while let Ok(cmd) = rx.recv() {
        match cmd {
            StreamCmd::Load(cmd) => {
                let result = execute(&platform, stream, &cmd);
                cmd.board.publish(cmd.ticket, result.clone());
                if let Some(notify) = cmd.notify {
                    match (&watch, result) {
                        (Some(w), Ok(())) => {
                            let _ = w.send(Watch::Load {
                                ticket: cmd.ticket,
                                target: cmd.target,
                                block: cmd.block,
                                event: cmd.ready,
                                notify,
                            });
                        }
                        (_, result) => {
                            let _ = notify.send(Completion {
                                ticket: cmd.ticket,
                                target: cmd.target,
                                block: cmd.block,
                                result,
                            });
                        }
                    }
                }
            }
            StreamCmd::Fence { reply } => match &watch {
                Some(w) => {
                    if let Err(mailbox::Disconnected) = w.send(Watch::Fence { reply: reply.clone() }) {
                        let _ = reply.send(platform.stream_synchronize(stream));
                    }
                }
                None => {
                    let _ = reply.send(platform.stream_synchronize(stream));
                }
            },
            StreamCmd::Shutdown => break,
        }
    }
}

fn watcher_loop(platform: PlatformRef, stream: StreamId, rx: Receiver<Watch>) {
    while let Ok(w) = rx.recv() {
        match w {
            Watch::Load { ticket, target, block, event, notify } => {
                let result = platform.event_synchronize(event);
                let _ = notify.send(Completion { ticket, target, block, result });
            }
            Watch::Fence { reply } => {
                let _ = reply.send(platform.stream_synchronize(stream));
            }
        }
    }
}
