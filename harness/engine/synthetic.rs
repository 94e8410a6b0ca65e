//! Synthetic weights: the reference engine's deterministic stand-in for a checkpoint. Every storage's bytes follow
//! from its id and a seed through [`splitmix64`] — small values (floats in (-0.05, 0.05)), so deep stacks stay
//! finite — and are the same on every machine, whatever the thread count. A model of them is
//! [`HostModel::synthetic`](SyntheticWeights::synthetic), built with the library's
//! [`HostModel::from_fn`].
//!
//! The library's own integration tests use this same file (through `tests/support/synthetic.rs`): it names only
//! the library, the scheduler crate and `half`, never the rest of the harness.

use std::sync::Arc;
use weightferry::model::{HostModel, ModelError};
use weightferry::pipeline::{DType, PipelineDesc, StorageId};
use weightferry::scheduler::{PlatformError, PlatformRef};

/// splitmix64: the tiny deterministic generator behind synthetic weights (the simulated device's fault plans use
/// the same one).
pub use weightferry::scheduler::splitmix64;

/// f32 → IEEE half bits, rounding toward zero; a value below the smallest normal half becomes a signed zero.
/// Synthetic f16 weights have always been made this way (`half` rounds to nearest, which gives other bytes), and
/// the reference outputs depend on their exact bytes.
fn f16_toward_zero(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xFF) as i32 - 127 + 15;
    let mant = bits & 0x7F_FFFF;
    if exp <= 0 {
        sign
    } else if exp >= 31 {
        sign | 0x7C00
    } else {
        sign | ((exp as u16) << 10) | ((mant >> 13) as u16)
    }
}

/// Deterministic synthetic bytes for a storage: small values so deep stacks stay finite.
pub fn synthetic_bytes(dtype: DType, numel: u64, seed: u64, storage: StorageId) -> Vec<u8> {
    let mut st = seed ^ storage.0.wrapping_mul(0xA24B_AED4_963E_E407);
    let n = numel as usize;
    let mut out = Vec::with_capacity(n * dtype.size_bytes() as usize);
    let unit = |st: &mut u64| ((splitmix64(st) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    for _ in 0..n {
        match dtype {
            DType::F32 => out.extend_from_slice(&(unit(&mut st) * 0.05).to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&half::bf16::from_f32(unit(&mut st) * 0.05).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16_toward_zero(unit(&mut st) * 0.05).to_le_bytes()),
            DType::F8e4m3 => out.push((splitmix64(&mut st) & 0x3F) as u8 | 0x20),
            // e5m2: sign, exponent 0b01xxx (small normal values), any mantissa.
            DType::F8e5m2 => out.push((splitmix64(&mut st) & 0x9F) as u8 | 0x20),
            DType::I8 => out.push((splitmix64(&mut st) % 64) as u8),
            DType::I64 => out.extend_from_slice(&((splitmix64(&mut st) % 1024) as i64).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&((splitmix64(&mut st) % 1024) as i32).to_le_bytes()),
            DType::U8 => out.push(splitmix64(&mut st) as u8),
        }
    }
    out
}

/// A host model of synthetic weights.
pub trait SyntheticWeights: Sized {
    /// Loads `desc` with deterministic synthetic weights ([`synthetic_bytes`]; pageable host buffers, one per
    /// storage, generated on all available cores). The result does not depend on the thread count.
    fn synthetic(platform: PlatformRef, desc: Arc<PipelineDesc>, seed: u64) -> Result<Self, PlatformError>;
}

impl SyntheticWeights for HostModel {
    fn synthetic(platform: PlatformRef, desc: Arc<PipelineDesc>, seed: u64) -> Result<HostModel, PlatformError> {
        HostModel::from_fn(platform, desc, |id, s| synthetic_bytes(s.dtype, s.numel, seed, id)).map_err(|e| match e {
            ModelError::Platform(p) => p,
            // Not reached: every storage's synthetic bytes are exactly its size, and new buffers are loaded.
            other => PlatformError::Driver(other.to_string()),
        })
    }
}
