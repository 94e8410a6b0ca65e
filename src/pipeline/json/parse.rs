//! Parsing a pipeline document: the format's keys, each object read and checked with its JSON path, repeats
//! expanded, into the parsed tree; then resolved and validated into a [`PipelineDesc`].

use super::tree::{resolve, PModule, PTensor, Src};
use super::value::{
    as_bool, as_str, as_u64, free_object, get, get_some, object, parse_dtype, parse_kind, string_array,
    string_list_map, string_map, u64_array, unique_object, Entries, Json,
};
use super::{FORMAT, MAX_NODES, MAX_REPEAT};
use crate::pipeline::validate::{check_view, is_valid_name, is_valid_path};
use crate::pipeline::{
    join, ComponentDecls, OffloadPlanDecl, PipelineDesc, PipelineError, StorageDesc, TensorDesc, TensorKind,
};
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;

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
    "pinned",
];
const TOP_KEYS_TEXT: &str = "format, class, modules, tensors, root_class, root_has_lifecycle, root_is_loaded, \
                             storages, components, offload_plan, class_block_attrs, class_block_attr, pinned";
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

fn too_large(at: &str) -> PipelineError {
    PipelineError::TooLarge { at: at.to_string(), limit: MAX_NODES }
}

/// Reads a whole document: the top-level keys in order, then storages resolved and the description validated.
pub(super) fn parse_document(v: &Json) -> Result<PipelineDesc, PipelineError> {
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
    let root = parse_root(top, &class)?;

    let storages = parse_storages(top)?;

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

    let pinned = match get(top, "pinned") {
        Some(x) => string_array(x, "pinned")?,
        None => Vec::new(),
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
        pinned,
    };
    desc.validate()?;
    Ok(desc)
}

/// The root module: its class (default: the pipeline's), flags, tensors and top-level modules.
fn parse_root(top: &Entries, class: &str) -> Result<PModule, PipelineError> {
    let root_class = match get(top, "root_class") {
        Some(c) => as_str(c, "root_class")?.to_string(),
        None => class.to_string(),
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
    Ok(root)
}

/// The `storages` object: named storages several views share, in declaration order.
fn parse_storages(top: &Entries) -> Result<Vec<(String, StorageDesc)>, PipelineError> {
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
    Ok(storages)
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
