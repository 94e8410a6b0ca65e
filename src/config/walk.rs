//! Hand-written walking of a `serde_json::Value` tree with exact key paths: typed accessors (bool, integer in a
//! range, string, object) and unknown-key rejection, each producing a [`ConfigError`] that names the dotted path,
//! what was found, and what is accepted.

use super::ConfigError;
use serde_json::{Map, Value};

/// Joins a parent path and a key. Keys made only of ASCII letters, digits, `_` and `-` are appended after a dot;
/// anything else is quoted (`layer_options." dit "`) so the path stays unambiguous. An empty parent means the root.
pub(crate) fn join(parent: &str, key: &str) -> String {
    let plain = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    let segment = if plain { key.to_string() } else { quote(key) };
    if parent.is_empty() {
        segment
    } else {
        format!("{parent}.{segment}")
    }
}

/// A JSON-style quoted string, shortened to 40 characters so messages stay readable.
pub(crate) fn quote(s: &str) -> String {
    const MAX: usize = 40;
    if s.chars().count() > MAX {
        let head: String = s.chars().take(MAX).collect();
        format!("{}...", Value::String(head))
    } else {
        Value::String(s.to_string()).to_string()
    }
}

/// Describes a value for "found ..." in messages.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) if n.is_f64() => format!("the number {n}"),
        Value::Number(n) => format!("the integer {n}"),
        Value::String(s) => format!("the string {}", quote(s)),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// Builds a type error: `expected {expected}, found {value}`.
pub(crate) fn type_error(path: &str, expected: &str, value: &Value) -> ConfigError {
    ConfigError::invalid(path, format!("expected {expected}, found {}", describe(value)))
}

/// Levenshtein distance, used for "did you mean" hints on short key names.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest valid name to `given`, if one is close enough to be a likely typo.
pub(crate) fn suggest<'v>(given: &str, valid: &[&'v str]) -> Option<&'v str> {
    if given.chars().count() > 64 {
        return None;
    }
    let lower = given.trim().to_ascii_lowercase().replace('-', "_");
    valid
        .iter()
        .map(|v| {
            let d = if lower == v.replace('-', "_") || v.starts_with(lower.as_str()) && lower.len() >= 4 {
                0
            } else {
                distance(&lower, &v.replace('-', "_"))
            };
            (d, *v)
        })
        .filter(|(d, v)| *d <= 2.max(v.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v)
}

/// A JSON object being walked, with its path.
pub(crate) struct Table<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl<'a> Table<'a> {
    /// Views `value` as an object at `path`, or returns a type error naming `path`.
    pub(crate) fn new(path: &str, value: &'a Value) -> Result<Self, ConfigError> {
        match value {
            Value::Object(map) => Ok(Table { path: path.to_string(), map }),
            other => Err(type_error(path, "an object", other)),
        }
    }

    /// The path of this object (empty for the root).
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// Path of a key inside this object.
    pub(crate) fn key_path(&self, key: &str) -> String {
        join(&self.path, key)
    }

    /// Whether the object has no keys.
    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Keys and values in sorted key order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&'a String, &'a Value)> {
        self.map.iter()
    }

    /// The value at `key`, if present (null included).
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    /// Rejects the first key (in sorted order) that is not in `valid`, listing the valid keys.
    pub(crate) fn reject_unknown(&self, what: &str, valid: &[&str]) -> Result<(), ConfigError> {
        self.reject_unknown_listing(what, valid, &[])
    }

    /// Like [`Table::reject_unknown`], also accepting the keys in `unlisted` (read elsewhere, left out of the
    /// message's list of valid keys).
    pub(crate) fn reject_unknown_listing(
        &self,
        what: &str,
        valid: &[&str],
        unlisted: &[&str],
    ) -> Result<(), ConfigError> {
        match self.map.keys().find(|k| !valid.contains(&k.as_str()) && !unlisted.contains(&k.as_str())) {
            None => Ok(()),
            Some(unknown) => {
                let hint = match suggest(unknown, valid) {
                    Some(s) => format!(" (did you mean `{s}`?)"),
                    None => String::new(),
                };
                Err(ConfigError::invalid(
                    self.key_path(unknown),
                    format!("unknown {what}{hint}; valid keys are: {}", valid.join(", ")),
                ))
            }
        }
    }

    /// An optional boolean (absent gives `None`; null is rejected).
    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(ConfigError::invalid(
                self.key_path(key),
                format!("expected true or false, found {}; remove the key to use the default", describe(other)),
            )),
        }
    }

    /// A boolean with a default when absent.
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        Ok(self.opt_bool(key)?.unwrap_or(default))
    }

    /// An optional integer within `min..=max` (booleans and fractional numbers are rejected).
    /// `rule` describes the accepted range for the message, e.g. `"an integer >= 1"`.
    pub(crate) fn opt_int(&self, key: &str, min: i64, max: i64, rule: &str) -> Result<Option<i64>, ConfigError> {
        let Some(value) = self.map.get(key) else { return Ok(None) };
        let path = self.key_path(key);
        let n = match value {
            Value::Number(n) if n.is_i64() || n.is_u64() => n,
            other => return Err(ConfigError::invalid(path, format!("expected {rule}, found {}", describe(other)))),
        };
        match n.as_i64() {
            Some(v) if (min..=max).contains(&v) => Ok(Some(v)),
            _ => Err(ConfigError::invalid(path, format!("expected {rule}, found {n}"))),
        }
    }

    /// An optional `u32` that must be at least `min` (and at most `max`).
    pub(crate) fn opt_u32(&self, key: &str, min: u32, max: u32) -> Result<Option<u32>, ConfigError> {
        let rule =
            if max == u32::MAX { format!("an integer >= {min}") } else { format!("an integer from {min} to {max}") };
        // The range check guarantees the value fits in u32.
        Ok(self.opt_int(key, i64::from(min), i64::from(max), &rule)?.map(|v| u32::try_from(v).unwrap_or(max)))
    }
}
