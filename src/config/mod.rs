//! Offload configuration: the engine fields that matter to offload, parsed from one JSON or TOML file, validated
//! and resolved once into an immutable [`OffloadConfig`].
//!
//! Invariant: an `OffloadConfig` only exists if every rule passed (legacy priority, compact-config conflicts,
//! group derivation). Every rejection is a [`ConfigError`] naming the exact key path and the fix.

mod budget;
mod error;
mod migrate;
mod parse;
mod resolve;
mod walk;

pub use budget::parse_byte_size;
pub use error::ConfigError;

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Which offload strategy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// No offload.
    None,
    /// Whole components swap between host and device per phase.
    ModelLevel,
    /// Block stacks stream through rings of device slots.
    LayerWise,
    /// Layerwise with AllGather transfer and/or resident leading layers.
    DistributedLayerWise,
}

impl Strategy {
    /// Name used in reports and `plan --json` (`none`, `model`, `layer`, `distributed_layer`).
    pub fn report_name(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::ModelLevel => "model",
            Strategy::LayerWise => "layer",
            Strategy::DistributedLayerWise => "distributed_layer",
        }
    }
}

/// A selectable component family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    /// Diffusion transformers.
    Dit,
    /// Text encoders.
    TextEncoder,
    /// VAEs.
    Vae,
}

impl Component {
    /// Config spelling (`dit`, `text_encoder`, `vae`).
    pub fn name(self) -> &'static str {
        match self {
            Component::Dit => "dit",
            Component::TextEncoder => "text_encoder",
            Component::Vae => "vae",
        }
    }
    /// All components.
    pub const ALL: [Component; 3] = [Component::Dit, Component::TextEncoder, Component::Vae];
}

/// How a layerwise component's blocks reach the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WeightTransfer {
    /// Each rank copies whole blocks from its own host copy.
    RankLocal,
    /// Each rank copies its 1/N shard, then an AllGather rebuilds the block.
    Allgather,
}

/// Who enqueues a rank-local streamed block's copies (`layer_options.<component>.copy_submission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopySubmission {
    /// The copy-stream actor enqueues them (a message from the hook, default).
    #[default]
    Actor,
    /// The engine thread enqueues them inside the hook (no thread woken; completions polled at the hooks).
    Hook,
}

impl CopySubmission {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CopySubmission::Actor => "actor",
            CopySubmission::Hook => "hook",
        }
    }
    /// Parses the config spelling (`"actor"` or `"hook"`).
    pub fn parse(s: &str) -> Option<CopySubmission> {
        match s {
            "actor" => Some(CopySubmission::Actor),
            "hook" => Some(CopySubmission::Hook),
            _ => None,
        }
    }
}

/// Where the host masters of streamed blocks live (`diffusion_offload_config.host_masters`) when the weights come
/// from a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostMasters {
    /// Mapped where a block's tensors of one dtype lie contiguously in one file, pinned elsewhere (default).
    #[default]
    Auto,
    /// Every master pinned (or pageable with `pin_memory = false`), filled straight from the files.
    Pinned,
    /// Every master a registered range of its checkpoint file; enabling fails if one cannot be.
    Mapped,
}

impl HostMasters {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            HostMasters::Auto => "auto",
            HostMasters::Pinned => "pinned",
            HostMasters::Mapped => "mapped",
        }
    }
    /// Parses the config spelling.
    pub fn parse(s: &str) -> Option<HostMasters> {
        [HostMasters::Auto, HostMasters::Pinned, HostMasters::Mapped].into_iter().find(|h| h.as_str() == s)
    }
}

/// Parallel layout of the engine, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ParallelConfig {
    /// `data_parallel_size`.
    pub data_parallel_size: u32,
    /// `sequence_parallel_size`.
    pub sequence_parallel_size: u32,
    /// `tensor_parallel_size`.
    pub tensor_parallel_size: u32,
    /// `use_hsdp`.
    pub use_hsdp: bool,
    /// `hsdp_shard_size` (-1 = unset).
    pub hsdp_shard_size: i64,
    /// `hsdp_replicate_size`.
    pub hsdp_replicate_size: u32,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            data_parallel_size: 1,
            sequence_parallel_size: 1,
            tensor_parallel_size: 1,
            use_hsdp: false,
            hsdp_shard_size: -1,
            hsdp_replicate_size: 1,
        }
    }
}

/// Which parallel axis the offload group was derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupAxis {
    /// No group (size 1).
    Single,
    /// The data-parallel group.
    DataParallel,
    /// The HSDP shard × replicate group.
    Hsdp,
    /// The sequence-parallel group.
    SequenceParallel,
}

/// The group of ranks that shard weights between them for AllGather transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OffloadGroup {
    /// Ranks in the group (1 = no sharding).
    pub size: u32,
    /// Where the size came from.
    pub axis: GroupAxis,
}

