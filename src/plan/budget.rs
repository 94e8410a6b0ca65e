//! The device-memory planner: how many bytes the weights will occupy on the device, and — when the config sets a
//! `device_budget` — how many leading blocks stay resident and how deep each ring prefetches so the weights fit.
//!
//! Invariant: the planned bound counts every byte the backends will allocate for weights (always-resident state,
//! resident heads, ring slots, the largest on-demand component), so a run's peak device weight memory never exceeds
//! `device_weight_bytes`. Each storage is counted once, where the backend places it: with the unit (block or staged
//! component) whose subtree holds it, or in the fixed placement when no unit, or more than one, holds it (see
//! [`placement`]), whichever component an attribute that views it belongs to; so a budget at the real need is
//! accepted.

use super::bytes::short_bytes;
use super::resolved::{BudgetPlan, ComponentKind, ResolvedComponent, ResolvedPlan};
use super::stack::{StackPlan, DEFAULT_PREFETCH_DEPTH};
use crate::config::{Component, OffloadConfig, Strategy};
use crate::pipeline::{PipelineDesc, StorageId};
use std::collections::BTreeSet;
use weightferry_actors::block_stack::slot_count;

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

/// Where the backend places every storage of the pipeline: the units it moves (each a set of storages), the
/// storages that more than one unit holds or that the pipeline pins (its `pinned` modules), and the fixed placement
/// (on the device for the whole run).
///
/// This mirrors the offload backend's unit plan: under the layerwise strategies a unit is a block of a selected
/// stack (DiT, DiT child or encoder) or a selected component staged on demand; under model-level offload it is a
/// whole selected DiT, encoder or VAE (only when a DiT and an encoder are selected: otherwise nothing swaps). A
/// storage held by two units (an alias across blocks or components) is pinned to the fixed placement; every storage
/// that no unit holds (non-block state, components that are not offloaded, root-level tensors) is fixed too, even
/// when an attribute of an offloaded component views it, and a storage inside a unit stays with that unit even when
/// an attribute of another component views it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// Storages held by more than one unit, and those of the pipeline's `pinned` modules (on the device for good).
    pub shared: BTreeSet<StorageId>,
    /// Storages on the device for the whole run: those of no unit, and the shared ones.
    pub fixed: BTreeSet<StorageId>,
}

impl Placement {
    /// Device bytes a unit holding `storages` moves: its storages less the shared ones, each aligned.
    pub fn unit_bytes(&self, p: &PipelineDesc, storages: &BTreeSet<StorageId>) -> u64 {
        storages
            .iter()
            .filter(|s| !self.shared.contains(s))
            .fold(0u64, |a, s| a.saturating_add(p.storage_device_bytes(*s)))
    }
    /// Device bytes of the fixed placement, each storage once.
    pub fn fixed_bytes(&self, p: &PipelineDesc) -> u64 {
        bytes_of(p, &self.fixed)
    }
}

/// The storage sets of the units the backend moves for `plan` (see [`Placement`]).
fn unit_storage_sets(p: &PipelineDesc, plan: &ResolvedPlan) -> Vec<BTreeSet<StorageId>> {
    let mut units = Vec::new();
    match plan.strategy {
        Strategy::None => {}
        Strategy::ModelLevel => {
            let dits = plan.dits.iter().filter(|d| d.selected);
            let encs = plan.encoders.iter().filter(|e| e.selected);
            if dits.clone().next().is_some() && encs.clone().next().is_some() {
                let vaes = plan.vaes.iter().filter(|v| v.selected);
                units.extend(dits.chain(encs).chain(vaes).map(|c| storages_under(p, &c.path)));
            }
        }
        Strategy::LayerWise | Strategy::DistributedLayerWise => {
            let mut visit = |c: &ResolvedComponent| {
                if !c.selected {
                    return;
                }
                if c.on_demand {
                    // Staged whole, less what its own stacks stream (a pipeline-managed encoder may do both).
                    units.push(non_block_storages(p, c));
                }
                units.extend(c.block_paths().map(|b| storages_under(p, b)));
            };
            for c in plan.components() {
                visit(c);
                for ch in &c.children {
                    visit(ch);
                }
            }
        }
    }
    units
}

