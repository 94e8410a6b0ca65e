//! The device-memory planner: how many bytes the weights will occupy on the device, and — when the config sets a
//! `device_budget` — how many leading blocks stay resident and how deep each ring prefetches so the weights fit.
//!
//! Invariant: the planned bound counts every byte the backends will allocate for weights (always-resident state,
//! resident heads, ring slots, the largest on-demand component), so a run's peak device weight memory never exceeds
//! `device_weight_bytes`.

use super::pipeline::{PipelineDesc, StorageId};
use super::resolver::{ResolvedComponent, ResolvedPlan};
use crate::config::{Component, OffloadConfig, Strategy};
use serde::Serialize;
use std::collections::BTreeSet;

/// The device memory plan for the weights.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BudgetPlan {
    /// Upper bound of device memory used by weights during a run.
    pub device_weight_bytes: u64,
    /// Bytes that stay on the device the whole run (non-block state, unselected components, residents).
    pub always_resident_bytes: u64,
    /// Bytes of resident block heads.
    pub resident_head_bytes: u64,
    /// Bytes of ring slots.
    pub slot_bytes: u64,
    /// Largest component staged on demand (loaded for its phase only).
    pub on_demand_peak_bytes: u64,
    /// The configured budget, if any.
    pub budget: Option<u64>,
    /// Whether the planner chose resident counts / depths (a budget was set for the layerwise strategy).
    pub planner_chose: bool,
    /// Human-readable notes on the choices made.
    pub notes: Vec<String>,
}

/// Distinct storages under a module path.
pub fn storages_under(p: &PipelineDesc, path: &str) -> BTreeSet<StorageId> {
    p.module(path).map(|m| m.tensors_recursive().into_iter().map(|(_, t)| t.storage).collect()).unwrap_or_default()
}

/// Device bytes of a set of storages packed together (each aligned, as the device layout packs them).
fn bytes_of(p: &PipelineDesc, set: &BTreeSet<StorageId>) -> u64 {
    set.iter().fold(0u64, |a, s| a.saturating_add(p.storage_device_bytes(*s)))
}

/// Storages of a component that stay on the device while its stacks stream: everything not owned by a block (by
/// storage identity, so an attribute aliasing a block weight stays with the ring) and not in a child.
pub fn non_block_storages(p: &PipelineDesc, c: &ResolvedComponent) -> BTreeSet<StorageId> {
    let mut all = storages_under(p, &c.path);
    for b in c.block_paths() {
        for s in storages_under(p, b) {
            all.remove(&s);
        }
    }
    for ch in &c.children {
        for s in storages_under(p, &ch.path) {
            all.remove(&s);
        }
    }
    all
}

/// Storages of the pipeline that belong to no discovered component (root-level state, undeclared modules): they
/// are placed on the device with everything else that never moves.
fn outside_components(p: &PipelineDesc, plan: &ResolvedPlan) -> BTreeSet<StorageId> {
    let mut all: BTreeSet<StorageId> = p.storages.keys().copied().collect();
    for c in plan.components() {
        for s in storages_under(p, &c.path) {
            all.remove(&s);
        }
    }
    all
}

