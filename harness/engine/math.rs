//! The reference engine's arithmetic: what one module (a block, or a non-block child) does to the activations.
//!
//! The activations are small row-major `f32` matrices of [`TOKENS`] × [`WIDTH`]. Every tensor of the module is read
//! element by element through its shape, strides and storage offset (so a transposed view is read as the logical
//! matrix it describes), converted to `f32` when its dtype is `f32` / `bf16` / `f16`, and applied:
//!
//! - a floating-point matrix `[out, in]` is a real matrix product `y = x · wᵀ` over the activation (input column
//!   `i` reads activation column `i mod WIDTH`; output column `o` accumulates into column `o mod WIDTH`, so any
//!   widths chain), added through `tanh`;
//! - any other floating-point tensor folds into a bounded mixing term (`tanh` of a per-column sum);
//! - every tensor, whatever its dtype, is also hashed (FNV-1a over its logical element bytes) and the hash adds a
//!   small perturbation to every activation element — so every byte of every weight changes the output, including
//!   bytes the arithmetic alone could round away and dtypes it does not interpret.
//!
//! Each module ends with a per-row RMS normalisation, so values stay finite over any number of steps. Everything is
//! sequential `f32` arithmetic in a fixed order: the same inputs always give the same bits.

use super::synthetic::splitmix64;
use std::collections::HashMap;
use weightferry::model::{fnv1a, FNV_OFFSET};
use weightferry::pipeline::{DType, StorageId, TensorDesc};

/// Rows (tokens) of each activation matrix.
pub const TOKENS: usize = 4;
/// Columns (hidden width) of each activation matrix.
pub const WIDTH: usize = 32;
/// Elements of one activation matrix.
pub const ACTIVATION_ELEMS: usize = TOKENS * WIDTH;
/// Bytes of one activation matrix (`f32`).
pub const ACTIVATION_BYTES: u64 = (ACTIVATION_ELEMS * 4) as u64;

/// Which activation a module transforms, and what it reads besides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Encoders (and other always-run modules) transform the context matrix.
    Encoder,
    /// The DiT transforms the latent matrix, conditioned on the context.
    Dit,
    /// The VAE transforms the latent matrix.
    Vae,
}

impl Phase {
    /// Short name for labels and progress.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Encoder => "encoder",
            Phase::Dit => "dit",
            Phase::Vae => "vae",
        }
    }
}

