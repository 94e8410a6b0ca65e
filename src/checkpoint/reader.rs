//! One `.safetensors` file: mapped read-only, its header parsed and checked before any tensor byte is used.
//!
//! Checks, in this order (the first failure is the error): the 8-byte header length and the header fit in the
//! file ([`CheckpointError::Truncated`]); the header is UTF-8 JSON of the format with no name twice
//! ([`CheckpointError::CorruptHeader`]); then for each tensor by start offset its dtype is supported
//! ([`CheckpointError::UnsupportedDtype`]) and its offsets span exactly `numel × element size` bytes
//! ([`CheckpointError::ShapeBytesMismatch`]); no tensor ends past the data region ([`CheckpointError::Truncated`]
//! when the tensors tile the declared region, so the file was cut short, [`CheckpointError::OffsetsPastEnd`]
//! otherwise); no two tensors overlap ([`CheckpointError::Overlap`]); every data byte belongs to a tensor
//! ([`CheckpointError::Uncovered`]). Last, the `safetensors` crate's own reader must accept the file
//! ([`CheckpointError::Rejected`]). Afterwards every tensor's range lies inside the file as opened; reads are file
//! reads ([`region`](super::region)), so a file changed later is an error, never a fault.

use super::error::CheckpointError;
use super::header::{FileTensor, Header};
use super::region::FileRegion;
use crate::pipeline::DType;
use serde::de::{Deserializer, MapAccess, Visitor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use weightferry_actors::platform::HostRegion;

/// Largest header the safetensors format allows (the crate's limit).
pub(super) const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Maps a safetensors dtype name onto the description's dtypes; `None` for every other dtype.
pub(super) fn dtype_from_safetensors(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::Bf16,
        "F8_E4M3" => DType::F8e4m3,
        "F8_E5M2" => DType::F8e5m2,
        "I8" => DType::I8,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "U8" => DType::U8,
        _ => return None,
    })
}

/// A mapped, checked `.safetensors` file (or `.gguf` file: `gguf.rs` reads its header into the same `Header`).
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    region: Arc<FileRegion>,
    header: Header,
    gguf: bool,
}

impl SafetensorsFile {
    /// Maps `path` read-only and checks its header (see the module doc).
    pub fn open(path: &Path) -> Result<SafetensorsFile, CheckpointError> {
        let io = |source| CheckpointError::Io { file: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(CheckpointError::Truncated {
                file: path.to_path_buf(),
                tensor: None,
                expected: 8,
                actual: len,
            });
        }
        let region = FileRegion::new(path, file).map_err(io)?;
        let bytes = region.mapped();
        let gguf = bytes.starts_with(super::gguf::MAGIC);
        let header = if gguf { super::gguf::parse_header(path, bytes)? } else { parse_header(path, bytes)? };
        Ok(SafetensorsFile { path: path.to_path_buf(), region: Arc::new(region), header, gguf })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Whether it is a GGUF file (its quantized tensors are `U8` block bytes).
    pub fn is_gguf(&self) -> bool {
        self.gguf
    }
    /// The file's length in bytes (at open).
    pub fn len(&self) -> u64 {
        self.region.len()
    }
    /// Whether the file is empty (never, once opened: a file has at least its header length).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }
    /// The checked header.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// The tensors in file order.
    pub fn tensors(&self) -> &[FileTensor] {
        &self.header.tensors
    }
    /// The file as a region to lend a platform ([`Platform::map_host`](weightferry_actors::platform::Platform::map_host)).
    pub fn region(&self) -> Arc<FileRegion> {
        Arc::clone(&self.region)
    }
    /// Reads a tensor of this file's header into `out` (which must be exactly its length), by a file read:
    /// [`CheckpointError::Changed`] if the file was truncated or rewritten since it was opened.
    pub fn read(&self, t: &FileTensor, out: &mut [u8]) -> Result<(), CheckpointError> {
        if out.len() as u64 != t.len {
            return Err(CheckpointError::Changed {
                file: self.path.clone(),
                reason: format!("tensor `{}` is {} bytes, asked for {}", t.name, t.len, out.len()),
            });
        }
        self.region
            .read_at(t.offset, out)
            .map_err(|reason| CheckpointError::Changed { file: self.path.clone(), reason })
    }
}

/// The header's top-level entries in file order, refusing a name given twice.
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object of tensor name → {dtype, shape, data_offsets}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Entries, A::Error> {
                let mut seen = BTreeSet::new();
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, serde_json::Value>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!("`{k}` appears twice")));
                    }
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A header's tensor entries: name and what the header says of it.
type RawEntries = Vec<(String, RawInfo)>;

#[derive(serde::Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Parses and checks the header of the file whose bytes are `bytes` (`path` names it in errors).
pub(super) fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header, CheckpointError> {
    let len = bytes.len() as u64;
    let (text, data_start) = header_text(path, bytes)?;
    let (metadata, raw) = header_entries(path, text)?;
    let mut tensors = file_tensors(path, &raw)?;
    check_coverage(path, &tensors, data_start, len)?;
    safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|source| CheckpointError::Rejected { file: path.to_path_buf(), source })?;
    for t in &mut tensors {
        t.offset += data_start;
    }
    Ok(Header { tensors, metadata, data_start })
}

