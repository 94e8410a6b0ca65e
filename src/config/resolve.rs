//! Resolution of a parsed config tree into an [`OffloadConfig`]: reading every key with its exact type, the
//! compact `diffusion_offload_config` rules, the legacy flag priority, compact/legacy conflicts, the weight-sharding
//! group derivation, and the cross-feature guards (step cache, prompt-embedding cache, HSDP).

use super::budget::{parse_budget_value, parse_chunk_value};
use super::migrate::{HostWeightRuntime, Migrated, MIGRATED_KEYS};
use super::walk::{describe, quote, suggest, type_error, Table};
use super::{
    Component, ConfigError, CopySubmission, GroupAxis, HostMasters, LayerOptions, OffloadConfig, OffloadGroup,
    ParallelConfig, Strategy, WeightTransfer,
};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// Every accepted top-level key, in the order they are read.
pub(crate) const TOP_KEYS: &[&str] = &[
    "enable_cpu_offload",
    "enable_layerwise_offload",
    "enable_distributed_layerwise_offload",
    "pin_cpu_memory",
    "dlo_use_allgather",
    "dlo_resident_layers",
    "data_parallel_size",
    "sequence_parallel_size",
    "tensor_parallel_size",
    "use_hsdp",
    "hsdp_shard_size",
    "hsdp_replicate_size",
    "cache_backend",
    "enable_prompt_embed_cache",
    "diffusion_offload_config",
];

/// Every accepted key of `diffusion_offload_config`.
pub(crate) const COMPACT_KEYS: &[&str] = &[
    "mode",
    "components",
    "layer_options",
    "pin_memory",
    "host_masters",
    "device_budget",
    "host_budget",
    "keep_dit_resident",
];

/// Every accepted key of `diffusion_offload_config.layer_options.<component>`.
pub(crate) const LAYER_KEYS: &[&str] = &[
    "weight_transfer",
    "resident_layers",
    "prefetch_depth",
    "allgather_chunk_size",
    "copy_submission",
    "static_slots",
];

/// The compact config's object key, used in paths.
const COMPACT: &str = "diffusion_offload_config";

/// Largest accepted `prefetch_depth`.
const MAX_PREFETCH_DEPTH: u32 = 64;

/// Human name of a strategy for messages.
fn strategy_words(s: Strategy) -> &'static str {
    match s {
        Strategy::None => "no offload",
        Strategy::ModelLevel => "model-level offload",
        Strategy::LayerWise => "layerwise offload",
        Strategy::DistributedLayerWise => "distributed layerwise offload",
    }
}

/// The legacy top-level settings.
struct Legacy {
    enable_cpu_offload: bool,
    enable_layerwise_offload: bool,
    enable_distributed_layerwise_offload: bool,
    pin_cpu_memory: bool,
    dlo_use_allgather: bool,
    dlo_resident_layers: u32,
}

impl Legacy {
    fn read(top: &Table<'_>) -> Result<Self, ConfigError> {
        Ok(Legacy {
            enable_cpu_offload: top.bool_or("enable_cpu_offload", false)?,
            enable_layerwise_offload: top.bool_or("enable_layerwise_offload", false)?,
            enable_distributed_layerwise_offload: top.bool_or("enable_distributed_layerwise_offload", false)?,
            pin_cpu_memory: top.bool_or("pin_cpu_memory", true)?,
            dlo_use_allgather: top.bool_or("dlo_use_allgather", true)?,
            dlo_resident_layers: top.opt_u32("dlo_resident_layers", 0, u32::MAX)?.unwrap_or(0),
        })
    }

    /// The flags that are set, with the strategy each selects, highest priority first.
    fn flags(&self) -> Vec<(&'static str, Strategy)> {
        let all = [
            (
                "enable_distributed_layerwise_offload",
                self.enable_distributed_layerwise_offload,
                Strategy::DistributedLayerWise,
            ),
            ("enable_layerwise_offload", self.enable_layerwise_offload, Strategy::LayerWise),
            ("enable_cpu_offload", self.enable_cpu_offload, Strategy::ModelLevel),
        ];
        all.into_iter().filter(|(_, set, _)| *set).map(|(name, _, s)| (name, s)).collect()
    }
}

/// Engine settings that constrain offload.
struct Engine {
    /// `cache_backend` when set to a real backend (not null, not `"none"`).
    cache_backend: Option<String>,
    enable_prompt_embed_cache: bool,
}