/// Computes the budget plan and, for the layerwise strategy with a `device_budget`, rewrites the DiT stacks'
/// resident heads and prefetch depths to fit. Errors name `device_budget` and the smallest budget that works.
pub fn plan_budget(p: &PipelineDesc, cfg: &OffloadConfig, plan: &mut ResolvedPlan) -> Result<BudgetPlan, String> {
    let mut b = BudgetPlan { budget: cfg.device_budget, ..Default::default() };
    match plan.strategy {
        Strategy::None => {
            let outside = bytes_of(p, &outside_components(p, plan));
            b.always_resident_bytes = plan.components().fold(outside, |a, c| a.saturating_add(c.device_bytes));
        }
        Strategy::ModelLevel => {
            let mut always = bytes_of(p, &outside_components(p, plan));
            let mut enc_stage = 0u64;
            let mut dit_stage = 0u64;
            let mut vae_stage = 0u64;
            for c in plan.components() {
                if !c.selected {
                    always = always.saturating_add(c.device_bytes);
                    continue;
                }
                match c.kind {
                    super::resolver::ComponentKind::Dit => {
                        if cfg.keep_dit_resident {
                            always = always.saturating_add(c.device_bytes);
                        } else {
                            dit_stage = dit_stage.max(c.device_bytes);
                        }
                    }
                    super::resolver::ComponentKind::Vae => vae_stage = vae_stage.max(c.device_bytes),
                    _ => enc_stage = enc_stage.max(c.device_bytes),
                }
            }
            b.always_resident_bytes = always;
            b.on_demand_peak_bytes = enc_stage.max(dit_stage).max(vae_stage);
            if cfg.keep_dit_resident {
                b.notes.push("keep_dit_resident: the DiT stays on the device; encoders and VAE swap".into());
            }
        }
        Strategy::LayerWise | Strategy::DistributedLayerWise => {
            let mut always = bytes_of(p, &outside_components(p, plan));
            let mut on_demand = 0u64;
            let mut fixed_slots = 0u64;
            let mut fixed_heads = 0u64;
            for c in plan.components() {
                if !c.selected {
                    always = always.saturating_add(c.device_bytes);
                    continue;
                }
                if c.on_demand {
                    on_demand = on_demand.max(c.device_bytes);
                    continue;
                }
                always = always.saturating_add(bytes_of(p, &non_block_storages(p, c)));
                for ch in &c.children {
                    if ch.on_demand {
                        on_demand = on_demand.max(ch.device_bytes);
                    } else {
                        always = always.saturating_add(bytes_of(p, &non_block_storages(p, ch)));
                        for s in &ch.stacks {
                            fixed_slots = fixed_slots.saturating_add(s.slot_bytes());
                            fixed_heads = fixed_heads.saturating_add(s.resident_bytes());
                        }
                    }
                }
                if c.kind != super::resolver::ComponentKind::Dit {
                    for s in &c.stacks {
                        fixed_slots = fixed_slots.saturating_add(s.slot_bytes());
                        fixed_heads = fixed_heads.saturating_add(s.resident_bytes());
                    }
                }
            }
            let fixed = always.saturating_add(on_demand).saturating_add(fixed_slots).saturating_add(fixed_heads);
            let auto = plan.strategy == Strategy::LayerWise && cfg.device_budget.is_some();
            let user_depth = cfg.prefetch_depth(Component::Dit);
            // The smallest footprint of every DiT stack, reserved up front so that an earlier stack's resident head
            // never takes the room a later stack needs.
            let mins: Vec<u64> = plan
                .dits
                .iter()
                .filter(|d| d.selected)
                .flat_map(|d| d.stacks.iter().map(|s| min_stack_bytes(&s.block_bytes, user_depth)))
                .collect();
            let mut reserved: u64 = mins.iter().fold(0, |a, &m| a.saturating_add(m));
            let mut dit_heads = 0u64;
            let mut dit_slots = 0u64;
            let mut remaining = cfg.device_budget.map(|bud| bud.saturating_sub(fixed));
            let mut index = 0;
            for d in plan.dits.iter_mut().filter(|d| d.selected) {
                for s in &mut d.stacks {
                    if auto {
                        let own_min = mins.get(index).copied().unwrap_or(0);
                        index += 1;
                        reserved = reserved.saturating_sub(own_min);
                        let avail = remaining.unwrap_or(u64::MAX);
                        let (head, depth) = fit_stack(&s.block_bytes, user_depth, avail.saturating_sub(reserved))
                            .ok_or_else(|| {
                                let need = mins.iter().fold(fixed, |a, &m| a.saturating_add(m));
                                let others = if mins.len() > 1 {
                                    let rest = need.saturating_sub(fixed).saturating_sub(own_min);
                                    format!(" and {rest} bytes for the other DiT stacks")
                                } else {
                                    String::new()
                                };
                                format!(
                                    "diffusion_offload_config.device_budget: {} bytes cannot hold the {fixed} bytes of \
                                     weights that stay on the device plus the smallest ring of {own_min} bytes for \
                                     '{}' (prefetch depth {}){others}; raise device_budget to at least {need} bytes \
                                     ({:.2} GiB)",
                                    cfg.device_budget.unwrap_or(0),
                                    s.name,
                                    user_depth.unwrap_or(1),
                                    need as f64 / (1u64 << 30) as f64
                                )
                            })?;
                        s.resident_head = head;
                        s.prefetch_depth = depth;
                        b.notes.push(format!(
                            "{}: planner keeps {head} of {} blocks resident and prefetches {depth} ahead ({} slots)",
                            s.name,
                            s.blocks.len(),
                            s.slot_count()
                        ));
                        remaining = Some(avail.saturating_sub(s.resident_bytes().saturating_add(s.slot_bytes())));
                    }
                    dit_heads = dit_heads.saturating_add(s.resident_bytes());
                    dit_slots = dit_slots.saturating_add(s.slot_bytes());
                }
            }
            b.planner_chose = auto;
            b.always_resident_bytes = always;
            b.on_demand_peak_bytes = on_demand;
            b.resident_head_bytes = fixed_heads.saturating_add(dit_heads);
            b.slot_bytes = fixed_slots.saturating_add(dit_slots);
        }
    }
    b.device_weight_bytes = b
        .always_resident_bytes
        .saturating_add(b.resident_head_bytes)
        .saturating_add(b.slot_bytes)
        .saturating_add(b.on_demand_peak_bytes);
    if let Some(budget) = cfg.device_budget {
        if b.device_weight_bytes > budget && plan.strategy != Strategy::None {
            return Err(format!(
                "diffusion_offload_config.device_budget: the plan needs {} bytes of device memory for weights but the \
                 budget is {budget}; raise device_budget, lower resident_layers or prefetch_depth, or select more \
                 components",
                b.device_weight_bytes
            ));
        }
    }
    Ok(b)
}

