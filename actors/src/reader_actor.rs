//! The reader actor of the disk tier: it reads blocks from their checkpoint file into a small ring of staging
//! buffers and hands each load on to the stack's stream actor, which copies from the staging buffer to the slot.
//!
//! A stack with blocks on disk sends *every* load through its reader, in ticket order (a load from host memory
//! passes straight through), so the stream actor still sees one stack's loads in FIFO order and its ticket board
//! stays a watermark. For a load with [`FileRead`]s the reader takes the next staging buffer of its
//! [`StagingRing`]; if that buffer still serves an earlier load, it first waits until that load is published on its
//! board (its events are recorded) and then for the staging event recorded after its copies (invariant: a staging
//! buffer is refilled only after the copies that read it completed). It reads the file straight into the buffer
//! ([`Platform::fill_host`](crate::platform::Platform::fill_host), each range into its aligned window), points the
//! load's copies at it, asks the stream actor to record the buffer's event after them, and forwards the load. A read
//! that fails publishes the error on the load's board and reports it as the load's completion; the buffer is free
//! again at once.
//!
//! The command mailbox is bounded (back-pressure); the reader sends into the stream actor's bounded mailbox and
//! never the other way, so no cycle of bounded channels exists.

use crate::error::SchedulerError;
use crate::messages::{Completion, FileRead, LoadCmd, TicketBoard, STAGING_HOST};
use crate::platform::{EventId, HostBufferId, HostMemoryKind, PlatformError, PlatformRef};
use crate::slot::Ticket;
use crate::staging::{NextBuffer, StagingRing};
use crate::stream_actor::StreamHandle;
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::mailbox::{self, Receiver, Sender};
use crate::sync::thread::{self, JoinHandle};
use crate::sync::{lock, Arc, Mutex};

/// Capacity of a reader's command mailbox.
pub const READER_MAILBOX: usize = 64;

enum ReaderCmd {
    Load { cmd: LoadCmd, reads: Vec<FileRead> },
    Fence { reply: Sender<Result<(), SchedulerError>> },
    Shutdown,
}

/// The staging buffers and their events, owned by the handle (freed by [`ReaderHandle::destroy`]).
#[derive(Debug, Clone)]
struct Staging {
    buffers: Vec<HostBufferId>,
    events: Vec<EventId>,
}

/// Cloneable handle to a reader actor.
#[derive(Clone)]
pub struct ReaderHandle {
    name: std::sync::Arc<str>,
    platform: PlatformRef,
    stream: StreamHandle,
    staging: Staging,
    tx: Sender<ReaderCmd>,
    alive: Arc<AtomicBool>,
    joins: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl std::fmt::Debug for ReaderHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaderHandle").field("name", &self.name).field("buffers", &self.staging.buffers).finish()
    }
}

impl ReaderHandle {
    /// Allocates `count` staging buffers of `bytes` each (`kind`: pinned on a GPU, so the copies run at full rate)
    /// and an event per buffer, and spawns the reader, which forwards loads to `stream`. On failure whatever was
    /// allocated is freed.
    pub fn spawn(
        platform: PlatformRef,
        name: &str,
        stream: StreamHandle,
        count: usize,
        bytes: u64,
        kind: HostMemoryKind,
    ) -> Result<ReaderHandle, SchedulerError> {
        Self::spawn_with(platform, name, stream, (count, bytes, kind), false)
    }

    /// Test-only: [`spawn`](Self::spawn) with the deliberately broken ordering that refills a staging buffer without
    /// waiting for the copies that read it (only in a build with `RUSTFLAGS="--cfg weightferry_broken"`), so the
    /// models and the hazard detector can show they catch it.
    #[cfg(weightferry_broken)]
    pub fn spawn_without_staging_wait(
        platform: PlatformRef,
        name: &str,
        stream: StreamHandle,
        count: usize,
        bytes: u64,
        kind: HostMemoryKind,
    ) -> Result<ReaderHandle, SchedulerError> {
        Self::spawn_with(platform, name, stream, (count, bytes, kind), true)
    }

