//! The pure plan resolver: `resolve_offload_plan(&pipeline, &config)` decides, before anything is touched, which
//! components are selected, what their block stacks are, how each stack splits into a resident head and a
//! streaming tail, and what is staged on demand.
//!
//! Invariants: the resolver takes shared references only, has no side effects beyond logging, and returns the
//! same plan (warnings included) for the same inputs. An explicit component selection turns every declaration
//! problem into an error; the compatibility topology (no selector) warns and skips instead. Every error is raised
//! here, so a backend fails before it installs a hook or moves a tensor.

use super::budget::plan_budget;
use super::discovery::{blocks_of, discover_components, dit_block_attrs, BlockAttrSource};
use super::resolved::{BudgetPlan, ComponentKind, ResolvedComponent, ResolvedPlan};
use super::stack::{StackPlan, DEFAULT_PREFETCH_DEPTH};
use crate::config::{Component, OffloadConfig, Strategy};
use crate::pipeline::{join, ModuleNode, PipelineDesc};
use std::collections::BTreeMap;

/// Nested DiT children larger than this are staged or streamed by the distributed strategy even undeclared.
pub const ON_DEMAND_THRESHOLD_BYTES: u64 = 1024 * 1024 * 1024;

/// Message of the layerwise no-op when the compatibility topology finds no DiT.
pub const NO_DIT_SKIP_REASON: &str = "No DiT/transformer modules found for selected DiT layerwise offload";

/// Why model-level offload does nothing when a DiT or an encoder stage is not selected.
pub const MODEL_SWAP_SKIP_REASON: &str =
    "model-level offload swaps a selected DiT against a selected encoder stage (the \
     VAE swaps with them); select both \"dit\" and \"text_encoder\" in diffusion_offload_config.components, or nothing \
     is offloaded";

/// A rejected pipeline/config combination, found before any mutation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

struct Ctx<'a> {
    p: &'a PipelineDesc,
    cfg: &'a OffloadConfig,
    explicit: bool,
    warnings: Vec<String>,
}

impl Ctx<'_> {
    fn warn(&mut self, msg: String) {
        tracing::warn!("{msg}");
        self.warnings.push(msg);
    }
    /// Error under an explicit selection, warning otherwise. Returns `Err` only in the explicit case.
    fn strict(&mut self, strict: bool, msg: String) -> Result<(), PlanError> {
        if strict {
            Err(PlanError(msg))
        } else {
            self.warn(msg);
            Ok(())
        }
    }
    fn depth_for(&self, c: Component) -> u32 {
        self.cfg.prefetch_depth(c).unwrap_or(DEFAULT_PREFETCH_DEPTH)
    }
    fn stack(&self, owner: &str, attrs: Vec<String>, blocks: Vec<String>, depth: u32) -> StackPlan {
        let block_bytes = blocks.iter().map(|b| self.p.subtree_device_bytes(b)).collect();
        StackPlan {
            name: format!("{owner}[{}]", attrs.join("+")),
            attrs,
            blocks,
            block_bytes,
            resident_head: 0,
            resident_mask: None,
            prefetch_depth: depth,
        }
    }
}

fn module<'a>(p: &'a PipelineDesc, path: &str) -> &'a ModuleNode {
    // Discovery only returns paths that exist.
    p.module(path).unwrap_or(&p.root)
}

fn component(p: &PipelineDesc, path: &str, kind: ComponentKind) -> ResolvedComponent {
    ResolvedComponent {
        path: path.to_string(),
        kind,
        class: module(p, path).class.clone(),
        selected: false,
        stacks: Vec::new(),
        on_demand: false,
        children: Vec::new(),
        bytes: p.subtree_bytes(path),
        device_bytes: p.subtree_device_bytes(path),
    }
}

