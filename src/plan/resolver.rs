//! The pure plan resolver: `resolve_offload_plan(&pipeline, &config)` decides, before anything is touched, which
//! components are selected, what their block stacks are, how each stack splits into a resident head and a
//! streaming tail, and what is staged on demand.
//!
//! Invariants: the resolver takes shared references only, has no side effects beyond logging, and returns the
//! same plan (warnings included) for the same inputs. An explicit component selection turns every declaration
//! problem into an error; the compatibility topology (no selector) warns and skips instead. Every error is raised
//! here, so a backend fails before it installs a hook or moves a tensor.
//!
//! The layerwise strategies' decisions live in their own files: `dit` (DiT stacks, resident heads, nested
//! children), `encoder` (encoder stacks and their resident layers) and `claims` (one owner per block).

mod claims;
mod dit;
mod encoder;

use super::budget::plan_budget;
use super::discovery::{discover_components, Discovered};
use super::resolved::{BudgetPlan, ComponentKind, ResolvedComponent, ResolvedPlan};
use super::stack::{StackPlan, DEFAULT_PREFETCH_DEPTH};
use crate::config::{Component, OffloadConfig, Strategy};
use crate::pipeline::{ModuleNode, OffloadPlanDecl, PipelineDesc};

/// Nested DiT children larger than this are staged or streamed by the distributed strategy even undeclared.
pub(crate) const ON_DEMAND_THRESHOLD_BYTES: u64 = 1024 * 1024 * 1024;

/// Message of the layerwise no-op when the compatibility topology finds no DiT.
pub const NO_DIT_SKIP_REASON: &str = "No DiT/transformer modules found for selected DiT layerwise offload";

/// Why model-level offload does nothing when a DiT or an encoder stage is not selected.
pub const MODEL_SWAP_SKIP_REASON: &str =
    "model-level offload swaps a selected DiT against a selected encoder stage (the \
     VAE swaps with them); select both \"dit\" and \"text_encoder\" in diffusion_offload_config.components, or nothing \
     is offloaded; to offload a lone DiT or encoder, set diffusion_offload_config.mode = \"layer\" (its blocks \
     stream)";

/// A rejected pipeline/config combination, found before any mutation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// What the resolver reads and what it has said so far.
struct Ctx<'a> {
    p: &'a PipelineDesc,
    cfg: &'a OffloadConfig,
    /// The pipeline's offload plan (empty when it declares none).
    decl: &'a OffloadPlanDecl,
    /// The config selects components explicitly: declaration problems are errors, not warnings.
    explicit: bool,
    warnings: Vec<String>,
}

impl Ctx<'_> {
    /// Whether the pipeline manages `path`'s residency itself (`offload_plan.on_demand_component_paths`).
    fn is_on_demand(&self, path: &str) -> bool {
        self.decl.on_demand_component_paths.iter().any(|p| p == path)
    }
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
    /// The plan of one stack of component `c`'s blocks, with `c`'s prefetch depth and schedule.
    fn stack(&self, owner: &str, attrs: Vec<String>, blocks: Vec<String>, c: Component) -> StackPlan {
        let depth = self.depth_for(c);
        let block_bytes = blocks.iter().map(|b| self.p.subtree_device_bytes(b)).collect();
        StackPlan {
            name: format!("{owner}[{}]", attrs.join("+")),
            attrs,
            blocks,
            block_bytes,
            resident_head: 0,
            resident_mask: None,
            prefetch_depth: depth,
            static_slots: self.cfg.static_slots(c),
        }
    }
}

/// Which components the config selects for offload.
#[derive(Debug, Clone, Copy)]
struct Selection {
    dit: bool,
    text_encoder: bool,
    vae: bool,
}

impl Selection {
    fn of(config: &OffloadConfig) -> Self {
        Selection {
            dit: config.offloads(Component::Dit),
            text_encoder: config.offloads(Component::TextEncoder),
            vae: config.components.as_ref().is_some_and(|s| s.contains(&Component::Vae)),
        }
    }
}

/// The discovered components, by role, as the resolver fills them in.
struct Components {
    dits: Vec<ResolvedComponent>,
    encoders: Vec<ResolvedComponent>,
    vaes: Vec<ResolvedComponent>,
    residents: Vec<ResolvedComponent>,
}

impl Components {
    /// The discovered components, nothing selected yet.
    fn new(p: &PipelineDesc, found: &Discovered) -> Result<Self, PlanError> {
        let dits = found.dits.iter().map(|d| component(p, d, ComponentKind::Dit)).collect();
        let mut encoders = Vec::new();
        for e in &found.encoders {
            encoders.push(component(p, e, encoder_kind(p, e)?));
        }
        let vaes = found.vaes.iter().map(|v| component(p, v, ComponentKind::Vae)).collect();
        let residents = found
            .residents
            .iter()
            .map(|r| component(p, r, ComponentKind::Resident))
            .chain(found.auxiliary.iter().map(|a| component(p, a, ComponentKind::Auxiliary)))
            .collect();
        Ok(Components { dits, encoders, vaes, residents })
    }
}

pub(super) fn module<'a>(p: &'a PipelineDesc, path: &str) -> &'a ModuleNode {
    // Discovery only returns paths that exist.
    p.module(path).unwrap_or(&p.root)
}