/// Where the backend places every storage of `p` under `plan` (see [`Placement`]).
pub fn placement(p: &PipelineDesc, plan: &ResolvedPlan) -> Placement {
    let units = unit_storage_sets(p, plan);
    let mut seen = BTreeSet::new();
    // Pinned storages (an adapter's weights inside a block) stay on the device, as shared ones do.
    let mut shared = p.pinned_storages();
    for u in &units {
        for s in u {
            if !seen.insert(*s) {
                shared.insert(*s);
            }
        }
    }
    let fixed = p.storages.keys().copied().filter(|s| !seen.contains(s) || shared.contains(s)).collect();
    Placement { shared, fixed }
}

/// Sets every stack's `block_bytes` to what its blocks move under `place` (their storages less the shared ones).
fn refine_block_bytes(p: &PipelineDesc, place: &Placement, c: &mut ResolvedComponent) {
    for s in &mut c.stacks {
        s.block_bytes = s.blocks.iter().map(|b| place.unit_bytes(p, &storages_under(p, b))).collect();
    }
    for ch in &mut c.children {
        refine_block_bytes(p, place, ch);
    }
}

/// Computes the budget plan and, for the layerwise strategy with a `device_budget`, rewrites the DiT stacks'
/// resident heads and prefetch depths to fit. Errors name `device_budget` and the smallest budget that works.
pub(crate) fn plan_budget(
    p: &PipelineDesc,
    cfg: &OffloadConfig,
    plan: &mut ResolvedPlan,
) -> Result<BudgetPlan, String> {
    let mut b = BudgetPlan { budget: cfg.device_budget, ..Default::default() };
    match plan.strategy {
        Strategy::None => {
            b.always_resident_bytes = bytes_of(p, &p.storages.keys().copied().collect());
        }
        Strategy::ModelLevel => model_level_budget(p, cfg, plan, &mut b),
        Strategy::LayerWise | Strategy::DistributedLayerWise => layerwise_budget(p, cfg, plan, &mut b)?,
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

/// Model-level offload: the fixed placement (and a DiT kept resident) stays; the largest swapped stage comes and
/// goes.
fn model_level_budget(p: &PipelineDesc, cfg: &OffloadConfig, plan: &ResolvedPlan, b: &mut BudgetPlan) {
    let place = placement(p, plan);
    let mut always = place.fixed_bytes(p);
    let mut enc_stage = 0u64;
    let mut dit_stage = 0u64;
    let mut vae_stage = 0u64;
    let swaps = plan.dits.iter().any(|d| d.selected) && plan.encoders.iter().any(|e| e.selected);
    for c in plan.components().filter(|c| c.selected && swaps) {
        let bytes = place.unit_bytes(p, &storages_under(p, &c.path));
        match c.kind {
            ComponentKind::Dit => {
                if cfg.keep_dit_resident {
                    always = always.saturating_add(bytes);
                } else {
                    dit_stage = dit_stage.max(bytes);
                }
            }
            ComponentKind::Vae => vae_stage = vae_stage.max(bytes),
            _ => enc_stage = enc_stage.max(bytes),
        }
    }
    b.always_resident_bytes = always;
    b.on_demand_peak_bytes = enc_stage.max(dit_stage).max(vae_stage);
    if cfg.keep_dit_resident {
        b.notes.push("keep_dit_resident: the DiT stays on the device; encoders and VAE swap".into());
    }
}

/// Device bytes of the layerwise plan apart from the DiT stacks.
#[derive(Debug, Clone, Copy, Default)]
struct FixedCosts {
    /// The fixed placement.
    always: u64,
    /// The largest component staged on demand.
    on_demand: u64,
    /// Ring slots of the encoder and DiT-child stacks.
    slots: u64,
    /// Resident blocks of the encoder and DiT-child stacks.
    heads: u64,
}

impl FixedCosts {
    fn of(p: &PipelineDesc, plan: &ResolvedPlan, place: &Placement) -> Self {
        let staged = |c: &ResolvedComponent| place.unit_bytes(p, &non_block_storages(p, c));
        let mut f = FixedCosts { always: place.fixed_bytes(p), ..Default::default() };
        let add_stacks = |f: &mut FixedCosts, c: &ResolvedComponent| {
            for s in &c.stacks {
                f.slots = f.slots.saturating_add(s.slot_bytes());
                f.heads = f.heads.saturating_add(s.resident_bytes());
            }
        };
        for c in plan.components() {
            if !c.selected {
                continue;
            }
            if c.on_demand {
                f.on_demand = f.on_demand.max(staged(c));
            }
            for ch in &c.children {
                if ch.on_demand {
                    f.on_demand = f.on_demand.max(staged(ch));
                } else {
                    add_stacks(&mut f, ch);
                }
            }
            if c.kind != ComponentKind::Dit {
                add_stacks(&mut f, c);
            }
        }
        f
    }

    fn total(&self) -> u64 {
        self.always.saturating_add(self.on_demand).saturating_add(self.slots).saturating_add(self.heads)
    }
}

/// The layerwise strategies: block bytes refined to the placement, the fixed costs, then the DiT stacks (chosen by
/// the planner under a `device_budget`).
fn layerwise_budget(
    p: &PipelineDesc,
    cfg: &OffloadConfig,
    plan: &mut ResolvedPlan,
    b: &mut BudgetPlan,
) -> Result<(), String> {
    let place = placement(p, plan);
    for c in plan.dits.iter_mut().chain(&mut plan.encoders).chain(&mut plan.vaes).chain(&mut plan.residents) {
        refine_block_bytes(p, &place, c);
    }
    let fixed = FixedCosts::of(p, plan, &place);
    let auto = plan.strategy == Strategy::LayerWise && cfg.device_budget.is_some();
    let (dit_heads, dit_slots) = plan_dit_stacks(cfg, plan, fixed.total(), auto, &mut b.notes)?;
    b.planner_chose = auto;
    b.always_resident_bytes = fixed.always;
    b.on_demand_peak_bytes = fixed.on_demand;
    b.resident_head_bytes = fixed.heads.saturating_add(dit_heads);
    b.slot_bytes = fixed.slots.saturating_add(dit_slots);
    Ok(())
}

/// The selected DiT stacks' resident and slot bytes. With `auto`, the planner first chooses each stack's resident
/// blocks and depth within what the budget leaves, reserving every later stack's smallest footprint up front so
/// that an earlier stack's resident blocks never take the room a later stack needs.
fn plan_dit_stacks(
    cfg: &OffloadConfig,
    plan: &mut ResolvedPlan,
    fixed: u64,
    auto: bool,
    notes: &mut Vec<String>,
) -> Result<(u64, u64), String> {
    let user_depth = cfg.prefetch_depth(Component::Dit);
    let mins: Vec<u64> = plan
        .dits
        .iter()
        .filter(|d| d.selected)
        .flat_map(|d| d.stacks.iter().map(|s| min_stack_bytes(&s.block_bytes, user_depth, s.static_slots)))
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
                let ring = Ring { depth: user_depth, static_slots: s.static_slots };
                let choice = plan_spread(&s.block_bytes, ring, avail.saturating_sub(reserved), ASSUMED_COMPUTE_RATIO)
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
                                 ({})",
                        cfg.device_budget.unwrap_or(0),
                        s.name,
                        user_depth.unwrap_or(1),
                        short_bytes(need)
                    )
                })?;
                apply_choice(s, choice, notes);
                remaining = Some(avail.saturating_sub(s.resident_bytes().saturating_add(s.slot_bytes())));
            }
            dit_heads = dit_heads.saturating_add(s.resident_bytes());
            dit_slots = dit_slots.saturating_add(s.slot_bytes());
        }
    }
    Ok((dit_heads, dit_slots))
}

