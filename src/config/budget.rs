//! Byte sizes for `device_budget` and `allgather_chunk_size`: a positive integer number of bytes, or a string with an optional decimal
//! fraction and a unit (`"24GiB"`, `"512MiB"`, `"1.5GB"`, `"8000000000"`). Decimal units (KB, MB, GB, TB) are
//! powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of 1024. Fractions of a byte are rounded down.

use super::walk::{describe, quote};
use super::{Bytes, ConfigError};
use serde_json::Value;

/// What `device_budget` accepts, quoted in every rejection.
pub(crate) const ACCEPTED_FORMS: &str = "a positive integer number of bytes such as 8000000000, or a string such as \
\"24GiB\", \"512MiB\", \"1.5GB\" or \"8000000000\" (units B; KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = \
powers of 1024)";

/// Multiplier of a unit, spelled exactly (case-sensitive). The empty unit means bytes.
fn unit_multiplier(unit: &str) -> Option<u128> {
    Some(match unit {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return None,
    })
}

/// Parses a byte size such as `"24GiB"`, `"1.5GB"`, `"512 MiB"` or `"8000000000"`; `key` names the setting in
/// the error. One space is allowed between the number and the unit. The result is always greater than zero.
pub fn parse_byte_size(text: &str, key: &str) -> Result<Bytes, ConfigError> {
    parse_byte_size_or(text, key, "or remove the key for no limit")
}

/// [`parse_byte_size`] with `when_zero` ending the message for a zero size (`"... give a positive size, {when_zero}"`).
fn parse_byte_size_or(text: &str, key: &str, when_zero: &str) -> Result<Bytes, ConfigError> {
    let bad = |why: String| ConfigError::invalid(key, format!("{why}; expected {ACCEPTED_FORMS}"));
    if text.starts_with('-') {
        return Err(bad(format!("{} is negative", quote(text))));
    }
    let num_end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, rest) = text.split_at(num_end);
    let unit = rest.strip_prefix(' ').unwrap_or(rest);
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    let well_formed = !int_part.is_empty()
        && int_part.bytes().all(|b| b.is_ascii_digit())
        && frac_part.bytes().all(|b| b.is_ascii_digit())
        && (frac_part.is_empty() != number.contains('.'));
    if !well_formed {
        return Err(bad(format!("{} is not a byte size", quote(text))));
    }
    let Some(multiplier) = unit_multiplier(unit) else {
        return Err(bad(format!("{} has an unknown unit {}", quote(text), quote(unit))));
    };
    if !frac_part.is_empty() && multiplier == 1 {
        return Err(bad(format!("{} has a fraction of a byte", quote(text))));
    }
    let too_large = || bad(format!("{} is larger than 2^64 - 1 bytes", quote(text)));
    if int_part.len() > 24 || frac_part.len() > 18 {
        return Err(if int_part.len() > 24 {
            too_large()
        } else {
            bad(format!("{} has too many decimals", quote(text)))
        });
    }
    // Both parts are at most 24 and 18 ASCII digits, so these parses cannot fail and the arithmetic stays far
    // below u128::MAX (10^24 * 2^40 < 10^37).
    let int_value: u128 = int_part.parse().map_err(|_| too_large())?;
    let frac_value: u128 = if frac_part.is_empty() { 0 } else { frac_part.parse().map_err(|_| too_large())? };
    let frac_scale = 10u128.pow(u32::try_from(frac_part.len()).unwrap_or(0));
    let total = int_value * multiplier + frac_value * multiplier / frac_scale;
    let total = u64::try_from(total).map_err(|_| too_large())?;
    if total == 0 {
        return Err(ConfigError::invalid(
            key,
            format!("{} is zero bytes; give a positive size, {when_zero}", quote(text)),
        ));
    }
    Ok(total)
}

/// What to do instead of a zero chunk size.
const CHUNK_WHEN_ZERO: &str = "or remove the key for one AllGather per section";

/// Parses the `allgather_chunk_size` value at `path`: like [`parse_budget_value`] (a positive integer or a size
/// string), with messages for a chunk size.
pub(crate) fn parse_chunk_value(path: &str, value: &Value) -> Result<Bytes, ConfigError> {
    match value {
        Value::String(s) => parse_byte_size_or(s, path, CHUNK_WHEN_ZERO),
        Value::Number(n) if n.as_u64() == Some(0) => Err(ConfigError::invalid(
            path,
            format!("0 bytes is no chunk size; give a positive size such as \"64MiB\", {CHUNK_WHEN_ZERO}"),
        )),
        other => parse_budget_value(path, other),
    }
}

/// Parses the `device_budget` value at `path`: a positive JSON/TOML integer, or a string for [`parse_byte_size`].
pub(crate) fn parse_budget_value(path: &str, value: &Value) -> Result<Bytes, ConfigError> {
    match value {
        Value::String(s) => parse_byte_size(s, path),
        Value::Number(n) => match n.as_u64() {
            Some(0) => Err(ConfigError::invalid(
                path,
                "0 bytes leaves no room for weights; give a positive size, or remove the key for no limit",
            )),
            Some(v) => Ok(v),
            None => Err(ConfigError::invalid(path, format!("expected {ACCEPTED_FORMS}, found {}", describe(value)))),
        },
        other => Err(ConfigError::invalid(path, format!("expected {ACCEPTED_FORMS}, found {}", describe(other)))),
    }
}
