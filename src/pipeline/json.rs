//! The pipeline JSON file format: [`load_pipeline_json`], [`load_pipeline_file`] and [`to_pipeline_json`].
//!
//! A pipeline file describes the module tree (modules, block lists, tensors and which tensors share storage) and
//! the pipeline's declarations. It holds metadata only, never weight values. Object keys keep the order they are
//! written in: the order of modules and tensors is their declaration (= execution) order.
//!
//! # Example
//!
//! ```
//! use weightferry::pipeline::json::{load_pipeline_json, to_pipeline_json};
//!
//! let text = r#"{
//!   "format": "weightferry-pipeline/1",
//!   "class": "TinyPipeline",
//!   "modules": {
//!     "transformer": {
//!       "class": "TinyDiT",
//!       "tensors": {
//!         "rope_freqs": {"dtype": "f32", "shape": [64, 8], "kind": "non_persistent_buffer"}
//!       },
//!       "children": {
//!         "x_embedder": {"class": "Linear", "tensors": {
//!           "weight": {"dtype": "bf16", "shape": [32, 16]},
//!           "bias": {"dtype": "bf16", "shape": [32]}
//!         }},
//!         "blocks": {"repeat": 4, "block": {"class": "TinyBlock", "children": {
//!           "fc": {"class": "Linear", "tensors": {"weight": {"dtype": "bf16", "shape": [32, 32]}}}
//!         }}},
//!         "proj_out": {"class": "Linear", "tensors": {
//!           "weight": {"dtype": "bf16", "shape": [16, 32], "strides": [1, 16]}
//!         }},
//!         "proj_alias": {"class": "Linear", "tensors": {
//!           "weight": {"dtype": "bf16", "shape": [32, 32], "tied_to": "transformer.blocks.0.fc.weight"}
//!         }}
//!       }
//!     },
//!     "vae": {"class": "TinyVAE", "has_lifecycle": true, "tensors": {
//!       "enc": {"dtype": "bf16", "shape": [8, 3, 3, 3], "storage": "vae_flat"},
//!       "dec": {"dtype": "bf16", "shape": [3, 8, 3, 3], "storage": "vae_flat", "storage_offset": 216}
//!     }}
//!   },
//!   "storages": {"vae_flat": {"dtype": "bf16", "numel": 432}},
//!   "components": {"dit": ["transformer"], "vaes": ["vae"]},
//!   "offload_plan": {"block_attrs": {"transformer": ["blocks"]}, "on_demand_component_paths": ["vae"]},
//!   "class_block_attrs": {"TinyDiT": ["blocks"]}
//! }"#;
//! let desc = load_pipeline_json(text).expect("valid");
//! assert_eq!(desc.module("transformer.blocks").map(|m| m.children.len()), Some(4));
//! assert_eq!(load_pipeline_json(&to_pipeline_json(&desc)), Ok(desc));
//! ```
//!
//! # Reference
//!
//! **Top level** (an object):
//!
//! | key | required | meaning |
//! | --- | --- | --- |
//! | `format` | no | `"weightferry-pipeline/1"`, the only version |
//! | `class` | yes | the pipeline class (declarations and warnings key on it) |
//! | `modules` | no | the root module's children: attribute name → module, in order |
//! | `tensors` | no | the root module's own tensors: attribute name → tensor |
//! | `root_class`, `root_has_lifecycle`, `root_is_loaded` | no | the root module's class (default: `class`) and flags |
//! | `storages` | no | storage name → `{"dtype": …, "numel": …}`, for storages several views share |
//! | `components` | no | `dit`, `encoders`, `vaes`, `resident`, `auxiliary`: arrays of dotted paths. Absent (or `null`) means the pipeline declares none (the deprecated attribute scan) |
//! | `offload_plan` | no | `block_attrs` and `encoder_block_attrs` (path → array of relative paths), `on_demand_component_paths`, `resident_dit_paths`, `encoder_dlo_weight_replication` (arrays of paths), `offload_submodules` (DiT path → {child name → block attribute}), `encoder_component_types` (encoder path → type), `resident_encoder_block_paths` (array of full block-list paths), the deprecated `layerwise_resident_layers` (DiT path → count); `encoder_host_resident_table_attrs` is refused with its replacement. Absent (or `null`) means no plan |
//! | `class_block_attrs` | no | DiT class → array of block-list attributes (`_layerwise_offload_blocks_attrs`) |
//! | `class_block_attr` | no | DiT class → one block-list attribute (the deprecated singular form) |
//!
//! **Module** (an object): `class` (required, non-empty), `has_lifecycle` (default `false`: the module implements
//! `load_to_device` / `offload_to_cpu`), `is_loaded` (default `true`; `false` for an unloaded stub), `tensors`
//! (attribute name → tensor) and `children` (attribute name → module). Tensors and children share one namespace.
//! Names are non-empty runs of ASCII letters, digits and `_`; a block list's children are named `0`, `1`, ….
//!
//! **Block list shorthand**: `{"repeat": N, "block": {module}}` is a list of class `ModuleList` (or the given
//! `class`, with optional `has_lifecycle` / `is_loaded`) whose children `0` … `N-1` are copies of the `block`
//! template. `N` is 1 to [`MAX_REPEAT`]. An optional `children` object gives leading blocks that differ from the
//! rest; they must be named `0` … `K-1`, and the copies then take the names `K` … `K+N-1`. A `tied_to` inside the
//! template names the same absolute path in every copy. A repeat has no `tensors`.
//!
//! **Tensor** (an object):
//!
//! | key | required | meaning |
//! | --- | --- | --- |
//! | `dtype` | yes | `f32`, `f16`, `bf16`, `f8e4m3`, `i64`, `i32` or `u8` |
//! | `shape` | yes | array of extents (`[]` for a scalar) |
//! | `strides` | no | strides in elements, one per dimension; default row-major contiguous |
//! | `kind` | no | `parameter` (default), `persistent_buffer` or `non_persistent_buffer` |
//! | `storage_offset` | no | first element's offset in the storage, default 0 |
//! | `tied_to` | no | dotted path from the root of another tensor; this tensor views that tensor's storage |
//! | `storage` | no | name of an entry in `storages`; this tensor views it |
//!
//! Without `tied_to` or `storage` a tensor owns a storage of exactly `storage_offset + span` elements, where the
//! span is `1 + Σ (extent − 1) · stride` (0 for an empty tensor). Every view must fit inside its storage and have
//! the storage's dtype. Storage ids are assigned depth first (a module's tensors, then its children), in order of
//! first appearance, from 0 — the same order as the builder, so `load_pipeline_json(&to_pipeline_json(&p)) == p`
//! for every valid `p` with canonical ids (see [`PipelineDesc::canonicalize_storage_ids`]).
//!
//! **Errors** name the JSON path of the offending value, with dots between keys and `[i]` for array elements
//! (`modules.transformer.children.blocks.repeat`, `components.dit[0]`), and say how to fix it. Limits: JSON nesting
//! up to 128 levels (each module level takes two, so modules nest about 60 deep), [`MAX_REPEAT`] copies per repeat, [`MAX_NODES`] modules and tensors after expansion; sizes
//! must fit in 64 bits.

