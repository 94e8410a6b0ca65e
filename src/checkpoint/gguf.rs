//! One `.gguf` file (llama.cpp's format, versions 2 and 3: what the `gguf` package, city96's Flux and Wan files and
//! diffusers' GGUF quantizer read): its header parsed and checked before any tensor byte is used, into the same
//! [`Header`] a safetensors file gives, so the rest of the checkpoint code (mapping, reads, binding by name) is
//! shared.
//!
//! A tensor's bytes are as stored: a block-quantized tensor (Q8_0, Q4_K, ...) is `U8` with the byte shape diffusers'
//! `GGUFParameter` holds (the GGUF dimensions reversed, the innermost one as bytes per row), an unquantized one
//! (F32, F16, BF16, I8, I32, I64) its own dtype and the dimensions reversed. Checks, in order (the first failure is
//! the error): the magic, the version and the counts ([`CheckpointError::CorruptHeader`]); every key, value and
//! tensor entry lies inside the file ([`CheckpointError::Truncated`] when the header is cut); no tensor name twice,
//! at most eight dimensions (ggml's own limit is four; the `gguf` package writes more), rows of whole blocks,
//! offsets on the file's alignment (`general.alignment`, 32 if absent) ([`CheckpointError::CorruptHeader`]); a known type that the description can hold
//! ([`CheckpointError::UnsupportedDtype`]); every tensor inside the file ([`CheckpointError::Truncated`]); no two
//! tensors overlap ([`CheckpointError::Overlap`]). Padding between tensors is the format's own and allowed.
//!
//! Written here rather than taken from a crate: the one maintained Rust reader lives inside a tensor library
//! (candle), and the header is a flat little-endian list this module reads in one pass.

