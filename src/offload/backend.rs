//! The streaming backend: the one machine all three strategies run on.
//!
//! `enable` resolves the plan (pure; `enable_planned` takes it resolved), builds the unit plan, then commits step
//! by step — copy-stream actor, fixed placement, host masters (one flat buffer per unit per dtype; each storage's loaded buffer is freed as soon as its
//! bytes are in a master, so the model never exists twice in host memory), block-stack actors, hooks — and undoes
//! every committed step if a later one fails. `disable` waits for all device work, frees device memory, removes its
//! hooks, and gives each storage its own host buffer back with a real copy out of the master; if that fails it keeps
//! the masters so a second `disable` can finish.
//!
//! `backend/write_through.rs`: writes while enabled (new bytes become the host copy; device copies are refreshed).

mod disk;
mod staging;
mod write_through;

use super::disk_tier::master_part;
use super::group::{Communicator, GatherNames, Group};
use super::layout::{write_section, UnitLayout, MASTER_BOUNCE_BYTES};
use super::mapped::{order_by_files, plan_sections, MappedSection, ServedSections};
use super::resident::ResidentPlacement;
use super::units::{build_unit_plan, UnitPlan};
use super::{OffloadError, WeightSource};
use crate::config::{HostMasters, OffloadConfig, Strategy};
use crate::hooks::{HookFailure, HookRegistry, ModelHook, Residency};
use crate::model::HostModel;
use crate::pipeline::StorageId;
use crate::plan::{resolve_offload_plan, ResolvedPlan};
use serde::Serialize;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use weightferry_actors::platform::{DeviceBufferId, HostBufferId, HostMemoryKind, PlatformRef, StreamId};
use weightferry_actors::{
    BlockSpec, BlockStack, OrderingFault, Segment, StackSpec, StackStats, StreamHandle, StreamOptions,
};

/// Per-stack figures for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StackReport {
    /// Stack name.
    pub name: String,
    /// Units (blocks, or whole components for model-level swapping).
    pub units: usize,
    /// Units kept resident.
    pub resident: usize,
    /// Prefetch depth (0 = staged).
    pub depth: usize,
    /// Loads issued.
    pub loads: u64,
    /// Bytes copied host → device.
    pub h2d_bytes: u64,
    /// Blocks found prefetched.
    pub prefetch_hits: u64,
    /// Blocks found still in a released slot.
    pub reuse_hits: u64,
    /// Blocks fetched synchronously.
    pub sync_fetches: u64,
    /// Hook calls that waited on the host for the copy actor to enqueue their block's load (the host-side stalls
    /// of a hook; the device may still have been busy).
    pub record_waits: u64,
    /// Device bytes held.
    pub device_bytes: u64,
    /// Who enqueued the streamed loads: `"actor"` (the copy-stream actor) or `"hook"` (the hooks themselves).
    pub submission: String,
    /// Load completions observed so far: by the completion watcher, or in hook mode by the hooks' polling (a slot's
    /// loads are observed once its latest load completed, so they may lag until a fence or disable).
    pub completions: u64,
}

/// What an enabled backend holds and did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BackendReport {
    /// Strategy name.
    pub strategy: String,
    /// Whether it is enabled.
    pub enabled: bool,
    /// Stacks.
    pub stacks: Vec<StackReport>,
    /// Device bytes of the fixed placement.
    pub fixed_device_bytes: u64,
    /// Host bytes of masters (pinned, or pageable with `pin_memory = false`).
    pub master_host_bytes: u64,
    /// Bytes of streamed sections served straight from their checkpoint files (mapped, registered; no master).
    pub mapped_host_bytes: u64,
    /// Bytes of the units the disk tier reads from their checkpoint files on every pass (no master, no mapping).
    pub disk_bytes: u64,
    /// Host bytes of the disk tier's staging buffers.
    pub staging_host_bytes: u64,
    /// Checkpoint files the disk tier reads through the page cache, because their filesystem refuses `O_DIRECT`
    /// (their pages then stay in the page cache, outside the host budget).
    pub buffered_files: Vec<String>,
    /// Whether masters are pinned.
    pub pinned: bool,
    /// Distributed layerwise offload: this rank's part of the group.
    pub group: Option<GroupReport>,
}

/// What a rank of a distributed backend holds and gathered.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GroupReport {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// Host bytes of the rank's shard masters (padding included).
    pub shard_host_bytes: u64,
    /// Loaded host bytes released to the group's shards at enable (restored at disable).
    pub released_bytes: u64,
    /// Storages released to the group's shards.
    pub released_storages: usize,
    /// AllGathers this rank issued since this enable.
    pub all_gathers: u64,
    /// AllGathers of the communicator's lifetime that ran between symmetric windows.
    pub windowed_all_gathers: u64,
}

/// The hook of one unit of a block stack: `pre_forward` / `post_forward` of its module become the stack's, and
/// `pre_forward` hands the engine the block's location with its storages' offsets.
pub(crate) struct StackHook {
    pub(crate) stack: Arc<BlockStack>,
    pub(crate) unit: usize,
    /// Offset of each of the unit's storages inside its block region.
    pub(crate) offsets: Arc<HashMap<StorageId, u64>>,
}

impl ModelHook for StackHook {
    fn pre_forward(&self, _module: &str) -> Result<Option<Residency>, HookFailure> {
        let loc = self.stack.pre_forward(self.unit)?;
        Ok(Some(Residency { buffer: loc.buffer, base: loc.offset, offsets: self.offsets.clone() }))
    }
    fn post_forward(&self, _module: &str) -> Result<(), HookFailure> {
        Ok(self.stack.post_forward(self.unit)?)
    }
}

