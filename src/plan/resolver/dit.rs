//! The DiT stacks of the layerwise strategies: which blocks each selected DiT streams, how many stay resident (the
//! config's `resident_layers` or the deprecated `layerwise_resident_layers`), and which nested children are staged or
//! streamed on their own.

use super::{component, module, Ctx, PlanError, ON_DEMAND_THRESHOLD_BYTES};
use crate::config::{Component, Strategy};
use crate::pipeline::{join, ModuleNode};
use crate::plan::discovery::{blocks_of, dit_block_attrs, BlockAttrSource};
use crate::plan::resolved::{ComponentKind, ResolvedComponent};
use crate::plan::stack::StackPlan;
use std::collections::BTreeMap;

/// Resolves every selected DiT: its stack, its resident blocks and its nested children. A DiT that streams nothing
/// useful is skipped with a warning (compatibility topology) or refused (explicit selection).
pub(super) fn resolve_dits(cx: &mut Ctx<'_>, dits: &mut [ResolvedComponent]) -> Result<(), PlanError> {
    let explicit = cx.explicit;
    let plan_decl = cx.decl;
    let distributed = cx.cfg.strategy == Strategy::DistributedLayerWise;
    for key in plan_decl.layerwise_resident_layers.keys() {
        if !dits.iter().any(|d| &d.path == key) {
            cx.strict(
                explicit,
                format!(
                    "offload_plan.layerwise_resident_layers names '{key}', which is not a discovered DiT; fix the \
                     path or remove the entry"
                ),
            )?;
        }
    }
    for d in dits.iter_mut() {
        let Some((attrs, mut stack)) = dit_stack(cx, d, distributed)? else {
            continue;
        };
        dit_resident_head(cx, &mut stack, &d.path)?;
        if stack.streaming().len() == 1 {
            // Distributed strategy with a single block and nothing resident (no residency requested, or requested
            // for an undeclared DiT under the compatibility topology): a one-block ring streams nothing useful.
            cx.strict(
                explicit,
                format!(
                    "Selected DiT '{}' requires at least two streamable layerwise-offload blocks (found one)",
                    d.path
                ),
            )?;
            continue;
        }
        d.selected = true;
        d.stacks.push(stack);
        d.children = resolve_dit_children(cx, d, &attrs, distributed)?;
    }
    Ok(())
}

/// The stack of DiT `d`: its declared block lists and their blocks. `None` when it has fewer blocks than a ring
/// needs (skipped with a warning, or an error under an explicit selection).
fn dit_stack(
    cx: &mut Ctx<'_>,
    d: &ResolvedComponent,
    distributed: bool,
) -> Result<Option<(Vec<String>, StackPlan)>, PlanError> {
    let p = cx.p;
    let explicit = cx.explicit;
    let dit_mod = module(p, &d.path);
    let (attrs, source) = dit_block_attrs(p, &d.path, dit_mod, &mut cx.warnings);
    let mut blocks = Vec::new();
    for a in &attrs {
        match blocks_of(&d.path, dit_mod, a, &mut cx.warnings) {
            Some(b) => blocks.extend(b),
            None => {
                let origin = match source {
                    BlockAttrSource::Plan => "offload_plan.block_attrs",
                    _ => "class_block_attrs",
                };
                return Err(PlanError(format!(
                    "DiT '{}' declares block list '{a}' in {origin}, but '{}' has no such attribute; fix the \
                     declaration",
                    d.path,
                    join(&d.path, a)
                )));
            }
        }
    }
    if blocks.is_empty() {
        cx.strict(
            explicit,
            if explicit {
                format!(
                    "Selected DiT '{}' has no streamable layerwise-offload blocks; declare its block lists in \
                     offload_plan.block_attrs",
                    d.path
                )
            } else {
                format!("Target layers (blocks) not found. Skipping offloading on '{}'", d.path)
            },
        )?;
        return Ok(None);
    }
    if blocks.len() == 1 && !distributed {
        cx.strict(
            explicit,
            if explicit {
                format!(
                    "Selected DiT '{}' requires at least two streamable layerwise-offload blocks (found one)",
                    d.path
                )
            } else {
                format!("Target layers (blocks) of '{}' <= 1. Skipping offloading", d.path)
            },
        )?;
        return Ok(None);
    }
    let stack = cx.stack(&d.path, attrs.clone(), blocks, Component::Dit);
    Ok(Some((attrs, stack)))
}

