//! What each strategy streams: the translation of a resolved plan into block stacks of units (a unit is one block,
//! or one whole component for model-level swapping and on-demand staging) plus the fixed device placement of
//! everything else.
//!
//! Invariants: every storage of the pipeline belongs to exactly one place — one unit, or the fixed placement; a
//! storage shared by two units (an alias across blocks) is pinned to the fixed placement so no unit depends on
//! another's bytes; placement follows storage identity, never attribute names, so an attribute aliasing a streamed
//! block's weight stays with the ring.

use super::layout::{storages_of, UnitLayout};
use crate::config::{Component, CopySubmission, OffloadConfig, Strategy, WeightTransfer};
use crate::hooks::{DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK, LAYERWISE_OFFLOAD_HOOK, SEQUENTIAL_OFFLOAD_HOOK};
use crate::pipeline::{PipelineDesc, StorageId};
use crate::plan::ComponentKind;
use crate::plan::{ResolvedComponent, ResolvedPlan};
use std::collections::{BTreeMap, BTreeSet};
use weightferry_actors::Submission;

/// One stack to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackPlan {
    /// Display name.
    pub name: String,
    /// Units in execution order.
    pub units: Vec<UnitLayout>,
    /// Leading units kept resident (the count of resident units when `resident_mask` is set).
    pub resident_head: usize,
    /// Exactly which units stay resident, when the planner spread them along the stack.
    pub resident_mask: Option<Vec<bool>>,
    /// Prefetch depth; 0 = staged (one slot, no prefetch).
    pub depth: usize,
    /// A static schedule (every streamed unit in the same slot on every pass).
    pub static_slots: bool,
    /// Prefetch at enable.
    pub eager: bool,
    /// Who enqueues the stack's streamed loads (`copy_submission` of its component; staged stacks use the actor).
    pub submission: Submission,
    /// The stack's component selects AllGather transfer (`weight_transfer = "allgather"`): with a collective, the
    /// backend shards its blocks over the group and rebuilds them by AllGather.
    pub allgather: bool,
    /// With `allgather`: gathered bytes per AllGather (`allgather_chunk_size`); `None` = one per section.
    pub chunk_bytes: Option<u64>,
}

/// Everything a backend builds for a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitPlan {
    /// Hook name (and owner) of the strategy.
    pub hook_name: &'static str,
    /// Stacks.
    pub stacks: Vec<StackPlan>,
    /// Storages placed on the device for the whole run.
    pub fixed: Vec<StorageId>,
}

impl UnitPlan {
    /// Whether there is anything to offload.
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }
}

/// Hook name of a strategy.
pub fn hook_name(strategy: Strategy) -> &'static str {
    match strategy {
        Strategy::ModelLevel => SEQUENTIAL_OFFLOAD_HOOK,
        Strategy::DistributedLayerWise => DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK,
        _ => LAYERWISE_OFFLOAD_HOOK,
    }
}

/// A stack before packing: its plan with `(unit path, storages)` instead of packed units.
struct RawStack {
    plan: StackPlan,
    units: Vec<(String, Vec<StorageId>)>,
}

impl RawStack {
    /// A staged stack (one slot, no prefetch, the actor submits) of `units`, keeping the first `head` resident.
    fn staged(name: &str, units: Vec<(String, Vec<StorageId>)>, head: usize) -> RawStack {
        let plan = StackPlan {
            name: name.to_string(),
            units: Vec::new(),
            resident_head: head,
            resident_mask: None,
            depth: 0,
            static_slots: false,
            eager: false,
            submission: Submission::Actor,
            allgather: false,
            chunk_bytes: None,
        };
        RawStack { plan, units }
    }
}

/// The config component whose layer options a plan component's stacks follow (encoder stacks follow
/// `text_encoder`).
fn option_component(kind: ComponentKind) -> Component {
    match kind {
        ComponentKind::TextEncoder | ComponentKind::Encoder => Component::TextEncoder,
        _ => Component::Dit,
    }
}

/// The submission mode a component's stacks use: its `copy_submission`.
fn submission_of(cfg: &OffloadConfig, kind: ComponentKind) -> Submission {
    match cfg.copy_submission(option_component(kind)) {
        CopySubmission::Actor => Submission::Actor,
        CopySubmission::Hook => Submission::Hook,
    }
}

