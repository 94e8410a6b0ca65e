//! The synthetic weights are the same bytes as ever: every dtype's output of the generator the harness took over
//! from the library (`f16` rounded toward zero by hand, `bf16` to nearest even, now through `half`) is pinned by
//! digest, and `f16` weights stay rounded toward zero (`half` would round them to nearest, giving other bytes).
//!
//! (Kept out of `engine/synthetic.rs` itself: the library's tests include that file and would run these too.)

use weightferry::model::{fnv1a, FNV_OFFSET};
use weightferry::pipeline::{DType, StorageId};
use weightferry_harness::engine::synthetic::{splitmix64, synthetic_bytes};

/// FNV-1a digests of 1000 elements (seed 7, storage 3) of each dtype, in the order of `DTYPES`, as the library's
/// generator made them (commit 6549479).
const EXPECTED_DIGESTS: [u64; 7] = [
    0xC365_8232_7E84_4C4F,
    0x72B4_E1E8_52A1_BCB6,
    0x45F3_FAAC_1125_07EF,
    0xFA98_D4FA_2704_CFCE,
    0x6DCC_0952_D292_1D64,
    0x3091_F8C2_E281_AEE4,
    0x6862_D1DE_5A8A_654E,
];

const DTYPES: [DType; 7] = [DType::F32, DType::Bf16, DType::F16, DType::F8e4m3, DType::I64, DType::I32, DType::U8];

#[test]
fn bytes_are_the_same_as_ever() {
    let got = DTYPES.map(|dtype| fnv1a(FNV_OFFSET, &synthetic_bytes(dtype, 1000, 7, StorageId(3))));
    assert_eq!(got, EXPECTED_DIGESTS);
}

#[test]
fn f16_weights_round_toward_zero() {
    // The generator's values, drawn the same way: each f16 weight is never larger in magnitude and keeps the sign.
    let mut st = 7 ^ 3u64.wrapping_mul(0xA24B_AED4_963E_E407);
    let bytes = synthetic_bytes(DType::F16, 1000, 7, StorageId(3));
    let mut nearest_differs = 0;
    for pair in bytes.chunks(2) {
        let h = half::f16::from_le_bytes([pair[0], pair[1]]).to_f32();
        let x = (((splitmix64(&mut st) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * 0.05;
        assert!(h.abs() <= x.abs() && (h == 0.0 || h.signum() == x.signum()), "{x} -> {h}");
        nearest_differs += usize::from(half::f16::from_f32(x).to_f32() != h);
    }
    assert!(nearest_differs > 100, "rounding to nearest would change many weights ({nearest_differs})");
}
