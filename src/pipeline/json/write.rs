//! Writing a pipeline description as JSON: which storages are written inline (`tied_to` the first view) or named,
//! the document as an order-preserving value with `repeat` for runs of identical blocks, and its text.

use super::value::{kind_name, Json};
use super::{FORMAT, MAX_REPEAT};
use crate::pipeline::validate::checked_span;
use crate::pipeline::{join, ModuleNode, PipelineDesc, StorageDesc, StorageId, TensorDesc, TensorKind};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

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

pub(super) fn render_document(p: &PipelineDesc) -> Json {
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
    if !p.pinned.is_empty() {
        put("pinned", str_list(&p.pinned));
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
pub(super) fn write_value(v: &Json, indent: usize, out: &mut String) {
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