/// The header's JSON text (after its 8-byte length) and where the data region starts.
fn header_text<'b>(path: &Path, bytes: &'b [u8]) -> Result<(&'b str, u64), CheckpointError> {
    let file = || path.to_path_buf();
    let len = bytes.len() as u64;
    let Some(n) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))) else {
        return Err(CheckpointError::Truncated { file: file(), tensor: None, expected: 8, actual: len });
    };
    if n > MAX_HEADER_BYTES {
        return Err(CheckpointError::CorruptHeader {
            format: "safetensors",
            file: file(),
            reason: format!("header length {n} exceeds the format's limit of {MAX_HEADER_BYTES} bytes"),
        });
    }
    let data_start = 8 + n;
    let Some(text) = bytes.get(8..data_start as usize) else {
        return Err(CheckpointError::Truncated { file: file(), tensor: None, expected: data_start, actual: len });
    };
    let text = std::str::from_utf8(text).map_err(|e| CheckpointError::CorruptHeader {
        file: file(),
        format: "safetensors",
        reason: format!("not UTF-8: {e}"),
    })?;
    Ok((text, data_start))
}

/// The header's `__metadata__` and its tensor entries, sorted by their data offsets (then names).
fn header_entries(path: &Path, text: &str) -> Result<(BTreeMap<String, String>, RawEntries), CheckpointError> {
    let corrupt =
        |reason: String| CheckpointError::CorruptHeader { file: path.to_path_buf(), format: "safetensors", reason };
    let Entries(entries) = serde_json::from_str(text).map_err(|e| corrupt(format!("invalid JSON: {e}")))?;
    let mut metadata = BTreeMap::new();
    let mut raw = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            metadata = serde_json::from_value(value)
                .map_err(|e| corrupt(format!("`__metadata__` is not an object of strings: {e}")))?;
            continue;
        }
        let info: RawInfo = serde_json::from_value(value)
            .map_err(|e| corrupt(format!("tensor `{name}`: expected {{dtype, shape, data_offsets}}: {e}")))?;
        raw.push((name, info));
    }
    raw.sort_by(|(a, x), (b, y)| x.data_offsets.cmp(&y.data_offsets).then(a.cmp(b)));
    Ok((metadata, raw))
}

/// The tensors of the entries, each with a dtype this crate reads and as many bytes as its shape needs (offsets
/// still relative to the data region).
fn file_tensors(path: &Path, raw: &[(String, RawInfo)]) -> Result<Vec<FileTensor>, CheckpointError> {
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, info) in raw {
        let Some(dtype) = dtype_from_safetensors(&info.dtype) else {
            return Err(CheckpointError::UnsupportedDtype {
                file: path.to_path_buf(),
                tensor: name.clone(),
                dtype: info.dtype.clone(),
            });
        };
        let (start, end) = info.data_offsets;
        let expected = info.shape.iter().fold(dtype.size_bytes() as u128, |a, &s| a.saturating_mul(s as u128));
        let actual = end.saturating_sub(start);
        if end < start || expected != actual as u128 {
            return Err(CheckpointError::ShapeBytesMismatch {
                file: path.to_path_buf(),
                tensor: name.clone(),
                dtype: info.dtype.clone(),
                shape: info.shape.clone(),
                expected,
                actual,
            });
        }
        tensors.push(FileTensor { name: name.clone(), dtype, shape: info.shape.clone(), offset: start, len: actual });
    }
    Ok(tensors)
}

/// Checks that the tensors (sorted, offsets relative to the data region) tile the data region of a file of `len`
/// bytes exactly: none past its end, none overlapping, no gap.
fn check_coverage(path: &Path, tensors: &[FileTensor], data_start: u64, len: u64) -> Result<(), CheckpointError> {
    let file = || path.to_path_buf();
    let data_len = len - data_start;
    let tiles = tensors.iter().try_fold(0u64, |at, t| (t.offset == at).then_some(t.offset + t.len)).is_some();
    if let Some(t) = tensors.iter().find(|t| t.offset + t.len > data_len) {
        if tiles {
            let declared = tensors.last().map_or(0, |l| l.offset + l.len);
            return Err(CheckpointError::Truncated {
                file: file(),
                tensor: Some(t.name.clone()),
                expected: data_start + declared,
                actual: len,
            });
        }
        return Err(CheckpointError::OffsetsPastEnd {
            file: file(),
            tensor: t.name.clone(),
            start: t.offset,
            end: t.offset + t.len,
            data_len,
        });
    }
    let mut at = 0u64;
    let mut prev: Option<&FileTensor> = None;
    for t in tensors {
        if let Some(p) = prev.filter(|p| t.offset < p.offset + p.len) {
            return Err(CheckpointError::Overlap { file: file(), tensor: t.name.clone(), other: p.name.clone() });
        }
        if t.offset > at {
            return Err(CheckpointError::Uncovered {
                file: file(),
                after: prev.map(|p| p.name.clone()),
                start: at,
                end: t.offset,
            });
        }
        at = t.offset + t.len;
        prev = Some(t);
    }
    if at < data_len {
        return Err(CheckpointError::Uncovered {
            file: file(),
            after: prev.map(|p| p.name.clone()),
            start: at,
            end: data_len,
        });
    }
    Ok(())
}