impl Engine {
    fn read(top: &Table<'_>) -> Result<Self, ConfigError> {
        let cache_backend = match top.get("cache_backend") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s == "none" => None,
            Some(Value::String(s)) if s.is_empty() => {
                return Err(ConfigError::invalid(
                    "cache_backend",
                    "empty backend name; use \"none\" (or remove the key) to run without a step cache",
                ))
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => return Err(type_error("cache_backend", "a cache backend name, \"none\" or null", other)),
        };
        Ok(Engine { cache_backend, enable_prompt_embed_cache: top.bool_or("enable_prompt_embed_cache", false)? })
    }
}

fn read_parallel(top: &Table<'_>) -> Result<ParallelConfig, ConfigError> {
    let d = ParallelConfig::default();
    let hsdp_shard_size =
        match top.opt_int("hsdp_shard_size", -1, i64::from(u32::MAX), "-1 (unset) or an integer >= 1")? {
            Some(0) => {
                return Err(ConfigError::invalid(
                    "hsdp_shard_size",
                    "expected -1 (unset) or an integer >= 1, found 0; use -1 to leave the shard size unset",
                ))
            }
            Some(v) => v,
            None => d.hsdp_shard_size,
        };
    let p = ParallelConfig {
        data_parallel_size: top.opt_u32("data_parallel_size", 1, u32::MAX)?.unwrap_or(d.data_parallel_size),
        sequence_parallel_size: top.opt_u32("sequence_parallel_size", 1, u32::MAX)?.unwrap_or(d.sequence_parallel_size),
        tensor_parallel_size: top.opt_u32("tensor_parallel_size", 1, u32::MAX)?.unwrap_or(d.tensor_parallel_size),
        use_hsdp: top.bool_or("use_hsdp", d.use_hsdp)?,
        hsdp_shard_size,
        hsdp_replicate_size: top.opt_u32("hsdp_replicate_size", 1, u32::MAX)?.unwrap_or(d.hsdp_replicate_size),
    };
    if p.hsdp_sharded() {
        // The shard size is at most u32::MAX here, so the product fits in u64.
        let ranks = p.hsdp_shard_size.unsigned_abs() * u64::from(p.hsdp_replicate_size);
        if ranks > u64::from(u32::MAX) {
            return Err(ConfigError::invalid(
                "hsdp_shard_size",
                format!("hsdp_shard_size x hsdp_replicate_size = {ranks} ranks is too large; use sizes that match the real cluster"),
            ));
        }
    }
    Ok(p)
}

impl ParallelConfig {
    /// Whether HSDP actually shards: `use_hsdp` with a positive `hsdp_shard_size` (`-1` leaves HSDP unsharded for
    /// group derivation).
    pub fn hsdp_sharded(&self) -> bool {
        self.use_hsdp && self.hsdp_shard_size > 0
    }

    /// The group that AllGather transfer would shard weights across, derived from the parallel layout alone:
    /// the data-parallel size; replaced by `hsdp_shard_size x hsdp_replicate_size` when HSDP shards; replaced by
    /// the sequence-parallel size when that leaves one rank and SP > 1. Tensor parallelism never forms the group.
    /// A size of 1 is reported with [`GroupAxis::Single`].
    pub fn weight_shard_group(&self) -> OffloadGroup {
        let mut size = u64::from(self.data_parallel_size);
        let mut axis = GroupAxis::DataParallel;
        if self.hsdp_sharded() {
            size = self.hsdp_shard_size.unsigned_abs().saturating_mul(u64::from(self.hsdp_replicate_size));
            axis = GroupAxis::Hsdp;
        }
        if size <= 1 && self.sequence_parallel_size > 1 {
            size = u64::from(self.sequence_parallel_size);
            axis = GroupAxis::SequenceParallel;
        }
        let size = u32::try_from(size).unwrap_or(u32::MAX);
        if size <= 1 {
            OffloadGroup { size: 1, axis: GroupAxis::Single }
        } else {
            OffloadGroup { size, axis }
        }
    }
}

/// The compact mode.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Module,
    Layer,
}

/// Options given under `layer_options.<component>`.
#[derive(Default, Clone, Copy)]
struct RawLayer {
    weight_transfer: Option<WeightTransfer>,
    resident_layers: Option<u32>,
    prefetch_depth: Option<u32>,
    allgather_chunk_bytes: Option<u64>,
    copy_submission: Option<CopySubmission>,
    static_slots: Option<bool>,
}

