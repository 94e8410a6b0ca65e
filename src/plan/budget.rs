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

fn bytes_of(p: &PipelineDesc, set: &BTreeSet<StorageId>) -> u64 {
    set.iter().map(|s| p.storages.get(s).map_or(0, |d| d.byte_size())).sum()
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

/// Computes the budget plan and, for the layerwise strategy with a `device_budget`, rewrites the DiT stacks'
/// resident heads and prefetch depths to fit. Errors name `device_budget` and the smallest budget that works.
pub fn plan_budget(p: &PipelineDesc, cfg: &OffloadConfig, plan: &mut ResolvedPlan) -> Result<BudgetPlan, String> {
    let mut b = BudgetPlan { budget: cfg.device_budget, ..Default::default() };
    match plan.strategy {
        Strategy::None => {
            b.always_resident_bytes = plan.components().map(|c| c.bytes).sum();
        }
        Strategy::ModelLevel => {
            let mut always = 0u64;
            let mut enc_stage = 0u64;
            let mut dit_stage = 0u64;
            let mut vae_stage = 0u64;
            for c in plan.components() {
                if !c.selected {
                    always += c.bytes;
                    continue;
                }
                match c.kind {
                    super::resolver::ComponentKind::Dit => {
                        if cfg.keep_dit_resident {
                            always += c.bytes;
                        } else {
                            dit_stage = dit_stage.max(c.bytes);
                        }
                    }
                    super::resolver::ComponentKind::Vae => vae_stage = vae_stage.max(c.bytes),
                    _ => enc_stage = enc_stage.max(c.bytes),
                }
            }
            b.always_resident_bytes = always;
            b.on_demand_peak_bytes = enc_stage.max(dit_stage).max(vae_stage);
            if cfg.keep_dit_resident {
                b.notes.push("keep_dit_resident: the DiT stays on the device; encoders and VAE swap".into());
            }
        }
        Strategy::LayerWise | Strategy::DistributedLayerWise => {
            let mut always = 0u64;
            let mut on_demand = 0u64;
            let mut fixed_slots = 0u64;
            let mut fixed_heads = 0u64;
            for c in plan.components() {
                if !c.selected {
                    always += c.bytes;
                    continue;
                }
                if c.on_demand {
                    on_demand = on_demand.max(c.bytes);
                    continue;
                }
                always += bytes_of(p, &non_block_storages(p, c));
                for ch in &c.children {
                    if ch.on_demand {
                        on_demand = on_demand.max(ch.bytes);
                    } else {
                        always += bytes_of(p, &non_block_storages(p, ch));
                        for s in &ch.stacks {
                            fixed_slots += s.slot_bytes();
                            fixed_heads += s.resident_bytes();
                        }
                    }
                }
                if c.kind != super::resolver::ComponentKind::Dit {
                    for s in &c.stacks {
                        fixed_slots += s.slot_bytes();
                        fixed_heads += s.resident_bytes();
                    }
                }
            }
            let fixed = always + on_demand + fixed_slots + fixed_heads;
            let auto = plan.strategy == Strategy::LayerWise && cfg.device_budget.is_some();
            let mut dit_heads = 0u64;
            let mut dit_slots = 0u64;
            let mut remaining = cfg.device_budget.map(|bud| bud.saturating_sub(fixed));
            for d in plan.dits.iter_mut().filter(|d| d.selected) {
                for s in &mut d.stacks {
                    if auto {
                        let avail = remaining.unwrap_or(u64::MAX);
                        let (head, depth) = fit_stack(&s.block_bytes, cfg.prefetch_depth(Component::Dit), avail)
                            .ok_or_else(|| {
                                let need = fixed + min_stack_bytes(&s.block_bytes);
                                format!(
                                    "diffusion_offload_config.device_budget: {} bytes cannot hold the {fixed} bytes of \
                                     weights that stay on the device plus two ring slots of {} bytes for '{}'; raise \
                                     device_budget to at least {need} bytes ({:.2} GiB)",
                                    cfg.device_budget.unwrap_or(0),
                                    s.block_bytes.iter().max().copied().unwrap_or(0),
                                    s.name,
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
                        remaining = Some(avail.saturating_sub(s.resident_bytes() + s.slot_bytes()));
                    }
                    dit_heads += s.resident_bytes();
                    dit_slots += s.slot_bytes();
                }
            }
            b.planner_chose = auto;
            b.always_resident_bytes = always;
            b.on_demand_peak_bytes = on_demand;
            b.resident_head_bytes = fixed_heads + dit_heads;
            b.slot_bytes = fixed_slots + dit_slots;
        }
    }
    b.device_weight_bytes = b.always_resident_bytes + b.resident_head_bytes + b.slot_bytes + b.on_demand_peak_bytes;
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

/// Smallest footprint of a stack: nothing resident, depth 1 (two slots of the largest block).
fn min_stack_bytes(blocks: &[u64]) -> u64 {
    let n = blocks.len();
    (2usize.min(n) as u64) * blocks.iter().max().copied().unwrap_or(0)
}

/// Chooses (resident head, depth) for one stack within `avail` bytes: the user's depth (or 2, falling back to 1),
/// then as many leading blocks resident as fit. `None` when even depth 1 with nothing resident does not fit.
pub fn fit_stack(blocks: &[u64], user_depth: Option<u32>, avail: u64) -> Option<(usize, u32)> {
    let n = blocks.len();
    let cost = |r: usize, k: u32| -> u64 {
        let head: u64 = blocks[..r].iter().sum();
        let tail_max = blocks[r..].iter().max().copied().unwrap_or(0);
        let slots = if r == n { 0 } else { (k as usize + 1).min(n - r) as u64 };
        head + slots * tail_max
    };
    let depths: Vec<u32> = match user_depth {
        Some(k) => vec![k],
        None => vec![super::resolver::DEFAULT_PREFETCH_DEPTH, 1],
    };
    for k in depths {
        if cost(0, k) > avail {
            continue;
        }
        // The cost is not monotone in r (the tail's largest block can shrink), so scan every split.
        let best = (0..=n).filter(|&r| cost(r, k) <= avail).max().unwrap_or(0);
        return Some((best, k));
    }
    None
}
