//! The distributed part of the streaming backend: what a backend holds when some of its stacks rebuild their blocks
//! by AllGather over a group of ranks.
//!
//! A [`Group`] owns the rank's collective actor (spawned from the host engine's [`CollectiveFactory`] at the first
//! `enable` and warmed up there, kept across `disable` / `enable` cycles so the communicator is set up once), the
//! rank's gather numbering, and per gathered stack the rank's sharded host masters. Building a unit's shards
//! releases the model's loaded host copy of the unit's storages ([`HostModel::release_to_shards`]), so while offload
//! is enabled the rank holds only its 1/N of every gathered block and the group holds one copy. `disable` restores
//! them by one final gather to host ([`restore_released`]).
//!
//! Invariants: every rank builds the same gathered stacks in the same order and tags each AllGather by position
//! ([`tag_of`]), so every rank issues the same AllGathers in the same order (invariant 4); no block is gathered
//! before the first `pre_forward` (gather stacks never prefetch at enable); once the collective is poisoned no
//! further collective is issued, the storages not restored stay [`Home::Sharded`] (a typed error to every read,
//! never stale bytes) and the error says to reload the pipeline (invariant 8).

use super::distributed::{build_sharded_masters, ShardedMasters};
use super::layout::UnitLayout;
use super::shard_restore::{restore_released, RestoreFailure};
use super::tags::{tag_of, MAX_STACKS};
use super::OffloadError;
use crate::model::{Home, HostModel};
use crate::pipeline::StorageId;
use std::collections::HashMap;
use weightferry_actors::collective_actor::{CollectiveFactory, CollectiveHandle};
use weightferry_actors::platform::{HostMemoryKind, PlatformRef};
use weightferry_actors::{GatherBlock, GatherPath, GatherSection, GatherSequence};

/// Name of a rank's comm stream (the collective actor's stream).
pub const COMM_STREAM: &str = "comm";

/// Which block each AllGather gathers, by tag: the unit's module path (for naming trace spans).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GatherNames(HashMap<u64, String>);

impl GatherNames {
    /// The module path of the block that the AllGather tagged `tag` gathers, if one of this backend's.
    pub fn name(&self, tag: u64) -> Option<&str> {
        self.0.get(&(tag >> 28)).map(String::as_str)
    }

    /// As a trace namer: the block's path for its AllGathers.
    pub fn into_namer(self) -> crate::platform::timeline::GatherNamer {
        std::sync::Arc::new(move |tag| self.name(tag).map(str::to_string))
    }

    /// Names every gathered stack's units: `stacks[gi][ui]` is unit `ui`'s path in gathered stack `gi`.
    pub(crate) fn of<'a>(stacks: impl IntoIterator<Item = impl IntoIterator<Item = &'a str>>) -> Self {
        let mut m = HashMap::new();
        for (gi, units) in stacks.into_iter().enumerate() {
            for (ui, path) in units.into_iter().enumerate() {
                // Every chunk of every section of a unit shares the tag's bits above the section index.
                m.insert(tag_of(gi, ui, 0, 0) >> 28, path.to_string());
            }
        }
        GatherNames(m)
    }
}

/// The communicator a backend gathers over: the host engine's factory until the first `enable` starts it, then the
/// running collective actor and the rank's gather numbering (which continues across enable cycles).
pub(crate) struct Communicator {
    /// Behind a lock only so the backend stays `Sync` (the factory is `Send`, not `Sync`); taken once.
    factory: std::sync::Mutex<Option<CollectiveFactory>>,
    running: Option<(CollectiveHandle, GatherSequence)>,
}

impl Communicator {
    /// A communicator that `factory` builds (on the collective actor's thread) at the first `enable`.
    pub(crate) fn new(factory: CollectiveFactory) -> Communicator {
        Communicator { factory: std::sync::Mutex::new(Some(factory)), running: None }
    }