/// What a captured forward copies for one static unit ([`StreamingBackend::capture_unit`]).
#[derive(Debug, Clone)]
pub struct CaptureUnit {
    /// Where the unit's bytes are now (its slot, loaded or loading, or its resident region), if anywhere:
    /// `(device buffer, offset)`.
    pub location: Option<(DeviceBufferId, u64)>,
    /// Its flat copies from host memory.
    pub segments: Vec<weightferry_actors::Segment>,
    /// Whether the disk tier reads it from its file on every pass (no host copy to capture).
    pub from_disk: bool,
}

#[derive(Default)]
struct State {
    units: Option<UnitPlan>,
    stream: Option<StreamHandle>,
    placement_stream: Option<StreamId>,
    fixed: Option<ResidentPlacement>,
    masters: Vec<HostBufferId>,
    master_bytes: u64,
    /// Bytes of the sections served straight from their checkpoint files (no master).
    mapped_bytes: u64,
    /// Mapped files registered for device copies (they stay registered until the model unmaps them).
    registered: std::collections::BTreeSet<HostBufferId>,
    /// Storages whose home is one of our masters.
    adopted: Vec<StorageId>,
    stacks: Vec<Arc<BlockStack>>,
    /// The flat copies of every unit of every stack (kept so stacks can be rebuilt by `retune`).
    block_specs: Vec<Vec<BlockSpec>>,
    locations: HashMap<StorageId, (usize, usize, u64)>,
    hooks_installed: bool,
    /// Distributed: the collective, the sharded masters and what was released.
    group: Option<Group>,
    /// Per stack: its index among the gathered stacks, if it gathers.
    gathered: Vec<Option<usize>>,
    /// Distributed: the final restore failed (the pipeline must be reloaded; nothing is left to retry).
    group_failure: Option<OffloadError>,
    /// Distributed: the final restore's AllGathers.
    restore_log: Vec<(u64, u64)>,
    /// Per stack: the disk tier's reader, for a stack with units read from disk on every pass.
    readers: Vec<Option<weightferry_actors::ReaderHandle>>,
    /// Bytes of the units read from disk on every pass (no master).
    disk_bytes: u64,
    /// Host bytes of the readers' staging buffers.
    staging_bytes: u64,
    /// Checkpoint files the disk tier reads through the page cache (their filesystem refused `O_DIRECT`).
    buffered_files: Vec<String>,
}

/// Most section bytes of one batch of units whose masters are built in parallel (one thread per unit) before their
/// storages' loaded buffers are freed. Masters are filled in place through a bounce buffer, so this bounds the host
/// memory `enable` needs beyond the loaded model to about 2 GiB (plus one bounce buffer per thread, and a single unit
/// larger than the cap, which forms a batch of its own): 16 units of a large DiT (0.7 GB blocks) would be 11 GB.
/// 2 GiB still holds a few blocks of every preset, so a few threads pin and fill in parallel.
pub const MASTER_BATCH_BYTES: u64 = 2 << 30;

/// Most units of one batch (threads building masters at once), however small the units are.
pub const MASTER_BATCH_UNITS: usize = 16;

/// Splits units of `unit_bytes` (each unit's section bytes, in stack order) into consecutive batches: each batch
/// takes units in order while its total stays `<= max_bytes` and it has fewer than `max_units` units; a batch always
/// has at least one unit (a unit larger than `max_bytes` is a batch of its own) and `max_units` is taken as at least
/// 1. The ranges cover `0..unit_bytes.len()` in order without gaps; no units give no batches.
pub fn master_batches(unit_bytes: &[u64], max_bytes: u64, max_units: usize) -> Vec<Range<usize>> {
    let max_units = max_units.max(1);
    let mut out = Vec::new();
    let mut start = 0;
    let mut total = 0u64;
    for (i, &b) in unit_bytes.iter().enumerate() {
        if i > start && (i - start == max_units || total.saturating_add(b) > max_bytes) {
            out.push(start..i);
            start = i;
            total = 0;
        }
        total = total.saturating_add(b);
    }
    if start < unit_bytes.len() {
        out.push(start..unit_bytes.len());
    }
    out
}

/// Observes `enable` building host masters (for a progress display): called on the thread that calls `enable` with
/// `(bytes done, bytes total)` of the streamed units' masters — once with `done = 0` before the first, then after
/// each batch of masters (and each gathered stack's shards). Set with [`StreamingBackend::set_progress`].
#[derive(Clone)]
pub struct EnableProgress(Arc<dyn Fn(u64, u64) + Send + Sync>);

impl EnableProgress {
    /// An observer calling `f(done, total)`.
    pub fn new(f: impl Fn(u64, u64) + Send + Sync + 'static) -> Self {
        EnableProgress(Arc::new(f))
    }
}

impl std::fmt::Debug for EnableProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EnableProgress")
    }
}

/// Section bytes of one unit (its masters' size).
fn unit_bytes(u: &UnitLayout) -> u64 {
    u.sections.iter().map(|s| s.len).sum()
}

/// The backend for every strategy.
pub struct StreamingBackend {
    config: OffloadConfig,
    platform: PlatformRef,
    plan: Option<ResolvedPlan>,
    state: Option<State>,
    enabled: bool,
    ordering_fault: OrderingFault,
    /// The communicator of AllGather transfer, when the host engine gave one.
    communicator: Option<Communicator>,
    /// `(sequence number, tag)` of the final restore's AllGathers at the last disable.
    restore_log: Vec<(u64, u64)>,
    /// Observer of master building at `enable`.
    progress: Option<EnableProgress>,
    /// Masters the host engine wrote into before `enable` (see `staging.rs`).
    staging: Option<staging::Staging>,
}

impl Drop for StreamingBackend {
    /// Stops the collective actor (a backend that is still enabled keeps its hooks' errors typed: the stacks
    /// answer with the actor gone).
    fn drop(&mut self) {
        if let Some(c) = &self.communicator {
            c.shutdown();
        }
    }
}

