//! Text to config tree: JSON (rejecting duplicate keys) and TOML (converted to the same `serde_json::Value` tree,
//! so both formats go through one validator), syntax errors with line and column, reading a file by extension,
//! and the public constructors of [`OffloadConfig`].

use super::walk::{join, quote};
use super::{resolve, ConfigError, OffloadConfig};
use crate::textfile::{read_text_capped, TextFileError, MAX_CONFIG_FILE_BYTES};
use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;
use std::path::Path;

/// Key used for syntax errors in text given directly.
const FILE_KEY: &str = "<file>";

impl OffloadConfig {
    /// Parses and validates a JSON config (an object of settings).
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        Self::from_value(&json_to_value(text)?)
    }

    /// Parses and validates a TOML config. The document is converted to the same tree as JSON, so a TOML file
    /// and the equivalent JSON file give the same result.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::from_value(&toml_to_value(text)?)
    }

    /// Reads a `.json` or `.toml` file (chosen by extension, case-insensitive) and validates it. Errors about the
    /// file itself (extension, reading, syntax) are keyed by the path as given.
    pub fn from_path(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
        let parse: fn(&str) -> Result<Value, ConfigError> = match ext.as_deref() {
            Some("json") => json_to_value,
            Some("toml") => toml_to_value,
            Some(other) => {
                return Err(ConfigError::invalid(
                    shown,
                    format!(
                        "unsupported config file extension {}; write the config as a .json or .toml file",
                        quote(&format!(".{other}"))
                    ),
                ))
            }
            None => {
                return Err(ConfigError::invalid(
                    shown,
                    "the file name has no extension; name the config file *.json or *.toml so its format is known",
                ))
            }
        };
        let text = read_text_capped(path, MAX_CONFIG_FILE_BYTES, "config file").map_err(|e| match e {
            TextFileError::Io { kind, message: why } => ConfigError::Io {
                key: shown.clone(),
                kind,
                message: format!(
                    "cannot read the config file ({why}); check that the path exists and is a readable UTF-8 file"
                ),
            },
            other => ConfigError::invalid(shown.clone(), other.to_string()),
        })?;
        let value = parse(&text).map_err(|e| match e {
            ConfigError::Syntax { .. } => e.with_key(shown),
            other => other,
        })?;
        Self::from_value(&value)
    }

    /// Validates an already-parsed config tree (the common path of every constructor).
    pub fn from_value(value: &Value) -> Result<Self, ConfigError> {
        resolve::resolve(value)
    }
}

/// A `serde_json::Value` that refuses duplicate object keys while deserializing.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(Value::Number(v.into())))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(Value::Number(v.into())))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Strict, E> {
        Number::from_f64(v).map(|n| Strict(Value::Number(n))).ok_or_else(|| E::custom("number out of range"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(v.to_string())))
    }
    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(v)))
    }
    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }
    fn visit_none<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Strict(Value::Array(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Strict, A::Error> {
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            if map.contains_key(&key) {
                return Err(A::Error::custom(format!("duplicate key {}; give each key once", quote(&key))));
            }
            let Strict(value) = access.next_value()?;
            map.insert(key, value);
        }
        Ok(Strict(Value::Object(map)))
    }
}

/// Parses JSON text into a tree, mapping syntax errors (and duplicate keys) to [`ConfigError::Syntax`].
pub(crate) fn json_to_value(text: &str) -> Result<Value, ConfigError> {
    // An empty file is an empty config (offload disabled), as an empty TOML file is.
    if text.trim().is_empty() {
        return Ok(Value::Object(Map::new()));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Strict::deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    match parsed {
        Ok(Strict(v)) => Ok(v),
        Err(e) => {
            let (line, column) = (e.line().max(1), e.column().max(1));
            let full = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let what = full.strip_suffix(&suffix).unwrap_or(&full);
            Err(ConfigError::Syntax {
                key: FILE_KEY.to_string(),
                line,
                column,
                message: format!("invalid JSON at line {line}, column {column}: {what}; fix the JSON at that position"),
            })
        }
    }
}

/// Line and column (1-based, column in characters) of a byte offset in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// Parses TOML text and converts it to the JSON tree the validator reads.
pub(crate) fn toml_to_value(text: &str) -> Result<Value, ConfigError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| {
        let (line, column) = e.span().map_or((1, 1), |s| line_column(text, s.start));
        let what = e.message().trim().replace('\n', " ");
        ConfigError::Syntax {
            key: FILE_KEY.to_string(),
            line,
            column,
            message: format!("invalid TOML at line {line}, column {column}: {what}; fix the TOML at that position"),
        }
    })?;
    table_to_json("", &table)
}

fn table_to_json(path: &str, table: &toml::Table) -> Result<Value, ConfigError> {
    let mut map = Map::new();
    for (k, v) in table {
        map.insert(k.clone(), toml_item_to_json(&join(path, k), v)?);
    }
    Ok(Value::Object(map))
}

fn toml_item_to_json(path: &str, value: &toml::Value) -> Result<Value, ConfigError> {
    Ok(match value {
        toml::Value::String(s) => Value::String(s.clone()),
        toml::Value::Integer(i) => Value::Number((*i).into()),
        toml::Value::Boolean(b) => Value::Bool(*b),
        toml::Value::Float(f) => match Number::from_f64(*f) {
            Some(n) => Value::Number(n),
            None => {
                return Err(ConfigError::invalid(
                    path,
                    format!("the float {f} is not accepted by any setting; use a finite number"),
                ))
            }
        },
        toml::Value::Datetime(d) => {
            return Err(ConfigError::invalid(
                path,
                format!("the date/time {d} is not accepted by any setting; quote it if a string was meant"),
            ))
        }
        toml::Value::Array(items) => Value::Array(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| toml_item_to_json(&format!("{path}[{i}]"), item))
                .collect::<Result<_, _>>()?,
        ),
        toml::Value::Table(t) => table_to_json(path, t)?,
    })
}