fn encoder_kind(p: &PipelineDesc, path: &str) -> Result<ComponentKind, PlanError> {
    if let Some(t) = p.offload_plan.as_ref().and_then(|pl| pl.encoder_component_types.get(path)) {
        return if t == "text_encoder" {
            Ok(ComponentKind::TextEncoder)
        } else {
            Err(PlanError(format!(
                "offload_plan.encoder_component_types['{path}'] is '{t}'; the only declarable encoder type is \
                 'text_encoder' (remove the entry for other encoders)"
            )))
        };
    }
    let leaf = path.rsplit('.').next().unwrap_or(path);
    Ok(if leaf.starts_with("text_encoder") || leaf.ends_with("text_encoder") {
        ComponentKind::TextEncoder
    } else {
        ComponentKind::Encoder
    })
}

/// Why a config with `device_budget = "auto"` cannot be planned before a device is known.
pub const AUTO_BUDGET_UNRESOLVED: &str = "diffusion_offload_config.device_budget = \"auto\" is resolved from the \
     device's free memory when offload is enabled on a device (weightferry.enable in Python); to plan or run it \
     here, give a size such as \"24GiB\"";

/// Resolves the offload plan for `pipeline` under `config`. Pure: reads its arguments only. A config whose
/// `device_budget` is still `"auto"` is refused ([`AUTO_BUDGET_UNRESOLVED`]).
pub fn resolve_offload_plan(pipeline: &PipelineDesc, config: &OffloadConfig) -> Result<ResolvedPlan, PlanError> {
    if config.device_budget_auto {
        return Err(PlanError(AUTO_BUDGET_UNRESOLVED.to_string()));
    }
    let mut cx =
        Ctx { p: pipeline, cfg: config, explicit: config.components.is_some(), warnings: config.warnings.clone() };
    let found = discover_components(pipeline, &mut cx.warnings);
    let strategy = config.strategy;
    let layer = matches!(strategy, Strategy::LayerWise | Strategy::DistributedLayerWise);
    let plan_decl = pipeline.offload_plan.clone().unwrap_or_default();
    let is_on_demand = |path: &str| plan_decl.on_demand_component_paths.iter().any(|p| p == path);

    let mut dits: Vec<ResolvedComponent> =
        found.dits.iter().map(|d| component(pipeline, d, ComponentKind::Dit)).collect();
    let mut encoders = Vec::new();
    for e in &found.encoders {
        encoders.push(component(pipeline, e, encoder_kind(pipeline, e)?));
    }
    let mut vaes: Vec<ResolvedComponent> =
        found.vaes.iter().map(|v| component(pipeline, v, ComponentKind::Vae)).collect();
    let mut residents: Vec<ResolvedComponent> = found
        .residents
        .iter()
        .map(|r| component(pipeline, r, ComponentKind::Resident))
        .chain(found.auxiliary.iter().map(|a| component(pipeline, a, ComponentKind::Auxiliary)))
        .collect();
    let mut skip_reason = None;

    if strategy != Strategy::None {
        let dit_selected = config.offloads(Component::Dit);
        let te_selected = config.offloads(Component::TextEncoder);
        let vae_selected = config.components.as_ref().is_some_and(|s| s.contains(&Component::Vae));

        // --- existence checks for explicit selections -------------------------------------------------------
        if cx.explicit && dit_selected && dits.is_empty() {
            return Err(PlanError(format!(
                "No DiT/transformer modules found for selected DiT offload in pipeline {}; declare the DiT in \
                 `components.dit` or remove \"dit\" from diffusion_offload_config.components",
                pipeline.class
            )));
        }
        let has_text_encoder = encoders.iter().any(|e| e.kind == ComponentKind::TextEncoder);
        if cx.explicit && te_selected && !has_text_encoder {
            return Err(PlanError(format!(
                "No text encoder modules found for selected text_encoder offload in pipeline {}; declare one in \
                 `components.encoders` or remove \"text_encoder\" from diffusion_offload_config.components",
                pipeline.class
            )));
        }
        if cx.explicit && vae_selected && vaes.is_empty() {
            return Err(PlanError(format!(
                "No VAE modules found for selected vae offload in pipeline {}; declare one in `components.vaes` or \
                 remove \"vae\" from diffusion_offload_config.components",
                pipeline.class
            )));
        }

        if strategy == Strategy::ModelLevel {
            if cx.explicit {
                if dits.is_empty() {
                    return Err(PlanError(
                        "Component-selective model offload requires a DiT/transformer module; the pipeline declares none"
                            .into(),
                    ));
                }
                if encoders.is_empty() {
                    return Err(PlanError(
                        "Component-selective model offload requires an encoder execution stage to swap against; the \
                         pipeline declares no encoder"
                            .into(),
                    ));
                }
            } else if dits.is_empty() {
                cx.warn("No DiT/transformer modules found; model-level offload will not be enabled".into());
            } else if encoders.is_empty() {
                cx.warn(
                    "No encoder modules found; model-level offload keeps the DiT resident and is not enabled".into(),
                );
            }
            for d in &mut dits {
                d.selected = dit_selected;
            }
            for e in &mut encoders {
                e.selected = if cx.explicit { e.kind == ComponentKind::TextEncoder && te_selected } else { true };
            }
            for v in &mut vaes {
                v.selected = vae_selected;
            }
            // The swap needs two stages: a selected DiT and a selected encoder (the VAE swaps with them). Without
            // both, nothing moves; say so here, so the plan and the backend agree.
            let stages = dits.iter().any(|d| d.selected) && encoders.iter().any(|e| e.selected);
            if !stages && !dits.is_empty() && !encoders.is_empty() {
                skip_reason = Some(MODEL_SWAP_SKIP_REASON.to_string());
                cx.warn(MODEL_SWAP_SKIP_REASON.to_string());
            }
        } else if layer {
            resolve_layer(
                &mut cx,
                &mut dits,
                &mut encoders,
                &mut vaes,
                &is_on_demand,
                dit_selected,
                te_selected,
                vae_selected,
            )?;
            if dit_selected && dits.is_empty() && strategy == Strategy::LayerWise {
                skip_reason = Some(NO_DIT_SKIP_REASON.to_string());
                cx.warn(NO_DIT_SKIP_REASON.to_string());
            }
            check_unique_block_owners(pipeline, dits.iter().chain(&encoders))?;
            // The distributed strategy warns and keeps preparing the rest; nothing else to do here.
        }
    }
    for r in &mut residents {
        r.selected = false;
    }

    let mut plan = ResolvedPlan {
        strategy,
        dits,
        encoders,
        vaes,
        residents,
        skip_reason,
        warnings: Vec::new(),
        budget: BudgetPlan::default(),
    };
    plan.budget = plan_budget(pipeline, config, &mut plan).map_err(PlanError)?;
    plan.warnings = cx.warnings;
    Ok(plan)
}

