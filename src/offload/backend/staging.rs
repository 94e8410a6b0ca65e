//! Staged masters: the host engine writes each streamed storage straight into the host master it will live in, so
//! `enable` adopts those masters instead of allocating them and copying every byte a second time.
//!
//! Without staging, a storage's bytes go from the engine (a torch tensor) into the storage's own loaded buffer, and
//! `enable` copies them into the unit's master: two copies of the whole model, and the loaded buffers and a batch of
//! masters in host memory at once. With staging, the first write of any storage of a unit's section allocates that
//! section's master (zeroed, the kind `enable` would allocate) and every write lands at the storage's offset in it;
//! the storage's home becomes the master at once and its loaded buffer (never touched) is freed. So host memory holds
//! about one copy of the weights while the engine hands them over storage by storage, and `enable` copies nothing.
//!
//! Only the sections `enable` will build a master for are staged: blocks of stacks streamed by this process (not a
//! distributed run's gathered stacks), from a model without checkpoint files, whose storages no other section
//! holds. A staged section `enable` does not take (a layout that changed) keeps working: its storages are read from
//! the staged master like from any home, and [`Staging::release`] gives them their own buffers back and frees it.
//!
//! A master is allocated without zero-filling ([`Platform::alloc_host_uninit`]) and its padding zeroed at once, so
//! each byte of it is written exactly once; `enable` takes only a master all of whose storages were written.
//!
//! [`Platform::alloc_host_uninit`]: weightferry_actors::platform::Platform::alloc_host_uninit

use crate::config::OffloadConfig;
use crate::model::{Home, HostModel, ModelError};
use crate::offload::layout::UnitLayout;
use crate::offload::units::build_unit_plan;
use crate::offload::OffloadError;
use crate::pipeline::{PipelineDesc, StorageId};
use crate::plan::ResolvedPlan;
use std::collections::HashMap;
use weightferry_actors::platform::{HostBufferId, HostMemoryKind, PlatformRef};

/// One section a master can be staged for.
#[derive(Debug)]
struct StagedSection {
    /// The unit's module path and the section's index in its layout.
    unit: String,
    index: usize,
    /// Bytes of the master (the section's length).
    len: u64,
    /// The master, once a write allocated it.
    buf: Option<HostBufferId>,
    /// `(offset, bytes)` of the master no storage covers (alignment padding): zeroed when it is allocated, the rest
    /// being written storage by storage.
    gaps: Vec<(u64, u64)>,
}

/// The ranges of a section of `len` bytes that none of `covered` (`(offset, bytes)`, in any order) covers.
fn gaps_of(len: u64, mut covered: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    covered.sort_unstable();
    let mut gaps = Vec::new();
    let mut at = 0;
    for (offset, bytes) in covered {
        if offset > at {
            gaps.push((at, offset - at));
        }
        at = at.max(offset + bytes);
    }
    if len > at {
        gaps.push((at, len - at));
    }
    gaps
}

/// The stageable sections of a plan and the masters written so far (see the module docs).
#[derive(Debug)]
pub(crate) struct Staging {
    kind: HostMemoryKind,
    sections: Vec<StagedSection>,
    /// Storage → (its section in `sections`, its offset in the master).
    slots: HashMap<StorageId, (usize, u64)>,
}

impl Staging {
    /// The stageable sections of `desc` under `config` and `plan`, with masters of `kind`: `None` when there are
    /// none.
    pub(crate) fn plan(
        desc: &PipelineDesc,
        config: &OffloadConfig,
        plan: &ResolvedPlan,
        kind: HostMemoryKind,
    ) -> Option<Staging> {
        let units = build_unit_plan(desc, config, plan);
        let layouts: Vec<&UnitLayout> = units.stacks.iter().filter(|s| !s.allgather).flat_map(|s| &s.units).collect();
        let mut count: HashMap<StorageId, usize> = HashMap::new();
        for s in units.stacks.iter().flat_map(|s| &s.units).flat_map(|u| &u.sections).flat_map(|s| &s.storages) {
            *count.entry(s.0).or_default() += 1;
        }
        let mut staging = Staging { kind, sections: Vec::new(), slots: HashMap::new() };
        for unit in layouts {
            for (index, sec) in unit.sections.iter().enumerate() {
                if sec.storages.iter().any(|(s, _)| count.get(s) != Some(&1)) {
                    continue; // a storage two sections hold is copied by enable, as without staging
                }
                let at = staging.sections.len();
                let covered = sec.storages.iter().map(|&(s, off)| (off, desc.storages[&s].byte_size())).collect();
                let gaps = gaps_of(sec.len, covered);
                staging.sections.push(StagedSection { unit: unit.path.clone(), index, len: sec.len, buf: None, gaps });
                staging.slots.extend(sec.storages.iter().map(|&(s, off)| (s, (at, off))));
            }
        }
        (!staging.slots.is_empty()).then_some(staging)
    }