/// The compact object, type-checked and validated on its own.
struct Compact {
    mode: Mode,
    components: BTreeSet<Component>,
    layers: BTreeMap<Component, RawLayer>,
    pin_memory: Option<bool>,
    host_masters: HostMasters,
    device_budget: Option<u64>,
    device_budget_auto: bool,
    host_budget: Option<u64>,
    host_budget_auto: bool,
    keep_dit_resident: bool,
}

fn parse_component(name: &str) -> Option<Component> {
    Component::ALL.into_iter().find(|c| c.name() == name)
}

fn component_list() -> String {
    Component::ALL.map(Component::name).join(", ")
}

impl Compact {
    fn read(t: &Table<'_>) -> Result<Self, ConfigError> {
        t.reject_unknown("diffusion_offload_config key", COMPACT_KEYS)?;
        let mode = read_mode(t)?;
        let components = read_components(t)?;
        let pin_memory = match t.get("pin_memory") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => {
                return Err(ConfigError::invalid(
                    t.key_path("pin_memory"),
                    format!(
                        "expected true, false or null, found {}; null (or no key) inherits pin_cpu_memory",
                        describe(other)
                    ),
                ))
            }
        };
        let host_masters = read_host_masters(t)?;
        let (device_budget, device_budget_auto) = match t.get("device_budget") {
            None => (None, false),
            Some(Value::String(s)) if s == "auto" => (None, true),
            Some(v) => (Some(parse_budget_value(&t.key_path("device_budget"), v)?), false),
        };
        let (host_budget, host_budget_auto) = match t.get("host_budget") {
            None => (None, false),
            Some(Value::String(s)) if s == "auto" => (None, true),
            Some(v) => (Some(parse_budget_value(&t.key_path("host_budget"), v)?), false),
        };
        let keep_dit_resident = match t.opt_bool("keep_dit_resident")? {
            None => false,
            Some(_) if mode == Mode::Layer => {
                return Err(ConfigError::invalid(
                    t.key_path("keep_dit_resident"),
                    "applies only to mode = \"module\"; remove keep_dit_resident (in layer mode the planner keeps \
                     leading blocks resident within device_budget) or set mode = \"module\"",
                ))
            }
            Some(true) if !components.contains(&Component::Dit) => {
                return Err(ConfigError::invalid(
                    t.key_path("keep_dit_resident"),
                    "the DiT is not offloaded, so there is nothing to keep resident; add \"dit\" to components or \
                     remove keep_dit_resident",
                ))
            }
            Some(b) => b,
        };
        let layers = read_layer_options(t, mode, &components)?;
        Ok(Compact {
            mode,
            components,
            layers,
            pin_memory,
            host_masters,
            device_budget,
            device_budget_auto,
            host_budget,
            host_budget_auto,
            keep_dit_resident,
        })
    }

    fn transfer(&self, c: Component) -> WeightTransfer {
        self.layers.get(&c).and_then(|l| l.weight_transfer).unwrap_or(WeightTransfer::RankLocal)
    }

    fn dit_resident_layers(&self) -> u32 {
        self.resident_layers(Component::Dit)
    }

    fn resident_layers(&self, c: Component) -> u32 {
        self.layers.get(&c).and_then(|l| l.resident_layers).unwrap_or(0)
    }

    fn strategy(&self) -> Strategy {
        match self.mode {
            Mode::Module => Strategy::ModelLevel,
            Mode::Layer => {
                let any_allgather = self.components.iter().any(|&c| self.transfer(c) == WeightTransfer::Allgather);
                let any_resident = self.components.iter().any(|&c| self.resident_layers(c) > 0);
                if any_allgather || any_resident {
                    Strategy::DistributedLayerWise
                } else {
                    Strategy::LayerWise
                }
            }
        }
    }
}