use super::validate::{check_fit, check_view, checked_span, is_valid_name, is_valid_path};
use super::{
    join, ComponentDecls, DType, ModuleNode, OffloadPlanDecl, PipelineDesc, PipelineError, StorageDesc, StorageId,
    TensorDesc, TensorKind,
};
use crate::textfile::{read_text_capped, MAX_PIPELINE_FILE_BYTES};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::rc::Rc;

/// The only `format` value this version reads and writes.
pub const FORMAT: &str = "weightferry-pipeline/1";

/// Largest `repeat` count.
pub const MAX_REPEAT: u64 = 65_536;

/// Largest number of modules plus tensors a file may expand to.
pub const MAX_NODES: u64 = 1 << 20;

/// Parses and validates a pipeline description from JSON text.
pub fn load_pipeline_json(text: &str) -> Result<PipelineDesc, PipelineError> {
    let value: Json = serde_json::from_str(text).map_err(|e| PipelineError::Syntax {
        line: e.line(),
        column: e.column(),
        message: strip_position(&e.to_string()),
    })?;
    parse_document(&value)
}

/// Reads a pipeline description from a JSON file (see [`load_pipeline_json`]).
pub fn load_pipeline_file(path: &Path) -> Result<PipelineDesc, PipelineError> {
    let text = read_text_capped(path, MAX_PIPELINE_FILE_BYTES, "pipeline description")
        .map_err(|e| PipelineError::Io { path: path.display().to_string(), message: e.to_string() })?;
    load_pipeline_json(&text)
}

/// Writes a pipeline description as JSON. Block lists of identical blocks are written with `repeat`; storages
/// shared by views are written as `tied_to` the first view when that view spans the whole storage, and as named
/// `storages` entries otherwise.
pub fn to_pipeline_json(p: &PipelineDesc) -> String {
    let value = render_document(p);
    let mut out = String::new();
    write_value(&value, 0, &mut out);
    out.push('\n');
    out
}

/// serde_json appends " at line L column C"; the position is reported separately.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// An order-preserving JSON value.

#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    U(u64),
    I(i64),
    F(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::U(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(if v >= 0 { Json::U(v as u64) } else { Json::I(v) })
    }
    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json::F(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element()? {
            items.push(v);
        }
        Ok(Json::Arr(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut entries = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, Json>()? {
            entries.push((k, v));
        }
        Ok(Json::Obj(entries))
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Reading helpers. `at` is always the JSON path of the value being read.

type Entries = [(String, Json)];

/// An object whose keys are all in `allowed` and unique.
fn object<'a>(v: &'a Json, at: &str, allowed: &[&str], expected: &'static str) -> Result<&'a Entries, PipelineError> {
    let entries = free_object(v, at)?;
    for (i, (k, _)) in entries.iter().enumerate() {
        if !allowed.contains(&k.as_str()) {
            return Err(PipelineError::UnknownKey { at: join(at, k), expected });
        }
        if entries[..i].iter().any(|(p, _)| p == k) {
            return Err(PipelineError::DuplicateKey { at: join(at, k) });
        }
    }
    Ok(entries)
}

/// An object with arbitrary keys (duplicates are checked by the caller).
fn free_object<'a>(v: &'a Json, at: &str) -> Result<&'a Entries, PipelineError> {
    match v {
        Json::Obj(entries) => Ok(entries),
        _ => Err(PipelineError::WrongType { at: at_or_document(at), expected: "an object" }),
    }
}

/// An object with arbitrary but unique keys.
fn unique_object<'a>(v: &'a Json, at: &str) -> Result<&'a Entries, PipelineError> {
    let entries = free_object(v, at)?;
    let mut seen = std::collections::HashSet::new();
    for (k, _) in entries {
        if !seen.insert(k.as_str()) {
            return Err(PipelineError::DuplicateKey { at: join(at, k) });
        }
    }
    Ok(entries)
}

fn at_or_document(at: &str) -> String {
    if at.is_empty() {
        "<document>".to_string()
    } else {
        at.to_string()
    }
}

fn get<'a>(entries: &'a Entries, key: &str) -> Option<&'a Json> {
    entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// `get`, treating `null` as absent.
fn get_some<'a>(entries: &'a Entries, key: &str) -> Option<&'a Json> {
    get(entries, key).filter(|v| !matches!(v, Json::Null))
}

fn as_u64(v: &Json, at: &str) -> Result<u64, PipelineError> {
    match v {
        Json::U(n) => Ok(*n),
        _ => Err(PipelineError::WrongType {
            at: at.to_string(),
            expected: "a non-negative integer that fits in 64 bits",
        }),
    }
}

fn as_str<'a>(v: &'a Json, at: &str) -> Result<&'a str, PipelineError> {
    match v {
        Json::Str(s) => Ok(s),
        _ => Err(PipelineError::WrongType { at: at.to_string(), expected: "a string" }),
    }
}