pub(super) fn component(p: &PipelineDesc, path: &str, kind: ComponentKind) -> ResolvedComponent {
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
    let decl = pipeline.offload_plan.clone().unwrap_or_default();
    let mut cx = Ctx {
        p: pipeline,
        cfg: config,
        decl: &decl,
        explicit: config.components.is_some(),
        warnings: config.warnings.clone(),
    };
    let found = discover_components(pipeline, &mut cx.warnings);
    let strategy = config.strategy;
    let mut comps = Components::new(pipeline, &found)?;
    let mut skip_reason = None;
    if strategy != Strategy::None {
        let sel = Selection::of(config);
        check_selected_exist(&cx, &comps, sel)?;
        if strategy == Strategy::ModelLevel {
            skip_reason = resolve_model_level(&mut cx, &mut comps, sel)?;
        } else if matches!(strategy, Strategy::LayerWise | Strategy::DistributedLayerWise) {
            resolve_layer(&mut cx, &mut comps, sel)?;
            if sel.dit && comps.dits.is_empty() && strategy == Strategy::LayerWise {
                skip_reason = Some(NO_DIT_SKIP_REASON.to_string());
                cx.warn(NO_DIT_SKIP_REASON.to_string());
            }
            claims::check_unique_block_owners(pipeline, comps.dits.iter().chain(&comps.encoders))?;
            // The distributed strategy warns and keeps preparing the rest; nothing else to do here.
        }
    }
    let Components { dits, encoders, vaes, mut residents } = comps;
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

/// Under an explicit selection, every selected kind of component must exist.
fn check_selected_exist(cx: &Ctx<'_>, comps: &Components, sel: Selection) -> Result<(), PlanError> {
    let pipeline = cx.p;
    if cx.explicit && sel.dit && comps.dits.is_empty() {
        return Err(PlanError(format!(
            "No DiT/transformer modules found for selected DiT offload in pipeline {}; declare the DiT in \
             `components.dit` or remove \"dit\" from diffusion_offload_config.components",
            pipeline.class
        )));
    }
    let has_text_encoder = comps.encoders.iter().any(|e| e.kind == ComponentKind::TextEncoder);
    if cx.explicit && sel.text_encoder && !has_text_encoder {
        return Err(PlanError(format!(
            "No text encoder modules found for selected text_encoder offload in pipeline {}; declare one in \
             `components.encoders` or remove \"text_encoder\" from diffusion_offload_config.components",
            pipeline.class
        )));
    }
    if cx.explicit && sel.vae && comps.vaes.is_empty() {
        return Err(PlanError(format!(
            "No VAE modules found for selected vae offload in pipeline {}; declare one in `components.vaes` or \
             remove \"vae\" from diffusion_offload_config.components",
            pipeline.class
        )));
    }
    Ok(())
}

/// Model-level offload: the selected DiT swaps against the selected encoder stage (the VAE with them). Returns the
/// skip reason when there are not two stages to swap.
fn resolve_model_level(cx: &mut Ctx<'_>, comps: &mut Components, sel: Selection) -> Result<Option<String>, PlanError> {
    let Components { dits, encoders, vaes, .. } = comps;
    // A selected stage the pipeline lacks was refused by the selection checks; a stage not selected is the skip
    // below, whether the pipeline has it or not (the CLI, a checkpoint and Python all see the same note).
    if !cx.explicit && dits.is_empty() {
        cx.warn("No DiT/transformer modules found; model-level offload will not be enabled".into());
    } else if !cx.explicit && encoders.is_empty() {
        cx.warn("No encoder modules found; model-level offload keeps the DiT resident and is not enabled".into());
    }
    for d in dits.iter_mut() {
        d.selected = sel.dit;
    }
    for e in encoders.iter_mut() {
        e.selected = if cx.explicit { e.kind == ComponentKind::TextEncoder && sel.text_encoder } else { true };
    }
    for v in vaes.iter_mut() {
        v.selected = sel.vae;
    }
    // The swap needs two stages: a selected DiT and a selected encoder (the VAE swaps with them). Without
    // both, nothing moves; say so here, so the plan and the backend agree.
    let stages = dits.iter().any(|d| d.selected) && encoders.iter().any(|e| e.selected);
    if !stages && (cx.explicit || (!dits.is_empty() && !encoders.is_empty())) {
        cx.warn(MODEL_SWAP_SKIP_REASON.to_string());
        return Ok(Some(MODEL_SWAP_SKIP_REASON.to_string()));
    }
    Ok(None)
}

/// The layerwise strategies: encoder replication first, then DiT stacks, encoder stacks and their resident layers,
/// then VAEs staged whole.
fn resolve_layer(cx: &mut Ctx<'_>, comps: &mut Components, sel: Selection) -> Result<(), PlanError> {
    encoder::check_allgather_replication(cx, &comps.encoders, sel.text_encoder)?;
    if sel.dit {
        dit::resolve_dits(cx, &mut comps.dits)?;
    }
    encoder::resolve_encoders(cx, &mut comps.encoders, sel.text_encoder)?;
    if cx.cfg.encoder_resident_layers > 0 {
        encoder::keep_encoder_resident_layers(cx, &mut comps.encoders)?;
    }
    resolve_vaes(cx, &mut comps.vaes, sel.vae)
}

/// VAEs: staged whole through the pipeline lifecycle, when selected (explicitly) or declared on demand.
fn resolve_vaes(cx: &mut Ctx<'_>, vaes: &mut [ResolvedComponent], vae_selected: bool) -> Result<(), PlanError> {
    let p = cx.p;
    let explicit = cx.explicit;
    for v in vaes.iter_mut() {
        let m = module(p, &v.path);
        if explicit {
            if vae_selected {
                if !cx.is_on_demand(&v.path) {
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
        } else if cx.is_on_demand(&v.path) {
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