fn read_mode(t: &Table<'_>) -> Result<Mode, ConfigError> {
    let path = t.key_path("mode");
    match t.get("mode") {
        None => Err(ConfigError::invalid(
            path,
            "missing; set mode = \"module\" (whole components swap per phase) or \"layer\" (blocks stream through \
             device slots)",
        )),
        Some(Value::String(s)) if s == "module" => Ok(Mode::Module),
        Some(Value::String(s)) if s == "layer" => Ok(Mode::Layer),
        Some(Value::String(s)) => {
            let hint = match suggest(s, &["module", "layer", "layerwise", "model"]) {
                Some("layer" | "layerwise") => " (did you mean \"layer\"?)",
                Some("module" | "model") => " (did you mean \"module\"?)",
                _ => "",
            };
            Err(ConfigError::invalid(path, format!("unknown mode {}{hint}; choose \"module\" or \"layer\"", quote(s))))
        }
        Some(other) => Err(type_error(&path, "\"module\" or \"layer\"", other)),
    }
}

fn read_host_masters(t: &Table<'_>) -> Result<HostMasters, ConfigError> {
    let path = t.key_path("host_masters");
    match t.get("host_masters") {
        None => Ok(HostMasters::Auto),
        Some(Value::String(s)) => HostMasters::parse(s).ok_or_else(|| {
            ConfigError::invalid(
                path,
                format!(
                    "unknown value {}; choose \"auto\" (mapped where the checkpoint's layout allows, pinned \
                     elsewhere), \"mapped\" or \"pinned\"",
                    quote(s)
                ),
            )
        }),
        Some(other) => Err(type_error(&path, "\"auto\", \"mapped\" or \"pinned\"", other)),
    }
}

fn read_components(t: &Table<'_>) -> Result<BTreeSet<Component>, ConfigError> {
    let path = t.key_path("components");
    let items = match t.get("components") {
        None => {
            return Err(ConfigError::invalid(
                path,
                format!("missing; list the components to offload, e.g. [\"dit\"] (choose from: {})", component_list()),
            ))
        }
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(type_error(
                &path,
                "a non-empty list of component names such as [\"dit\", \"text_encoder\"]",
                other,
            ))
        }
    };
    if items.is_empty() {
        return Err(ConfigError::invalid(
            path,
            format!(
                "the list is empty; name at least one of {} (or remove diffusion_offload_config to disable offload)",
                component_list()
            ),
        ));
    }
    let mut set = BTreeSet::new();
    for (i, item) in items.iter().enumerate() {
        let item_path = format!("{path}[{i}]");
        let Value::String(name) = item else {
            return Err(type_error(&item_path, "a component name (dit, text_encoder or vae)", item));
        };
        let Some(c) = parse_component(name) else {
            let hint = match suggest(name, &Component::ALL.map(Component::name)) {
                Some(s) => format!(" (did you mean \"{s}\"?)"),
                None => String::new(),
            };
            return Err(ConfigError::invalid(
                item_path,
                format!(
                    "unknown component {}{hint}; choose from {} (names are matched exactly)",
                    quote(name),
                    component_list()
                ),
            ));
        };
        if !set.insert(c) {
            return Err(ConfigError::invalid(
                item_path,
                format!("{} is listed twice; list each component once", quote(name)),
            ));
        }
    }
    Ok(set)
}

fn read_layer_options(
    t: &Table<'_>,
    mode: Mode,
    components: &BTreeSet<Component>,
) -> Result<BTreeMap<Component, RawLayer>, ConfigError> {
    let mut out = BTreeMap::new();
    let Some(value) = t.get("layer_options") else { return Ok(out) };
    let options = Table::new(&t.key_path("layer_options"), value)?;
    if options.is_empty() {
        return Ok(out);
    }
    if mode == Mode::Module {
        return Err(ConfigError::invalid(
            options.path(),
            "layer options apply only to mode = \"layer\"; remove layer_options or set mode = \"layer\"",
        ));
    }
    for (name, entry) in options.entries() {
        let path = options.key_path(name);
        let component = match parse_component(name) {
            Some(Component::Vae) => {
                return Err(ConfigError::invalid(
                    path,
                    "the VAE is staged to the device as a whole component and takes no layer options; remove \
                     layer_options.vae",
                ))
            }
            Some(c) => c,
            None => {
                let valid = ["dit", "text_encoder"];
                let hint = match suggest(name, &valid) {
                    Some(s) => format!(" (did you mean `{s}`?)"),
                    None => String::new(),
                };
                return Err(ConfigError::invalid(
                    path,
                    format!("unknown component{hint}; valid keys are: {}", valid.join(", ")),
                ));
            }
        };
        if !components.contains(&component) {
            return Err(ConfigError::invalid(
                path,
                format!(
                    "{0} is not in diffusion_offload_config.components; add \"{0}\" to components or remove these \
                     options",
                    component.name()
                ),
            ));
        }
        let layer = Table::new(&path, entry)?;
        layer.reject_unknown("layer option", LAYER_KEYS)?;
        let raw = read_layer(&layer)?;
        out.insert(component, raw);
    }
    Ok(out)
}