/// Device bytes of a stack with `r` leading blocks resident at prefetch depth `k`: the head plus `min(k + 1,
/// streaming)` slots of the largest streamed block (saturating).
fn stack_cost(blocks: &[u64], r: usize, k: u32) -> u64 {
    let n = blocks.len();
    let head = blocks[..r].iter().fold(0u64, |a, &b| a.saturating_add(b));
    let tail_max = blocks[r..].iter().max().copied().unwrap_or(0);
    let slots = if r == n { 0 } else { (k as usize).saturating_add(1).min(n - r) as u64 };
    head.saturating_add(slots.saturating_mul(tail_max))
}

/// Smallest footprint of a stack at the smallest depth the planner may use (the user's, else 1), over every
/// resident split (a resident big block can shrink the slots below the nothing-resident cost).
fn min_stack_bytes(blocks: &[u64], user_depth: Option<u32>) -> u64 {
    let k = user_depth.unwrap_or(1);
    (0..=blocks.len()).map(|r| stack_cost(blocks, r, k)).min().unwrap_or(0)
}

/// Chooses (resident head, depth) for one stack within `avail` bytes: the user's depth (or 2, falling back to 1),
/// then as many leading blocks resident as fit. `None` when no resident split fits even at the smallest depth.
pub fn fit_stack(blocks: &[u64], user_depth: Option<u32>, avail: u64) -> Option<(usize, u32)> {
    let depths: Vec<u32> = match user_depth {
        Some(k) => vec![k],
        None => vec![super::resolver::DEFAULT_PREFETCH_DEPTH, 1],
    };
    // The cost is not monotone in r (the tail's largest block can shrink), so scan every split.
    depths
        .into_iter()
        .find_map(|k| (0..=blocks.len()).filter(|&r| stack_cost(blocks, r, k) <= avail).max().map(|r| (r, k)))
}
