//! [`SessionError`]: why a session could not be opened or driven, by kind. Each kind is one exception class of
//! the Python binding; the message is the text the CLI prints after `error: `, already on one line.

/// A failure of a [`Session`](super::Session) call, by kind; the message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// A config that cannot be read, parsed or accepted: `invalid config: {key}: {message}`.
    #[error("{0}")]
    Config(String),
    /// An invalid pipeline description: `pipeline {name}: {message}`.
    #[error("{0}")]
    Pipeline(String),
    /// A valid config the pipeline cannot serve: `the config cannot be applied to {name}: {message}`.
    #[error("{0}")]
    Plan(String),
    /// The offload machinery failed, or was used out of order (enable, a hook, a device read, disable), or the
    /// rank's collective could not be built.
    #[error("{0}")]
    Offload(String),
    /// A device that cannot be used: unknown, absent, without CUDA support in this build, or not in the caller's
    /// CUDA context.
    #[error("{0}")]
    Device(String),
    /// A checkpoint that cannot be read, or does not match the pipeline.
    #[error("{0}")]
    Checkpoint(String),
}

/// Collapses a message onto one line, as the CLI does before printing it.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An offload failure, on one line.
pub(crate) fn offload_err(e: impl std::fmt::Display) -> SessionError {
    SessionError::Offload(one_line(&e.to_string()))
}