/// Deterministic initial activation bytes (`f32`, little-endian) for `seed` and a salt naming the matrix.
pub fn initial_activation(seed: u64, salt: u64) -> Vec<u8> {
    let mut st = seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut out = Vec::with_capacity(ACTIVATION_BYTES as usize);
    for _ in 0..ACTIVATION_ELEMS {
        let v = ((splitmix64(&mut st) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Decodes little-endian `f32` bytes.
pub fn f32s_from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Encodes `f32` values as little-endian bytes.
pub fn f32s_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Byte offsets (within the storage) of every logical element of `t`, in row-major logical order.
///
/// Errors if the view reaches past `storage_len` bytes or its shape and strides disagree in rank.
pub fn element_offsets(t: &TensorDesc, storage_len: u64) -> Result<Vec<u64>, String> {
    if t.shape.len() != t.strides.len() {
        return Err(format!("tensor '{}' has {} dimensions but {} strides", t.name, t.shape.len(), t.strides.len()));
    }
    let esize = t.dtype.size_bytes();
    let numel = t.numel();
    if numel == 0 {
        return Ok(Vec::new());
    }
    let end = t
        .storage_offset
        .checked_add(t.physical_numel())
        .and_then(|n| n.checked_mul(esize))
        .ok_or_else(|| format!("tensor '{}' spans more elements than fit in u64", t.name))?;
    if end > storage_len {
        return Err(format!(
            "tensor '{}' reaches byte {end} of its storage, which has only {storage_len} bytes",
            t.name
        ));
    }
    let mut out = Vec::with_capacity(numel as usize);
    let rank = t.shape.len();
    let mut idx = vec![0u64; rank];
    for _ in 0..numel {
        let elem = t.storage_offset + idx.iter().zip(&t.strides).map(|(i, s)| i * s).sum::<u64>();
        out.push(elem * esize);
        // Advance the row-major multi-index.
        for d in (0..rank).rev() {
            idx[d] += 1;
            if idx[d] < t.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// Decodes one element to `f32`, or `None` for dtypes the arithmetic does not interpret.
fn decode(dtype: DType, b: &[u8]) -> Option<f32> {
    match dtype {
        DType::F32 => Some(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::Bf16 => Some(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::F16 => Some(half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => None,
    }
}

/// A small value in `[-0.5, 0.5)` derived from a hash and a position.
fn jitter(h: u64, pos: usize) -> f32 {
    let mut st = h ^ (pos as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (splitmix64(&mut st) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// Applies one tensor to `state` (a `TOKENS × WIDTH` matrix).
fn apply_tensor(state: &mut [f32], t: &TensorDesc, storage: &[u8]) -> Result<(), String> {
    let offsets = element_offsets(t, storage.len() as u64)?;
    let esize = t.dtype.size_bytes() as usize;
    // Hash of the logical bytes (also covers dtypes the arithmetic ignores).
    let mut h = fnv1a(FNV_OFFSET, t.name.as_bytes());
    for &o in &offsets {
        let o = o as usize;
        h = fnv1a(h, &storage[o..o + esize]);
    }
    let values: Option<Vec<f32>> = offsets
        .iter()
        .map(|&o| {
            decode(t.dtype, &storage[o as usize..o as usize + esize]).map(|v| if v.is_finite() { v } else { 0.0 })
        })
        .collect();
    if let Some(vals) = values {
        if t.shape.len() == 2 && t.shape[0] > 0 && t.shape[1] > 0 {
            let (out, inn) = (t.shape[0] as usize, t.shape[1] as usize);
            let mut z = [0f32; ACTIVATION_ELEMS];
            for tok in 0..TOKENS {
                let row = &state[tok * WIDTH..(tok + 1) * WIDTH];
                for o in 0..out {
                    let w = &vals[o * inn..(o + 1) * inn];
                    let mut s = 0f32;
                    for (i, wi) in w.iter().enumerate() {
                        s += row[i % WIDTH] * wi;
                    }
                    z[tok * WIDTH + o % WIDTH] += s;
                }
            }
            for (x, zi) in state.iter_mut().zip(z.iter()) {
                *x += 0.5 * zi.tanh();
            }
        } else if !vals.is_empty() {
            let mut m = [0f32; WIDTH];
            for (k, v) in vals.iter().enumerate() {
                m[k % WIDTH] += v;
            }
            for tok in 0..TOKENS {
                for j in 0..WIDTH {
                    let mix = m[j] + 0.5 * m[(j + tok + 1) % WIDTH];
                    state[tok * WIDTH + j] += 0.25 * mix.tanh();
                }
            }
        }
    }
    for (pos, x) in state.iter_mut().enumerate() {
        *x += 0.01 * jitter(h, pos);
    }
    Ok(())
}

/// Scales every row of `state` to unit RMS.
fn normalize_rows(state: &mut [f32]) {
    for row in state.chunks_mut(WIDTH) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / WIDTH as f32;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// Runs one module: applies its tensors in order to the phase's activation, then normalises.
///
/// `latent` and `context` are `TOKENS × WIDTH` matrices; the encoder phase transforms `context`, the DiT phase
/// transforms `latent` and mixes in `context`, the VAE phase transforms `latent`. `storages` holds the bytes of
/// every storage the tensors view.
pub fn apply_module(
    phase: Phase,
    latent: &mut [f32],
    context: &mut [f32],
    tensors: &[TensorDesc],
    storages: &HashMap<StorageId, Vec<u8>>,
) -> Result<(), String> {
    if latent.len() != ACTIVATION_ELEMS || context.len() != ACTIVATION_ELEMS {
        return Err(format!("activations must hold {ACTIVATION_ELEMS} elements"));
    }
    let state: &mut [f32] = match phase {
        Phase::Encoder => context,
        Phase::Dit | Phase::Vae => latent,
    };
    for t in tensors {
        let bytes = storages
            .get(&t.storage)
            .ok_or_else(|| format!("storage {} of tensor '{}' was not provided", t.storage.0, t.name))?;
        apply_tensor(state, t, bytes)?;
    }
    if phase == Phase::Dit {
        for (x, c) in latent.iter_mut().zip(context.iter()) {
            *x += 0.05 * c;
        }
    }
    let state: &mut [f32] = match phase {
        Phase::Encoder => context,
        Phase::Dit | Phase::Vae => latent,
    };
    normalize_rows(state);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightferry::pipeline::TensorKind;

    fn tensor(dtype: DType, shape: &[u64], strides: &[u64], offset: u64) -> TensorDesc {
        TensorDesc {
            name: "weight".into(),
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            storage_offset: offset,
            storage: StorageId(1),
            kind: TensorKind::Parameter,
        }
    }

    #[test]
    fn offsets_follow_strides() {
        let t = tensor(DType::Bf16, &[2, 3], &[1, 2], 1);
        assert_eq!(element_offsets(&t, 14).unwrap(), vec![2, 6, 10, 4, 8, 12]);
        assert!(element_offsets(&t, 13).unwrap_err().contains("reaches byte 14"));
    }

    #[test]
    fn every_byte_matters_and_results_stay_finite() {
        let t = tensor(DType::Bf16, &[8, 40], &[40, 1], 0);
        let bytes = crate::engine::synthetic::synthetic_bytes(DType::Bf16, 320, 7, StorageId(1));
        let run = |bytes: &[u8]| {
            let mut lat = f32s_from_bytes(&initial_activation(1, 1));
            let mut ctx = f32s_from_bytes(&initial_activation(1, 2));
            let map = HashMap::from([(StorageId(1), bytes.to_vec())]);
            for _ in 0..500 {
                apply_module(Phase::Dit, &mut lat, &mut ctx, std::slice::from_ref(&t), &map).unwrap();
            }
            lat
        };
        let base = run(&bytes);
        assert!(base.iter().all(|v| v.is_finite()));
        for i in [0usize, 1, 333, 639] {
            let mut b = bytes.clone();
            b[i] ^= 1;
            assert_ne!(f32s_to_bytes(&run(&b)), f32s_to_bytes(&base), "byte {i}");
        }
    }

    #[test]
    fn transposed_view_reads_the_logical_matrix() {
        // The same logical [2, 3] matrix stored row-major and column-major gives the same result.
        let logical = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let row_major: Vec<u8> = logical.iter().flat_map(|v| v.to_le_bytes()).collect();
        let col_major: Vec<u8> = [0, 3, 1, 4, 2, 5].iter().flat_map(|&i| logical[i].to_le_bytes()).collect();
        let a = tensor(DType::F32, &[2, 3], &[3, 1], 0);
        let b = tensor(DType::F32, &[2, 3], &[1, 2], 0);
        let go = |t: &TensorDesc, bytes: Vec<u8>| {
            let mut lat = f32s_from_bytes(&initial_activation(3, 1));
            let mut ctx = f32s_from_bytes(&initial_activation(3, 2));
            let map = HashMap::from([(StorageId(1), bytes)]);
            apply_module(Phase::Vae, &mut lat, &mut ctx, std::slice::from_ref(t), &map).unwrap();
            f32s_to_bytes(&lat)
        };
        assert_eq!(go(&a, row_major), go(&b, col_major));
    }
}