impl std::fmt::Debug for StreamingBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingBackend")
            .field("strategy", &self.config.strategy)
            .field("enabled", &self.enabled)
            .finish()
    }
}

impl StreamingBackend {
    /// A disabled backend for `config` that moves blocks rank-locally (use
    /// [`get_offload_backend`](super::get_offload_backend) to gather them over a collective).
    pub fn new(config: OffloadConfig, platform: PlatformRef) -> Self {
        Self::with_collective(config, platform, None)
    }

    pub(crate) fn with_collective(
        config: OffloadConfig,
        platform: PlatformRef,
        communicator: Option<Communicator>,
    ) -> Self {
        StreamingBackend {
            config,
            platform,
            plan: None,
            state: None,
            enabled: false,
            ordering_fault: OrderingFault::None,
            communicator,
            restore_log: Vec::new(),
            progress: None,
            staging: None,
        }
    }

    /// `(sequence number, tag)` of every AllGather this rank's collective issued (the warm-up first), in issue
    /// order; empty without a collective.
    pub fn gather_log(&self) -> Vec<(u64, u64)> {
        self.communicator.as_ref().and_then(Communicator::handle).map_or_else(Vec::new, |h| h.issued())
    }

    /// The failure that poisoned this rank's collective, if an AllGather failed (the pipeline must then be reloaded).
    pub fn poisoned(&self) -> Option<weightferry_actors::platform::PlatformError> {
        self.communicator.as_ref().and_then(Communicator::handle).and_then(|h| h.poisoned())
    }

    /// AllGathers of the communicator's lifetime that ran between symmetric windows (0 without a collective).
    pub fn windowed_gathers(&self) -> u64 {
        self.communicator.as_ref().and_then(Communicator::handle).map_or(0, |h| h.windowed_gathers())
    }

    /// `(sequence number, tag)` of the final restore's AllGathers at the last `disable` (empty when nothing was
    /// released).
    pub fn restore_log(&self) -> &[(u64, u64)] {
        &self.restore_log
    }

    /// Observes master building at every later `enable` (`None`: no observer).
    pub fn set_progress(&mut self, progress: Option<EnableProgress>) {
        self.progress = progress;
    }

    /// While enabled, the module path of the unit each host master holds: `(buffer, unit path)` for every master of
    /// every stack (a distributed rank's shard masters included), in stack and unit order; empty when disabled.
    /// Lets a trace writer name a copy by the block it loads.
    pub fn master_units(&self) -> Vec<(HostBufferId, String)> {
        let Some(st) = &self.state else { return Vec::new() };
        let Some(units) = &st.units else { return Vec::new() };
        let mut out = Vec::new();
        for (sp, blocks) in units.stacks.iter().zip(&st.block_specs) {
            for (unit, block) in sp.units.iter().zip(blocks) {
                out.extend(block.segments.iter().map(|seg| (seg.host, unit.path.clone())));
            }
        }
        if let Some(g) = &st.group {
            for unit in g.masters.iter().flat_map(|m| &m.units) {
                out.extend(unit.sections.iter().map(|sec| (sec.host, unit.path.clone())));
            }
        }
        out
    }

    /// Which block each AllGather of this backend gathers, by tag (empty unless enabled with gathered stacks): for
    /// naming the spans of a device timeline.
    pub fn gather_names(&self) -> GatherNames {
        match self.state.as_ref().and_then(|st| st.group.as_ref()) {
            Some(g) => GatherNames::of(g.masters.iter().map(|m| m.units.iter().map(|u| u.path.as_str()))),
            None => GatherNames::default(),
        }
    }

    /// Test hook: run every stack with a deliberately broken ordering (to prove the hazard checks can fail).
    pub fn set_ordering_fault(&mut self, fault: OrderingFault) {
        self.ordering_fault = fault;
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.config.strategy
    }
    /// The config.
    pub fn config(&self) -> &OffloadConfig {
        &self.config
    }
    /// Whether hooks are installed and weights are offloaded.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }
    /// The plan resolved at the last `enable`.
    pub fn plan(&self) -> Option<&ResolvedPlan> {
        self.plan.as_ref()
    }

    /// The unit module paths of each rank-local stack with a static schedule (`static_slots`), in execution order;
    /// empty while not enabled.
    pub fn static_stacks(&self) -> Vec<Vec<String>> {
        let Some(units) = self.state.as_ref().and_then(|st| st.units.as_ref()) else { return Vec::new() };
        let stacks = units.stacks.iter().filter(|sp| sp.static_slots && !sp.allgather);
        stacks.map(|sp| sp.units.iter().map(|u| u.path.clone()).collect()).collect()
    }

    /// What a captured forward copies for static unit `module` (a unit of a stack with `static_slots`): where its
    /// bytes are now, and its flat copies (host buffer, offset, length, offset in the block).
    /// `None` for a module that is no unit of a rank-local static stack. Touches no device: a CUDA graph capture may
    /// be under way, where a query of an event would end it.
    pub fn capture_unit(&self, module: &str) -> Option<CaptureUnit> {
        let st = self.state.as_ref()?;
        let units = st.units.as_ref()?;
        for (i, sp) in units.stacks.iter().enumerate() {
            if !sp.static_slots || sp.allgather {
                continue;
            }
            if let Some(j) = sp.units.iter().position(|u| u.path == module) {
                let spec = &st.block_specs[i][j];
                return Some(CaptureUnit {
                    location: st.stacks[i].location(j).map(|l| (l.buffer, l.offset)),
                    segments: spec.segments.clone(),
                    from_disk: !spec.reads.is_empty(),
                });
            }
        }
        None
    }

    /// Discovers, places, builds masters and stacks, installs hooks. Transactional.
    pub fn enable(
        &mut self,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
    ) -> Result<(), OffloadError> {
        self.enable_with(model, hooks, compute, None)
    }

