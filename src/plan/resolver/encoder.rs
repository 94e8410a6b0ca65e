//! The encoder stacks of the layerwise strategies: the AllGather replication check, which declared block lists each
//! selected text encoder streams, whether it is staged on demand, and which of its leading blocks stay resident.

use super::{module, Ctx, PlanError};
use crate::config::Component;
use crate::pipeline::join;
use crate::plan::resolved::{ComponentKind, ResolvedComponent};

/// Refuses AllGather transfer for a text encoder whose weights the pipeline does not declare replicated. Runs
/// before any block discovery.
pub(super) fn check_allgather_replication(
    cx: &Ctx<'_>,
    encoders: &[ResolvedComponent],
    te_selected: bool,
) -> Result<(), PlanError> {
    let cfg = cx.cfg;
    let explicit = cx.explicit;
    let plan_decl = cx.decl;
    let te_allgather = cfg.uses_allgather(Component::TextEncoder);
    for e in encoders.iter() {
        let wants = e.kind == ComponentKind::TextEncoder && (te_selected || !explicit);
        if wants && te_allgather && !plan_decl.encoder_dlo_weight_replication.iter().any(|r| r == &e.path) {
            return Err(PlanError(format!(
                "Text encoder '{}' cannot use AllGather across the offload group of {} ranks: its weights are not \
                 declared replicated (offload_plan.encoder_dlo_weight_replication). Set \
                 diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\"",
                e.path, cfg.group.size
            )));
        }
    }
    Ok(())
}

/// Resolves every wanted encoder: a text encoder under an explicit selection of `text_encoder`, any encoder under
/// the compatibility topology.
pub(super) fn resolve_encoders(
    cx: &mut Ctx<'_>,
    encoders: &mut [ResolvedComponent],
    te_selected: bool,
) -> Result<(), PlanError> {
    for e in encoders.iter_mut() {
        resolve_encoder(cx, e, te_selected)?;
    }
    Ok(())
}

/// One encoder: its streamed block lists and whether the pipeline stages it on demand.
fn resolve_encoder(cx: &mut Ctx<'_>, e: &mut ResolvedComponent, te_selected: bool) -> Result<(), PlanError> {
    let p = cx.p;
    let cfg = cx.cfg;
    let explicit = cx.explicit;
    let plan_decl = cx.decl;
    let te_allgather = cfg.uses_allgather(Component::TextEncoder);
    if e.kind != ComponentKind::TextEncoder && explicit {
        return Ok(()); // never selectable
    }
    let wanted = if explicit { te_selected } else { true };
    if !wanted {
        return Ok(());
    }
    let strict = explicit || cfg.group.size > 1;
    let enc = module(p, &e.path);
    let on_demand = cx.is_on_demand(&e.path);
    if on_demand && !enc.has_lifecycle {
        return Err(PlanError(format!(
            "On-demand component '{}' must implement load_to_device() and offload_to_cpu() (has_lifecycle) or be \
                 removed from offload_plan.on_demand_component_paths",
            e.path
        )));
    }
    for a in plan_decl.encoder_block_attrs.get(&e.path).cloned().unwrap_or_default() {
        match enc.get(&a) {
            Some(m) if m.is_block_list() && m.children.len() > 1 => {
                let blocks: Vec<String> = m.children.iter().map(|(n, _)| join(&join(&e.path, &a), n)).collect();
                let st = cx.stack(&e.path, vec![a.clone()], blocks, Component::TextEncoder);
                e.stacks.push(st);
            }
            Some(_) => cx.strict(
                strict,
                format!(
                    "Encoder block path '{}' is not a streamable block list (a list of more than one block)",
                    join(&e.path, &a)
                ),
            )?,
            None => cx.strict(
                strict,
                format!(
                    "Encoder block path '{}' does not exist; fix offload_plan.encoder_block_attrs",
                    join(&e.path, &a)
                ),
            )?,
        }
    }
    if on_demand && e.stacks.is_empty() && te_allgather {
        return Err(PlanError(format!(
            "On-demand text encoder '{}' has no streamable block stacks, so it cannot use AllGather transfer; set \
                 diffusion_offload_config.layer_options.text_encoder.weight_transfer = \"rank-local\"",
            e.path
        )));
    }
    if explicit && e.stacks.is_empty() && !on_demand {
        return Err(PlanError(format!(
            "Selected text encoder '{}' requires a model-declared streamable (offload_plan.encoder_block_attrs) or \
                 on-demand (offload_plan.on_demand_component_paths) plan",
            e.path
        )));
    }
    // A pipeline-managed encoder stays on demand even when it streams blocks: its non-block weights are
    // parked between its phases, its blocks stream while it runs.
    e.on_demand = on_demand;
    e.selected = !e.stacks.is_empty() || e.on_demand;
    Ok(())
}