/// Writes the planner's choice into the stack and notes it.
fn apply_choice(s: &mut StackPlan, choice: SpreadChoice, notes: &mut Vec<String>) {
    let kept = choice.resident.iter().filter(|r| **r).count();
    let depth = choice.depth;
    let pattern: String = choice.resident.iter().map(|&r| if r { 'R' } else { 's' }).collect();
    s.resident_head = kept;
    s.resident_mask = Some(choice.resident);
    s.prefetch_depth = depth;
    notes.push(format!(
        "{}: planner keeps {kept} of {} blocks resident, spread along the stack so copies hide \
         behind their compute, and prefetches {depth} ahead ({} slots); layout {pattern}",
        s.name,
        s.blocks.len(),
        s.slot_count()
    ));
}

/// Device bytes of a stack with `r` leading blocks resident at prefetch depth `k`, for every `r` in `0..=n`: the
/// head plus the ring's slots ([`slot_count`]: `min(k + 1, streaming)`, or for a static ring the smallest divisor of
/// the streaming count from there) of the largest streamed block (saturating). Linear in the blocks (a prefix sum
/// and a suffix maximum), so stacks of the format's largest block lists plan at once.
fn stack_costs(blocks: &[u64], k: u32, static_slots: bool) -> Vec<u64> {
    let n = blocks.len();
    let mut tail_max = vec![0u64; n + 1];
    for i in (0..n).rev() {
        tail_max[i] = tail_max[i + 1].max(blocks[i]);
    }
    let mut head = 0u64;
    let mut out = Vec::with_capacity(n + 1);
    for r in 0..=n {
        let slots = slot_count(n - r, k as usize, static_slots) as u64;
        out.push(head.saturating_add(slots.saturating_mul(tail_max[r])));
        if r < n {
            head = head.saturating_add(blocks[r]);
        }
    }
    out
}