    /// [`enable`](Self::enable) with the plan already resolved: `plan` must be what
    /// [`resolve_offload_plan`] gives for `model`'s description under this backend's config (a caller that resolved
    /// it to report it need not resolve it again).
    pub fn enable_planned(
        &mut self,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
        plan: ResolvedPlan,
    ) -> Result<(), OffloadError> {
        self.enable_with(model, hooks, compute, Some(plan))
    }

    fn enable_with(
        &mut self,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
        plan: Option<ResolvedPlan>,
    ) -> Result<(), OffloadError> {
        if self.enabled {
            tracing::warn!("{} offload already enabled", self.config.strategy.report_name());
            return Ok(());
        }
        if self.state.is_some() {
            // A failed disable left state behind: finish it first.
            self.disable(model, hooks)?;
        }
        let plan = match plan {
            Some(plan) => plan,
            None => resolve_offload_plan(model.desc(), &self.config)?,
        };
        let mut units = build_unit_plan(model.desc(), &self.config, &plan);
        for sp in units.stacks.iter_mut().filter(|sp| !sp.allgather) {
            order_by_files(model.desc(), model, &mut sp.units);
        }
        self.plan = Some(plan);
        if units.is_empty() {
            let why = self
                .plan
                .as_ref()
                .and_then(|p| p.skip_reason.clone())
                .unwrap_or_else(|| "nothing to offload for this pipeline under this config".to_string());
            tracing::warn!("offload not enabled: {why}");
            return self.release_staging(model);
        }
        hooks.claim_offload(units.hook_name)?;
        let mut st = State { units: Some(units), ..Default::default() };
        match self.commit(&mut st, model, hooks, compute) {
            Ok(()) => {
                self.state = Some(st);
                self.enabled = true;
                // Every staged master was taken, unless a layout changed: those storages get their own buffers.
                if let Err(e) = self.release_staging(model) {
                    tracing::warn!("a staged master enable did not take could not be released: {e}");
                }
                Ok(())
            }
            Err(e) => {
                if let Err(released) = self.release_staging(model) {
                    tracing::error!("rollback after failed enable could not release the staged masters: {released}");
                }
                let hook_name = st.units.as_ref().map_or("", |u| u.hook_name);
                let rolled_back = Self::teardown(&self.platform, &mut st, model, hooks);
                if let Some(g) = st.group_failure.take() {
                    tracing::error!("rollback after failed enable could not restore the released weights: {g}");
                }
                if let Err(rollback) = rolled_back {
                    tracing::error!("rollback after failed enable was incomplete: {rollback}");
                    self.state = Some(st);
                } else {
                    hooks.release_offload(hook_name);
                }
                Err(e)
            }
        }
    }

    fn commit(
        &mut self,
        st: &mut State,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
    ) -> Result<(), OffloadError> {
        let units = st.units.clone().unwrap_or_else(|| UnitPlan { hook_name: "", stacks: vec![], fixed: vec![] });
        let mut served = self.plan_mapped(model, &units)?;
        let on_disk = disk::plan(model, self.config.host_budget, &units, &mut served);
        let (files, buffered) = disk::open_files(model, &units, &on_disk)?;
        st.buffered_files = buffered;
        self.register_files(st, &mut served)?;
        let stream = StreamHandle::spawn(self.platform.clone(), "copy", StreamOptions::default())?;
        st.stream = Some(stream.clone());
        let ps = self.platform.create_stream("placement")?;
        st.placement_stream = Some(ps);
        st.fixed = Some(ResidentPlacement::upload(&self.platform, model, &units.fixed, ps)?);

        let kind = if self.config.pin_memory { HostMemoryKind::Pinned } else { HostMemoryKind::Pageable };
        if let Some(comm) = self.communicator.as_mut().filter(|_| units.stacks.iter().any(|s| s.allgather)) {
            let (handle, sequence) = comm.start(&self.platform, self.config.group.size as usize)?;
            st.group = Some(Group::new(handle, sequence));
        }
        let total: u64 = units.stacks.iter().flat_map(|sp| &sp.units).map(unit_bytes).sum();
        let mut done = 0;
        let progress = self.progress.clone();
        let report = |done| {
            if let Some(p) = &progress {
                (p.0)(done, total);
            }
        };
        report(done);
        for (si, sp) in units.stacks.iter().enumerate() {
            if let Some(group) = st.group.as_mut().filter(|_| sp.allgather) {
                let gi = group.add_stack(model, &sp.units, kind, sp.chunk_bytes, si, &mut st.locations)?;
                st.gathered.push(Some(gi));
                let blocks = sp.units.iter().map(|u| BlockSpec {
                    segments: Vec::new(),
                    reads: Vec::new(),
                    device_bytes: u.device_bytes,
                });
                st.block_specs.push(blocks.collect());
                done += sp.units.iter().map(unit_bytes).sum::<u64>();
                report(done);
                continue;
            }
            st.gathered.push(None);
            let mut blocks = Vec::new();
            let sizes: Vec<u64> = sp.units.iter().map(unit_bytes).collect();
            let mut ui = 0;
            while ui < sp.units.len() {
                if on_disk.on_disk(si, ui) {
                    let mut spec = disk::block(st, model, &units, &files, (si, ui))?;
                    // Its sections not in a file (converted from another dtype) are copied from masters.
                    if let Some(rest) = master_part(model, &sp.units[ui]) {
                        let (rest, none) = (std::slice::from_ref(&rest), vec![vec![None; rest.sections.len()]]);
                        let staged = vec![vec![None; rest[0].sections.len()]];
                        let built = self.build_masters(st, model, (rest, &none, &staged), kind, si, ui)?;
                        spec.segments.extend(built.into_iter().flat_map(|b| b.segments));
                    }
                    blocks.push(spec);
                    ui += 1;
                    continue;
                }
                // The next run of units with masters, built in batches.
                let end = (ui..sp.units.len()).find(|&k| on_disk.on_disk(si, k)).unwrap_or(sp.units.len());
                for r in master_batches(&sizes[ui..end], MASTER_BATCH_BYTES, MASTER_BATCH_UNITS) {
                    let r = r.start + ui..r.end + ui;
                    let staged = self.take_staged(st, model, &sp.units[r.clone()]);
                    let batch = (&sp.units[r.clone()], &served[si][r.clone()], &staged[..]);
                    blocks.extend(self.build_masters(st, model, batch, kind, si, r.start)?);
                    done += sizes[r].iter().sum::<u64>();
                    report(done);
                }
                ui = end;
            }
            st.block_specs.push(blocks);
        }
        disk::readers(&self.platform, st, &stream, kind)?;
        Self::build_stacks_with(&self.platform, self.ordering_fault, st, &units, hooks, compute, &stream)
    }