fn as_bool(v: &Json, at: &str) -> Result<bool, PipelineError> {
    match v {
        Json::Bool(b) => Ok(*b),
        _ => Err(PipelineError::WrongType { at: at.to_string(), expected: "true or false" }),
    }
}

fn as_array<'a>(v: &'a Json, at: &str, expected: &'static str) -> Result<&'a [Json], PipelineError> {
    match v {
        Json::Arr(items) => Ok(items),
        _ => Err(PipelineError::WrongType { at: at.to_string(), expected }),
    }
}

fn u64_array(v: &Json, at: &str) -> Result<Vec<u64>, PipelineError> {
    let items = as_array(v, at, "an array of non-negative integers")?;
    items.iter().enumerate().map(|(i, x)| as_u64(x, &format!("{at}[{i}]"))).collect()
}

fn string_array(v: &Json, at: &str) -> Result<Vec<String>, PipelineError> {
    let items = as_array(v, at, "an array of strings")?;
    items.iter().enumerate().map(|(i, x)| as_str(x, &format!("{at}[{i}]")).map(str::to_string)).collect()
}

fn string_list_map(v: &Json, at: &str) -> Result<BTreeMap<String, Vec<String>>, PipelineError> {
    let mut out = BTreeMap::new();
    for (k, x) in unique_object(v, at)? {
        out.insert(k.clone(), string_array(x, &join(at, k))?);
    }
    Ok(out)
}

fn string_map(v: &Json, at: &str) -> Result<BTreeMap<String, String>, PipelineError> {
    let mut out = BTreeMap::new();
    for (k, x) in unique_object(v, at)? {
        out.insert(k.clone(), as_str(x, &join(at, k))?.to_string());
    }
    Ok(out)
}

fn parse_dtype(v: &Json, at: &str) -> Result<DType, PipelineError> {
    let s = as_str(v, at)?;
    dtype_from_name(s).ok_or_else(|| PipelineError::UnknownDType { at: at.to_string(), found: s.to_string() })
}

fn dtype_from_name(s: &str) -> Option<DType> {
    [DType::F32, DType::F16, DType::Bf16, DType::F8e4m3, DType::I64, DType::I32, DType::U8]
        .into_iter()
        .find(|d| d.name() == s)
}

fn kind_name(k: TensorKind) -> &'static str {
    match k {
        TensorKind::Parameter => "parameter",
        TensorKind::PersistentBuffer => "persistent_buffer",
        TensorKind::NonPersistentBuffer => "non_persistent_buffer",
    }
}

fn parse_kind(v: &Json, at: &str) -> Result<TensorKind, PipelineError> {
    let s = as_str(v, at)?;
    [TensorKind::Parameter, TensorKind::PersistentBuffer, TensorKind::NonPersistentBuffer]
        .into_iter()
        .find(|k| kind_name(*k) == s)
        .ok_or_else(|| PipelineError::UnknownKind { at: at.to_string(), found: s.to_string() })
}

// ---------------------------------------------------------------------------------------------------------------
// Parsing the document into a pending tree, then resolving storages.

const TOP_KEYS: &[&str] = &[
    "format",
    "class",
    "modules",
    "tensors",
    "root_class",
    "root_has_lifecycle",
    "root_is_loaded",
    "storages",
    "components",
    "offload_plan",
    "class_block_attrs",
    "class_block_attr",
];
const TOP_KEYS_TEXT: &str = "format, class, modules, tensors, root_class, root_has_lifecycle, root_is_loaded, \
                             storages, components, offload_plan, class_block_attrs, class_block_attr";
const MODULE_KEYS: &[&str] = &["class", "has_lifecycle", "is_loaded", "tensors", "children", "repeat"];
const MODULE_KEYS_TEXT: &str = "class, has_lifecycle, is_loaded, tensors, children, repeat";
const REPEAT_KEYS: &[&str] = &["repeat", "block", "children", "class", "has_lifecycle", "is_loaded"];
const REPEAT_KEYS_TEXT: &str = "repeat, block, children, class, has_lifecycle, is_loaded";
const TENSOR_KEYS: &[&str] = &["dtype", "shape", "strides", "kind", "storage_offset", "tied_to", "storage"];
const TENSOR_KEYS_TEXT: &str = "dtype, shape, strides, kind, storage_offset, tied_to, storage";
const STORAGE_KEYS: &[&str] = &["dtype", "numel"];
const STORAGE_KEYS_TEXT: &str = "dtype, numel";
const COMPONENT_KEYS: &[&str] = &["dit", "encoders", "vaes", "resident", "auxiliary"];
const COMPONENT_KEYS_TEXT: &str = "dit, encoders, vaes, resident, auxiliary";
const PLAN_KEYS: &[&str] = &[
    "block_attrs",
    "encoder_block_attrs",
    "on_demand_component_paths",
    "resident_dit_paths",
    "encoder_dlo_weight_replication",
    "offload_submodules",
    "encoder_component_types",
    "resident_encoder_block_paths",
    "layerwise_resident_layers",
    "encoder_host_resident_table_attrs",
];
const PLAN_KEYS_TEXT: &str = "block_attrs, encoder_block_attrs, on_demand_component_paths, resident_dit_paths, \
                              encoder_dlo_weight_replication, offload_submodules, encoder_component_types, \
                              resident_encoder_block_paths, layerwise_resident_layers";

#[derive(Debug, Clone)]
enum Src {
    Own,
    Named(String),
    Tied(String),
}

#[derive(Debug, Clone)]
struct PTensor {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    strides: Vec<u64>,
    storage_offset: u64,
    kind: TensorKind,
    src: Src,
    /// Storage elements the view needs.
    needed: u64,
    /// JSON path of the tensor object.
    at: Rc<str>,
}

#[derive(Debug, Clone)]
struct PModule {
    class: String,
    has_lifecycle: bool,
    is_loaded: bool,
    tensors: Vec<PTensor>,
    children: Vec<(String, PModule)>,
    /// Modules plus tensors in this subtree.
    nodes: u64,
}

