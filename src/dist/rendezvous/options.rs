//! [`RendezvousOptions`]: the timeout, run id and fingerprint of a rendezvous.

use super::identity::{Fingerprint, RunId};
use std::time::Duration;

/// Settings of a rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// Longest wait for joining, and for each message of an operation.
    pub timeout: Duration,
    /// The run this rank belongs to; [`Rendezvous::connect`](super::Rendezvous::connect) uses
    /// [`LaunchEnv::run_id`](crate::dist::LaunchEnv::run_id) when this is [`RunId::NONE`].
    pub run: RunId,
    /// What this rank runs; compared by rank 0 only without a run id (see the [module docs](super)).
    pub fingerprint: Fingerprint,
}

impl Default for RendezvousOptions {
    /// A 60 s timeout, no run id, no fingerprint.
    fn default() -> Self {
        RendezvousOptions { timeout: Duration::from_secs(60), run: RunId::NONE, fingerprint: Fingerprint::NONE }
    }
}

/// Longest time rank 0 gives one accepted connection to send its hello (unless the rendezvous timeout is shorter).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

impl RendezvousOptions {
    /// How long rank 0 gives each accepted connection to send a complete hello before dropping it:
    /// [`HANDSHAKE_TIMEOUT`], or the rendezvous timeout when that is shorter.
    pub fn handshake_timeout(&self) -> Duration {
        self.timeout.min(HANDSHAKE_TIMEOUT)
    }
}
