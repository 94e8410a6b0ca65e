//! The streaming backend: the one machine all three strategies run on.
//!
//! `enable` resolves the plan (pure), builds the unit plan, then commits step by step — copy-stream actor, fixed
//! placement, host masters (one flat buffer per unit per dtype; each storage's loaded buffer is freed as soon as its
//! bytes are in a master, so the model never exists twice in host memory), block-stack actors, hooks — and undoes
//! every committed step if a later one fails. `disable` waits for all device work, frees device memory, removes its
//! hooks, and gives each storage its own host buffer back with a real copy out of the master; if that fails it keeps
//! the masters so a second `disable` can finish.

use super::layout::UnitLayout;
use super::resident::ResidentPlacement;
use super::units::{build_unit_plan, UnitPlan};
use super::{OffloadError, WeightSource};
use crate::config::{OffloadConfig, Strategy};
use crate::hooks::{HookRegistry, ModelHook};
use crate::model::HostModel;
use crate::plan::{resolve_offload_plan, ResolvedPlan, StorageId};
use serde::Serialize;
use std::collections::HashMap;
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
    /// Units (blocks or components).
    pub units: usize,
    /// Resident head.
    pub resident_head: usize,
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
    /// Device bytes held.
    pub device_bytes: u64,
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
    /// Host bytes of masters.
    pub master_host_bytes: u64,
    /// Whether masters are pinned.
    pub pinned: bool,
}

struct StackHook {
    stack: Arc<BlockStack>,
    unit: usize,
}

impl ModelHook for StackHook {
    fn pre_forward(&self, _module: &str) -> Result<(), String> {
        self.stack.pre_forward(self.unit).map(|_| ()).map_err(|e| e.to_string())
    }
    fn post_forward(&self, _module: &str) -> Result<(), String> {
        self.stack.post_forward(self.unit).map_err(|e| e.to_string())
    }
}

#[derive(Default)]
struct State {
    units: Option<UnitPlan>,
    stream: Option<StreamHandle>,
    placement_stream: Option<StreamId>,
    fixed: Option<ResidentPlacement>,
    masters: Vec<HostBufferId>,
    master_bytes: u64,
    /// Storages whose home is one of our masters.
    adopted: Vec<StorageId>,
    stacks: Vec<Arc<BlockStack>>,
    locations: HashMap<StorageId, (usize, usize, u64)>,
    hooks_installed: bool,
}

