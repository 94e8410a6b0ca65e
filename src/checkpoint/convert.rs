//! Converting a checkpoint tensor's floats to the dtype the module holds them in: a GGUF file stores its unquantized
//! tensors as F32 (or F16) while diffusers' GGUF loader gives the module the compute dtype (bf16), and a module can
//! be loaded in another float dtype than its file. Conversions round to nearest, ties to even, as torch's `.to()`
//! does (the `half` crate), so a tensor converted here is bit-identical to the one diffusers made of the same file.

use crate::pipeline::DType;

/// Whether `dtype` is one of the floats converted here: F32, F16 and BF16.
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::Bf16)
}

/// Whether floats of `from` convert to `to` here (both [`is_float`], and different).
pub fn converts(from: DType, to: DType) -> bool {
    from != to && is_float(from) && is_float(to)
}

/// `bytes` (little-endian values of `from`) as little-endian values of `to`; `None` unless [`converts`].
pub fn convert(bytes: &[u8], from: DType, to: DType) -> Option<Vec<u8>> {
    if !converts(from, to) {
        return None;
    }
    let width = from.size_bytes() as usize;
    let values = bytes.chunks_exact(width).map(|c| match from {
        DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        DType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
        _ => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
    });
    let mut out = Vec::with_capacity(bytes.len() / width * to.size_bytes() as usize);
    for v in values {
        match to {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_to_bf16_rounds_to_nearest_even_and_only_floats_convert() {
        // 1 + 2^-8 lies halfway between two bf16 values: ties go to the even one (1.0); just above rounds up.
        let halfway = f32::from_bits(0x3F80_8000);
        let above = f32::from_bits(0x3F80_8001);
        let bytes: Vec<u8> = [1.5f32, halfway, above, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = convert(&bytes, DType::F32, DType::Bf16).unwrap();
        let got: Vec<u16> = out.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(got, vec![0x3FC0, 0x3F80, 0x3F81, 0xC000]);
        let back = convert(&out, DType::Bf16, DType::F32).unwrap();
        assert_eq!(&back[..4], &1.5f32.to_le_bytes());
        assert!(convert(&bytes, DType::F32, DType::F32).is_none());
        assert!(convert(&bytes, DType::F32, DType::I32).is_none());
        assert!(!converts(DType::U8, DType::Bf16));
    }
}