fn read_layer(layer: &Table<'_>) -> Result<RawLayer, ConfigError> {
    let transfer_path = layer.key_path("weight_transfer");
    let weight_transfer = match layer.get("weight_transfer") {
        None => None,
        Some(Value::String(s)) if s == "allgather" => Some(WeightTransfer::Allgather),
        Some(Value::String(s)) if s == "rank-local" => Some(WeightTransfer::RankLocal),
        Some(Value::String(s)) => {
            let hint = match suggest(s, &["allgather", "rank-local"]) {
                Some(v) => format!(" (did you mean \"{v}\"?)"),
                None => String::new(),
            };
            return Err(ConfigError::invalid(
                transfer_path,
                format!("unknown weight transfer {}{hint}; choose \"allgather\" or \"rank-local\"", quote(s)),
            ));
        }
        Some(other) => return Err(type_error(&transfer_path, "\"allgather\" or \"rank-local\"", other)),
    };
    let resident_path = layer.key_path("resident_layers");
    let resident_layers = layer.opt_u32("resident_layers", 0, u32::MAX)?;
    if resident_layers.unwrap_or(0) > 0 && weight_transfer == Some(WeightTransfer::Allgather) {
        return Err(ConfigError::invalid(
            resident_path,
            format!(
                "resident layers need weight_transfer = \"rank-local\"; set {} = \"rank-local\" or remove \
                 resident_layers",
                transfer_path
            ),
        ));
    }
    let prefetch_depth = layer.opt_u32("prefetch_depth", 1, MAX_PREFETCH_DEPTH)?;
    let chunk_path = layer.key_path("allgather_chunk_size");
    let allgather_chunk_bytes = match layer.get("allgather_chunk_size") {
        None => None,
        Some(_) if weight_transfer != Some(WeightTransfer::Allgather) => {
            return Err(ConfigError::invalid(
                chunk_path,
                format!(
                    "the chunk size applies only to AllGather transfer; set {transfer_path} = \"allgather\" or \
                     remove allgather_chunk_size"
                ),
            ))
        }
        Some(v) => Some(parse_chunk_value(&chunk_path, v)?),
    };
    let submission_path = layer.key_path("copy_submission");
    let choices = "\"actor\" or \"hook\"";
    let copy_submission = match layer.get("copy_submission") {
        None => None,
        Some(Value::String(s)) => match CopySubmission::parse(s) {
            Some(v) => Some(v),
            None => {
                let hint = match suggest(s, &["actor", "hook"]) {
                    Some(v) => format!(" (did you mean \"{v}\"?)"),
                    None => String::new(),
                };
                return Err(ConfigError::invalid(
                    submission_path,
                    format!("unknown copy submission {}{hint}; choose {choices}", quote(s)),
                ));
            }
        },
        Some(other) => return Err(type_error(&submission_path, choices, other)),
    };
    if copy_submission == Some(CopySubmission::Hook) && weight_transfer == Some(WeightTransfer::Allgather) {
        return Err(ConfigError::invalid(
            submission_path,
            format!(
                "copy_submission = \"hook\" applies only to rank-local transfer (AllGather stacks submit through \
                 their actors); set {transfer_path} = \"rank-local\" or remove copy_submission"
            ),
        ));
    }
    let static_slots = layer.opt_bool("static_slots")?;
    Ok(RawLayer {
        weight_transfer,
        resident_layers,
        prefetch_depth,
        allgather_chunk_bytes,
        copy_submission,
        static_slots,
    })
}

