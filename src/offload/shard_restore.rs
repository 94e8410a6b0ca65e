//! The final gather to host of a distributed backend, which released the loaded host copies of its gathered
//! stacks' weights at enable: every released storage ([`Home::Sharded`]) is rebuilt from the group's shards and given a loaded host buffer again.
//!
//! Unit by unit, in the run's stack and unit order: the rank copies its shards of the unit host → device into one
//! restore input buffer and observes the copy's completion; it then sends one [`GatherCmd`] per section chunk — the
//! same chunks as the gather path, numbered by the run's own [`GatherSequence`] right after the run's last gather,
//! tagged `restore_tag` — to the run's collective actor, which issues them in sequence order into one restore
//! output buffer, and observes their completion; it frees its shards of the unit (no rank needs them any more: every
//! AllGather of the unit has completed on this rank); then it copies each released storage of the unit from its
//! place in the gathered output (device → host, the platform's copy) into a new pageable host buffer, observes
//! those copies, and only then re-homes the storages as loaded ([`HostModel::restore_from_shards`]).
//!
//! Invariants: every rank issues the same restore gathers in the same order (they depend on the plan alone, never on
//! what this rank restored); a rank sends a unit's gathers only once its shards are on the device, so no peer ever
//! gathers bytes that are not the weights; a storage is re-homed only after the copy of all its bytes completed, so
//! each storage is either restored bit-exactly or still [`Home::Sharded`] (a typed error to every read), and a host
//! buffer that does not become a storage's home is freed; a failure of the device-to-host side of one unit (a host
//! allocation, a copy) leaves that unit's storages released but does not stop the gathers of the next units, so the
//! peers' restore is not held up; nothing is freed while work that touches it may still be pending.

use super::distributed::ShardedMasters;
use super::layout::UnitLayout;
use crate::model::{Home, HostModel, ModelError};
use crate::pipeline::StorageId;
use weightferry_actors::collective_actor::{CollectiveHandle, GatherCmd};
use weightferry_actors::messages::TicketBoard;
use weightferry_actors::platform::{
    DeviceBufferId, EventId, HostBufferId, HostMemoryKind, PlatformError, PlatformRef, StreamId,
};
use weightferry_actors::sync::Arc;
use weightferry_actors::GatherSequence;

pub use super::tags::{is_restore_tag, RESTORE_TAG};

pub(crate) use super::tags::restore_tag;

/// Why a restore stopped short.
#[derive(Debug)]
pub(crate) enum RestoreFailure {
    /// A restore AllGather failed to start or on the device, or the collective actor stopped: the communicator is
    /// unusable and the storages not restored so far stay released.
    Collective(PlatformError),
    /// A failure of this rank alone: before a unit's gathers (its buffers, streams, shard copies: no further gather
    /// was sent, so the peers' restore fails too), or in the device-to-host side of one or more units (every gather
    /// was still sent). The storages not restored stay released.
    Local(ModelError),
}

/// Device buffers, streams and the event of one restore.
#[derive(Default)]
struct Resources {
    input: Option<DeviceBufferId>,
    output: Option<DeviceBufferId>,
    ready: Option<EventId>,
    h2d: Option<StreamId>,
    d2h: Option<StreamId>,
}

impl Resources {
    /// Frees everything once no work touching it can be pending (the comm stream holds the gathers); the restore's
    /// own streams are destroyed (after their work completed).
    fn release(self, platform: &PlatformRef, comm: StreamId) {
        for s in [self.h2d, self.d2h].into_iter().flatten() {
            let _ = platform.destroy_stream(s);
        }
        let _ = platform.stream_synchronize(comm);
        if let Some(e) = self.ready {
            let _ = platform.event_synchronize(e);
            let _ = platform.destroy_event(e);
        }
        for b in [self.input, self.output].into_iter().flatten() {
            let _ = platform.free_device(b);
        }
    }
}