/// Which leading blocks of DiT `dit`'s stack stay resident: the config's resident layers (for a DiT the pipeline
/// lists in `resident_dit_paths`), else the deprecated `layerwise_resident_layers` when no budget plans it.
fn dit_resident_head(cx: &mut Ctx<'_>, stack: &mut StackPlan, dit: &str) -> Result<(), PlanError> {
    let cfg = cx.cfg;
    let explicit = cx.explicit;
    let plan_decl = cx.decl;
    let declared_head = plan_decl.layerwise_resident_layers.get(dit).copied().filter(|&k| k > 0);
    // Resident leading layers (distributed strategy with rank-local transfer).
    if cfg.resident_layers > 0 {
        if let Some(k) = declared_head {
            cx.warn(format!(
                "offload_plan.layerwise_resident_layers['{}'] = {k} is ignored: the config's resident layers \
                 ({}) decide",
                dit, cfg.resident_layers
            ));
        }
        if plan_decl.resident_dit_paths.iter().any(|r| r == dit) {
            keep_resident_head(cx, stack, dit, cfg.resident_layers, "resident_layers")?;
        } else if explicit {
            return Err(PlanError(format!(
                "diffusion_offload_config.layer_options.dit.resident_layers: DiT '{}' is not listed in the \
                 pipeline's offload_plan.resident_dit_paths, so it cannot keep resident layers; add it there or \
                 set resident_layers = 0",
                dit
            )));
        } else {
            cx.warn(format!(
                "dlo_resident_layers={} requested but DiT '{}' is not in offload_plan.resident_dit_paths; all \
                 blocks will be streamed",
                cfg.resident_layers, dit
            ));
        }
    } else if let Some(k) = declared_head {
        if cfg.device_budget.is_some() {
            cx.warn(format!(
                "offload_plan.layerwise_resident_layers['{}'] = {k} is ignored: with device_budget the planner \
                 chooses the resident blocks",
                dit
            ));
        } else {
            cx.warn(format!(
                "offload_plan.layerwise_resident_layers is deprecated: it maps to \
                 diffusion_offload_config.layer_options.dit.resident_layers = {k} (with '{}' in \
                 offload_plan.resident_dit_paths)",
                dit
            ));
            keep_resident_head(cx, stack, dit, k, "layerwise_resident_layers")?;
        }
    }
    Ok(())
}

/// Keeps the first `count` blocks of a DiT stack resident. A split that leaves exactly one streaming block is an
/// error under an explicit selection; the compatibility topology keeps that block resident too, with a warning.
fn keep_resident_head(
    cx: &mut Ctx<'_>,
    stack: &mut StackPlan,
    dit: &str,
    count: u32,
    label: &str,
) -> Result<(), PlanError> {
    let n = stack.blocks.len();
    let head = (count as usize).min(n);
    if n - head == 1 {
        if cx.explicit {
            return Err(PlanError(format!(
                "DiT '{dit}' has {n} blocks: {label}={count} leaves only one streaming block; choose a resident count \
                 that leaves zero or at least two (e.g. {n} or {})",
                n.saturating_sub(2)
            )));
        }
        cx.warn(format!(
            "#Streaming target layers (blocks) of '{dit}' <= 1 after {label}={count}. Keeping the final block resident"
        ));
        stack.resident_head = n;
    } else {
        stack.resident_head = head;
    }
    Ok(())
}

/// The nested children of DiT `dit` staged or streamed on their own: those declared in
/// `offload_plan.offload_submodules`, and under the distributed strategy any child above
/// [`ON_DEMAND_THRESHOLD_BYTES`] outside the block lists.
fn resolve_dit_children(
    cx: &mut Ctx<'_>,
    dit: &ResolvedComponent,
    block_attrs: &[String],
    distributed: bool,
) -> Result<Vec<ResolvedComponent>, PlanError> {
    let p = cx.p;
    let dit_mod = module(p, &dit.path);
    let declared: BTreeMap<String, String> =
        p.offload_plan.as_ref().and_then(|pl| pl.offload_submodules.get(&dit.path)).cloned().unwrap_or_default();
    let mut out = Vec::new();
    for (name, child) in &dit_mod.children {
        if block_attrs.iter().any(|a| a == name || a.starts_with(&format!("{name}."))) {
            continue;
        }
        let path = join(&dit.path, name);
        let decl = declared.get(name);
        let bytes = p.subtree_bytes(&path);
        if decl.is_none() && !(distributed && bytes > ON_DEMAND_THRESHOLD_BYTES) {
            continue;
        }
        let mut c = component(p, &path, ComponentKind::DitChild);
        c.selected = true;
        let attr = match decl {
            Some(a) => Some(a.clone()),
            None => {
                let found = ["layers", "blocks", "h", "model.layers"]
                    .iter()
                    .find(|a| child.get(a).is_some_and(ModuleNode::is_block_list));
                if found.is_some() {
                    crate::diag::warn_once(
                        &format!("nested-scan:{}", child.class),
                        &format!("nested DiT child class {} found by the block-list scan; declare it in offload_plan.offload_submodules", child.class),
                    );
                }
                found.map(|a| a.to_string())
            }
        };
        let streamable = attr
            .as_ref()
            .and_then(|a| child.get(a).map(|m| (a, m)))
            .filter(|(_, m)| m.is_block_list() && m.children.len() > 1);
        match streamable {
            Some((a, m)) => {
                let blocks = m.children.iter().map(|(n, _)| join(&join(&path, a), n)).collect();
                let st = cx.stack(&path, vec![a.clone()], blocks, Component::Dit);
                c.stacks.push(st);
            }
            None => {
                if let Some(a) = decl {
                    cx.warn(format!(
                        "offload_submodules entry '{path}.{a}' is not a block list; staging '{path}' whole"
                    ));
                }
                if !child.has_lifecycle {
                    return Err(PlanError(format!(
                        "DiT child '{path}' is staged on demand and must implement load_to_device() and offload_to_cpu() \
                         (has_lifecycle), or declare a block list for it in offload_plan.offload_submodules"
                    )));
                }
                c.on_demand = true;
            }
        }
        out.push(c);
    }
    Ok(out)
}