/// Per-component layer options after resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerOptions {
    /// Transfer kind (defaults to rank-local).
    pub weight_transfer: WeightTransfer,
    /// Prefetch depth if the user set one; `None` lets the planner choose.
    pub prefetch_depth: Option<u32>,
    /// Chunked AllGather transport: gathered bytes per AllGather (`allgather_chunk_size`); `None` = one AllGather
    /// per block section. Only set with `weight_transfer = "allgather"`.
    pub allgather_chunk_bytes: Option<Bytes>,
    /// Who enqueues the copies of streamed blocks (rank-local transfer only; default the copy-stream actor).
    pub copy_submission: CopySubmission,
    /// A static schedule (`static_slots`): every streamed block lands in the same device slot on every pass, the
    /// slot count the smallest one of at least depth + 1 that divides the streamed blocks (so a block's tensors can
    /// be bound once: the ground for captured graphs). Default off.
    #[serde(skip_serializing_if = "is_false")]
    pub static_slots: bool,
}

/// Serde's test for a flag left at its default (`false`): not written.
fn is_false(b: &bool) -> bool {
    !*b
}

/// A byte count parsed from a number or a string such as `"24GiB"`.
pub type Bytes = u64;

/// The resolved, validated offload configuration. Immutable; build it with [`OffloadConfig::from_json_str`],
/// [`OffloadConfig::from_toml_str`] or [`OffloadConfig::from_path`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OffloadConfig {
    /// The strategy that runs.
    pub strategy: Strategy,
    /// Explicit component selection, or `None` for the compatibility topology (legacy flags, no selector).
    pub components: Option<BTreeSet<Component>>,
    /// Per-component options, one entry for every component (defaults filled in).
    pub layer_options: BTreeMap<Component, LayerOptions>,
    /// Leading DiT blocks kept resident (`resident_layers` / `dlo_resident_layers`).
    pub resident_layers: u32,
    /// Leading blocks kept resident in every encoder stack the pipeline declares eligible
    /// (`offload_plan.resident_encoder_block_paths`): `layer_options.text_encoder.resident_layers` /
    /// `dlo_encoder_resident_layers`.
    pub encoder_resident_layers: u32,
    /// Pin host masters.
    pub pin_memory: bool,
    /// Mapped or pinned masters for weights from a checkpoint.
    pub host_masters: HostMasters,
    /// Device memory the weights may use, if bounded.
    pub device_budget: Option<Bytes>,
    /// `device_budget = "auto"`: the budget comes from the device's free memory when offload is enabled
    /// ([`OffloadConfig::resolve_auto_budget`]); until then `device_budget` is `None` and planning refuses.
    pub device_budget_auto: bool,
    /// Host memory the masters may use (`host_budget`), if bounded: enable refuses a plan whose masters need more.
    pub host_budget: Option<Bytes>,
    /// `host_budget = "auto"`: the budget comes from the host's available memory when a session opens
    /// ([`OffloadConfig::resolve_auto_host_budget`]); until then `host_budget` is `None`.
    pub host_budget_auto: bool,
    /// Model-level only: keep the DiT resident (no swapping) when everything fits in the budget/device.
    pub keep_dit_resident: bool,
    /// Parallel layout as configured.
    pub parallel: ParallelConfig,
    /// The weight-sharding group derived from the parallel layout.
    pub group: OffloadGroup,
    /// Whether the config came from the compact `diffusion_offload_config` object (vs legacy flags only).
    pub compact: bool,
    /// Deprecation warnings raised while reading the config (each names the compact key to use instead); the
    /// resolver repeats them in the plan's warnings.
    pub warnings: Vec<String>,
}

impl OffloadConfig {
    /// Headroom `device_budget = "auto"` leaves beside the weights for activations and the framework's workspace:
    /// the larger of 2 GiB and a tenth of the free memory.
    pub fn auto_budget_headroom(free: u64) -> u64 {
        (2u64 << 30).max(free / 10)
    }

    /// Resolves `device_budget = "auto"` from the device's free memory: the budget becomes `free` minus
    /// [`OffloadConfig::auto_budget_headroom`] (at least 1 byte, so a tiny device fails in the planner with its
    /// usual message). Returns `(budget, headroom)` when the config asked for "auto", `None` otherwise.
    pub fn resolve_auto_budget(&mut self, free: u64) -> Option<(u64, u64)> {
        if !self.device_budget_auto {
            return None;
        }
        let headroom = Self::auto_budget_headroom(free);
        let budget = free.saturating_sub(headroom).max(1);
        self.device_budget = Some(budget);
        self.device_budget_auto = false;
        Some((budget, headroom))
    }