    /// Starts the collective actor if needed (warming the communicator up with one small AllGather, which every
    /// rank issues first) and checks that its group has `world` ranks and is not poisoned.
    pub(crate) fn start(
        &mut self,
        platform: &PlatformRef,
        world: usize,
    ) -> Result<(CollectiveHandle, GatherSequence), OffloadError> {
        if self.running.is_none() {
            let taken = self.factory.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            let Some(make) = taken else {
                return Err(OffloadError::Unsupported(
                    "the backend's collective could not be started earlier; create a new backend with a new \
                     collective"
                        .into(),
                ));
            };
            let handle = CollectiveHandle::spawn(platform.clone(), COMM_STREAM, make)?;
            let sequence = GatherSequence::new();
            self.running = Some((handle.clone(), sequence.clone()));
            if handle.world() == world && handle.rank() < world {
                handle.warm_up(sequence.claim(1))?;
            }
        }
        let Some((handle, sequence)) = &self.running else {
            return Err(OffloadError::Unsupported("the backend's collective is not running".into()));
        };
        if handle.world() != world || handle.rank() >= world {
            return Err(OffloadError::GroupMismatch { rank: handle.rank(), world: handle.world(), expected: world });
        }
        if let Some(cause) = handle.poisoned() {
            return Err(OffloadError::Poisoned { rank: handle.rank(), cause, unrestored: 0 });
        }
        Ok((handle.clone(), sequence.clone()))
    }

    /// The running actor, if started.
    pub(crate) fn handle(&self) -> Option<&CollectiveHandle> {
        self.running.as_ref().map(|(h, _)| h)
    }

    /// Stops the actor, drops the communicator and destroys the comm stream (idempotent).
    pub(crate) fn shutdown(&self) {
        if let Some(h) = self.handle() {
            // A second call finds the stream gone (`InvalidHandle`): nothing left to release.
            let _ = h.destroy();
        }
    }
}

/// What an enabled backend holds for its gathered stacks.
pub(crate) struct Group {
    pub(crate) collective: CollectiveHandle,
    pub(crate) sequence: GatherSequence,
    /// Per gathered stack: the rank's shard masters, unit by unit.
    pub(crate) masters: Vec<ShardedMasters>,
    /// Per gathered stack: the layouts of its units (same order as `masters`).
    pub(crate) layouts: Vec<Vec<UnitLayout>>,
    /// Per gathered stack: its AllGathers, block by block.
    pub(crate) blocks: Vec<Vec<GatherBlock>>,
    /// Storages released to the shards, in release order.
    pub(crate) released: Vec<StorageId>,
    /// Loaded host bytes released.
    pub(crate) released_bytes: u64,
    /// AllGathers issued before this enable (the warm-up and earlier cycles), so reports count this cycle only.
    pub(crate) issued_before: usize,
}

impl Group {
    /// An empty group over a started communicator.
    pub(crate) fn new(collective: CollectiveHandle, sequence: GatherSequence) -> Group {
        let issued_before = collective.issued().len();
        Group {
            collective,
            sequence,
            masters: Vec::new(),
            layouts: Vec::new(),
            blocks: Vec::new(),
            released: Vec::new(),
            released_bytes: 0,
            issued_before,
        }
    }

    /// Builds the rank's shard masters of one stack's `units` (unit by unit, releasing each unit's loaded storages
    /// as soon as its shards exist), records where each storage sits in its block into `locations` under stack
    /// index `si`, and returns the stack's gathered index. On failure what was built stays recorded, so teardown
    /// frees and restores it.
    pub(crate) fn add_stack(
        &mut self,
        model: &mut HostModel,
        units: &[UnitLayout],
        kind: HostMemoryKind,
        chunk_bytes: Option<u64>,
        si: usize,
        locations: &mut HashMap<StorageId, (usize, usize, u64)>,
    ) -> Result<usize, OffloadError> {
        let gi = self.masters.len();
        if gi >= MAX_STACKS {
            return Err(OffloadError::Unsupported(format!(
                "the plan gathers more than {MAX_STACKS} block stacks; gather fewer components by AllGather"
            )));
        }
        let (rank, world) = (self.collective.rank(), self.collective.world());
        self.masters.push(ShardedMasters { rank, world, units: Vec::with_capacity(units.len()) });
        self.layouts.push(Vec::with_capacity(units.len()));
        self.blocks.push(Vec::with_capacity(units.len()));
        for (ui, unit) in units.iter().enumerate() {
            let built = build_sharded_masters(model, std::slice::from_ref(unit), world, rank, kind, chunk_bytes)
                .map_err(OffloadError::Shards)?;
            self.masters[gi].units.extend(built.units);
            self.layouts[gi].push(unit.clone());
            for s in unit.storages() {
                if matches!(model.home(s), Some(Home::Loaded { .. })) {
                    model.release_to_shards(s)?;
                    self.released.push(s);
                    self.released_bytes += model.storage_bytes(s);
                }
            }
            for sec in &unit.sections {
                for &(s, off) in &sec.storages {
                    locations.insert(s, (si, ui, sec.device_offset + off));
                }
            }
            let sharded = &self.masters[gi].units[ui];
            let sections = sharded
                .sections
                .iter()
                .enumerate()
                .flat_map(|(k, s)| {
                    s.spec.chunks().map(move |c| GatherSection {
                        host: s.host,
                        host_offset: c.shard_offset,
                        shard_bytes: c.shard_bytes,
                        output_offset: s.device_offset + c.gathered_offset,
                        tag: tag_of(gi, ui, k, c.index),
                    })
                })
                .collect();
            self.blocks[gi].push(GatherBlock { sections });
        }
        Ok(gi)
    }