fn too_large(at: &str) -> PipelineError {
    PipelineError::TooLarge { at: at.to_string(), limit: MAX_NODES }
}

fn parse_document(v: &Json) -> Result<PipelineDesc, PipelineError> {
    let top = object(v, "", TOP_KEYS, TOP_KEYS_TEXT)?;
    if let Some(f) = get(top, "format") {
        let s = as_str(f, "format")?;
        if s != FORMAT {
            return Err(PipelineError::Format { at: "format".into(), found: s.to_string(), expected: FORMAT });
        }
    }
    let class = match get(top, "class") {
        Some(c) => as_str(c, "class")?.to_string(),
        None => {
            return Err(PipelineError::MissingKey {
                at: "class".into(),
                hint: "give the pipeline class, e.g. \"class\": \"FluxPipeline\"",
            })
        }
    };
    if class.is_empty() {
        return Err(PipelineError::EmptyClass { at: "class".into() });
    }
    let root_class = match get(top, "root_class") {
        Some(c) => as_str(c, "root_class")?.to_string(),
        None => class.clone(),
    };
    if root_class.is_empty() {
        return Err(PipelineError::EmptyClass { at: "root_class".into() });
    }
    let mut root = PModule {
        class: root_class,
        has_lifecycle: false,
        is_loaded: true,
        tensors: Vec::new(),
        children: Vec::new(),
        nodes: 1,
    };
    if let Some(b) = get(top, "root_has_lifecycle") {
        root.has_lifecycle = as_bool(b, "root_has_lifecycle")?;
    }
    if let Some(b) = get(top, "root_is_loaded") {
        root.is_loaded = as_bool(b, "root_is_loaded")?;
    }
    fill_module(&mut root, get(top, "tensors"), "tensors", get(top, "modules"), "modules")?;

    let mut storages: Vec<(String, StorageDesc)> = Vec::new();
    if let Some(s) = get(top, "storages") {
        for (name, sv) in unique_object(s, "storages")? {
            let at = join("storages", name);
            let e = object(sv, &at, STORAGE_KEYS, STORAGE_KEYS_TEXT)?;
            let dtype = match get(e, "dtype") {
                Some(d) => parse_dtype(d, &join(&at, "dtype"))?,
                None => {
                    return Err(PipelineError::MissingKey {
                        at: join(&at, "dtype"),
                        hint: "every storage needs a dtype, e.g. \"dtype\": \"bf16\"",
                    })
                }
            };
            let numel = match get(e, "numel") {
                Some(n) => as_u64(n, &join(&at, "numel"))?,
                None => {
                    return Err(PipelineError::MissingKey {
                        at: join(&at, "numel"),
                        hint: "every storage needs its element count, e.g. \"numel\": 4096",
                    })
                }
            };
            numel
                .checked_mul(dtype.size_bytes())
                .ok_or(PipelineError::Overflow { at: join(&at, "numel"), what: "the byte size" })?;
            storages.push((name.clone(), StorageDesc { dtype, numel }));
        }
    }

    let components = match get_some(top, "components") {
        Some(c) => Some(parse_components(c)?),
        None => None,
    };
    let offload_plan = match get_some(top, "offload_plan") {
        Some(p) => Some(parse_plan(p)?),
        None => None,
    };
    let class_block_attrs = match get(top, "class_block_attrs") {
        Some(m) => string_list_map(m, "class_block_attrs")?,
        None => BTreeMap::new(),
    };
    let class_block_attr_singular = match get(top, "class_block_attr") {
        Some(m) => string_map(m, "class_block_attr")?,
        None => BTreeMap::new(),
    };

    let (root, storage_table) = resolve(root, &storages)?;
    let desc = PipelineDesc {
        class,
        root,
        storages: storage_table,
        components,
        offload_plan,
        class_block_attrs,
        class_block_attr_singular,
    };
    desc.validate()?;
    Ok(desc)
}

fn parse_components(v: &Json) -> Result<ComponentDecls, PipelineError> {
    let e = object(v, "components", COMPONENT_KEYS, COMPONENT_KEYS_TEXT)?;
    let list = |key: &str| match get(e, key) {
        Some(x) => string_array(x, &join("components", key)),
        None => Ok(Vec::new()),
    };
    Ok(ComponentDecls {
        dit: list("dit")?,
        encoders: list("encoders")?,
        vaes: list("vaes")?,
        resident: list("resident")?,
        auxiliary: list("auxiliary")?,
    })
}

fn parse_plan(v: &Json) -> Result<OffloadPlanDecl, PipelineError> {
    let e = object(v, "offload_plan", PLAN_KEYS, PLAN_KEYS_TEXT)?;
    let at = |key: &str| join("offload_plan", key);
    let list = |key: &str| match get(e, key) {
        Some(x) => string_array(x, &at(key)),
        None => Ok(Vec::new()),
    };
    let list_map = |key: &str| match get(e, key) {
        Some(x) => string_list_map(x, &at(key)),
        None => Ok(BTreeMap::new()),
    };
    let mut offload_submodules = BTreeMap::new();
    if let Some(x) = get(e, "offload_submodules") {
        let base = at("offload_submodules");
        for (dit, subs) in unique_object(x, &base)? {
            offload_submodules.insert(dit.clone(), string_map(subs, &join(&base, dit))?);
        }
    }
    if get(e, "encoder_host_resident_table_attrs").is_some() {
        return Err(PipelineError::Unsupported {
            at: at("encoder_host_resident_table_attrs"),
            message: "host-resident encoder tables are not supported (every weight the engine reads is on the device \
                      when it runs); remove the declaration: the table then stays on the device with the encoder's \
                      non-block weights, or streams with its block if it lies inside one",
        });
    }
    let mut layerwise_resident_layers = BTreeMap::new();
    if let Some(x) = get(e, "layerwise_resident_layers") {
        let base = at("layerwise_resident_layers");
        for (dit, n) in unique_object(x, &base)? {
            let here = join(&base, dit);
            let n = as_u64(n, &here)?;
            let n = u32::try_from(n)
                .map_err(|_| PipelineError::WrongType { at: here, expected: "a block count below 2^32" })?;
            layerwise_resident_layers.insert(dit.clone(), n);
        }
    }
    Ok(OffloadPlanDecl {
        resident_encoder_block_paths: list("resident_encoder_block_paths")?,
        layerwise_resident_layers,
        block_attrs: list_map("block_attrs")?,
        encoder_block_attrs: list_map("encoder_block_attrs")?,
        on_demand_component_paths: list("on_demand_component_paths")?,
        resident_dit_paths: list("resident_dit_paths")?,
        encoder_dlo_weight_replication: list("encoder_dlo_weight_replication")?,
        offload_submodules,
        encoder_component_types: match get(e, "encoder_component_types") {
            Some(x) => string_map(x, &at("encoder_component_types"))?,
            None => BTreeMap::new(),
        },
    })
}