/// The backend for every strategy.
pub struct StreamingBackend {
    config: OffloadConfig,
    platform: PlatformRef,
    plan: Option<ResolvedPlan>,
    state: Option<State>,
    enabled: bool,
    ordering_fault: OrderingFault,
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
    /// A disabled backend for `config`.
    pub fn new(config: OffloadConfig, platform: PlatformRef) -> Self {
        StreamingBackend {
            config,
            platform,
            plan: None,
            state: None,
            enabled: false,
            ordering_fault: OrderingFault::None,
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

    /// Discovers, places, builds masters and stacks, installs hooks. Transactional.
    pub fn enable(
        &mut self,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
    ) -> Result<(), OffloadError> {
        if self.enabled {
            tracing::warn!("{} offload already enabled", self.config.strategy.report_name());
            return Ok(());
        }
        if self.state.is_some() {
            // A failed disable left state behind: finish it first.
            self.disable(model, hooks)?;
        }
        let plan = resolve_offload_plan(model.desc(), &self.config)?;
        let units = build_unit_plan(model.desc(), &self.config, &plan);
        self.plan = Some(plan);
        if units.is_empty() {
            let why = self
                .plan
                .as_ref()
                .and_then(|p| p.skip_reason.clone())
                .unwrap_or_else(|| "nothing to offload for this pipeline under this config".to_string());
            tracing::warn!("offload not enabled: {why}");
            return Ok(());
        }
        hooks.claim_offload(units.hook_name)?;
        let mut st = State { units: Some(units), ..Default::default() };
        match self.commit(&mut st, model, hooks, compute) {
            Ok(()) => {
                self.state = Some(st);
                self.enabled = true;
                Ok(())
            }
            Err(e) => {
                let hook_name = st.units.as_ref().map_or("", |u| u.hook_name);
                if let Err(rollback) = Self::teardown(&self.platform, &mut st, model, hooks) {
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
        &self,
        st: &mut State,
        model: &mut HostModel,
        hooks: &HookRegistry,
        compute: StreamId,
    ) -> Result<(), OffloadError> {
        let units = st.units.clone().unwrap_or_else(|| UnitPlan { hook_name: "", stacks: vec![], fixed: vec![] });
        let stream = StreamHandle::spawn(self.platform.clone(), "copy", StreamOptions::default())?;
        st.stream = Some(stream.clone());
        let ps = self.platform.create_stream("placement")?;
        st.placement_stream = Some(ps);
        st.fixed = Some(ResidentPlacement::upload(&self.platform, model, &units.fixed, ps)?);

        let kind = if self.config.pin_memory { HostMemoryKind::Pinned } else { HostMemoryKind::Pageable };
        let mut specs = Vec::new();
        for (si, sp) in units.stacks.iter().enumerate() {
            let mut blocks = Vec::new();
            for (ui, unit) in sp.units.iter().enumerate() {
                blocks.push(self.build_masters(st, model, unit, kind, si, ui)?);
            }
            specs.push(StackSpec {
                name: sp.name.clone(),
                blocks,
                resident_head: sp.resident_head,
                prefetch_depth: sp.depth,
                eager_prefetch: sp.eager,
                ordering_fault: self.ordering_fault,
            });
        }
        for spec in specs {
            let stack = BlockStack::new(self.platform.clone(), spec, compute, stream.clone())?;
            st.stacks.push(Arc::new(stack));
        }
        st.hooks_installed = true;
        for (si, sp) in units.stacks.iter().enumerate() {
            for (ui, unit) in sp.units.iter().enumerate() {
                let hook = Arc::new(StackHook { stack: st.stacks[si].clone(), unit: ui });
                hooks.register(&unit.path, units.hook_name, units.hook_name, hook)?;
            }
        }
        Ok(())
    }

    /// Builds the masters of one unit and moves its storages' homes into them.
    fn build_masters(
        &self,
        st: &mut State,
        model: &mut HostModel,
        unit: &UnitLayout,
        kind: HostMemoryKind,
        si: usize,
        ui: usize,
    ) -> Result<BlockSpec, OffloadError> {
        let mut segments = Vec::new();
        let mut made = Vec::new();
        for sec in &unit.sections {
            let bytes = unit.section_bytes(model, sec)?;
            let buf = self.platform.alloc_host(sec.len.max(1), kind)?;
            st.masters.push(buf);
            st.master_bytes += sec.len;
            self.platform.write_host(buf, 0, &bytes)?;
            segments.push(Segment { host: buf, host_offset: 0, len: sec.len, device_offset: sec.device_offset });
            made.push((buf, sec));
        }
        for (buf, sec) in made {
            for &(s, off) in &sec.storages {
                model.adopt_master(s, buf, off)?;
                st.adopted.push(s);
                st.locations.insert(s, (si, ui, sec.device_offset + off));
            }
        }
        Ok(BlockSpec { segments, device_bytes: unit.device_bytes })
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
        if let Some(ps) = st.placement_stream {
            if let Err(e) = platform.stream_synchronize(ps) {
                first.get_or_insert(e.into());
            }
        }
        if let Some(mut f) = st.fixed.take() {
            if let Err(e) = f.release() {
                first.get_or_insert(e.into());
            }
        }
        let mut kept = Vec::new();
        for s in std::mem::take(&mut st.adopted) {
            if let Err(e) = model.restore_loaded(s) {
                first.get_or_insert(e.into());
                kept.push(s);
            }
        }
        if kept.is_empty() {
            for b in std::mem::take(&mut st.masters) {
                if let Err(e) = platform.free_host(b) {
                    first.get_or_insert(e.into());
                }
            }
            st.master_bytes = 0;
            st.locations.clear();
        } else {
            st.adopted = kept;
        }
        if let Some(s) = st.stream.take() {
            s.shutdown();
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
            return Ok(());
        };
        let hook_name = st.units.as_ref().map_or("", |u| u.hook_name);
        match Self::teardown(&self.platform, &mut st, model, hooks) {
            Ok(()) => {
                hooks.release_offload(hook_name);
                self.enabled = false;
                Ok(())
            }
            Err(e) => {
                self.state = Some(st);
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
            r.master_host_bytes = st.master_bytes;
            if let Some(units) = &st.units {
                for (sp, stack) in units.stacks.iter().zip(&st.stacks) {
                    let s: StackStats = stack.stats();
                    r.stacks.push(StackReport {
                        name: sp.name.clone(),
                        units: sp.units.len(),
                        resident_head: sp.resident_head,
                        depth: sp.depth,
                        loads: s.loads,
                        h2d_bytes: s.h2d_bytes,
                        prefetch_hits: s.prefetch_hits,
                        reuse_hits: s.reuse_hits,
                        sync_fetches: s.sync_fetches,
                        device_bytes: s.device_bytes,
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