#[allow(clippy::too_many_arguments)]
fn resolve_layer(
    cx: &mut Ctx<'_>,
    dits: &mut [ResolvedComponent],
    encoders: &mut [ResolvedComponent],
    vaes: &mut [ResolvedComponent],
    is_on_demand: &dyn Fn(&str) -> bool,
    dit_selected: bool,
    te_selected: bool,
    vae_selected: bool,
) -> Result<(), PlanError> {
    let p = cx.p;
    let cfg = cx.cfg;
    let explicit = cx.explicit;
    let plan_decl = p.offload_plan.clone().unwrap_or_default();
    let distributed = cfg.strategy == Strategy::DistributedLayerWise;

    // --- encoders: the AllGather replication check runs before any block discovery ----------------------------
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

    // --- DiTs ---------------------------------------------------------------------------------------------------
    if dit_selected {
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
                continue;
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
                continue;
            }
            let mut stack = cx.stack(&d.path, attrs.clone(), blocks, cx.depth_for(Component::Dit));
            let declared_head = plan_decl.layerwise_resident_layers.get(&d.path).copied().filter(|&k| k > 0);
            // Resident leading layers (distributed strategy with rank-local transfer).
            if cfg.resident_layers > 0 {
                if let Some(k) = declared_head {
                    cx.warn(format!(
                        "offload_plan.layerwise_resident_layers['{}'] = {k} is ignored: the config's resident layers \
                         ({}) decide",
                        d.path, cfg.resident_layers
                    ));
                }
                if plan_decl.resident_dit_paths.iter().any(|r| r == &d.path) {
                    keep_resident_head(cx, &mut stack, &d.path, cfg.resident_layers, "resident_layers")?;
                } else if explicit {
                    return Err(PlanError(format!(
                        "diffusion_offload_config.layer_options.dit.resident_layers: DiT '{}' is not listed in the \
                         pipeline's offload_plan.resident_dit_paths, so it cannot keep resident layers; add it there or \
                         set resident_layers = 0",
                        d.path
                    )));
                } else {
                    cx.warn(format!(
                        "dlo_resident_layers={} requested but DiT '{}' is not in offload_plan.resident_dit_paths; all \
                         blocks will be streamed",
                        cfg.resident_layers, d.path
                    ));
                }
            } else if let Some(k) = declared_head {
                if cfg.device_budget.is_some() {
                    cx.warn(format!(
                        "offload_plan.layerwise_resident_layers['{}'] = {k} is ignored: with device_budget the planner \
                         chooses the resident blocks",
                        d.path
                    ));
                } else {
                    cx.warn(format!(
                        "offload_plan.layerwise_resident_layers is deprecated: it maps to \
                         diffusion_offload_config.layer_options.dit.resident_layers = {k} (with '{}' in \
                         offload_plan.resident_dit_paths)",
                        d.path
                    ));
                    keep_resident_head(cx, &mut stack, &d.path, k, "layerwise_resident_layers")?;
                }
            }
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
    }

    // --- encoders -------------------------------------------------------------------------------------------------
    for e in encoders.iter_mut() {
        if e.kind != ComponentKind::TextEncoder && explicit {
            continue; // never selectable
        }
        let wanted = if explicit { te_selected } else { true };
        if !wanted {
            continue;
        }
        let strict = explicit || cfg.group.size > 1;
        let enc = module(p, &e.path);
        let on_demand = is_on_demand(&e.path);
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
                    let st = cx.stack(&e.path, vec![a.clone()], blocks, cx.depth_for(Component::TextEncoder));
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
    }
    if cfg.encoder_resident_layers > 0 {
        keep_encoder_resident_layers(cx, encoders, &plan_decl)?;
    }

    // --- VAEs: whole-component staging through the pipeline lifecycle --------------------------------------------
    for v in vaes.iter_mut() {
        let m = module(p, &v.path);
        if explicit {
            if vae_selected {
                if !is_on_demand(&v.path) {
                    return Err(PlanError(format!(
                        "Selected VAE '{}' requires a pipeline-managed lifecycle: the pipeline's offload plan must list \
                         it in offload_plan.on_demand_component_paths (and the module must implement load_to_device / \
                         offload_to_cpu); declare it there or remove \"vae\" from diffusion_offload_config.components",
                        v.path
                    )));
                }
                if !m.has_lifecycle {
                    return Err(PlanError(format!(
                        "Selected VAE '{}' requires a pipeline-managed lifecycle (load_to_device / offload_to_cpu); \
                         remove \"vae\" from diffusion_offload_config.components or declare the lifecycle",
                        v.path
                    )));
                }
                v.selected = true;
                v.on_demand = true;
            }
        } else if is_on_demand(&v.path) {
            if !m.has_lifecycle {
                return Err(PlanError(format!(
                    "On-demand component '{}' must implement load_to_device() and offload_to_cpu() (has_lifecycle) or be \
                     removed from offload_plan.on_demand_component_paths",
                    v.path
                )));
            }
            v.selected = true;
            v.on_demand = true;
        }
    }
    Ok(())
}