/// Smallest footprint of a stack at the smallest depth the planner may use (the user's, else 1), over every
/// resident split (a resident big block can shrink the slots below the nothing-resident cost).
fn min_stack_bytes(blocks: &[u64], user_depth: Option<u32>, static_slots: bool) -> u64 {
    stack_costs(blocks, user_depth.unwrap_or(1), static_slots).into_iter().min().unwrap_or(0)
}

/// The ring a stack is planned for: the prefetch depth the user chose (else the planner chooses) and whether its
/// schedule is static (`static_slots`: the slot count a divisor of the streamed blocks, [`slot_count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ring {
    /// The user's prefetch depth, if any.
    pub depth: Option<u32>,
    /// A static schedule.
    pub static_slots: bool,
}

/// Compute time per byte of a block relative to copy time per byte, assumed by the planner's timing model when it
/// chooses which blocks to keep resident (DiT blocks compute in time proportional to their weights at a fixed token
/// count; 0.5 sits between a transfer-bound image DiT and a compute-bound video DiT).
pub const ASSUMED_COMPUTE_RATIO: f64 = 0.5;

/// The planner's choice for one stack: which blocks stay resident, the prefetch depth, and the predicted time of a
/// steady-state pass in units of "time to copy one byte".
#[derive(Debug, Clone, PartialEq)]
pub struct SpreadChoice {
    /// Per block: resident.
    pub resident: Vec<bool>,
    /// Prefetch depth.
    pub depth: u32,
    /// Predicted time of one steady-state pass.
    pub predicted: f64,
    /// Device bytes of the choice (resident blocks + slots).
    pub bytes: u64,
}

/// Device bytes of a resident set at depth `k`: the resident blocks plus the ring's slots ([`slot_count`]:
/// `min(k+1, streamed)`, more for a static ring) of the largest streamed block.
pub fn resident_set_cost(blocks: &[u64], resident: &[bool], k: u32, static_slots: bool) -> u64 {
    let head: u64 = blocks.iter().zip(resident).filter(|(_, r)| **r).map(|(b, _)| *b).sum();
    let streamed: Vec<u64> = blocks.iter().zip(resident).filter(|(_, r)| !**r).map(|(b, _)| *b).collect();
    let slots = slot_count(streamed.len(), k as usize, static_slots) as u64;
    head.saturating_add(slots.saturating_mul(streamed.iter().copied().max().unwrap_or(0)))
}

