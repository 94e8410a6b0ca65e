//! Writing small safetensors checkpoints in tests: a tensor type the `safetensors` crate serializes, deterministic
//! bytes, fresh folders (shared by the checkpoint tests through `#[path]`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor to serialize.
pub struct T {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl safetensors::View for &T {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// A tensor of `dtype` and `shape` with bytes from `seed` (xorshift).
pub(crate) fn t(dtype: safetensors::Dtype, shape: &[usize], seed: u64) -> T {
    let n = shape.iter().product::<usize>() * (dtype.bitsize() / 8);
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    T { dtype, shape: shape.to_vec(), data }
}

/// A fresh empty folder `<prefix>-<name>` under the test target's temporary folder.
pub(crate) fn fresh_dir(prefix: &str, name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{prefix}-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Serializes `tensors` into the file `path`.
pub(crate) fn write(path: &Path, tensors: &BTreeMap<String, T>) {
    let bytes = safetensors::serialize(tensors.iter().map(|(k, v)| (k.clone(), v)), None).unwrap();
    std::fs::write(path, bytes).unwrap();
}