/// Rejects legacy settings that contradict (or duplicate with other values) the compact config.
fn check_compact_against_legacy(legacy: &Legacy, migrated: &Migrated, strategy: Strategy) -> Result<(), ConfigError> {
    for (flag, flag_strategy) in legacy.flags() {
        if flag_strategy != strategy {
            return Err(ConfigError::invalid(
                flag,
                format!(
                    "this legacy flag selects {}, but diffusion_offload_config selects {}; remove {flag} \
                     (diffusion_offload_config alone decides the strategy)",
                    strategy_words(flag_strategy),
                    strategy_words(strategy)
                ),
            ));
        }
    }
    if !legacy.dlo_use_allgather {
        return Err(ConfigError::invalid(
            "dlo_use_allgather",
            "legacy distributed-offload tuning cannot be combined with diffusion_offload_config; remove \
             dlo_use_allgather and set diffusion_offload_config.layer_options.<component>.weight_transfer instead",
        ));
    }
    if legacy.dlo_resident_layers != 0 {
        return Err(ConfigError::invalid(
            "dlo_resident_layers",
            "legacy distributed-offload tuning cannot be combined with diffusion_offload_config; remove \
             dlo_resident_layers and set diffusion_offload_config.layer_options.dit.resident_layers instead",
        ));
    }
    migrated.check_against_compact()
}

fn default_layer_options() -> BTreeMap<Component, LayerOptions> {
    let opts = LayerOptions {
        weight_transfer: WeightTransfer::RankLocal,
        prefetch_depth: None,
        allgather_chunk_bytes: None,
        copy_submission: CopySubmission::Actor,
        static_slots: false,
    };
    Component::ALL.iter().map(|&c| (c, opts)).collect()
}

fn resolve_compact(compact: &Compact, legacy: &Legacy, migrated: &Migrated) -> Result<OffloadConfig, ConfigError> {
    let strategy = compact.strategy();
    check_compact_against_legacy(legacy, migrated, strategy)?;
    let pin_memory = compact.pin_memory.unwrap_or(legacy.pin_cpu_memory);
    if !pin_memory {
        // A copy from pageable memory synchronises its stream before it starts, so the hook would wait on the host
        // for the copy stream (behind the slot's last use) while holding the stack's lock.
        if let Some(c) = compact.layers.iter().find(|(_, l)| l.copy_submission == Some(CopySubmission::Hook)) {
            return Err(ConfigError::invalid(
                format!("{COMPACT}.layer_options.{}.copy_submission", c.0.name()),
                "copy_submission = \"hook\" needs pinned host masters (a copy from pageable memory makes the hook \
                 wait for the copy stream); set pin_memory = true or use copy_submission = \"actor\"",
            ));
        }
    }
    let mut layer_options = default_layer_options();
    for (c, opts) in layer_options.iter_mut() {
        opts.weight_transfer = compact.transfer(*c);
        opts.prefetch_depth = compact.layers.get(c).and_then(|l| l.prefetch_depth);
        opts.allgather_chunk_bytes = compact.layers.get(c).and_then(|l| l.allgather_chunk_bytes);
        opts.copy_submission = compact.layers.get(c).and_then(|l| l.copy_submission).unwrap_or_default();
        opts.static_slots = compact.layers.get(c).and_then(|l| l.static_slots).unwrap_or(false);
    }
    Ok(OffloadConfig {
        strategy,
        components: Some(compact.components.clone()),
        layer_options,
        resident_layers: compact.dit_resident_layers(),
        encoder_resident_layers: compact.resident_layers(Component::TextEncoder),
        pin_memory,
        host_masters: compact.host_masters,
        device_budget: compact.device_budget,
        device_budget_auto: compact.device_budget_auto,
        host_budget: compact.host_budget,
        host_budget_auto: compact.host_budget_auto,
        keep_dit_resident: compact.keep_dit_resident,
        parallel: ParallelConfig::default(),
        group: OffloadGroup { size: 1, axis: GroupAxis::Single },
        compact: true,
        warnings: Vec::new(),
    })
}