/// Predicted time of a steady-state pass: copies run one at a time on the copy stream, a streamed block's copy
/// needs a free slot (freed when the compute of the block that held it finished), compute runs in order and waits
/// for its block's copy. Copy time of a block is its bytes; compute time is `ratio ·` its bytes. A static ring
/// (`static_slots`) may have more slots than `k + 1`; its copies are still issued only `k` streamed blocks ahead
/// (when the block `k` earlier starts its compute).
pub fn simulate_pass(blocks: &[u64], resident: &[bool], k: u32, static_slots: bool, ratio: f64) -> f64 {
    let streamed: Vec<usize> = (0..blocks.len()).filter(|&i| !resident[i]).collect();
    let slots = slot_count(streamed.len(), k as usize, static_slots);
    let mut started: Vec<f64> = Vec::new(); // compute-start times of streamed blocks in stream order
    let passes = 3;
    let mut copy_free = 0.0f64;
    let mut compute_end = 0.0f64;
    // Compute-finish times of streamed blocks in stream order (across passes), to know when a slot frees.
    let mut finished: Vec<f64> = Vec::new();
    let mut pass_end = Vec::new();
    for _ in 0..passes {
        for (i, &b) in blocks.iter().enumerate() {
            let mut ready = 0.0f64;
            if !resident[i] {
                let order = finished.len();
                let slot_free = if order >= slots { finished[order - slots] } else { 0.0 };
                let issued = match static_slots && order >= k as usize {
                    true => started[order - k as usize],
                    false => 0.0,
                };
                let start = copy_free.max(slot_free).max(issued);
                copy_free = start + b as f64;
                ready = copy_free;
            }
            let begin = compute_end.max(ready);
            compute_end = begin + ratio * b as f64;
            if !resident[i] {
                started.push(begin);
                finished.push(compute_end);
            }
        }
        pass_end.push(compute_end);
    }
    pass_end[passes - 1] - pass_end[passes - 2]
}

/// Marks blocks resident evenly along the stack (in byte order) until `room` bytes are used, so every streamed
/// block sits between resident ones whose compute hides its copy. Blocks in `must` are resident first.
fn spread(blocks: &[u64], eligible: &[bool], must: &[bool], room: u64) -> Vec<bool> {
    let mut resident = must.to_vec();
    let total: u64 = blocks.iter().zip(eligible).filter(|(_, e)| **e).map(|(b, _)| *b).sum();
    if total == 0 {
        return resident;
    }
    let frac = (room as f64 / total as f64).min(1.0);
    let mut acc = 0.0f64;
    let mut used = 0u64;
    for (i, &b) in blocks.iter().enumerate() {
        if !eligible[i] {
            continue;
        }
        acc += frac * b as f64;
        if acc + 1e-9 >= b as f64 && used + b <= room {
            resident[i] = true;
            used += b;
            acc -= b as f64;
        }
    }
    resident
}

/// Chooses which blocks of a stack stay resident and how deep it prefetches within `avail` bytes, by predicting the
/// pass time of candidate layouts with [`simulate_pass`]: for every depth (the user's, or 1–4) and every slot size
/// (a block size: larger blocks must then be resident), resident blocks either spread evenly along the stack or
/// packed at its head. Ties go to fewer streamed bytes, then to the shallower depth. `None` when nothing fits. A
/// static ring's slot count depends on how many blocks stream: each candidate is costed with its own.
pub fn plan_spread(blocks: &[u64], ring: Ring, avail: u64, ratio: f64) -> Option<SpreadChoice> {
    let n = blocks.len();
    let static_slots = ring.static_slots;
    let depths: Vec<u32> = match ring.depth {
        Some(k) => vec![k],
        None => vec![1, 2, 3, 4],
    };
    let mut sizes: Vec<u64> = blocks.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let mut best: Option<SpreadChoice> = None;
    let mut consider = |resident: Vec<bool>, k: u32| {
        let bytes = resident_set_cost(blocks, &resident, k, static_slots);
        if bytes > avail {
            return;
        }
        let predicted = simulate_pass(blocks, &resident, k, static_slots, ratio);
        let streamed: u64 = blocks.iter().zip(&resident).filter(|(_, r)| !**r).map(|(b, _)| *b).sum();
        let better = match &best {
            None => true,
            Some(b) => {
                let b_streamed: u64 = blocks.iter().zip(&b.resident).filter(|(_, r)| !**r).map(|(x, _)| *x).sum();
                predicted < b.predicted * (1.0 - 1e-9)
                    || ((predicted - b.predicted).abs() <= b.predicted * 1e-9 && (streamed, k) < (b_streamed, b.depth))
            }
        };
        if better {
            best = Some(SpreadChoice { resident, depth: k, predicted, bytes });
        }
    };
    for &k in &depths {
        // Everything resident.
        consider(vec![true; n], k);
        for &m in &sizes {
            let must: Vec<bool> = blocks.iter().map(|&b| b > m).collect();
            let eligible: Vec<bool> = blocks.iter().map(|&b| b <= m).collect();
            let streamable = eligible.iter().filter(|e| **e).count();
            let fixed: u64 = blocks.iter().zip(&must).filter(|(_, r)| **r).map(|(b, _)| *b).sum();
            for slots in candidate_slots(streamable, k, static_slots) {
                let Some(room) = avail.checked_sub(fixed.saturating_add((slots as u64).saturating_mul(m))) else {
                    continue;
                };
                consider(spread(blocks, &eligible, &must, room), k);
                consider(head_packed(blocks, &eligible, &must, room), k);
            }
        }
    }
    best
}