/// Parses the `tensors` and `children` objects into `m`.
fn fill_module(
    m: &mut PModule,
    tensors: Option<&Json>,
    tensors_at: &str,
    children: Option<&Json>,
    children_at: &str,
) -> Result<(), PipelineError> {
    let mut seen: HashSet<String> =
        m.tensors.iter().map(|t| t.name.clone()).chain(m.children.iter().map(|(n, _)| n.clone())).collect();
    if let Some(t) = tensors {
        for (name, tv) in free_object(t, tensors_at)? {
            let at = join(tensors_at, name);
            check_attr_name(&mut seen, name, &at)?;
            let tensor = parse_tensor(tv, &at, name)?;
            m.tensors.push(tensor);
            m.nodes += 1;
            if m.nodes > MAX_NODES {
                return Err(too_large(&at));
            }
        }
    }
    if let Some(c) = children {
        for (name, cv) in free_object(c, children_at)? {
            let at = join(children_at, name);
            check_attr_name(&mut seen, name, &at)?;
            let child = parse_module(cv, &at)?;
            m.nodes = m.nodes.saturating_add(child.nodes);
            if m.nodes > MAX_NODES {
                return Err(too_large(&at));
            }
            m.children.push((name.clone(), child));
        }
    }
    Ok(())
}

/// Checks a tensor or child name: valid, and not taken in this module (`seen` holds the names so far: tensors and
/// children share one namespace; a set, so modules of tens of thousands of blocks parse in linear time).
fn check_attr_name(seen: &mut HashSet<String>, name: &str, at: &str) -> Result<(), PipelineError> {
    if !is_valid_name(name) {
        return Err(PipelineError::InvalidName { at: at.to_string(), name: name.to_string() });
    }
    if !seen.insert(name.to_string()) {
        return Err(PipelineError::DuplicateName { at: at.to_string() });
    }
    Ok(())
}

fn module_class(e: &Entries, at: &str, default: Option<&str>) -> Result<String, PipelineError> {
    let class = match (get(e, "class"), default) {
        (Some(c), _) => as_str(c, &join(at, "class"))?.to_string(),
        (None, Some(d)) => d.to_string(),
        (None, None) => {
            return Err(PipelineError::MissingKey {
                at: join(at, "class"),
                hint: "every module needs its class, e.g. \"class\": \"Linear\"",
            })
        }
    };
    if class.is_empty() {
        return Err(PipelineError::EmptyClass { at: join(at, "class") });
    }
    Ok(class)
}

fn parse_module(v: &Json, at: &str) -> Result<PModule, PipelineError> {
    let is_repeat = matches!(v, Json::Obj(e) if e.iter().any(|(k, _)| k == "repeat"));
    let e = if is_repeat {
        object(v, at, REPEAT_KEYS, REPEAT_KEYS_TEXT)?
    } else {
        object(v, at, MODULE_KEYS, MODULE_KEYS_TEXT)?
    };
    let class = module_class(e, at, if is_repeat { Some("ModuleList") } else { None })?;
    let mut m =
        PModule { class, has_lifecycle: false, is_loaded: true, tensors: Vec::new(), children: Vec::new(), nodes: 1 };
    if let Some(b) = get(e, "has_lifecycle") {
        m.has_lifecycle = as_bool(b, &join(at, "has_lifecycle"))?;
    }
    if let Some(b) = get(e, "is_loaded") {
        m.is_loaded = as_bool(b, &join(at, "is_loaded"))?;
    }
    if !is_repeat {
        let tensors_at = join(at, "tensors");
        let children_at = join(at, "children");
        fill_module(&mut m, get(e, "tensors"), &tensors_at, get(e, "children"), &children_at)?;
        return Ok(m);
    }
    let children_at = join(at, "children");
    fill_module(&mut m, None, "", get(e, "children"), &children_at)?;
    for (i, (name, _)) in m.children.iter().enumerate() {
        if *name != i.to_string() {
            return Err(PipelineError::BlockIndex { at: join(&children_at, name), expected: i as u64 });
        }
    }
    let repeat_at = join(at, "repeat");
    let count = match get(e, "repeat") {
        Some(r) => as_u64(r, &repeat_at)?,
        None => 0,
    };
    if count == 0 || count > MAX_REPEAT {
        return Err(PipelineError::RepeatCount { at: repeat_at, count, max: MAX_REPEAT });
    }
    let block_at = join(at, "block");
    let template = match get(e, "block") {
        Some(b) => parse_module(b, &block_at)?,
        None => {
            return Err(PipelineError::MissingKey {
                at: block_at,
                hint: "a repeat needs its block template, e.g. \"block\": {\"class\": \"MyBlock\", \"tensors\": {…}}",
            })
        }
    };
    let total = template.nodes.checked_mul(count).and_then(|n| n.checked_add(m.nodes)).filter(|&n| n <= MAX_NODES);
    let Some(total) = total else {
        return Err(too_large(&repeat_at));
    };
    let first = m.children.len() as u64;
    m.children.extend((first..first + count).map(|i| (i.to_string(), template.clone())));
    m.nodes = total;
    Ok(m)
}