    fn spawn_with(
        platform: PlatformRef,
        name: &str,
        stream: StreamHandle,
        (count, bytes, kind): (usize, u64, HostMemoryKind),
        skip_wait: bool,
    ) -> Result<ReaderHandle, SchedulerError> {
        let mut staging = Staging { buffers: Vec::new(), events: Vec::new() };
        let allocated = (0..count.max(1)).try_for_each(|_| -> Result<(), PlatformError> {
            staging.buffers.push(platform.alloc_host(bytes.max(1), kind)?);
            staging.events.push(platform.create_event()?);
            Ok(())
        });
        if let Err(e) = allocated {
            free_staging(&platform, &staging);
            return Err(e.into());
        }
        let (tx, rx) = mailbox::bounded::<ReaderCmd>(READER_MAILBOX);
        let alive = Arc::new(AtomicBool::new(true));
        let (a, p, s, st) = (alive.clone(), platform.clone(), stream.clone(), staging.clone());
        let spawned = thread::spawn_named(&format!("wf-reader-{name}"), move || {
            reader_loop(&p, &s, &st, &rx, skip_wait);
            a.store(false, Ordering::Release);
            // Loads sent after Shutdown are never read: wake their waiters, which then see the reader stopped.
            while let Ok(Some(ReaderCmd::Load { cmd, .. })) = rx.try_recv() {
                cmd.board.wake_all();
            }
        });
        let join = match spawned {
            Ok(j) => j,
            Err(e) => {
                free_staging(&platform, &staging);
                return Err(SchedulerError::Platform(PlatformError::Driver(format!("spawn reader: {e}"))));
            }
        };
        Ok(ReaderHandle {
            name: std::sync::Arc::from(name),
            platform,
            stream,
            staging,
            tx,
            alive,
            joins: Arc::new(Mutex::new(vec![join])),
        })
    }

    /// The reader's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Whether the reader thread is still running (and so is the stream actor it forwards to).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.stream.is_alive()
    }
    /// Bytes of host memory the staging buffers hold.
    pub fn staging_bytes(&self) -> Result<u64, SchedulerError> {
        let mut total = 0;
        for &b in &self.staging.buffers {
            total += self.platform.host_buffer_info(b)?.0;
        }
        Ok(total)
    }

    /// Sends a load: with `reads`, its copies' host offsets are offsets in the staging buffer the reads fill;
    /// without, it passes straight through to the stream actor. Blocks while the mailbox is full.
    pub fn load(&self, cmd: LoadCmd, reads: Vec<FileRead>) -> Result<(), SchedulerError> {
        self.tx
            .send(ReaderCmd::Load { cmd, reads })
            .map_err(|_| SchedulerError::ActorGone { actor: format!("reader '{}'", self.name) })
    }

    /// Returns once every load sent before it was handed on and has completed on the device (a fence of the
    /// stream actor, sent by the reader after those loads).
    pub fn fence(&self) -> Result<(), SchedulerError> {
        let (rtx, rrx) = mailbox::unbounded();
        let gone = || SchedulerError::ActorGone { actor: format!("reader '{}'", self.name) };
        self.tx.send(ReaderCmd::Fence { reply: rtx }).map_err(|_| gone())?;
        rrx.recv().map_err(|_| gone())?
    }

    /// Stops the reader after it handed on every load it received, and joins it. Idempotent.
    pub fn shutdown(&self) {
        let _ = self.tx.send(ReaderCmd::Shutdown);
        let joins: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.joins));
        for j in joins {
            let _ = j.join();
        }
    }

    /// [`shutdown`](Self::shutdown), then waits for the stream's work (the copies that read the staging buffers)
    /// with a fence and frees the buffers and their events. The stream actor stays (its owner destroys it).
    pub fn destroy(&self) -> Result<(), SchedulerError> {
        self.shutdown();
        let fenced = self.stream.fence();
        free_staging(&self.platform, &self.staging);
        fenced
    }
}

fn free_staging(platform: &PlatformRef, staging: &Staging) {
    for &e in &staging.events {
        let _ = platform.destroy_event(e);
    }
    for &b in &staging.buffers {
        let _ = platform.free_host(b);
    }
}

/// The load each staging buffer served last: its board and ticket.
type LastUse = Vec<Option<(Arc<TicketBoard>, Ticket)>>;

fn reader_loop(
    platform: &PlatformRef,
    stream: &StreamHandle,
    staging: &Staging,
    rx: &Receiver<ReaderCmd>,
    skip_wait: bool,
) {
    let mut ring = StagingRing::new(staging.buffers.len());
    let mut last: LastUse = vec![None; staging.buffers.len()];
    while let Ok(cmd) = rx.recv() {
        let (cmd, reads) = match cmd {
            ReaderCmd::Load { cmd, reads } => (cmd, reads),
            ReaderCmd::Fence { reply } => {
                let _ = reply.send(stream.fence());
                continue;
            }
            ReaderCmd::Shutdown => break,
        };
        if reads.is_empty() {
            if stream.load(cmd).is_err() {
                break; // the stream actor is gone: the waiters see it stopped
            }
            continue;
        }
        let ring_and_last = (&mut ring, &mut last);
        match stage(platform, stream, staging, ring_and_last, cmd, &reads, skip_wait) {
            Ok(()) => {}
            Err(Staged::Failed { cmd, error }) => fail(*cmd, error),
            Err(Staged::StreamGone) => break,
        }
    }
}