use super::error::CheckpointError;
use super::header::{FileTensor, Header};
use crate::pipeline::DType;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The four bytes a GGUF file starts with.
pub(super) const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions of a tensor: ggml itself stops at 4, but the `gguf` Python package writes more (a video model's
/// 5-dimensional patch embedding) and diffusers reads them, so such files are read too.
const MAX_DIMS: u32 = 8;
/// Deepest nesting of arrays in a metadata value that is read (the format nests arrays of arrays).
const MAX_ARRAY_DEPTH: u32 = 4;

/// A GGML tensor type: its name, values per block, bytes per block, and the dtype it is held as (`U8` bytes for a
/// block-quantized type); `None` for a type the description cannot hold.
fn ggml_type(id: u32) -> Option<(&'static str, u64, u64, Option<DType>)> {
    let q = Some(DType::U8);
    Some(match id {
        0 => ("F32", 1, 4, Some(DType::F32)),
        1 => ("F16", 1, 2, Some(DType::F16)),
        2 => ("Q4_0", 32, 18, q),
        3 => ("Q4_1", 32, 20, q),
        6 => ("Q5_0", 32, 22, q),
        7 => ("Q5_1", 32, 24, q),
        8 => ("Q8_0", 32, 34, q),
        9 => ("Q8_1", 32, 40, q),
        10 => ("Q2_K", 256, 84, q),
        11 => ("Q3_K", 256, 110, q),
        12 => ("Q4_K", 256, 144, q),
        13 => ("Q5_K", 256, 176, q),
        14 => ("Q6_K", 256, 210, q),
        15 => ("Q8_K", 256, 292, q),
        16 => ("IQ2_XXS", 256, 66, q),
        17 => ("IQ2_XS", 256, 74, q),
        18 => ("IQ3_XXS", 256, 98, q),
        19 => ("IQ1_S", 256, 50, q),
        20 => ("IQ4_NL", 32, 18, q),
        21 => ("IQ3_S", 256, 110, q),
        22 => ("IQ2_S", 256, 82, q),
        23 => ("IQ4_XS", 256, 136, q),
        24 => ("I8", 1, 1, Some(DType::I8)),
        25 => ("I16", 1, 2, None),
        26 => ("I32", 1, 4, Some(DType::I32)),
        27 => ("I64", 1, 8, Some(DType::I64)),
        28 => ("F64", 1, 8, None),
        29 => ("IQ1_M", 256, 56, q),
        30 => ("BF16", 1, 2, Some(DType::Bf16)),
        34 => ("TQ1_0", 256, 54, q),
        35 => ("TQ2_0", 256, 66, q),
        _ => return None,
    })
}

/// Reads the header's little-endian fields in order; every read past the end is [`CheckpointError::Truncated`].
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: u64) -> Result<&[u8], CheckpointError> {
        let end = u64::try_from(self.at).ok().and_then(|a| a.checked_add(n));
        match end.and_then(|e| usize::try_from(e).ok()).filter(|&e| e <= self.bytes.len()) {
            Some(e) => {
                let out = &self.bytes[self.at..e];
                self.at = e;
                Ok(out)
            }
            None => Err(CheckpointError::Truncated {
                file: self.path.to_path_buf(),
                tensor: None,
                expected: (self.at as u64).saturating_add(n),
                actual: self.bytes.len() as u64,
            }),
        }
    }
    fn u32(&mut self) -> Result<u32, CheckpointError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, CheckpointError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self) -> Result<String, CheckpointError> {
        let n = self.u64()?;
        let path = self.path;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| corrupt(path, "a string that is not UTF-8".into()))
    }
    /// Skips one metadata value of type `ty`, or returns it when it is a string or an integer.
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, CheckpointError> {
        Ok(match ty {
            0 | 1 | 7 => Value::Int(u64::from(self.take(1)?[0])),
            2 | 3 => {
                let b = self.take(2)?;
                Value::Int(u64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            4..=6 => Value::Int(u64::from(self.u32()?)),
            10..=12 => Value::Int(self.u64()?),
            8 => Value::Str(self.string()?),
            9 if depth < MAX_ARRAY_DEPTH => {
                let (elem, n) = (self.u32()?, self.u64()?);
                for _ in 0..n {
                    self.value(elem, depth + 1)?;
                }
                Value::Other
            }
            _ => return Err(corrupt(self.path, format!("a metadata value of unknown type {ty}"))),
        })
    }
}

/// A metadata value as far as the header needs it.
enum Value {
    Int(u64),
    Str(String),
    Other,
}

fn corrupt(path: &Path, reason: String) -> CheckpointError {
    CheckpointError::CorruptHeader { file: path.to_path_buf(), format: "GGUF", reason }
}

/// Parses and checks the header of the GGUF file `bytes` (the whole file, mapped); see the module doc.
pub(super) fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header, CheckpointError> {
    let mut c = Cursor { path, bytes, at: 0 };
    if c.take(4)? != MAGIC {
        return Err(corrupt(path, "it does not start with GGUF".into()));
    }
    let version = c.u32()?;
    if !(2..=3).contains(&version) {
        return Err(corrupt(path, format!("GGUF version {version}; weightferry reads versions 2 and 3")));
    }
    let (count, kvs) = (c.u64()?, c.u64()?);
    // Each entry takes at least 8 bytes: a count larger than the file is a corrupt header, not an allocation.
    if count.max(kvs) > bytes.len() as u64 / 8 {
        return Err(corrupt(path, format!("{count} tensors and {kvs} metadata entries do not fit in the file")));
    }
    let mut metadata = BTreeMap::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..kvs {
        let key = c.string()?;
        let ty = c.u32()?;
        match (key.as_str(), c.value(ty, 0)?) {
            ("general.alignment", Value::Int(a)) if ty == 4 && a.is_power_of_two() => alignment = a,
            ("general.alignment", _) => {
                return Err(corrupt(path, "general.alignment is not a power of two (a UINT32)".into()));
            }
            (_, Value::Str(s)) => {
                metadata.insert(key, s);
            }
            _ => {}
        }
    }
    let mut tensors = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    let mut names = BTreeSet::new();
    for _ in 0..count {
        let t = tensor_entry(&mut c, alignment)?;
        if !names.insert(t.name.clone()) {
            return Err(corrupt(path, format!("tensor `{}` is listed twice", t.name)));
        }
        tensors.push(t);
    }
    let data_start = (c.at as u64).div_ceil(alignment) * alignment;
    place(path, bytes.len() as u64, data_start, &mut tensors)?;
    Ok(Header { tensors, metadata, data_start })
}

/// Reads one tensor entry: its name, dimensions, type and offset in the data region (not yet placed in the file).
fn tensor_entry(c: &mut Cursor<'_>, alignment: u64) -> Result<FileTensor, CheckpointError> {
    let path = c.path;
    let name = c.string()?;
    let bad = |what: String| corrupt(path, format!("tensor `{name}`: {what}"));
    let n = c.u32()?;
    if !(1..=MAX_DIMS).contains(&n) {
        return Err(bad(format!("{n} dimensions; weightferry reads GGUF tensors of 1 to {MAX_DIMS}")));
    }
    let mut dims = Vec::with_capacity(n as usize);
    for _ in 0..n {
        dims.push(c.u64()?);
    }
    let ty = c.u32()?;
    let offset = c.u64()?;
    let Some((tname, block, size, dtype)) = ggml_type(ty) else {
        return Err(unsupported(path, &name, format!("GGML type {ty}")));
    };
    let Some(dtype) = dtype else {
        return Err(unsupported(path, &name, tname.to_string()));
    };
    if dims[0] % block != 0 {
        return Err(bad(format!("its rows of {} values are not whole {tname} blocks of {block}", dims[0])));
    }
    if offset % alignment != 0 {
        return Err(bad(format!("its offset {offset} is not a multiple of the file's alignment {alignment}")));
    }
    let row = dims[0] / block * size;
    let mut shape: Vec<u64> = dims[1..].iter().rev().copied().collect();
    shape.push(if block == 1 { dims[0] } else { row });
    let len = dims[1..].iter().try_fold(row, |acc, &d| acc.checked_mul(d)).ok_or_else(|| bad("too large".into()))?;
    Ok(FileTensor { name, dtype, shape, offset, len })
}

fn unsupported(path: &Path, tensor: &str, dtype: String) -> CheckpointError {
    CheckpointError::UnsupportedDtype { file: path.to_path_buf(), tensor: tensor.to_string(), dtype }
}

/// Turns the tensors' offsets into file offsets, in file order, checking that each lies inside the file and that
/// none overlaps the one before it.
fn place(path: &Path, file_len: u64, data_start: u64, tensors: &mut [FileTensor]) -> Result<(), CheckpointError> {
    tensors.sort_by_key(|t| t.offset);
    let mut prev: Option<(String, u64)> = None;
    for t in tensors.iter_mut() {
        let start = data_start.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.len)).filter(|&e| e <= file_len);
        let Some(end) = end else {
            return Err(CheckpointError::Truncated {
                file: path.to_path_buf(),
                tensor: Some(t.name.clone()),
                expected: start.unwrap_or(u64::MAX).saturating_add(t.len),
                actual: file_len,
            });
        };
        if let Some((other, prev_end)) = prev.take() {
            if data_start + t.offset < prev_end {
                return Err(CheckpointError::Overlap { file: path.to_path_buf(), tensor: t.name.clone(), other });
            }
        }
        t.offset += data_start;
        prev = Some((t.name.clone(), end));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor entry of a test file: name, GGUF dimensions (innermost first), type id, offset in the data region.
    type Entry<'a> = (&'a str, Vec<u64>, u32, u64);

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A GGUF v3 file: one string and one alignment entry, `tensors`, then `data` bytes after the aligned header.
    fn file(tensors: &[Entry<'_>], alignment: u32, data: usize) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend(2u64.to_le_bytes());
        string(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        string(&mut b, "flux");
        string(&mut b, "general.alignment");
        b.extend(4u32.to_le_bytes());
        b.extend(alignment.to_le_bytes());
        for (name, dims, ty, offset) in tensors {
            string(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b.resize(b.len().div_ceil(alignment as usize) * alignment as usize + data, 0);
        b
    }

    fn parse(bytes: &[u8]) -> Result<Header, String> {
        parse_header(Path::new("m.gguf"), bytes).map_err(|e| e.to_string())
    }

    #[test]
    fn quantized_tensors_are_their_bytes_in_diffusers_byte_shape_and_plain_ones_their_dtype() {
        // A Q8_0 matrix of 3 rows of 64 values (2 blocks of 34 bytes a row), an F32 vector of 64, a BF16 matrix.
        let t = [("a.weight", vec![64, 3], 8, 0), ("a.bias", vec![64], 0, 256), ("b.weight", vec![2, 5], 30, 512)];
        let bytes = file(&t, 256, 512 + 20);
        let h = parse(&bytes).unwrap();
        let start = h.data_start;
        assert_eq!(start % 256, 0);
        assert_eq!(h.metadata.get("general.architecture").map(String::as_str), Some("flux"));
        let got: Vec<_> =
            h.tensors.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.clone(), t.offset, t.len)).collect();
        assert_eq!(
            got,
            [
                ("a.weight", DType::U8, vec![3, 68], start, 204),
                ("a.bias", DType::F32, vec![64], start + 256, 256),
                ("b.weight", DType::Bf16, vec![5, 2], start + 512, 20),
            ]
        );
    }

    #[test]
    fn every_malformed_header_is_a_typed_error_naming_the_file_and_the_tensor() {
        let ok = file(&[("w", vec![32, 2], 8, 0)], 32, 68);
        assert!(parse(&ok).is_ok());
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"GGUX".iter().chain(&ok[4..]).copied().collect(), "m.gguf: corrupt header: it does not start with GGUF"),
            (
                [&ok[..4], &1u32.to_le_bytes(), &ok[8..]].concat(),
                "m.gguf: corrupt header: GGUF version 1; weightferry reads versions 2 and 3",
            ),
            (ok[..40].to_vec(), "m.gguf: truncated: the header declares 52 bytes, the file has 40"),
            (
                file(&[("w", vec![32], 8, 0), ("w", vec![32], 8, 64)], 32, 200),
                "m.gguf: corrupt header: tensor `w` is listed twice",
            ),
            (
                file(&[("w", vec![1, 1, 1, 1, 1, 1, 1, 1, 32], 0, 0)], 32, 200),
                "m.gguf: corrupt header: tensor `w`: 9 dimensions; weightferry reads GGUF tensors of 1 to 8",
            ),
            (
                file(&[("w", vec![48, 2], 8, 0)], 32, 200),
                "m.gguf: corrupt header: tensor `w`: its rows of 48 values are not whole Q8_0 blocks of 32",
            ),
            (
                file(&[("w", vec![32], 8, 16)], 32, 200),
                "m.gguf: corrupt header: tensor `w`: its offset 16 is not a multiple of the file's alignment 32",
            ),
            (file(&[("w", vec![32], 99, 0)], 32, 200), "GGML type 99"),
            (file(&[("w", vec![4], 28, 0)], 32, 200), "tensor `w` has dtype F64"),
            (file(&[("w", vec![32, 3], 8, 0)], 32, 68), "(tensor `w` is cut)"),
            (
                file(&[("v", vec![64], 0, 0), ("w", vec![32], 0, 128)], 32, 400),
                "m.gguf: tensors `w` and `v` overlap in the data region; the header is corrupt",
            ),
        ];
        for (bytes, expected) in cases {
            let e = parse(&bytes).unwrap_err();
            assert!(e.contains(expected), "{e}\n  expected: {expected}");
        }
    }
}