fn parse_tensor(v: &Json, at: &str, name: &str) -> Result<PTensor, PipelineError> {
    let e = object(v, at, TENSOR_KEYS, TENSOR_KEYS_TEXT)?;
    let dtype = match get(e, "dtype") {
        Some(d) => parse_dtype(d, &join(at, "dtype"))?,
        None => {
            return Err(PipelineError::MissingKey {
                at: join(at, "dtype"),
                hint: "every tensor needs a dtype, e.g. \"dtype\": \"bf16\"",
            })
        }
    };
    let shape = match get(e, "shape") {
        Some(s) => u64_array(s, &join(at, "shape"))?,
        None => {
            return Err(PipelineError::MissingKey {
                at: join(at, "shape"),
                hint: "every tensor needs a shape, e.g. \"shape\": [3072, 64] ([] for a scalar)",
            })
        }
    };
    let strides = match get(e, "strides") {
        Some(s) => {
            let strides = u64_array(s, &join(at, "strides"))?;
            if strides.len() != shape.len() {
                return Err(PipelineError::StrideRank {
                    at: join(at, "strides"),
                    shape_len: shape.len(),
                    strides_len: strides.len(),
                });
            }
            strides
        }
        None => TensorDesc::contiguous_strides(&shape),
    };
    let kind = match get(e, "kind") {
        Some(k) => parse_kind(k, &join(at, "kind"))?,
        None => TensorKind::Parameter,
    };
    let storage_offset = match get(e, "storage_offset") {
        Some(o) => as_u64(o, &join(at, "storage_offset"))?,
        None => 0,
    };
    let needed = check_view(at, dtype, &shape, &strides, storage_offset)?;
    let src = match (get(e, "tied_to"), get(e, "storage")) {
        (Some(_), Some(_)) => return Err(PipelineError::ConflictingStorage { at: at.to_string() }),
        (Some(t), None) => {
            let t_at = join(at, "tied_to");
            let target = as_str(t, &t_at)?;
            if !is_valid_path(target) {
                return Err(PipelineError::InvalidPath { at: t_at, path: target.to_string() });
            }
            Src::Tied(target.to_string())
        }
        (None, Some(s)) => Src::Named(as_str(s, &join(at, "storage"))?.to_string()),
        (None, None) => Src::Own,
    };
    Ok(PTensor { name: name.to_string(), dtype, shape, strides, storage_offset, kind, src, needed, at: Rc::from(at) })
}

/// Where a tensor's storage comes from, after following ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    /// Owned by the tensor with this flat index.
    Own(usize),
    /// The named storage with this index in the declaration list.
    Named(usize),
}

/// Resolves ties and storage names, assigns canonical storage ids and checks every view against its storage.
fn resolve(
    root: PModule,
    declared: &[(String, StorageDesc)],
) -> Result<(ModuleNode, BTreeMap<StorageId, StorageDesc>), PipelineError> {
    // Flat depth-first list of tensors with their absolute paths.
    let mut flat: Vec<(String, &PTensor)> = Vec::new();
    let mut stack: Vec<(String, &PModule)> = vec![(String::new(), &root)];
    while let Some((path, m)) = stack.pop() {
        for t in &m.tensors {
            flat.push((join(&path, &t.name), t));
        }
        for (n, c) in m.children.iter().rev() {
            stack.push((join(&path, n), c));
        }
    }
    let by_path: HashMap<&str, usize> = flat.iter().enumerate().map(|(i, (p, _))| (p.as_str(), i)).collect();
    let by_name: HashMap<&str, usize> = declared.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();

    // Follow tie chains iteratively; 0 = unvisited, 1 = on the current chain, 2 = resolved.
    let mut keys: Vec<Option<Key>> = vec![None; flat.len()];
    let mut mark = vec![0u8; flat.len()];
    for start in 0..flat.len() {
        let mut chain = Vec::new();
        let mut cur = start;
        let key = loop {
            if mark[cur] == 2 {
                match keys[cur] {
                    Some(k) => break k,
                    None => {
                        return Err(PipelineError::TieCycle {
                            at: flat[start].1.at.to_string(),
                            target: flat[cur].0.clone(),
                        })
                    }
                }
            }
            if mark[cur] == 1 {
                return Err(PipelineError::TieCycle { at: flat[start].1.at.to_string(), target: flat[cur].0.clone() });
            }
            let t = flat[cur].1;
            match &t.src {
                Src::Own => break Key::Own(cur),
                Src::Named(n) => match by_name.get(n.as_str()) {
                    Some(&i) => break Key::Named(i),
                    None => return Err(PipelineError::UnknownStorage { at: join(&t.at, "storage"), name: n.clone() }),
                },
                Src::Tied(target) => {
                    mark[cur] = 1;
                    chain.push(cur);
                    match by_path.get(target.as_str()) {
                        Some(&next) => cur = next,
                        None => {
                            return Err(PipelineError::UnknownTensor {
                                at: join(&t.at, "tied_to"),
                                target: target.clone(),
                            })
                        }
                    }
                }
            }
        };
        for c in chain {
            keys[c] = Some(key);
            mark[c] = 2;
        }
        keys[start] = Some(key);
        mark[start] = 2;
    }

    // Canonical ids by first appearance; check every view.
    let mut ids: HashMap<Key, StorageId> = HashMap::new();
    let mut table: BTreeMap<StorageId, StorageDesc> = BTreeMap::new();
    let mut tensor_ids: Vec<StorageId> = Vec::with_capacity(flat.len());
    for (i, (_, t)) in flat.iter().enumerate() {
        let key = keys[i].unwrap_or(Key::Own(i));
        let next = StorageId(ids.len() as u64);
        let id = *ids.entry(key).or_insert(next);
        let desc = match key {
            Key::Own(o) => StorageDesc { dtype: flat[o].1.dtype, numel: flat[o].1.needed },
            Key::Named(n) => declared[n].1.clone(),
        };
        check_fit(&t.at, t.dtype, t.needed, &desc)?;
        table.entry(id).or_insert(desc);
        tensor_ids.push(id);
    }
    for (i, (name, _)) in declared.iter().enumerate() {
        if !ids.contains_key(&Key::Named(i)) {
            return Err(PipelineError::UnusedStorage { at: join("storages", name) });
        }
    }
    drop(flat);
    let mut next = 0usize;
    let node = materialize(root, &tensor_ids, &mut next);
    Ok((node, table))
}