enum Staged {
    /// The load could not be read (or its buffer waited for); report this error as its result.
    Failed { cmd: Box<LoadCmd>, error: PlatformError },
    /// The stream actor is gone.
    StreamGone,
}

/// Reads `cmd`'s bytes into the next staging buffer (after the copies that last read it completed) and forwards it.
fn stage(
    platform: &PlatformRef,
    stream: &StreamHandle,
    staging: &Staging,
    (ring, last): (&mut StagingRing, &mut LastUse),
    mut cmd: LoadCmd,
    reads: &[FileRead],
    skip_wait: bool,
) -> Result<(), Staged> {
    let k = match ring.next() {
        NextBuffer::Free(k) => k,
        NextBuffer::AfterCopies(k, ticket) => {
            let waited = match skip_wait {
                true => Ok(()), // the broken ordering (test builds only)
                false => wait_for_copies(platform, stream, staging.events[k], last[k].clone()),
            };
            if let Err(error) = waited {
                // The buffer stays Queued: the copies that read it may still run; no later read may use it.
                return Err(Staged::Failed { cmd: Box::new(cmd), error });
            }
            last[k] = None;
            ring.completed(k, ticket).expect("the ring named this buffer Queued under this ticket");
            k
        }
    };
    ring.begin_fill(k, cmd.ticket).expect("the ring named this buffer free and next");
    if let Err(error) = fill(platform, staging.buffers[k], reads) {
        ring.abandoned(k, cmd.ticket).expect("filling under this ticket");
        return Err(Staged::Failed { cmd: Box::new(cmd), error });
    }
    for c in cmd.copies.iter_mut().filter(|c| c.host == STAGING_HOST) {
        c.host = staging.buffers[k];
    }
    cmd.staged = Some(staging.events[k]);
    let (board, ticket) = (cmd.board.clone(), cmd.ticket);
    if stream.load(cmd).is_err() {
        ring.abandoned(k, ticket).expect("filling under this ticket");
        return Err(Staged::StreamGone);
    }
    ring.queued(k, ticket).expect("filling under this ticket");
    last[k] = Some((board, ticket));
    Ok(())
}

/// Waits until the load that last used a staging buffer is published (its staging event recorded) and then for
/// that event: the copies that read the buffer completed.
fn wait_for_copies(
    platform: &PlatformRef,
    stream: &StreamHandle,
    event: EventId,
    last: Option<(Arc<TicketBoard>, Ticket)>,
) -> Result<(), PlatformError> {
    let Some((board, ticket)) = last else {
        // Not reached (a Queued buffer keeps the load that queued it); wait for all the stream's work if it were.
        return stream.fence().map_err(|e| PlatformError::Driver(e.to_string()));
    };
    match board.wait(ticket, &|| stream.is_alive()) {
        Some(Ok(())) => platform.event_synchronize(event),
        // Enqueuing its copies failed part-way, before its staging event was recorded: wait for all the stream's
        // work instead.
        Some(Err(_)) => stream.fence().map_err(|e| PlatformError::Driver(e.to_string())),
        None => Err(PlatformError::Driver(format!("stream '{}' stopped", stream.name()))),
    }
}

/// Reads every range straight into its window of the staging buffer ([`FileRead::window`]).
fn fill(platform: &PlatformRef, buffer: HostBufferId, reads: &[FileRead]) -> Result<(), PlatformError> {
    for r in reads {
        let (start, len) = r.window();
        let failed = |reason| PlatformError::FileReadFailed { offset: r.offset, bytes: r.len, reason };
        platform.fill_host(buffer, start, len, &mut |w| r.file.read_window(r.offset, r.len, w).map_err(failed))?;
    }
    Ok(())
}

/// Reports a load that was not forwarded: its error on its board, and as its completion.
fn fail(cmd: LoadCmd, error: PlatformError) {
    cmd.board.publish(cmd.ticket, Err(error.clone()));
    if let Some(notify) = cmd.notify {
        let _ =
            notify.send(Completion { ticket: cmd.ticket, target: cmd.target, block: cmd.block, result: Err(error) });
    }
}