/// Bytes of the restore input (all of one unit's shards) and output (its gathered sections, padding included)
/// buffers: the largest unit's.
fn buffer_sizes(masters: &[ShardedMasters], layouts: &[Vec<UnitLayout>]) -> (u64, u64) {
    let (mut input, mut output) = (0u64, 0u64);
    for (m, ls) in masters.iter().zip(layouts) {
        for (u, l) in m.units.iter().zip(ls) {
            input = input.max(u.sections.iter().map(|s| s.spec.shard_bytes()).sum());
            output = output.max(l.device_bytes);
            for s in &u.sections {
                for c in s.spec.chunks() {
                    let end = s.device_offset + c.gathered_offset + c.shard_bytes * s.spec.world() as u64;
                    output = output.max(end);
                }
            }
        }
    }
    (input, output)
}

/// Rebuilds every released storage of `model` from the shards in `masters` (one per stack, its units in the order
/// of `layouts`), as the module documentation describes, through `collective` with sequence numbers from
/// `sequence`. Each unit's shard buffers are freed once its gathers completed (the unit's sections are emptied).
/// Returns the first failure; the storages not restored stay [`Home::Sharded`].
pub(crate) fn restore_released(
    platform: &PlatformRef,
    collective: &CollectiveHandle,
    sequence: &GatherSequence,
    masters: &mut [ShardedMasters],
    layouts: &[Vec<UnitLayout>],
    model: &mut HostModel,
) -> Result<(), RestoreFailure> {
    let mut res = Resources::default();
    let result = restore_units(platform, collective, sequence, masters, layouts, model, &mut res);
    res.release(platform, collective.stream());
    result
}

fn restore_units(
    platform: &PlatformRef,
    collective: &CollectiveHandle,
    sequence: &GatherSequence,
    masters: &mut [ShardedMasters],
    layouts: &[Vec<UnitLayout>],
    model: &mut HostModel,
    res: &mut Resources,
) -> Result<(), RestoreFailure> {
    let local = |e: PlatformError| RestoreFailure::Local(e.into());
    let (in_len, out_len) = buffer_sizes(masters, layouts);
    let input = *res.input.insert(platform.alloc_device(in_len.max(1)).map_err(local)?);
    let output = *res.output.insert(platform.alloc_device(out_len.max(1)).map_err(local)?);
    let ready = *res.ready.insert(platform.create_event().map_err(local)?);
    let h2d = *res.h2d.insert(platform.create_stream("restore-h2d").map_err(local)?);
    let d2h = *res.d2h.insert(platform.create_stream("restore-d2h").map_err(local)?);
    let mut first_local: Option<ModelError> = None;
    for (si, (m, ls)) in masters.iter_mut().zip(layouts).enumerate() {
        for (ui, (unit, layout)) in m.units.iter_mut().zip(ls).enumerate() {
            // 1. This rank's shards of the unit on the device, observed: a peer must never gather stale bytes.
            let mut chunks = Vec::new();
            let mut off = 0u64;
            for (k, s) in unit.sections.iter().enumerate() {
                for c in s.spec.chunks() {
                    if c.shard_bytes > 0 {
                        platform.copy_h2d(h2d, s.host, c.shard_offset, input, off, c.shard_bytes).map_err(local)?;
                    }
                    chunks.push((k, c, off, s.device_offset));
                    off += c.shard_bytes;
                }
            }
            platform.stream_synchronize(h2d).map_err(local)?;
            // 2. The AllGathers, numbered right after everything this rank gathered so far, observed.
            gather_unit(collective, sequence, (si, ui), &chunks, Buffers { input, output, ready })?;
            platform.event_synchronize(ready).map_err(RestoreFailure::Collective)?;
            // 3. Every AllGather of the unit completed here: nobody needs this rank's shards of it any more.
            for s in std::mem::take(&mut unit.sections) {
                if let Err(e) = platform.free_host(s.host) {
                    first_local.get_or_insert(e.into());
                }
            }
            // 4. The released storages of the unit, device → host; a failure here is this rank's alone.
            if let Err(e) = read_back_unit(platform, d2h, output, layout, model) {
                first_local.get_or_insert(e);
            }
        }
    }
    match first_local {
        Some(e) => Err(RestoreFailure::Local(e)),
        None => Ok(()),
    }
}