/// Keeps the first `encoder_resident_layers` blocks of every encoder stack the pipeline declares eligible
/// (`offload_plan.resident_encoder_block_paths`) resident. Every eligible path must be a declared encoder block list
/// of a discovered, pipeline-managed (on-demand) encoder and hold at least that many blocks.
fn keep_encoder_resident_layers(
    cx: &mut Ctx<'_>,
    encoders: &mut [ResolvedComponent],
    plan_decl: &crate::pipeline::OffloadPlanDecl,
) -> Result<(), PlanError> {
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
                let st = cx.stack(&path, vec![a.clone()], blocks, cx.depth_for(Component::Dit));
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

fn check_unique_block_owners<'a>(
    p: &PipelineDesc,
    comps: impl Iterator<Item = &'a ResolvedComponent> + Clone,
) -> Result<(), PlanError> {
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    fn visit<'a>(c: &'a ResolvedComponent, owner: &mut BTreeMap<&'a str, &'a str>) -> Result<(), PlanError> {
        for b in c.block_paths() {
            if let Some(prev) = owner.insert(b.as_str(), c.path.as_str()) {
                if prev != c.path {
                    return Err(PlanError(format!(
                        "Offload block '{b}' is claimed by both '{prev}' and '{}'; declare one owner for each block list",
                        c.path
                    )));
                }
                return Err(PlanError(format!(
                    "Offload block '{b}' is listed twice in the block lists of '{}'; declare each block list once",
                    c.path
                )));
            }
        }
        for ch in &c.children {
            visit(ch, owner)?;
        }
        Ok(())
    }
    for c in comps.clone() {
        visit(c, &mut owner)?;
    }
    // A block nested inside another claimed block is also a double claim.
    let keys: Vec<&str> = owner.keys().copied().collect();
    for w in keys.windows(2) {
        if w[1].starts_with(w[0]) && w[1].as_bytes().get(w[0].len()) == Some(&b'.') {
            return Err(PlanError(format!(
                "Offload block '{}' lies inside block '{}' (claimed by '{}' and '{}'); declare one owner for each block \
                 list",
                w[1], w[0], owner[w[0]], owner[w[1]]
            )));
        }
    }
    // The same block reached a second time through tied weights.
    check_tied_blocks(p, comps)
}

