//! (in progress)
/// A rejected configuration (placeholder until the parser lands).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError;
