//! Property tests of the offload config parser: arbitrary bytes and strings never panic either text parser, and
//! arbitrary JSON trees (random and config-shaped) never panic the validator and always give the same result for
//! the same input.

use proptest::prelude::*;
use serde_json::{Map, Value};
use weightferry::config::{parse_byte_size, Component, GroupAxis, OffloadConfig, Strategy as Chosen, WeightTransfer};

/// Keys the validator knows, mixed with near-misses, so random trees reach deep validation paths.
const KEYS: &[&str] = &[
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
    "mode",
    "components",
    "layer_options",
    "pin_memory",
    "device_budget",
    "keep_dit_resident",
    "dit",
    "text_encoder",
    "vae",
    "weight_transfer",
    "resident_layers",
    "prefetch_depth",
    "prefetch",
    " dit ",
    "",
];

/// String values the validator gives meaning to, plus garbage.
const STRINGS: &[&str] = &[
    "module",
    "layer",
    "layerwise",
    "dit",
    "text_encoder",
    "vae",
    "allgather",
    "rank-local",
    "rank_local",
    "none",
    "tea_cache",
    "24GiB",
    "1.5GB",
    "-1GB",
    "0",
    "8000000000",
    "1.GB",
    "",
    "\u{0}",
    "é",
];

/// Random scalar leaves, from well-typed to garbage.
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| Value::Number(i.into())),
        (-3i64..70).prop_map(|i| Value::Number(i.into())),
        any::<u64>().prop_map(|u| Value::Number(u.into())),
        any::<f64>().prop_filter_map("finite", serde_json::Number::from_f64).prop_map(Value::Number),
        prop::sample::select(STRINGS).prop_map(|s| Value::String(s.to_string())),
        ".{0,12}".prop_map(Value::String),
    ]
}

/// Random keys: mostly known names, sometimes anything short.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![4 => prop::sample::select(KEYS).prop_map(str::to_string), 1 => "[a-z_ ]{0,10}"]
}

/// Random JSON trees up to depth 5.
fn tree() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A value for a known key: usually of the right type and range, sometimes anything.
fn value_for(key: &'static str) -> BoxedStrategy<Value> {
    let int = |lo: i64, hi: i64| (lo..hi).prop_map(|i| Value::Number(i.into())).boxed();
    let str_of = |options: &'static [&'static str]| {
        prop::sample::select(options).prop_map(|s| Value::String(s.to_string())).boxed()
    };
    let typed = match key {
        "dlo_resident_layers" | "resident_layers" => int(0, 4),
        "data_parallel_size" | "sequence_parallel_size" | "tensor_parallel_size" | "hsdp_replicate_size" => int(1, 5),
        "hsdp_shard_size" => prop_oneof![Just(Value::Number((-1).into())), int(1, 4)].boxed(),
        "prefetch_depth" => int(1, 8),
        "cache_backend" => prop_oneof![Just(Value::Null), str_of(&["none", "tea_cache"])].boxed(),
        "weight_transfer" => str_of(&["allgather", "rank-local"]),
        "device_budget" => prop_oneof![int(1, 1 << 40), str_of(&["24GiB", "1.5GB", "512 MiB"])].boxed(),
        "pin_memory" => prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::Bool)].boxed(),
        _ => any::<bool>().prop_map(Value::Bool).boxed(),
    };
    prop_oneof![12 => typed, 1 => leaf()].boxed()
}