/// Turns the pending tree into module nodes, taking storage ids in the same depth-first order as `resolve`.
fn materialize(m: PModule, ids: &[StorageId], next: &mut usize) -> ModuleNode {
    let mut node = ModuleNode::new(m.class);
    node.has_lifecycle = m.has_lifecycle;
    node.is_loaded = m.is_loaded;
    for t in m.tensors {
        let storage = ids.get(*next).copied().unwrap_or(StorageId(0));
        *next += 1;
        node.tensors.push(TensorDesc {
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            strides: t.strides,
            storage_offset: t.storage_offset,
            storage,
            kind: t.kind,
        });
    }
    for (n, c) in m.children {
        node.children.push((n, materialize(c, ids, next)));
    }
    node
}

// ---------------------------------------------------------------------------------------------------------------
// Writing.

/// How each storage is written.
struct StoragePlan<'a> {
    /// Storage → path of the view that owns it inline (the first view, spanning it exactly).
    inline_owner: HashMap<StorageId, String>,
    /// Storages written under `storages`.
    named: BTreeMap<StorageId, &'a StorageDesc>,
}

fn storage_name(id: StorageId) -> String {
    format!("s{}", id.0)
}

fn plan_storages(p: &PipelineDesc) -> StoragePlan<'_> {
    let mut first: HashMap<StorageId, (String, &TensorDesc)> = HashMap::new();
    for (path, t) in p.root.tensors_recursive() {
        first.entry(t.storage).or_insert((path, t));
    }
    let mut inline_owner = HashMap::new();
    let mut named = BTreeMap::new();
    for (id, s) in &p.storages {
        let spans_exactly = first.get(id).is_some_and(|(_, t)| {
            t.dtype == s.dtype
                && t.shape.len() == t.strides.len()
                && checked_span(&t.shape, &t.strides).and_then(|span| span.checked_add(t.storage_offset))
                    == Some(s.numel)
        });
        match first.get(id) {
            Some((path, _)) if spans_exactly => {
                inline_owner.insert(*id, path.clone());
            }
            _ => {
                named.insert(*id, s);
            }
        }
    }
    StoragePlan { inline_owner, named }
}

fn render_document(p: &PipelineDesc) -> Json {
    let plan = plan_storages(p);
    let mut top: Vec<(String, Json)> = Vec::new();
    let mut put = |k: &str, v: Json| top.push((k.to_string(), v));
    put("format", Json::Str(FORMAT.to_string()));
    put("class", Json::Str(p.class.clone()));
    if p.root.class != p.class {
        put("root_class", Json::Str(p.root.class.clone()));
    }
    if p.root.has_lifecycle {
        put("root_has_lifecycle", Json::Bool(true));
    }
    if !p.root.is_loaded {
        put("root_is_loaded", Json::Bool(false));
    }
    if !p.root.tensors.is_empty() {
        put("tensors", render_tensors(&p.root, "", &plan));
    }
    let modules = p.root.children.iter().map(|(n, c)| (n.clone(), render_module(c, n, &plan))).collect();
    put("modules", Json::Obj(modules));
    if !plan.named.is_empty() {
        let entries = plan
            .named
            .iter()
            .map(|(id, s)| {
                let desc = vec![
                    ("dtype".to_string(), Json::Str(s.dtype.name().to_string())),
                    ("numel".to_string(), Json::U(s.numel)),
                ];
                (storage_name(*id), Json::Obj(desc))
            })
            .collect();
        put("storages", Json::Obj(entries));
    }
    if let Some(c) = &p.components {
        let mut e = Vec::new();
        for (k, v) in [
            ("dit", &c.dit),
            ("encoders", &c.encoders),
            ("vaes", &c.vaes),
            ("resident", &c.resident),
            ("auxiliary", &c.auxiliary),
        ] {
            if !v.is_empty() {
                e.push((k.to_string(), str_list(v)));
            }
        }
        put("components", Json::Obj(e));
    }
    if let Some(o) = &p.offload_plan {
        let mut e = Vec::new();
        let mut list_map = |k: &str, m: &BTreeMap<String, Vec<String>>| {
            if !m.is_empty() {
                e.push((k.to_string(), Json::Obj(m.iter().map(|(a, b)| (a.clone(), str_list(b))).collect())));
            }
        };
        list_map("block_attrs", &o.block_attrs);
        list_map("encoder_block_attrs", &o.encoder_block_attrs);
        for (k, v) in [
            ("on_demand_component_paths", &o.on_demand_component_paths),
            ("resident_dit_paths", &o.resident_dit_paths),
            ("encoder_dlo_weight_replication", &o.encoder_dlo_weight_replication),
            ("resident_encoder_block_paths", &o.resident_encoder_block_paths),
        ] {
            if !v.is_empty() {
                e.push((k.to_string(), str_list(v)));
            }
        }
        if !o.offload_submodules.is_empty() {
            let subs = o.offload_submodules.iter().map(|(k, m)| (k.clone(), str_map(m))).collect();
            e.push(("offload_submodules".to_string(), Json::Obj(subs)));
        }
        if !o.encoder_component_types.is_empty() {
            e.push(("encoder_component_types".to_string(), str_map(&o.encoder_component_types)));
        }
        if !o.layerwise_resident_layers.is_empty() {
            let m = o.layerwise_resident_layers.iter().map(|(k, n)| (k.clone(), Json::U(u64::from(*n)))).collect();
            e.push(("layerwise_resident_layers".to_string(), Json::Obj(m)));
        }
        put("offload_plan", Json::Obj(e));
    }
    if !p.class_block_attrs.is_empty() {
        let e = p.class_block_attrs.iter().map(|(k, v)| (k.clone(), str_list(v))).collect();
        put("class_block_attrs", Json::Obj(e));
    }
    if !p.class_block_attr_singular.is_empty() {
        put("class_block_attr", str_map(&p.class_block_attr_singular));
    }
    Json::Obj(top)
}