    /// Creates the block stacks of `units` over the masters in `st` and installs their hooks.
    fn build_stacks_with(
        platform: &PlatformRef,
        ordering_fault: OrderingFault,
        st: &mut State,
        units: &UnitPlan,
        hooks: &HookRegistry,
        compute: StreamId,
        stream: &StreamHandle,
    ) -> Result<(), OffloadError> {
        for (si, (sp, blocks)) in units.stacks.iter().zip(&st.block_specs).enumerate() {
            let gather = st.gathered.get(si).copied().flatten().zip(st.group.as_ref());
            let spec = StackSpec {
                name: sp.name.clone(),
                blocks: blocks.clone(),
                resident_head: if gather.is_some() { 0 } else { sp.resident_head },
                prefetch_depth: sp.depth,
                static_slots: sp.static_slots,
                // Gathered blocks are never prefetched at enable: every rank's first AllGather happens inside the
                // same hook sequence.
                eager_prefetch: sp.eager && gather.is_none(),
                ordering_fault,
                submission: sp.submission,
            };
            let reader = st.readers.get(si).cloned().flatten();
            let stack = match (gather, reader) {
                (Some((gi, group)), _) => {
                    let none_resident = Some(vec![false; sp.units.len()]);
                    let path = group.path(gi);
                    BlockStack::with_gather(platform.clone(), spec, none_resident, compute, stream.clone(), path)?
                }
                (None, Some(reader)) => {
                    let resident = sp.resident_mask.clone();
                    BlockStack::with_reader(platform.clone(), spec, resident, compute, stream.clone(), reader)?
                }
                (None, None) => BlockStack::with_resident_set(
                    platform.clone(),
                    spec,
                    sp.resident_mask.clone(),
                    compute,
                    stream.clone(),
                )?,
            };
            st.stacks.push(Arc::new(stack));
        }
        st.hooks_installed = true;
        let mut offsets: HashMap<(usize, usize), HashMap<StorageId, u64>> = HashMap::new();
        for (&s, &(si, ui, off)) in &st.locations {
            offsets.entry((si, ui)).or_default().insert(s, off);
        }
        for (si, sp) in units.stacks.iter().enumerate() {
            for (ui, unit) in sp.units.iter().enumerate() {
                let offsets = Arc::new(offsets.remove(&(si, ui)).unwrap_or_default());
                let hook = Arc::new(StackHook { stack: st.stacks[si].clone(), unit: ui, offsets });
                hooks.register(&unit.path, units.hook_name, units.hook_name, hook)?;
            }
        }
        Ok(())
    }

    /// Changes prefetch depths and resident heads (any new config that keeps the same components and block stacks)
    /// without rebuilding host masters or the fixed placement: waits for outstanding work, then replaces the block
    /// stacks and their hooks. A config that would change what is streamed is refused before anything is touched
    /// (disable and enable instead). If building the new stacks fails, the backend stays enabled without hooks and
    /// `disable` still restores everything.
    pub fn retune(
        &mut self,
        config: OffloadConfig,
        model: &HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
    ) -> Result<(), OffloadError> {
        if self.state.is_none() {
            return Err(OffloadError::Unsupported("retune needs an enabled backend; call enable first".into()));
        }
        let plan = resolve_offload_plan(model.desc(), &config)?;
        self.retune_planned(config, plan, model, hooks, compute)
    }

    /// [`retune`](Self::retune) with the new config's plan already resolved (`plan` as for
    /// [`enable_planned`](Self::enable_planned), under `config`).
    pub fn retune_planned(
        &mut self,
        config: OffloadConfig,
        plan: ResolvedPlan,
        model: &HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
    ) -> Result<(), OffloadError> {
        let Some(st) = self.state.as_mut() else {
            return Err(OffloadError::Unsupported("retune needs an enabled backend; call enable first".into()));
        };
        let mut units = build_unit_plan(model.desc(), &config, &plan);
        // Ordered as enable ordered them (blocks read from a checkpoint in file order), or they never compare equal.
        for sp in units.stacks.iter_mut().filter(|sp| !sp.allgather) {
            order_by_files(model.desc(), model, &mut sp.units);
        }
        if config.strategy != self.config.strategy {
            let layerwise = [Strategy::LayerWise, Strategy::DistributedLayerWise];
            let why = if layerwise.contains(&config.strategy) && layerwise.contains(&self.config.strategy) {
                " (the new config's keys select it: resident layers under layer_options select the distributed \
                 layerwise strategy)"
            } else {
                ""
            };
            return Err(OffloadError::Unsupported(format!(
                "retune cannot switch from the {} strategy to {}{why}; disable and enable with the new config instead",
                self.config.strategy.report_name(),
                config.strategy.report_name()
            )));
        }
        let same = st.units.as_ref().is_some_and(|old| {
            old.hook_name == units.hook_name
                && old.fixed == units.fixed
                && old.stacks.len() == units.stacks.len()
                && old.stacks.iter().zip(&units.stacks).all(|(a, b)| a.name == b.name && a.units == b.units)
        });
        if !same || config.pin_memory != self.config.pin_memory {
            return Err(OffloadError::Unsupported(
                "retune can change prefetch depths, resident layers and the device budget, not which components or \
                 blocks are offloaded (or pinning); disable and enable with the new config instead"
                    .into(),
            ));
        }
        let Some(stream) = st.stream.clone() else {
            return Err(OffloadError::Unsupported("retune needs an enabled backend; call enable first".into()));
        };
        hooks.remove_owned_by(units.hook_name);
        let _ = hooks.claim_offload(units.hook_name);
        st.hooks_installed = false;
        for s in std::mem::take(&mut st.stacks) {
            s.disable()?;
        }
        st.units = Some(units.clone());
        self.config = config;
        self.plan = Some(plan);
        let st = self.state.as_mut().ok_or_else(|| OffloadError::Unsupported("backend state vanished".into()))?;
        let r = Self::build_stacks_with(&self.platform, self.ordering_fault, st, &units, hooks, compute, &stream);
        if r.is_err() {
            hooks.remove_owned_by(units.hook_name);
            let _ = hooks.claim_offload(units.hook_name);
            for s in std::mem::take(&mut st.stacks) {
                let _ = s.disable();
            }
        }
        r
    }