fn resolve_legacy(legacy: &Legacy, migrated: &Migrated) -> Result<OffloadConfig, ConfigError> {
    let flags = legacy.flags();
    let strategy = flags.first().map_or(Strategy::None, |&(_, s)| s);
    if let Some(&(winner, _)) = flags.first() {
        for &(dropped, _) in flags.iter().skip(1) {
            tracing::info!(kept = winner, dropped, "legacy offload flags: {winner} takes priority; {dropped} ignored");
        }
    }
    let dlo = strategy == Strategy::DistributedLayerWise;
    if dlo && legacy.dlo_resident_layers > 0 && legacy.dlo_use_allgather {
        return Err(ConfigError::invalid(
            "dlo_resident_layers",
            "resident layers need the DiT weight transfer to be rank-local; set dlo_use_allgather = false, or set \
             dlo_resident_layers = 0",
        ));
    }
    if !dlo && (legacy.dlo_resident_layers != 0 || !legacy.dlo_use_allgather) {
        tracing::info!("dlo_use_allgather / dlo_resident_layers ignored: distributed layerwise offload is not enabled");
    }
    let mut warnings = Vec::new();
    let mut layer_options = default_layer_options();
    if dlo && legacy.dlo_use_allgather {
        if let Some(o) = layer_options.get_mut(&Component::Dit) {
            o.weight_transfer = WeightTransfer::Allgather;
        }
    }
    let components = legacy_components(strategy, migrated, &mut warnings)?;
    check_legacy_encoder_residents(legacy, migrated, dlo)?;
    migrated_warnings(migrated, &mut layer_options, &mut warnings);
    for w in &warnings {
        tracing::warn!("{w}");
    }
    Ok(OffloadConfig {
        strategy,
        components,
        layer_options,
        resident_layers: if dlo { legacy.dlo_resident_layers } else { 0 },
        encoder_resident_layers: if dlo { migrated.encoder_resident_layers } else { 0 },
        pin_memory: legacy.pin_cpu_memory,
        host_masters: HostMasters::Auto,
        device_budget: None,
        device_budget_auto: false,
        host_budget: None,
        host_budget_auto: false,
        keep_dit_resident: false,
        parallel: ParallelConfig::default(),
        group: OffloadGroup { size: 1, axis: GroupAxis::Single },
        compact: false,
        warnings,
    })
}

/// The components `layerwise_offload_components` selects (a deprecation warning), which needs a layerwise strategy.
fn legacy_components(
    strategy: Strategy,
    migrated: &Migrated,
    warnings: &mut Vec<String>,
) -> Result<Option<BTreeSet<Component>>, ConfigError> {
    let Some(set) = &migrated.layerwise_components else { return Ok(None) };
    if !matches!(strategy, Strategy::LayerWise | Strategy::DistributedLayerWise) {
        return Err(ConfigError::invalid(
            "layerwise_offload_components",
            format!(
                "selects components for layerwise offload, but {}; set enable_layerwise_offload = true, or \
                 use diffusion_offload_config with mode = \"layer\" and components",
                match strategy {
                    Strategy::ModelLevel => "enable_cpu_offload selects model-level offload",
                    _ => "no layerwise offload flag is set",
                }
            ),
        ));
    }
    let names: Vec<String> = set.iter().map(|c| format!("\"{}\"", c.name())).collect();
    warnings.push(format!(
        "layerwise_offload_components is deprecated: it maps to diffusion_offload_config.components = [{}] \
         (with mode = \"layer\")",
        names.join(", ")
    ));
    Ok(Some(set.clone()))
}

/// Resident encoder layers (`dlo_encoder_resident_layers`) need distributed layerwise offload with rank-local
/// weights.
fn check_legacy_encoder_residents(legacy: &Legacy, migrated: &Migrated, dlo: bool) -> Result<(), ConfigError> {
    if migrated.encoder_resident_layers == 0 {
        return Ok(());
    }
    if !dlo {
        return Err(ConfigError::invalid(
            "dlo_encoder_resident_layers",
            "resident encoder layers require distributed layerwise offload; set \
             enable_distributed_layerwise_offload = true, or use \
             diffusion_offload_config.layer_options.text_encoder.resident_layers",
        ));
    }
    if legacy.dlo_use_allgather {
        return Err(ConfigError::invalid(
            "dlo_encoder_resident_layers",
            "resident encoder layers keep the rank-local weights the loader produced; set dlo_use_allgather = \
             false, or set dlo_encoder_resident_layers = 0",
        ));
    }
    Ok(())
}

