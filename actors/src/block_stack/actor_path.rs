//! The copy-stream actor path ([`Submission::Actor`](super::Submission::Actor)): a load is a [`LoadCmd`] sent to
//! the stack's stream actor, which enqueues the GPU-side waits, the flat copies and the record of the slot's ready
//! event on its copy stream, publishes "recorded" on the stack's ticket board, and reports completion (through its
//! watcher, or itself) in the stack's mailbox. The hook thread never calls the driver for a copy.
//!
//! The resident head loads this way in every mode (hook submission and gather stacks included), once, at creation.

use super::{BlockSpec, BlockStack, Inner, Load, LoadPath};
use crate::error::SchedulerError;
use crate::messages::{CopyDirection, CopyOp, LoadCmd};
use crate::platform::DeviceBufferId;
use crate::slot::Ticket;
use crate::sync::lock;

/// The flat copies that load `b` into the region at the start of `dst`.
pub(super) fn copies_for(b: &BlockSpec, dst: DeviceBufferId) -> Vec<CopyOp> {
    b.segments
        .iter()
        .map(|s| CopyOp {
            direction: CopyDirection::HostToDevice,
            host: s.host,
            host_offset: s.host_offset,
            device: dst,
            device_offset: s.device_offset,
            len: s.len,
        })
        .collect()
}

/// Sends the load of `load.block` into `load.slot` to the stream actor. The slot stays `Loading` until the board
/// says the load is recorded. A failed send (the actor is gone) fails the hook without poisoning the stack.
pub(super) fn issue(st: &BlockStack, g: &mut Inner, load: &Load<'_>) -> Result<(), SchedulerError> {
    let spec = &st.blocks[load.block];
    let copies = copies_for(spec, g.mem.slot_bufs[load.slot]);
    g.stats.loads += 1;
    g.stats.h2d_bytes += spec.copy_bytes();
    send(
        st,
        spec,
        LoadCmd {
            ticket: load.ticket,
            target: load.slot,
            block: load.block,
            waits: load.waits.to_vec(),
            copies,
            ready: g.mem.ready_ev[load.slot],
            staged: None,
            board: st.board.clone(),
            notify: Some(g.notify.clone()),
        },
    )
}

/// Sends a load of `spec` to the stream actor, or through the stack's reader (with the block's file reads) when the
/// stack has one: then every load of the stack goes through it, in ticket order.
fn send(st: &BlockStack, spec: &BlockSpec, cmd: LoadCmd) -> Result<(), SchedulerError> {
    match &st.path {
        LoadPath::Disk(reader) => reader.load(cmd, spec.reads.clone()),
        _ => st.stream.load(cmd),
    }
}

/// Waits (without the stack's lock) until load `ticket` of `block` is recorded on the stream board.
pub(super) fn wait_recorded(st: &BlockStack, ticket: Ticket, block: usize) -> Result<(), SchedulerError> {
    match st.wait_ticket(&st.board, ticket, &|| st.done_alive()) {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(SchedulerError::LoadFailed { stack: st.name.to_string(), block, source: e }),
        None => Err(SchedulerError::ActorGone { actor: st.done_actor() }),
    }
}

/// Loads every resident block through the stream actor and waits until all of them completed (creation only).
/// Every head load's enqueue result is checked, not just the last one's: a failed early copy fails creation.
pub(super) fn load_resident_head(st: &BlockStack) -> Result<(), SchedulerError> {
    let mut g = lock(&st.inner);
    if !g.ring.has_resident() {
        return Ok(());
    }
    let ready = g.mem.resident_ev.ok_or_else(|| SchedulerError::InvalidSpec {
        stack: st.name.to_string(),
        reason: "resident head without its event".into(),
    })?;
    let mut tickets = Vec::new();
    for (i, spec) in st.blocks.iter().enumerate() {
        let Some(dst) = g.mem.resident_bufs[i] else { continue };
        let ticket = g.ring.take_ticket();
        g.stats.loads += 1;
        g.stats.h2d_bytes += spec.copy_bytes();
        send(
            st,
            spec,
            LoadCmd {
                ticket,
                target: usize::MAX,
                block: i,
                waits: Vec::new(),
                copies: copies_for(spec, dst),
                ready,
                staged: None,
                board: st.board.clone(),
                notify: None,
            },
        )?;
        tickets.push((ticket, i));
    }
    drop(g);
    for &(ticket, block) in &tickets {
        wait_recorded(st, ticket, block)?;
    }
    // The head must be complete before any compute reads it; this runs once, at creation.
    let fenced = match &st.path {
        LoadPath::Disk(reader) => reader.fence(),
        _ => st.stream.fence(),
    };
    fenced.map_err(|e| match e {
        SchedulerError::Platform(source) => {
            SchedulerError::LoadFailed { stack: st.name.to_string(), block: tickets.first().map_or(0, |t| t.1), source }
        }
        e => e,
    })
}