/// The weights a block views: every tensor's storage, offset, shape and strides, as a set (names do not matter).
type BlockViews = std::collections::BTreeSet<(crate::pipeline::StorageId, u64, Vec<u64>, Vec<u64>)>;

/// Rejects a block reached twice through tied weights: two blocks (of any stacks, in any components) that view
/// exactly the same weights are one block claimed twice, however they are reached.
fn check_tied_blocks<'a>(
    p: &PipelineDesc,
    comps: impl Iterator<Item = &'a ResolvedComponent>,
) -> Result<(), PlanError> {
    let mut seen: BTreeMap<BlockViews, (&str, &str)> = BTreeMap::new();
    fn visit<'a>(
        p: &PipelineDesc,
        c: &'a ResolvedComponent,
        seen: &mut BTreeMap<BlockViews, (&'a str, &'a str)>,
    ) -> Result<(), PlanError> {
        for b in c.block_paths() {
            let views: BlockViews = p
                .module(b)
                .map(|m| {
                    m.tensors_recursive()
                        .into_iter()
                        .map(|(_, t)| (t.storage, t.storage_offset, t.shape.clone(), t.strides.clone()))
                        .collect()
                })
                .unwrap_or_default();
            if views.is_empty() {
                continue;
            }
            if let Some((prev, prev_owner)) = seen.get(&views) {
                return Err(PlanError(format!(
                    "Offload block '{b}' (of '{}') views exactly the weights of block '{prev}' (of '{prev_owner}'): \
                     the same block is claimed twice through tied weights; declare one owner for each block list",
                    c.path
                )));
            }
            seen.insert(views, (b.as_str(), c.path.as_str()));
        }
        for ch in &c.children {
            visit(p, ch, seen)?;
        }
        Ok(())
    }
    for c in comps {
        visit(p, c, &mut seen)?;
    }
    Ok(())
}