/// The warnings of migrated vLLM-Omni settings weightferry has no use for, and the DiT chunk size
/// `dlo_chunk_size_mb` maps to.
fn migrated_warnings(
    migrated: &Migrated,
    layer_options: &mut BTreeMap<Component, LayerOptions>,
    warnings: &mut Vec<String>,
) {
    if migrated.host_weight_runtime == HostWeightRuntime::Preferred {
        warnings.push(
            "host_weight_runtime_mode = \"preferred\": weightferry has no Host Weight Runtime, so host masters are \
             built from the loaded weights (vLLM-Omni's fallback when the runtime is unavailable); set \
             host_weight_runtime_mode = \"disabled\" to silence this"
                .to_string(),
        );
    }
    if migrated.registration_limit {
        warnings.push(
            "dlo_host_registration_limit_gib has no effect: it limits Host Weight Runtime registrations, which \
             weightferry never makes; remove it"
                .to_string(),
        );
    }
    if let Some(mb) = migrated.chunk_size_mb {
        let target = format!("diffusion_offload_config.layer_options.dit.allgather_chunk_size = \"{mb}MiB\"");
        match layer_options.get_mut(&Component::Dit) {
            Some(o) if o.weight_transfer == WeightTransfer::Allgather => {
                o.allgather_chunk_bytes = Some(u64::from(mb) * 1024 * 1024);
                warnings.push(format!("dlo_chunk_size_mb is deprecated: it maps to {target}"));
            }
            _ => warnings
                .push(format!("dlo_chunk_size_mb has no effect without DiT AllGather transfer (it maps to {target})")),
        }
    }
}

/// How to switch AllGather off, phrased for the config form in use.
fn allgather_fix(cfg: &OffloadConfig, only: Option<Component>) -> String {
    if cfg.compact {
        let names: Vec<&str> = Component::ALL
            .into_iter()
            .filter(|&c| only.is_none_or(|o| o == c))
            .filter(|&c| cfg.offloads(c) && cfg.transfer_for(c) == WeightTransfer::Allgather)
            .map(Component::name)
            .collect();
        let keys: Vec<String> = names.iter().map(|n| format!("{COMPACT}.layer_options.{n}.weight_transfer")).collect();
        format!("set {} = \"rank-local\"", keys.join(" and "))
    } else {
        "set dlo_use_allgather = false".to_string()
    }
}

/// Resolves a whole config tree.
pub(crate) fn resolve(root: &Value) -> Result<OffloadConfig, ConfigError> {
    let top = match root {
        Value::Object(_) => Table::new("", root)?,
        other => {
            return Err(ConfigError::invalid(
                "<root>",
                format!(
                    "expected an object of settings at the top level, found {}; write the settings as an object, \
                     e.g. {{\"enable_cpu_offload\": true}}",
                    describe(other)
                ),
            ))
        }
    };
    top.reject_unknown_listing("top-level key", TOP_KEYS, MIGRATED_KEYS)?;
    let legacy = Legacy::read(&top)?;
    let migrated = Migrated::read(&top)?;
    let parallel = read_parallel(&top)?;
    let engine = Engine::read(&top)?;
    let compact = match top.get(COMPACT) {
        None | Some(Value::Null) => None,
        Some(v) => Some(Compact::read(&Table::new(COMPACT, v)?)?),
    };
    let mut cfg = match &compact {
        Some(c) => resolve_compact(c, &legacy, &migrated)?,
        None => resolve_legacy(&legacy, &migrated)?,
    };
    cfg.parallel = parallel;

    let any_allgather = cfg.strategy == Strategy::DistributedLayerWise
        && Component::ALL.into_iter().any(|c| cfg.offloads(c) && cfg.transfer_for(c) == WeightTransfer::Allgather);
    if any_allgather {
        if parallel.hsdp_sharded() {
            return Err(ConfigError::invalid(
                "use_hsdp",
                format!(
                    "HSDP already shards the weights across ranks, so AllGather offload would shard them twice; {} \
                     or set use_hsdp = false",
                    allgather_fix(&cfg, None)
                ),
            ));
        }
        cfg.group = parallel.weight_shard_group();
    }

    if cfg.group.size > 1 {
        if let Some(backend) = &engine.cache_backend {
            return Err(ConfigError::invalid(
                "cache_backend",
                format!(
                    "the step cache {} decides per rank which steps to skip, so ranks could skip different weight \
                     AllGathers and hang; set cache_backend = \"none\", or {}",
                    quote(backend),
                    allgather_fix(&cfg, None)
                ),
            ));
        }
        let encoder_gathers = cfg.offloads(Component::TextEncoder)
            && cfg.transfer_for(Component::TextEncoder) == WeightTransfer::Allgather;
        if engine.enable_prompt_embed_cache && encoder_gathers {
            return Err(ConfigError::invalid(
                "enable_prompt_embed_cache",
                format!(
                    "prompt-embedding cache hits are per rank, so ranks could skip different text-encoder \
                     AllGathers and hang; set enable_prompt_embed_cache = false, or {}",
                    allgather_fix(&cfg, Some(Component::TextEncoder))
                ),
            ));
        }
    }
    Ok(cfg)
}