fn str_list(v: &[String]) -> Json {
    Json::Arr(v.iter().map(|s| Json::Str(s.clone())).collect())
}

fn str_map(m: &BTreeMap<String, String>) -> Json {
    Json::Obj(m.iter().map(|(k, v)| (k.clone(), Json::Str(v.clone()))).collect())
}

fn render_tensors(m: &ModuleNode, path: &str, plan: &StoragePlan<'_>) -> Json {
    Json::Obj(m.tensors.iter().map(|t| (t.name.clone(), render_tensor(t, &join(path, &t.name), plan))).collect())
}

fn render_tensor(t: &TensorDesc, path: &str, plan: &StoragePlan<'_>) -> Json {
    let mut e = vec![
        ("dtype".to_string(), Json::Str(t.dtype.name().to_string())),
        ("shape".to_string(), Json::Arr(t.shape.iter().map(|&s| Json::U(s)).collect())),
    ];
    if t.strides != TensorDesc::contiguous_strides(&t.shape) {
        e.push(("strides".to_string(), Json::Arr(t.strides.iter().map(|&s| Json::U(s)).collect())));
    }
    if t.kind != TensorKind::Parameter {
        e.push(("kind".to_string(), Json::Str(kind_name(t.kind).to_string())));
    }
    if t.storage_offset != 0 {
        e.push(("storage_offset".to_string(), Json::U(t.storage_offset)));
    }
    match plan.inline_owner.get(&t.storage) {
        Some(owner) if owner == path => {}
        Some(owner) => e.push(("tied_to".to_string(), Json::Str(owner.clone()))),
        None if plan.named.contains_key(&t.storage) => {
            e.push(("storage".to_string(), Json::Str(storage_name(t.storage))));
        }
        None => {}
    }
    Json::Obj(e)
}

fn render_module(m: &ModuleNode, path: &str, plan: &StoragePlan<'_>) -> Json {
    let mut e: Vec<(String, Json)> = Vec::new();
    let flags = |e: &mut Vec<(String, Json)>| {
        if m.has_lifecycle {
            e.push(("has_lifecycle".to_string(), Json::Bool(true)));
        }
        if !m.is_loaded {
            e.push(("is_loaded".to_string(), Json::Bool(false)));
        }
    };
    let children: Vec<(String, Json)> =
        m.children.iter().map(|(n, c)| (n.clone(), render_module(c, &join(path, n), plan))).collect();
    let numbered = children.iter().enumerate().all(|(i, (n, _))| *n == i.to_string());
    // The shortest explicit head after which at least two identical blocks follow.
    let head = if m.tensors.is_empty() && numbered && children.len() >= 2 {
        let mut k = children.len() - 1;
        while k > 0 && children[k - 1].1 == children[k].1 {
            k -= 1;
        }
        let tail = (children.len() - k) as u64;
        (2..=MAX_REPEAT).contains(&tail).then_some(k)
    } else {
        None
    };
    if let Some(k) = head {
        let mut children = children;
        let tail = children.split_off(k);
        if m.class != "ModuleList" {
            e.push(("class".to_string(), Json::Str(m.class.clone())));
        }
        flags(&mut e);
        if !children.is_empty() {
            e.push(("children".to_string(), Json::Obj(children)));
        }
        e.push(("repeat".to_string(), Json::U(tail.len() as u64)));
        if let Some((_, block)) = tail.into_iter().next() {
            e.push(("block".to_string(), block));
        }
        return Json::Obj(e);
    }
    e.push(("class".to_string(), Json::Str(m.class.clone())));
    flags(&mut e);
    if !m.tensors.is_empty() {
        e.push(("tensors".to_string(), render_tensors(m, path, plan)));
    }
    if !children.is_empty() {
        e.push(("children".to_string(), Json::Obj(children)));
    }
    Json::Obj(e)
}

/// Nesting depth: 0 for scalars.
fn depth(v: &Json) -> usize {
    match v {
        Json::Arr(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Json::Obj(entries) => 1 + entries.iter().map(|(_, x)| depth(x)).max().unwrap_or(0),
        _ => 0,
    }
}

fn write_inline(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::U(n) => {
            let _ = write!(out, "{n}");
        }
        Json::I(n) => {
            let _ = write!(out, "{n}");
        }
        Json::F(x) => {
            let _ = write!(out, "{x}");
        }
        Json::Str(s) => write_string(s, out),
        Json::Arr(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_inline(x, out);
            }
            out.push(']');
        }
        Json::Obj(entries) => {
            out.push('{');
            for (i, (k, x)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_string(k, out);
                out.push_str(": ");
                write_inline(x, out);
            }
            out.push('}');
        }
    }
}

/// Writes `v` at `indent`: small values (depth ≤ 3, short) on one line, others one entry per line.
fn write_value(v: &Json, indent: usize, out: &mut String) {
    let mut inline = String::new();
    if depth(v) <= 3 {
        write_inline(v, &mut inline);
        if inline.len() + indent <= 110 {
            out.push_str(&inline);
            return;
        }
    }
    let pad = |out: &mut String, n: usize| out.extend(std::iter::repeat_n(' ', n));
    match v {
        Json::Arr(items) if !items.is_empty() => {
            out.push_str("[\n");
            for (i, x) in items.iter().enumerate() {
                pad(out, indent + 2);
                write_value(x, indent + 2, out);
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            pad(out, indent);
            out.push(']');
        }
        Json::Obj(entries) if !entries.is_empty() => {
            out.push_str("{\n");
            for (i, (k, x)) in entries.iter().enumerate() {
                pad(out, indent + 2);
                write_string(k, out);
                out.push_str(": ");
                write_value(x, indent + 2, out);
                out.push_str(if i + 1 < entries.len() { ",\n" } else { "\n" });
            }
            pad(out, indent);
            out.push('}');
        }
        _ => write_inline(v, out),
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