    /// The gather path of gathered stack `gi`.
    pub(crate) fn path(&self, gi: usize) -> GatherPath {
        GatherPath {
            collective: self.collective.clone(),
            sequence: self.sequence.clone(),
            blocks: self.blocks.get(gi).cloned().unwrap_or_default(),
        }
    }

    /// Host bytes of the rank's shard masters.
    pub(crate) fn shard_host_bytes(&self) -> u64 {
        self.masters.iter().map(ShardedMasters::host_bytes).sum()
    }

    /// Gives every released storage a loaded host buffer again by one final gather to host (the stacks' slots must
    /// be freed first: the restore needs one unit's worth of device memory), then frees the shards. Returns the
    /// restore's `(sequence number, tag)`s. On failure the storages not restored stay [`Home::Sharded`], every
    /// shard is freed, and the error is [`OffloadError::Poisoned`] (the collective is unusable) or
    /// [`OffloadError::RestoreFailed`] (this rank failed alone); either way the pipeline must be reloaded.
    pub(crate) fn restore_and_free(
        mut self,
        platform: &PlatformRef,
        model: &mut HostModel,
    ) -> Result<Vec<(u64, u64)>, OffloadError> {
        let rank = self.collective.rank();
        let mut outcome = Ok(Vec::new());
        if !self.released.is_empty() {
            let before = self.collective.issued().len();
            let r = match self.collective.poisoned() {
                Some(cause) => Err(RestoreFailure::Collective(cause)),
                None => match self.collective.fence() {
                    Err(e) => Err(RestoreFailure::Collective(e.into())),
                    Ok(()) => restore_released(
                        platform,
                        &self.collective,
                        &self.sequence,
                        &mut self.masters,
                        &self.layouts,
                        model,
                    ),
                },
            };
            let unrestored = self.released.iter().filter(|s| model.home(**s) == Some(Home::Sharded)).count();
            outcome = match r {
                Ok(()) => Ok(self.collective.issued().split_off(before)),
                Err(RestoreFailure::Collective(cause)) => Err(OffloadError::Poisoned { rank, cause, unrestored }),
                Err(RestoreFailure::Local(e)) => {
                    Err(OffloadError::RestoreFailed { rank, unrestored, cause: e.to_string() })
                }
            };
        }
        let mut freed = Ok(());
        for m in std::mem::take(&mut self.masters) {
            if let Err(e) = m.free(platform) {
                freed = freed.and(Err(OffloadError::from(e)));
            }
        }
        let issued = outcome?;
        freed?;
        Ok(issued)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_of_every_section_of_a_unit_is_named_by_that_unit() {
        let names = GatherNames::of([vec!["dit.blocks.0", "dit.blocks.1"], vec!["enc.block.0"]]);
        assert_eq!(names.name(tag_of(0, 0, 0, 0)), Some("dit.blocks.0"));
        assert_eq!(names.name(tag_of(0, 1, 3, 17)), Some("dit.blocks.1"));
        assert_eq!(names.name(tag_of(1, 0, 255, (1 << 20) - 1)), Some("enc.block.0"));
        assert_eq!(names.name(tag_of(0, 2, 0, 0)), None);
        assert_eq!(names.name(tag_of(2, 0, 0, 0)), None);
        assert_eq!(names.name(weightferry_actors::collective_actor::WARM_UP_TAG), None);
    }
}