/// An object whose keys are drawn from `keys`, each with a [`value_for`] value.
fn object_of(keys: &'static [&'static str], max: usize) -> impl Strategy<Value = Value> {
    prop::collection::vec(prop::sample::select(keys).prop_flat_map(|k| (Just(k), value_for(k))), 0..max)
        .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

/// Config-shaped trees: a top-level object that usually holds a compact object with plausible values, so that
/// random cases reach the rule checks (conflicts, groups, guards) and not only the type checks.
fn config_tree() -> impl Strategy<Value = Value> {
    let layer = object_of(&["weight_transfer", "resident_layers", "prefetch_depth", "weight_transfer", "prefetch"], 3);
    let options = prop::collection::vec(
        (prop::sample::select(&["dit", "dit", "text_encoder", "text_encoder", "vae", "x"][..]), layer),
        0..3,
    )
    .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()));
    let component = prop_oneof![
        8 => prop::sample::select(&["dit", "text_encoder", "vae"][..]),
        1 => Just("dit "),
    ];
    let components =
        prop::collection::vec(component.prop_map(|s| Value::String(s.to_string())), 0..4).prop_map(Value::Array);
    let mode = prop_oneof![8 => prop::sample::select(&["module", "layer"][..]), 1 => Just("layerwise")];
    let extras = object_of(&["pin_memory", "device_budget", "keep_dit_resident"], 2);
    let compact = (mode, components, prop::option::of(options), extras).prop_map(|(mode, comps, opts, extras)| {
        let Value::Object(mut m) = extras else { return Value::Null };
        m.insert("mode".into(), Value::String(mode.to_string()));
        m.insert("components".into(), comps);
        if let Some(o) = opts {
            m.insert("layer_options".into(), o);
        }
        Value::Object(m)
    });
    (prop::option::of(compact), object_of(&KEYS[..14], 5)).prop_map(|(compact, top)| {
        let Value::Object(mut m) = top else { return Value::Null };
        if let Some(c) = compact {
            m.insert("diffusion_offload_config".into(), c);
        }
        Value::Object(m)
    })
}

/// Properties every accepted config has, whatever the input.
fn check_invariants(c: &OffloadConfig) -> Result<(), TestCaseError> {
    let gathers = Component::ALL.into_iter().any(|x| c.offloads(x) && c.transfer_for(x) == WeightTransfer::Allgather);
    if c.group.size > 1 {
        prop_assert_eq!(c.strategy, Chosen::DistributedLayerWise);
        prop_assert!(gathers);
        prop_assert!(!c.parallel.hsdp_sharded());
    } else {
        prop_assert_eq!(c.group.axis, GroupAxis::Single);
    }
    prop_assert_eq!(c.compact, c.components.is_some());
    if c.strategy == Chosen::None {
        prop_assert!(!c.compact);
    }
    if c.resident_layers > 0 {
        prop_assert_eq!(c.strategy, Chosen::DistributedLayerWise);
        prop_assert_eq!(c.transfer_for(Component::Dit), WeightTransfer::RankLocal);
    }
    if c.keep_dit_resident {
        prop_assert_eq!(c.strategy, Chosen::ModelLevel);
    }
    if c.strategy != Chosen::DistributedLayerWise {
        prop_assert!(!gathers);
    }
    prop_assert_eq!(c.layer_options.len(), 3);
    Ok(())
}

/// A parallel layout and distributed-offload setup, for checking group derivation and guards against an
/// independent model of the rules.
#[derive(Debug, Clone)]
struct Layout {
    dp: u32,
    sp: u32,
    tp: u32,
    use_hsdp: bool,
    shard: i64,
    replicate: u32,
    legacy: bool,
    dit_allgather: bool,
    text_encoder_allgather: bool,
    cache: bool,
    prompt_cache: bool,
}

fn layout() -> impl Strategy<Value = Layout> {
    (
        (1u32..5, 1u32..5, 1u32..5, any::<bool>(), prop_oneof![Just(-1i64), 1i64..4], 1u32..4),
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
    )
        .prop_map(|((dp, sp, tp, use_hsdp, shard, replicate), (legacy, dit_ag, te_ag, cache, prompt_cache))| {
            Layout {
                dp,
                sp,
                tp,
                use_hsdp,
                shard,
                replicate,
                legacy,
                dit_allgather: dit_ag,
                // The legacy path never gathers the text encoder.
                text_encoder_allgather: te_ag && !legacy,
                cache,
                prompt_cache,
            }
        })
}