    /// Resolves `host_budget = "auto"`: the memory the process may still take (`available`: the smaller of the
    /// kernel's available memory and the room under its cgroup limit) plus the weights it holds now that the
    /// masters will replace (`held`), less a headroom of the larger of 2 GiB and a tenth of that sum (for
    /// activations, the framework and the page cache). Returns `(budget, headroom)` when the config asked for
    /// "auto", `None` otherwise.
    pub fn resolve_auto_host_budget(&mut self, available: u64, held: u64) -> Option<(u64, u64)> {
        if !self.host_budget_auto {
            return None;
        }
        let room = available.saturating_add(held);
        let headroom = (2u64 << 30).max(room / 10);
        let budget = room.saturating_sub(headroom).max(1);
        self.host_budget = Some(budget);
        self.host_budget_auto = false;
        Some((budget, headroom))
    }

    /// Offload disabled.
    pub fn disabled() -> Self {
        let opts = LayerOptions {
            weight_transfer: WeightTransfer::RankLocal,
            prefetch_depth: None,
            allgather_chunk_bytes: None,
            copy_submission: CopySubmission::Actor,
            static_slots: false,
        };
        OffloadConfig {
            strategy: Strategy::None,
            components: None,
            layer_options: Component::ALL.iter().map(|&c| (c, opts)).collect(),
            resident_layers: 0,
            encoder_resident_layers: 0,
            pin_memory: true,
            host_masters: HostMasters::Auto,
            device_budget: None,
            device_budget_auto: false,
            host_budget: None,
            host_budget_auto: false,
            keep_dit_resident: false,
            parallel: ParallelConfig::default(),
            group: OffloadGroup { size: 1, axis: GroupAxis::Single },
            compact: false,
            warnings: Vec::new(),
        }
    }
    /// Distributed layerwise offload of the DiT alone, sharded by AllGather over a data-parallel group of `world`
    /// ranks, gathering `depth` blocks ahead in chunks of `chunk_bytes` (`None`: one AllGather per section): the
    /// config that `{"data_parallel_size": world, "diffusion_offload_config": {"mode": "layer", "components":
    /// ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather", "prefetch_depth": depth,
    /// "allgather_chunk_size": chunk_bytes}}}}` resolves to.
    pub fn distributed_dit(world: u32, depth: u32, chunk_bytes: Option<Bytes>) -> Self {
        let mut c = OffloadConfig::disabled();
        c.strategy = Strategy::DistributedLayerWise;
        c.components = Some([Component::Dit].into_iter().collect());
        c.layer_options.insert(
            Component::Dit,
            LayerOptions {
                weight_transfer: WeightTransfer::Allgather,
                prefetch_depth: Some(depth),
                allgather_chunk_bytes: chunk_bytes,
                copy_submission: CopySubmission::Actor,
                static_slots: false,
            },
        );
        c.parallel.data_parallel_size = world;
        let axis = if world > 1 { GroupAxis::DataParallel } else { GroupAxis::Single };
        c.group = OffloadGroup { size: world, axis };
        c.compact = true;
        c
    }
    /// Whether `c` is offloaded under this config. Under the compatibility topology only the DiT is selected.
    pub fn offloads(&self, c: Component) -> bool {
        match &self.components {
            Some(set) => set.contains(&c),
            None => c == Component::Dit && self.strategy != Strategy::None,
        }
    }
    /// Transfer kind of a component.
    pub fn transfer_for(&self, c: Component) -> WeightTransfer {
        self.layer_options.get(&c).map_or(WeightTransfer::RankLocal, |o| o.weight_transfer)
    }
    /// Whether `c` uses AllGather across a group of more than one rank.
    pub fn uses_allgather(&self, c: Component) -> bool {
        self.transfer_for(c) == WeightTransfer::Allgather && self.group.size > 1
    }
    /// User-set prefetch depth for a component.
    pub fn prefetch_depth(&self, c: Component) -> Option<u32> {
        self.layer_options.get(&c).and_then(|o| o.prefetch_depth)
    }
    /// Whether a component's stacks run a static schedule (`layer_options.<component>.static_slots`).
    pub fn static_slots(&self, c: Component) -> bool {
        self.layer_options.get(&c).is_some_and(|o| o.static_slots)
    }
    /// Who enqueues the copies of a component's streamed blocks.
    pub fn copy_submission(&self, c: Component) -> CopySubmission {
        self.layer_options.get(&c).map_or(CopySubmission::Actor, |o| o.copy_submission)
    }
    /// User-set AllGather chunk size of a component (`None`: one AllGather per block section).
    pub fn allgather_chunk_bytes(&self, c: Component) -> Option<Bytes> {
        self.layer_options.get(&c).and_then(|o| o.allgather_chunk_bytes)
    }
}