/// Keeps the first `encoder_resident_layers` blocks of every encoder stack the pipeline declares eligible
/// (`offload_plan.resident_encoder_block_paths`) resident. Every eligible path must be a declared encoder block list
/// of a discovered, pipeline-managed (on-demand) encoder and hold at least that many blocks.
pub(super) fn keep_encoder_resident_layers(
    cx: &mut Ctx<'_>,
    encoders: &mut [ResolvedComponent],
) -> Result<(), PlanError> {
    let plan_decl = cx.decl;
    let p = cx.p;
    let n = cx.cfg.encoder_resident_layers;
    let key = if cx.cfg.compact {
        "diffusion_offload_config.layer_options.text_encoder.resident_layers"
    } else {
        "dlo_encoder_resident_layers"
    };
    if plan_decl.resident_encoder_block_paths.is_empty() {
        return Err(PlanError(format!(
            "{key} = {n}: pipeline {} declares no offload_plan.resident_encoder_block_paths, so no encoder stack may \
             keep resident layers; declare the eligible encoder block lists there or set {key} = 0",
            p.class
        )));
    }
    for path in &plan_decl.resident_encoder_block_paths {
        let owner = plan_decl
            .encoder_block_attrs
            .iter()
            .find(|(enc, attrs)| attrs.iter().any(|a| join(enc, a) == *path))
            .map(|(enc, _)| enc.clone());
        let Some(owner) = owner else {
            return Err(PlanError(format!(
                "offload_plan.resident_encoder_block_paths names '{path}', which must also be declared as an encoder \
                 block list in offload_plan.encoder_block_attrs; declare it there or remove it"
            )));
        };
        let Some(e) = encoders.iter_mut().find(|e| e.path == owner) else {
            return Err(PlanError(format!(
                "offload_plan.resident_encoder_block_paths names '{path}', but its encoder '{owner}' was not \
                 discovered; declare '{owner}' in components.encoders or remove the path"
            )));
        };
        if !module(p, &e.path).is_loaded || !e.selected {
            // An unloaded stub (a rank without this encoder) or an encoder that is not offloaded keeps nothing.
            continue;
        }
        if !e.on_demand {
            return Err(PlanError(format!(
                "Encoder '{}' keeps resident layers ({key} = {n}) only under pipeline-managed stage ownership: list it \
                 in offload_plan.on_demand_component_paths (with load_to_device / offload_to_cpu), or remove '{path}' \
                 from offload_plan.resident_encoder_block_paths",
                e.path
            )));
        }
        let enc_path = e.path.clone();
        let Some(stack) = e.stacks.iter_mut().find(|s| s.attrs.iter().any(|a| join(&enc_path, a) == *path)) else {
            return Err(PlanError(format!(
                "offload_plan.resident_encoder_block_paths names '{path}', which is not a streamed block list of \
                 encoder '{enc_path}'; fix offload_plan.encoder_block_attrs or remove the path"
            )));
        };
        let len = stack.blocks.len();
        if n as usize > len {
            return Err(PlanError(format!(
                "{key} = {n} exceeds the {len} blocks of encoder stack '{path}'; choose at most {len}"
            )));
        }
        stack.resident_head = n as usize;
    }
    Ok(())
}