    /// Writes `bytes` (exactly the storage's size: [`ModelError::WrongLength`] otherwise) into the storage's staged master,
    /// allocating the master at its section's first write, and makes it the storage's home. `Ok(false)`, with
    /// nothing done, for a storage no staged section holds. On an error nothing changed for the storage.
    pub(crate) fn write(
        &mut self,
        platform: &PlatformRef,
        model: &mut HostModel,
        storage: StorageId,
        bytes: &[u8],
    ) -> Result<bool, OffloadError> {
        let Some(&(at, offset)) = self.slots.get(&storage) else { return Ok(false) };
        let expected = model.storage_bytes(storage);
        if bytes.len() as u64 != expected {
            return Err(ModelError::WrongLength { storage: storage.0, expected, got: bytes.len() as u64 }.into());
        }
        let sec = &mut self.sections[at];
        let buf = match sec.buf {
            Some(buf) => buf,
            None => {
                // Every byte of the master is written: the storages one by one, the gaps here. No zeroing pass over
                // the whole buffer first (on a GPU host, a pass over the model's size in pinned memory).
                let buf = platform.alloc_host_uninit(sec.len.max(1), self.kind)?;
                let zeroed =
                    sec.gaps.iter().try_for_each(|&(at, n)| platform.write_host(buf, at, &vec![0; n as usize]));
                if let Err(e) = zeroed {
                    let _ = platform.free_host(buf);
                    return Err(e.into());
                }
                sec.buf = Some(buf);
                buf
            }
        };
        platform.write_host(buf, offset, bytes)?;
        model.adopt_master(storage, buf, offset)?;
        Ok(true)
    }

    /// Takes the staged masters of `unit`'s sections (`None` for a section with none, or whose storages are not
    /// all homed in it): the caller owns each one taken, with its storages homed in it.
    pub(crate) fn take(&mut self, model: &HostModel, unit: &UnitLayout) -> Vec<Option<HostBufferId>> {
        let mut taken = vec![None; unit.sections.len()];
        for sec in self.sections.iter_mut().filter(|s| s.unit == unit.path && s.buf.is_some()) {
            let Some(layout) = unit.sections.get(sec.index) else { continue };
            let buf = sec.buf.expect("filtered on a master");
            let homed =
                layout.storages.iter().all(|&(s, off)| model.home(s) == Some(Home::Master { buf, offset: off }));
            if homed && layout.len == sec.len {
                taken[sec.index] = sec.buf.take();
            }
        }
        taken
    }

    /// Gives every storage homed in a master not taken its own loaded buffer back (a copy) and frees the masters.
    /// A storage that cannot be restored keeps its master, which is then not freed, and the first error is
    /// returned after every other one was tried.
    pub(crate) fn release(&mut self, platform: &PlatformRef, model: &mut HostModel) -> Result<(), OffloadError> {
        let mut first = None;
        let mut storages_of: HashMap<usize, Vec<StorageId>> = HashMap::new();
        for (&s, &(at, _)) in &self.slots {
            storages_of.entry(at).or_default().push(s);
        }
        for (at, sec) in self.sections.iter_mut().enumerate() {
            let Some(buf) = sec.buf else { continue };
            let mut restored = true;
            for &s in storages_of.get(&at).into_iter().flatten() {
                if !matches!(model.home(s), Some(Home::Master { buf: b, .. }) if b == buf) {
                    continue;
                }
                if let Err(e) = model.restore_loaded(s) {
                    first.get_or_insert(OffloadError::from(e));
                    restored = false;
                }
            }
            if restored {
                if let Err(e) = platform.free_host(buf) {
                    first.get_or_insert(e.into());
                }
                sec.buf = None;
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Whether any master is still staged (not taken, not released).
    pub(crate) fn holds_masters(&self) -> bool {
        self.sections.iter().any(|s| s.buf.is_some())
    }
}

impl super::StreamingBackend {
    /// Lets the host engine write the storages `plan` streams straight into their masters from now until `enable`
    /// (see the module docs): for a model without checkpoint files, with `plan` what this backend will enable.
    pub(crate) fn begin_staging(&mut self, model: &HostModel, plan: &ResolvedPlan) {
        if !model.mapped_files().is_empty() || self.enabled {
            return;
        }
        let kind = if self.config.pin_memory { HostMemoryKind::Pinned } else { HostMemoryKind::Pageable };
        self.staging = Staging::plan(model.desc(), &self.config, plan, kind);
    }

    /// Writes a storage's bytes into its staged master, before `enable`: `Ok(false)`, with nothing done, when
    /// nothing is staged for it (the caller writes its loaded buffer).
    pub(crate) fn stage_write(
        &mut self,
        model: &mut HostModel,
        storage: StorageId,
        bytes: &[u8],
    ) -> Result<bool, OffloadError> {
        match self.staging.as_mut().filter(|_| !self.enabled) {
            Some(staging) => staging.write(&self.platform, model, storage, bytes),
            None => Ok(false),
        }
    }

    /// Takes the staged masters of `units` into `st` (their bytes and storages counted as built and adopted, so a
    /// rollback restores and frees them like any master): per unit, per section, the master or `None`.
    pub(super) fn take_staged(
        &mut self,
        st: &mut super::State,
        model: &HostModel,
        units: &[UnitLayout],
    ) -> Vec<Vec<Option<HostBufferId>>> {
        let Some(staging) = self.staging.as_mut() else {
            return units.iter().map(|u| vec![None; u.sections.len()]).collect();
        };
        let taken: Vec<Vec<Option<HostBufferId>>> = units.iter().map(|u| staging.take(model, u)).collect();
        for (unit, bufs) in units.iter().zip(&taken) {
            for (sec, buf) in unit.sections.iter().zip(bufs) {
                if let Some(buf) = *buf {
                    st.masters.push(buf);
                    st.master_bytes += sec.len;
                    st.adopted.extend(sec.storages.iter().map(|&(s, _)| s));
                }
            }
        }
        taken
    }

    /// Ends staging: a master still staged gives its storages their own buffers back and is freed.
    pub(super) fn release_staging(&mut self, model: &mut HostModel) -> Result<(), OffloadError> {
        match self.staging.take() {
            Some(mut staging) => {
                let released = staging.release(&self.platform, model);
                if staging.holds_masters() {
                    self.staging = Some(staging); // kept for a retry of disable
                }
                released
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