/// The device side of one unit's restore gathers: the shard input, the gathered output and the event the
/// gathers wait on.
struct Buffers {
    input: DeviceBufferId,
    output: DeviceBufferId,
    ready: EventId,
}

/// Sends the AllGathers of unit `ui` of stack `si` (`(section, chunk, input offset, section device offset)` per
/// chunk) and waits until the collective actor has issued (or refused) every one.
fn gather_unit(
    collective: &CollectiveHandle,
    sequence: &GatherSequence,
    (si, ui): (usize, usize),
    chunks: &[(usize, weightferry_actors::shard::ShardChunk, u64, u64)],
    Buffers { input, output, ready }: Buffers,
) -> Result<(), RestoreFailure> {
    let board = Arc::new(TicketBoard::new());
    let first = sequence.claim(chunks.len() as u64);
    for (i, &(k, c, in_off, dev_off)) in chunks.iter().enumerate() {
        let cmd = GatherCmd {
            seq: first + i as u64,
            ticket: i as u64 + 1,
            target: usize::MAX,
            block: ui,
            waits: Vec::new(),
            input: (input, in_off, c.shard_bytes),
            output: (output, dev_off + c.gathered_offset),
            ready,
            tag: restore_tag(si, ui, k, c.index),
            board: Some(board.clone()),
            notify: None,
        };
        collective.gather(cmd).map_err(|e| RestoreFailure::Collective(e.into()))?;
    }
    let alive = || collective.is_alive();
    let last = chunks.len() as u64;
    if last == 0 {
        return Ok(());
    }
    match board.wait(last, &alive) {
        Some(_) => {}
        None => {
            let gone = PlatformError::Driver(format!("the collective actor stopped during gather #{first}"));
            return Err(RestoreFailure::Collective(gone));
        }
    }
    for t in 1..=last {
        if let Some(Err(e)) = board.poll(t) {
            return Err(RestoreFailure::Collective(e));
        }
    }
    Ok(())
}

/// Copies every released storage of `layout` out of the gathered unit in `output` into a new host buffer, observes
/// the copies, then makes each buffer its storage's loaded home. On a failure before that, every buffer made here
/// is freed (after the stream drained) and the unit's storages stay released.
fn read_back_unit(
    platform: &PlatformRef,
    stream: StreamId,
    output: DeviceBufferId,
    layout: &UnitLayout,
    model: &mut HostModel,
) -> Result<(), ModelError> {
    let mut made: Vec<(StorageId, HostBufferId)> = Vec::new();
    let copied = (|| -> Result<(), PlatformError> {
        for sec in &layout.sections {
            for &(s, off) in &sec.storages {
                if model.home(s) != Some(Home::Sharded) || made.iter().any(|(m, _)| *m == s) {
                    continue;
                }
                let len = model.storage_bytes(s);
                let buf = platform.alloc_host(len.max(1), HostMemoryKind::Pageable)?;
                made.push((s, buf));
                if len > 0 {
                    platform.copy_d2h(stream, output, sec.device_offset + off, buf, 0, len)?;
                }
            }
        }
        platform.stream_synchronize(stream)
    })();
    if let Err(e) = copied {
        // Nothing may still be writing into the buffers when they are freed.
        let _ = platform.stream_synchronize(stream);
        for (_, b) in made {
            let _ = platform.free_host(b);
        }
        return Err(e.into());
    }
    for (i, &(s, buf)) in made.iter().enumerate() {
        if let Err(e) = model.restore_from_shards(s, buf) {
            // Every storage was checked released above, so this is not expected; still, leave no buffer behind.
            for &(_, b) in &made[i..] {
                let _ = platform.free_host(b);
            }
            return Err(e);
        }
    }
    Ok(())
}
