//! [`ConfigError`]: the one error type of the config module. Every rejection names the exact dotted key path it
//! concerns (or `<file>` / `<root>` / a file path where no key applies) and a message that says what is wrong and
//! how to fix it. `Display` is always `"{key}: {message}"`.

use std::io;

/// A configuration that could not be read, parsed or accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A value is missing, has the wrong type, or breaks a rule.
    #[error("{key}: {message}")]
    Invalid {
        /// Dotted key path, e.g. `diffusion_offload_config.layer_options.dit.resident_layers`.
        key: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The text is not well-formed JSON or TOML.
    #[error("{key}: {message}")]
    Syntax {
        /// `<file>` for text given directly, or the file path for [`super::OffloadConfig::from_path`].
        key: String,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column (in characters) of the error.
        column: usize,
        /// What is wrong, including the position and the fix.
        message: String,
    },
    /// The config file could not be read.
    #[error("{key}: {message}")]
    Io {
        /// The file path as given.
        key: String,
        /// Kind of the underlying I/O error.
        kind: io::ErrorKind,
        /// What went wrong and how to fix it.
        message: String,
    },
}

impl ConfigError {
    /// The dotted key path (or `<file>`, `<root>`, or a file path) the error concerns.
    pub fn key(&self) -> &str {
        match self {
            ConfigError::Invalid { key, .. } | ConfigError::Syntax { key, .. } | ConfigError::Io { key, .. } => key,
        }
    }

    /// The message part of the error (the text after `"{key}: "`).
    pub fn message(&self) -> &str {
        match self {
            ConfigError::Invalid { message, .. }
            | ConfigError::Syntax { message, .. }
            | ConfigError::Io { message, .. } => message,
        }
    }

    /// Line and column (both 1-based) of a syntax error; `None` for other errors.
    pub fn line_column(&self) -> Option<(usize, usize)> {
        match self {
            ConfigError::Syntax { line, column, .. } => Some((*line, *column)),
            _ => None,
        }
    }

    /// Builds an [`ConfigError::Invalid`].
    pub(crate) fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid { key: key.into(), message: message.into() }
    }

    /// Replaces the key (used to name the file in errors of [`super::OffloadConfig::from_path`]).
    pub(crate) fn with_key(mut self, new_key: String) -> Self {
        match &mut self {
            ConfigError::Invalid { key, .. } | ConfigError::Syntax { key, .. } | ConfigError::Io { key, .. } => {
                *key = new_key
            }
        }
        self
    }
}
