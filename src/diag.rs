//! Diagnostics shared by the planner and the backends: warnings that must be logged once per key per process.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

fn seen() -> &'static Mutex<HashSet<String>> {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    SEEN.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Logs `message` as a warning the first time `key` is seen in this process; later calls are silent.
/// Returns whether it logged.
pub fn warn_once(key: &str, message: &str) -> bool {
    let first = match seen().lock() {
        Ok(mut s) => s.insert(key.to_string()),
        Err(poisoned) => poisoned.into_inner().insert(key.to_string()),
    };
    if first {
        tracing::warn!("{message}");
    }
    first
}
