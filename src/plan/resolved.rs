//! The resolved plan: what the resolver decided for each component ([`ResolvedComponent`], its role
//! [`ComponentKind`] and its [`StackPlan`]s) and the budget planner's device-memory bound ([`BudgetPlan`]).

use super::stack::StackPlan;
use crate::config::Strategy;
use serde::Serialize;

/// What role a component plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ComponentKind {
    /// A diffusion transformer.
    Dit,
    /// A text encoder (selectable as `text_encoder`).
    TextEncoder,
    /// Another encoder (image, …): never selectable.
    Encoder,
    /// A VAE.
    Vae,
    /// A module that always stays on the device.
    Resident,
    /// An auxiliary module (stays on the device).
    Auxiliary,
    /// A nested DiT child that is staged or streamed separately.
    DitChild,
}

impl ComponentKind {
    /// Short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            ComponentKind::Dit => "dit",
            ComponentKind::TextEncoder => "text_encoder",
            ComponentKind::Encoder => "encoder",
            ComponentKind::Vae => "vae",
            ComponentKind::Resident => "resident",
            ComponentKind::Auxiliary => "auxiliary",
            ComponentKind::DitChild => "dit_child",
        }
    }
}

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

/// One component of the resolved plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedComponent {
    /// Dotted path from the pipeline root.
    pub path: String,
    /// Role.
    pub kind: ComponentKind,
    /// Module class.
    pub class: String,
    /// Whether the strategy offloads this component.
    pub selected: bool,
    /// Block stacks streamed through rings.
    pub stacks: Vec<StackPlan>,
    /// Residency managed by the pipeline's `load_to_device` / `offload_to_cpu` lifecycle.
    pub on_demand: bool,
    /// Nested children staged or streamed separately (DiTs only).
    pub children: Vec<ResolvedComponent>,
    /// Bytes of the component's distinct storages.
    pub bytes: u64,
    /// Device bytes of the component when packed (each storage aligned).
    pub device_bytes: u64,
}

impl ResolvedComponent {
    /// Every block path owned by this component's stacks (children excluded).
    pub fn block_paths(&self) -> impl Iterator<Item = &String> {
        self.stacks.iter().flat_map(|s| s.blocks.iter())
    }
}

/// The resolver's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedPlan {
    /// The strategy that will run.
    pub strategy: Strategy,
    /// Diffusion transformers.
    pub dits: Vec<ResolvedComponent>,
    /// Encoders.
    pub encoders: Vec<ResolvedComponent>,
    /// VAEs.
    pub vaes: Vec<ResolvedComponent>,
    /// Always-resident modules (declared residents and auxiliaries).
    pub residents: Vec<ResolvedComponent>,
    /// Why the backend should do nothing at all (layerwise, compatibility topology, no DiT).
    pub skip_reason: Option<String>,
    /// Warnings raised while resolving (also logged).
    pub warnings: Vec<String>,
    /// Device memory plan for the weights.
    pub budget: BudgetPlan,
}

impl ResolvedPlan {
    /// All top-level components: DiTs, encoders, VAEs, residents.
    pub fn components(&self) -> impl Iterator<Item = &ResolvedComponent> {
        self.dits.iter().chain(&self.encoders).chain(&self.vaes).chain(&self.residents)
    }
    /// Every block stack of every component and child, with its owner.
    pub fn stacks(&self) -> Vec<(&ResolvedComponent, &StackPlan)> {
        let mut out = Vec::new();
        fn walk<'a>(c: &'a ResolvedComponent, out: &mut Vec<(&'a ResolvedComponent, &'a StackPlan)>) {
            for s in &c.stacks {
                out.push((c, s));
            }
            for ch in &c.children {
                walk(ch, out);
            }
        }
        for c in self.components() {
            walk(c, &mut out);
        }
        out
    }
}