impl Layout {
    fn to_json(&self) -> Value {
        let transfer = |ag: bool| if ag { "allgather" } else { "rank-local" };
        let mut v = serde_json::json!({
            "data_parallel_size": self.dp,
            "sequence_parallel_size": self.sp,
            "tensor_parallel_size": self.tp,
            "use_hsdp": self.use_hsdp,
            "hsdp_shard_size": self.shard,
            "hsdp_replicate_size": self.replicate,
            "cache_backend": if self.cache { "tea_cache" } else { "none" },
            "enable_prompt_embed_cache": self.prompt_cache,
        });
        if self.legacy {
            v["enable_distributed_layerwise_offload"] = Value::Bool(true);
            v["dlo_use_allgather"] = Value::Bool(self.dit_allgather);
        } else {
            v["diffusion_offload_config"] = serde_json::json!({
                "mode": "layer",
                "components": ["dit", "text_encoder"],
                "layer_options": {
                    "dit": {"weight_transfer": transfer(self.dit_allgather)},
                    "text_encoder": {"weight_transfer": transfer(self.text_encoder_allgather)},
                },
            });
        }
        v
    }

    /// The expected outcome: the group size, or the key of the expected error.
    fn expected(&self) -> Result<u32, &'static str> {
        let gathers = self.dit_allgather || self.text_encoder_allgather;
        let sharded = self.use_hsdp && self.shard > 0;
        if !gathers {
            return Ok(1);
        }
        if sharded {
            return Err("use_hsdp");
        }
        let mut size = self.dp;
        if size <= 1 && self.sp > 1 {
            size = self.sp;
        }
        if size > 1 && self.cache {
            return Err("cache_backend");
        }
        if size > 1 && self.prompt_cache && self.text_encoder_allgather {
            return Err("enable_prompt_embed_cache");
        }
        Ok(size)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = OffloadConfig::from_json_str(&text);
        let _ = OffloadConfig::from_toml_str(&text);
        let _ = parse_byte_size(&text, "device_budget");
    }

    #[test]
    fn arbitrary_strings_never_panic(text in ".{0,200}") {
        let a = OffloadConfig::from_json_str(&text);
        let b = OffloadConfig::from_toml_str(&text);
        prop_assert_eq!(a, OffloadConfig::from_json_str(&text));
        prop_assert_eq!(b, OffloadConfig::from_toml_str(&text));
    }

    #[test]
    fn toml_like_text_never_panics(text in "([a-z_\\[\\]\\.]{1,30} ?= ?(true|1|-1|\"layer\"|\\[\"dit\"\\]|\\{\\}|nan|1979-05-27)\n){0,6}") {
        let _ = OffloadConfig::from_toml_str(&text);
    }

    #[test]
    fn arbitrary_trees_are_deterministic(value in tree()) {
        let first = OffloadConfig::from_value(&value);
        let second = OffloadConfig::from_value(&value);
        prop_assert_eq!(&first, &second);
        // The JSON text of the tree gives the same outcome (same config, or an error at the same key; float text
        // in messages may differ after a round trip through decimal).
        let text = value.to_string();
        let reparsed = OffloadConfig::from_json_str(&text);
        prop_assert_eq!(first.as_ref().map_err(|e| e.key()), reparsed.as_ref().map_err(|e| e.key()));
    }

    #[test]
    fn config_shaped_trees_are_deterministic(value in config_tree()) {
        let first = OffloadConfig::from_value(&value);
        prop_assert_eq!(&first, &OffloadConfig::from_value(&value));
        match &first {
            Err(e) => {
                prop_assert!(!e.key().is_empty());
                prop_assert_eq!(e.to_string(), format!("{}: {}", e.key(), e.message()));
            }
            Ok(c) => check_invariants(c)?,
        }
    }

    #[test]
    fn group_and_guards_follow_the_rules(l in layout()) {
        let got = OffloadConfig::from_value(&l.to_json());
        match l.expected() {
            Ok(size) => {
                let c = got.map_err(|e| TestCaseError::fail(format!("{l:?} rejected: {e}")))?;
                prop_assert_eq!(c.group.size, size, "{:?}", l);
                let dlo = l.legacy || l.dit_allgather || l.text_encoder_allgather;
                let strategy = if dlo { Chosen::DistributedLayerWise } else { Chosen::LayerWise };
                prop_assert_eq!(c.strategy, strategy);
            }
            Err(key) => {
                let e = got.err().ok_or_else(|| TestCaseError::fail(format!("{l:?} accepted")))?;
                prop_assert_eq!(e.key(), key, "{:?}", l);
            }
        }
    }
}