/// The slot counts a ring over at most `streamable` streamed blocks may take at depth `k`: `min(k + 1, streamable)`;
/// for a static ring every count [`slot_count`] gives for 1..=`streamable` streamed blocks (keeping more blocks
/// resident can leave a streamed count with a smaller divisor).
fn candidate_slots(streamable: usize, k: u32, static_slots: bool) -> Vec<usize> {
    if !static_slots {
        return vec![slot_count(streamable, k as usize, false)];
    }
    let mut counts: Vec<usize> = (1..=streamable).map(|t| slot_count(t, k as usize, true)).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// Head packing: `must` plus the leading `eligible` blocks that fit in `room` bytes.
fn head_packed(blocks: &[u64], eligible: &[bool], must: &[bool], room: u64) -> Vec<bool> {
    let mut head = must.to_vec();
    let mut used = 0u64;
    for (i, &b) in blocks.iter().enumerate() {
        if eligible[i] && used + b <= room {
            head[i] = true;
            used += b;
        } else if eligible[i] {
            break;
        }
    }
    head
}

/// Chooses (resident head, depth) for one stack within `avail` bytes: the user's depth (or 2, falling back to 1),
/// then as many leading blocks resident as fit. `None` when no resident split fits even at the smallest depth.
pub fn fit_stack(blocks: &[u64], user_depth: Option<u32>, avail: u64) -> Option<(usize, u32)> {
    let depths: Vec<u32> = match user_depth {
        Some(k) => vec![k],
        None => vec![DEFAULT_PREFETCH_DEPTH, 1],
    };
    // The cost is not monotone in r (the tail's largest block can shrink), so scan every split.
    depths.into_iter().find_map(|k| stack_costs(blocks, k, false).iter().rposition(|&c| c <= avail).map(|r| (r, k)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cost by its definition: the head's bytes plus the slots of the largest streamed block.
    fn naive(blocks: &[u64], r: usize, k: u32) -> u64 {
        let head = blocks[..r].iter().fold(0u64, |a, &b| a.saturating_add(b));
        let tail_max = blocks[r..].iter().max().copied().unwrap_or(0);
        let slots = if r == blocks.len() { 0 } else { (k as usize + 1).min(blocks.len() - r) as u64 };
        head.saturating_add(slots.saturating_mul(tail_max))
    }

    #[test]
    fn the_linear_costs_equal_the_definition_for_every_split() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for n in 0..40usize {
            let blocks: Vec<u64> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x % 11 == 0 {
                        u64::MAX / 3
                    } else {
                        x % 1000
                    }
                })
                .collect();
            for k in [1u32, 2, 4] {
                let want: Vec<u64> = (0..=n).map(|r| naive(&blocks, r, k)).collect();
                assert_eq!(stack_costs(&blocks, k, false), want, "n={n} k={k}");
            }
        }
    }
}