    /// How each section of each rank-local stack is served (`Some`: from its checkpoint file), decided before
    /// anything is allocated: with `host_masters = "mapped"`, a section that cannot be is an error here.
    fn plan_mapped(&self, model: &HostModel, units: &UnitPlan) -> Result<Vec<ServedSections>, OffloadError> {
        let mode = self.config.host_masters;
        if mode == HostMasters::Mapped && model.mapped_files().is_empty() {
            return Err(OffloadError::Unsupported(
                "host_masters = \"mapped\" needs weights read from a checkpoint (run --checkpoint, or enable(..., \
                 checkpoint=PATH)); use host_masters = \"auto\" or \"pinned\""
                    .into(),
            ));
        }
        units
            .stacks
            .iter()
            .map(|sp| {
                if sp.allgather {
                    return Ok(vec![Vec::new(); sp.units.len()]);
                }
                plan_sections(model, &sp.units, mode).map_err(|(path, dtype, why)| {
                    OffloadError::Unsupported(format!(
                        "host_masters = \"mapped\": the {dtype} tensors of `{path}` cannot be served from the \
                         checkpoint file: {why}; use host_masters = \"auto\" (pinned where the file's layout does \
                         not allow) or \"pinned\""
                    ))
                })
            })
            .collect()
    }

    /// Registers every file a section is served from, once. With `host_masters = "auto"` a file the platform will
    /// not register (a driver refusing to pin its pages) falls back to pinned masters for its sections, with a
    /// warning; with `"mapped"` that is an error.
    fn register_files(&self, st: &mut State, served: &mut [ServedSections]) -> Result<(), OffloadError> {
        let files: std::collections::BTreeSet<HostBufferId> =
            served.iter().flatten().flatten().flatten().map(|m| m.buf).collect();
        for buf in files {
            if st.registered.contains(&buf) {
                continue;
            }
            match self.platform.register_host(buf) {
                Ok(()) => {
                    st.registered.insert(buf);
                }
                Err(e) if self.config.host_masters == HostMasters::Auto => {
                    tracing::warn!("serving a checkpoint file's blocks from pinned masters instead: {e}");
                    for m in served.iter_mut().flatten().flatten() {
                        if m.is_some_and(|m| m.buf == buf) {
                            *m = None;
                        }
                    }
                }
                Err(e) => {
                    return Err(OffloadError::Unsupported(format!(
                        "host_masters = \"mapped\": the platform cannot register the checkpoint file for device \
                         copies ({e}); use host_masters = \"auto\" or \"pinned\""
                    )))
                }
            }
        }
        Ok(())
    }