/// Builds the unit plan. Returns an empty plan when the strategy has nothing to do for this pipeline.
pub fn build_unit_plan(p: &PipelineDesc, cfg: &OffloadConfig, plan: &ResolvedPlan) -> UnitPlan {
    let hook = hook_name(plan.strategy);
    let mut stacks: Vec<RawStack> = Vec::new();
    match plan.strategy {
        Strategy::None => {}
        Strategy::ModelLevel => {
            let dits: Vec<&ResolvedComponent> = plan.dits.iter().filter(|d| d.selected).collect();
            let encs: Vec<&ResolvedComponent> = plan.encoders.iter().filter(|e| e.selected).collect();
            if !dits.is_empty() && !encs.is_empty() {
                let vaes = plan.vaes.iter().filter(|v| v.selected);
                let units: Vec<(String, Vec<StorageId>)> = dits
                    .iter()
                    .copied()
                    .chain(encs.iter().copied())
                    .chain(vaes)
                    .map(|c| (c.path.clone(), storages_of(p, &c.path)))
                    .collect();
                let head = if cfg.keep_dit_resident { dits.len() } else { 0 };
                stacks.push(RawStack::staged("model-swap", units, head));
            }
        }
        Strategy::LayerWise | Strategy::DistributedLayerWise => {
            if plan.skip_reason.is_none() {
                let eager = plan.strategy == Strategy::LayerWise;
                let mut staged: Vec<(String, Vec<StorageId>)> = Vec::new();
                let visit = |c: &ResolvedComponent, stacks: &mut Vec<_>, staged: &mut Vec<_>| {
                    if !c.selected {
                        return;
                    }
                    if c.on_demand {
                        // Staged whole, less what its own stacks stream (a pipeline-managed encoder may do both).
                        let own = crate::plan::budget::non_block_storages(p, c);
                        let st = storages_of(p, &c.path).into_iter().filter(|s| own.contains(s)).collect();
                        staged.push((c.path.clone(), st));
                    }
                    for s in &c.stacks {
                        let units = s.blocks.iter().map(|b| (b.clone(), storages_of(p, b))).collect();
                        let allgather = cfg.transfer_for(option_component(c.kind)) == WeightTransfer::Allgather;
                        let plan = StackPlan {
                            name: s.name.clone(),
                            units: Vec::new(),
                            resident_head: s.resident_head,
                            resident_mask: s.resident_mask.clone(),
                            depth: s.prefetch_depth as usize,
                            static_slots: s.static_slots,
                            eager,
                            submission: submission_of(cfg, c.kind),
                            allgather,
                            chunk_bytes: cfg.allgather_chunk_bytes(option_component(c.kind)),
                        };
                        stacks.push(RawStack { plan, units });
                    }
                };
                for c in plan.components() {
                    visit(c, &mut stacks, &mut staged);
                    for ch in &c.children {
                        visit(ch, &mut stacks, &mut staged);
                    }
                }
                if !staged.is_empty() {
                    stacks.push(RawStack::staged("on-demand", staged, 0));
                }
            }
        }
    }

    // A storage claimed by two units is pinned to the fixed placement, as are those of the pipeline's `pinned`
    // modules.
    let mut count: BTreeMap<StorageId, usize> = BTreeMap::new();
    for raw in &stacks {
        for (_, st) in &raw.units {
            for s in st {
                *count.entry(*s).or_default() += 1;
            }
        }
    }
    let mut shared: BTreeSet<StorageId> = count.iter().filter(|(_, &n)| n > 1).map(|(s, _)| *s).collect();
    shared.extend(p.pinned_storages());
    let streamed: BTreeSet<StorageId> = count.keys().copied().filter(|s| !shared.contains(s)).collect();
    let fixed: Vec<StorageId> = p.storages.keys().copied().filter(|s| !streamed.contains(s)).collect();
    let stacks = stacks
        .into_iter()
        .map(|raw| StackPlan {
            units: raw
                .units
                .into_iter()
                .map(|(path, st)| {
                    let st: Vec<StorageId> = st.into_iter().filter(|s| !shared.contains(s)).collect();
                    UnitLayout::pack(p, &path, &st)
                })
                .collect(),
            ..raw.plan
        })
        .collect();
    UnitPlan { hook_name: hook, stacks, fixed }
}
