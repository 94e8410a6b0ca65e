//! Who may join: the [`RunId`] of a run and the [`Fingerprint`] of what a rank runs, both 128-bit digests a hello
//! carries.

/// Which run a rank belongs to: a digest of a run id the launcher gives every rank of one run
/// ([`LaunchEnv::run_id`](crate::dist::LaunchEnv::run_id)). Rank 0 drops a hello of another run as a stranger's, so a
/// stale or foreign process naming a rank cannot take that rank's place. [`RunId::NONE`] (no run id known) matches only
/// itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RunId(pub u128);

impl RunId {
    /// No run id: every hello without one is taken at its word.
    pub const NONE: RunId = RunId(0);

    /// The digest of a run id string (FNV-1a, 128-bit; never [`RunId::NONE`]).
    pub fn from_name(name: &str) -> RunId {
        RunId(digest(name.as_bytes()))
    }
}

/// FNV-1a, 128-bit, of `bytes`; never 0.
fn digest(bytes: &[u8]) -> u128 {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for b in bytes {
        h ^= u128::from(*b);
        h = h.wrapping_mul(PRIME);
    }
    h.max(1)
}

/// The first 32 bits in hex, or `none` for 0.
fn short_hex(v: u128, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    if v == 0 {
        f.write_str("none")
    } else {
        write!(f, "{:08x}", (v >> 96) as u32)
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        short_hex(self.0, f)
    }
}

/// What a rank runs, as a digest its caller makes (of its serialized job, say; `weightferry run` uses its rank
/// check). Without a run id, rank 0 takes a hello with another fingerprint for a stranger's (the [rendezvous
/// module docs](super)); with one, the fingerprint is not compared. [`Fingerprint::NONE`] matches only itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Fingerprint(pub u128);

impl Fingerprint {
    /// No fingerprint.
    pub const NONE: Fingerprint = Fingerprint(0);

    /// The digest of `bytes` (FNV-1a, 128-bit; never [`Fingerprint::NONE`]).
    pub fn of(bytes: &[u8]) -> Fingerprint {
        Fingerprint(digest(bytes))
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        short_hex(self.0, f)
    }
}