    /// Builds the masters of a batch of units (in parallel: one thread per unit; each master is allocated and filled
    /// in place through a bounce buffer, see [`write_section`]), then moves their storages' homes into them, freeing
    /// the loaded buffers. A section served from its file (`Some` in the batch's second half; the file was
    /// registered by [`register_files`](Self::register_files)) gets no master: the copy reads the file's range and
    /// its storages keep their file home. A section with a staged master (the batch's third part, already in `st`,
    /// see [`take_staged`](Self::take_staged)) uses it as it is.
    /// `first_ui` is the index of the batch's first unit in its stack. Returns the units' flat copies.
    fn build_masters(
        &self,
        st: &mut State,
        model: &mut HostModel,
        (batch, served, staged): MasterBatch<'_>,
        kind: HostMemoryKind,
        si: usize,
        first_ui: usize,
    ) -> Result<Vec<BlockSpec>, OffloadError> {
        let built = fill_masters(&self.platform, model, batch, served, staged, kind);
        // Record every buffer first so a failure anywhere frees them all on rollback.
        let mut first_err = None;
        let mut per_unit = Vec::new();
        for b in built {
            match b {
                Ok(made) => {
                    for &(buf, len) in made.iter().flatten() {
                        st.masters.push(buf);
                        st.master_bytes += len;
                    }
                    per_unit.push(made);
                }
                Err((e, made)) => {
                    st.masters.extend(made);
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let mut specs = Vec::new();
        for (k, ((unit, made), mapped)) in batch.iter().zip(per_unit).zip(served).enumerate() {
            let mut segments = Vec::new();
            for (j, (sec, master)) in unit.sections.iter().zip(made).enumerate() {
                let device_offset = sec.device_offset;
                let staged_master = staged[k].get(j).copied().flatten();
                match (master.or_else(|| staged_master.map(|b| (b, sec.len))), mapped.get(j).copied().flatten()) {
                    (Some((buf, _)), _) => {
                        segments.push(Segment { host: buf, host_offset: 0, len: sec.len, device_offset });
                        // A staged master's storages are homed in it and adopted already (`take_staged`).
                        for &(s, off) in sec.storages.iter().filter(|_| staged_master.is_none()) {
                            model.adopt_master(s, buf, off)?;
                            st.adopted.push(s);
                        }
                    }
                    (None, Some(m)) => {
                        segments.push(Segment { host: m.buf, host_offset: m.offset, len: m.len, device_offset });
                        st.mapped_bytes += m.len;
                    }
                    (None, None) => {
                        return Err(OffloadError::Unsupported(format!(
                            "internal: section {j} of `{}` has neither a master nor a file range",
                            unit.path
                        )))
                    }
                }
                for &(s, off) in &sec.storages {
                    st.locations.insert(s, (si, first_ui + k, device_offset + off));
                }
            }
            specs.push(BlockSpec { segments, reads: Vec::new(), device_bytes: unit.device_bytes });
        }
        Ok(specs)
    }

    /// Undoes everything in `st`, in reverse order. Keeps masters whose storages could not be restored.
    fn teardown(
        platform: &PlatformRef,
        st: &mut State,
        model: &mut HostModel,
        hooks: &HookRegistry,
    ) -> Result<(), OffloadError> {
        let mut first: Option<OffloadError> = None;
        let hook_name = st.units.as_ref().map_or("", |u| u.hook_name);
        if st.hooks_installed {
            hooks.remove_owned_by(hook_name);
            // `remove_owned_by` also drops offload ownership; keep it until the caller releases it after a complete
            // teardown, so a backend holding state for a retry still excludes other strategies.
            let _ = hooks.claim_offload(hook_name);
            st.hooks_installed = false;
        }
        for s in std::mem::take(&mut st.stacks) {
            if let Err(e) = s.disable() {
                first.get_or_insert(e.into());
            }
        }
        // Destroying the placement stream waits for its uploads (and reports their failure, as synchronising did).
        if let Some(ps) = st.placement_stream.take() {
            if let Err(e) = platform.destroy_stream(ps) {
                first.get_or_insert(e.into());
            }
        }
        if let Some(mut f) = st.fixed.take() {
            if let Err(e) = f.release() {
                first.get_or_insert(e.into());
            }
        }
        // The gathered stacks' weights come back by one final gather to host (every rank does it at its disable,
        // in the same order); a failure there cannot be retried alone, so it is reported, not kept for a retry.
        if let Some(group) = st.group.take() {
            match group.restore_and_free(platform, model) {
                Ok(log) => st.restore_log = log,
                Err(e) => st.group_failure = Some(e),
            }
        }
        st.gathered.clear();
        // Restore master by master and free each master as soon as every storage it holds has its own buffer
        // again, so host memory stays at about one copy of the weights during disable too. A storage that cannot be
        // restored keeps its master (and the backend its state) for a retry.
        let mut by_master: std::collections::BTreeMap<HostBufferId, Vec<StorageId>> = Default::default();
        for s in std::mem::take(&mut st.adopted) {
            // A storage already restored by an earlier, partial teardown has no master any more.
            if let Some(crate::model::Home::Master { buf, .. }) = model.home(s) {
                by_master.entry(buf).or_default().push(s);
            }
        }
        let mut kept = Vec::new();
        let mut kept_masters = Vec::new();
        let mut freed = std::collections::BTreeSet::new();
        for (buf, storages) in by_master {
            let mut all_restored = true;
            for s in storages {
                if let Err(e) = model.restore_loaded(s) {
                    first.get_or_insert(e.into());
                    kept.push(s);
                    all_restored = false;
                }
            }
            if all_restored {
                if let Err(e) = platform.free_host(buf) {
                    first.get_or_insert(e.into());
                }
                freed.insert(buf);
            } else {
                kept_masters.push(buf);
            }
        }
        // Masters no adopted storage points to (built before a failed enable adopted them) go too.
        for b in std::mem::take(&mut st.masters) {
            if freed.contains(&b) || kept_masters.contains(&b) {
                continue;
            }
            if let Err(e) = platform.free_host(b) {
                first.get_or_insert(e.into());
            }
        }
        if kept.is_empty() {
            st.master_bytes = 0;
            st.mapped_bytes = 0;
            st.locations.clear();
        } else {
            st.adopted = kept;
            st.masters = kept_masters;
        }
        disk::destroy(st); // after the stacks that sent through the readers, before the stream they send to
                           // The copy stream goes with its actor. Its work's outcome was reported by the stacks above (a failed enable
                           // may leave a failed copy on it that no stack saw); the stream is destroyed either way.
        if let Some(s) = st.stream.take() {
            let _ = s.destroy();
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits for outstanding device work, frees device memory, removes this backend's hooks and restores every
    /// storage to its own host buffer. On failure keeps what a retry needs and reports `DisableIncomplete`.
    pub fn disable(&mut self, model: &mut HostModel, hooks: &HookRegistry) -> Result<(), OffloadError> {
        let Some(mut st) = self.state.take() else {
            self.enabled = false;
            // Never enabled: the masters the engine wrote into give their storages back.
            return self.release_staging(model);
        };
        let hook_name = st.units.as_ref().map_or("", |u| u.hook_name);
        let torn = Self::teardown(&self.platform, &mut st, model, hooks);
        self.restore_log = std::mem::take(&mut st.restore_log);
        match torn {
            Ok(()) => {
                hooks.release_offload(hook_name);
                self.enabled = false;
                match st.group_failure.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
            // A failed final gather cannot be retried alone: the pipeline must be reloaded, so that error wins, and
            // the state is kept only while rank-local masters still hold storages a retry can restore.
            Err(e) => {
                let group_failure = st.group_failure.take();
                if group_failure.is_none() || !st.adopted.is_empty() {
                    self.state = Some(st);
                } else {
                    hooks.release_offload(hook_name);
                    self.enabled = false;
                }
                if let Some(g) = group_failure {
                    return Err(g);
                }
                Err(OffloadError::DisableIncomplete {
                    strategy: self.config.strategy.report_name(),
                    cause: e.to_string(),
                })
            }
        }
    }

    /// Blocks until every load issued so far and every released slot's last use have completed.
    pub fn fence(&self) -> Result<(), OffloadError> {
        if let Some(st) = &self.state {
            for s in &st.stacks {
                s.fence()?;
            }
        }
        Ok(())
    }

    /// Counters and sizes.
    pub fn report(&self) -> BackendReport {
        let mut r = BackendReport {
            strategy: self.config.strategy.report_name().to_string(),
            enabled: self.enabled,
            pinned: self.config.pin_memory,
            ..Default::default()
        };
        if let Some(st) = &self.state {
            r.fixed_device_bytes = st.fixed.as_ref().map_or(0, |f| f.bytes());
            r.group = st.group.as_ref().map(|g| GroupReport {
                rank: g.collective.rank(),
                world: g.collective.world(),
                shard_host_bytes: g.shard_host_bytes(),
                released_bytes: g.released_bytes,
                released_storages: g.released.len(),
                all_gathers: (g.collective.issued().len().saturating_sub(g.issued_before)) as u64,
                windowed_all_gathers: g.collective.windowed_gathers(),
            });
            r.master_host_bytes = st.master_bytes;
            r.mapped_host_bytes = st.mapped_bytes;
            (r.disk_bytes, r.staging_host_bytes) = (st.disk_bytes, st.staging_bytes);
            r.buffered_files.clone_from(&st.buffered_files);
            if let Some(units) = &st.units {
                for (sp, stack) in units.stacks.iter().zip(&st.stacks) {
                    let s: StackStats = stack.stats();
                    r.stacks.push(StackReport {
                        name: sp.name.clone(),
                        units: sp.units.len(),
                        resident: sp.resident_head,
                        depth: sp.depth,
                        loads: s.loads,
                        h2d_bytes: s.h2d_bytes,
                        prefetch_hits: s.prefetch_hits,
                        reuse_hits: s.reuse_hits,
                        sync_fetches: s.sync_fetches,
                        record_waits: s.record_waits,
                        device_bytes: s.device_bytes,
                        submission: sp.submission.as_str().to_string(),
                        completions: s.completions,
                    });
                }
            }
        }
        r
    }
}

impl WeightSource for StreamingBackend {
    fn locate(&self, storage: StorageId) -> Result<(DeviceBufferId, u64), OffloadError> {
        let Some(st) = &self.state else {
            return Err(OffloadError::NotResident { storage: storage.0, reason: "offload is not enabled".into() });
        };
        if let Some(&(si, ui, off)) = st.locations.get(&storage) {
            return match st.stacks.get(si).and_then(|s| s.location(ui)) {
                Some(loc) => Ok((loc.buffer, loc.offset + off)),
                None => Err(OffloadError::NotResident {
                    storage: storage.0,
                    reason: "its block is not loaded (call pre_forward on the module first)".into(),
                }),
            };
        }
        match &st.fixed {
            Some(f) => f.locate(storage),
            None => Err(OffloadError::NotResident { storage: storage.0, reason: "no placement".into() }),
        }
    }
}

/// One unit's new masters, per section (`None` for a section served from its file), or the first error and the
/// buffers made before it.
/// A batch of units whose masters are built together: their layouts, the sections their files serve, the sections
/// staged masters hold (see `build_masters`).
type MasterBatch<'a> = (&'a [UnitLayout], &'a [Vec<Option<MappedSection>>], &'a [Vec<Option<HostBufferId>>]);

type UnitMasters = Result<Vec<Option<(HostBufferId, u64)>>, (OffloadError, Vec<HostBufferId>)>;

/// Allocates and fills the masters of a batch of units, one thread per unit (see `build_masters`).
fn fill_masters(
    platform: &PlatformRef,
    model: &HostModel,
    batch: &[UnitLayout],
    served: &[Vec<Option<MappedSection>>],
    staged: &[Vec<Option<HostBufferId>>],
    kind: HostMemoryKind,
) -> Vec<UnitMasters> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = batch
            .iter()
            .zip(served)
            .zip(staged)
            .map(|((unit, mapped), staged)| {
                scope.spawn(move || unit_masters(platform, model, unit, mapped, staged, kind))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err((OffloadError::Unsupported("master building thread panicked".into()), Vec::new()))
                })
            })
            .collect()
    })
}

/// The masters of one unit's sections neither served from their file nor staged: each allocated and filled in place
/// through a bounce buffer (see [`write_section`]).
fn unit_masters(
    platform: &PlatformRef,
    model: &HostModel,
    unit: &UnitLayout,
    mapped: &[Option<MappedSection>],
    staged: &[Option<HostBufferId>],
    kind: HostMemoryKind,
) -> UnitMasters {
    let mut made: Vec<Option<(HostBufferId, u64)>> = Vec::new();
    for (k, sec) in unit.sections.iter().enumerate() {
        if mapped.get(k).copied().flatten().is_some() || staged.get(k).copied().flatten().is_some() {
            made.push(None);
            continue;
        }
        let r = (|| -> Result<HostBufferId, OffloadError> {
            let buf = platform.alloc_host(sec.len.max(1), kind)?;
            if let Err(e) = write_section(platform, buf, model, sec, MASTER_BOUNCE_BYTES) {
                let _ = platform.free_host(buf);
                return Err(e.into());
            }
            Ok(buf)
        })();
        match r {
            Ok(buf) => made.push(Some((buf, sec.len))),
            Err(e) => return Err((e, made.into_iter().flatten().map(|(b, _)| b).collect())),
        }
    }
    Ok(made)
}
