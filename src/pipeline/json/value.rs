//! An order-preserving JSON value (object keys keep the order they are written in, as module and tensor order is
//! execution order) and the typed reads of it the parser makes. `at` is always the JSON path of the value read.

use crate::pipeline::{join, DType, PipelineError, TensorKind};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Json {
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

pub(super) type Entries = [(String, Json)];

/// An object whose keys are all in `allowed` and unique.
pub(super) fn object<'a>(
    v: &'a Json,
    at: &str,
    allowed: &[&str],
    expected: &'static str,
) -> Result<&'a Entries, PipelineError> {
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
pub(super) fn free_object<'a>(v: &'a Json, at: &str) -> Result<&'a Entries, PipelineError> {
    match v {
        Json::Obj(entries) => Ok(entries),
        _ => Err(PipelineError::WrongType { at: at_or_document(at), expected: "an object" }),
    }
}

/// An object with arbitrary but unique keys.
pub(super) fn unique_object<'a>(v: &'a Json, at: &str) -> Result<&'a Entries, PipelineError> {
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

pub(super) fn get<'a>(entries: &'a Entries, key: &str) -> Option<&'a Json> {
    entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// `get`, treating `null` as absent.
pub(super) fn get_some<'a>(entries: &'a Entries, key: &str) -> Option<&'a Json> {
    get(entries, key).filter(|v| !matches!(v, Json::Null))
}

pub(super) fn as_u64(v: &Json, at: &str) -> Result<u64, PipelineError> {
    match v {
        Json::U(n) => Ok(*n),
        _ => Err(PipelineError::WrongType {
            at: at.to_string(),
            expected: "a non-negative integer that fits in 64 bits",
        }),
    }
}

pub(super) fn as_str<'a>(v: &'a Json, at: &str) -> Result<&'a str, PipelineError> {
    match v {
        Json::Str(s) => Ok(s),
        _ => Err(PipelineError::WrongType { at: at.to_string(), expected: "a string" }),
    }
}

pub(super) fn as_bool(v: &Json, at: &str) -> Result<bool, PipelineError> {
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

pub(super) fn u64_array(v: &Json, at: &str) -> Result<Vec<u64>, PipelineError> {
    let items = as_array(v, at, "an array of non-negative integers")?;
    items.iter().enumerate().map(|(i, x)| as_u64(x, &format!("{at}[{i}]"))).collect()
}

pub(super) fn string_array(v: &Json, at: &str) -> Result<Vec<String>, PipelineError> {
    let items = as_array(v, at, "an array of strings")?;
    items.iter().enumerate().map(|(i, x)| as_str(x, &format!("{at}[{i}]")).map(str::to_string)).collect()
}

pub(super) fn string_list_map(v: &Json, at: &str) -> Result<BTreeMap<String, Vec<String>>, PipelineError> {
    let mut out = BTreeMap::new();
    for (k, x) in unique_object(v, at)? {
        out.insert(k.clone(), string_array(x, &join(at, k))?);
    }
    Ok(out)
}

pub(super) fn string_map(v: &Json, at: &str) -> Result<BTreeMap<String, String>, PipelineError> {
    let mut out = BTreeMap::new();
    for (k, x) in unique_object(v, at)? {
        out.insert(k.clone(), as_str(x, &join(at, k))?.to_string());
    }
    Ok(out)
}

pub(super) fn parse_dtype(v: &Json, at: &str) -> Result<DType, PipelineError> {
    let s = as_str(v, at)?;
    dtype_from_name(s).ok_or_else(|| PipelineError::UnknownDType { at: at.to_string(), found: s.to_string() })
}

fn dtype_from_name(s: &str) -> Option<DType> {
    [DType::F32, DType::F16, DType::Bf16, DType::F8e4m3, DType::F8e5m2, DType::I64, DType::I32, DType::I8, DType::U8]
        .into_iter()
        .find(|d| d.name() == s)
}

pub(super) fn kind_name(k: TensorKind) -> &'static str {
    match k {
        TensorKind::Parameter => "parameter",
        TensorKind::PersistentBuffer => "persistent_buffer",
        TensorKind::NonPersistentBuffer => "non_persistent_buffer",
    }
}

pub(super) fn parse_kind(v: &Json, at: &str) -> Result<TensorKind, PipelineError> {
    let s = as_str(v, at)?;
    [TensorKind::Parameter, TensorKind::PersistentBuffer, TensorKind::NonPersistentBuffer]
        .into_iter()
        .find(|k| kind_name(*k) == s)
        .ok_or_else(|| PipelineError::UnknownKind { at: at.to_string(), found: s.to_string() })
}
