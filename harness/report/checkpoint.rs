//! What a checkpoint holds, as `weightferry inspect` prints it (text, or one JSON object): its files, tensors,
//! dtypes, bytes, and the block lists the derived description declares.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use weightferry::checkpoint::{BlockList, Checkpoint, Derived};
use weightferry::offload::mapped::{first_misplaced, FileRange};
use weightferry::plan::bytes::human_bytes;

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileSummary {
    /// Its path.
    pub path: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// Tensors in it.
    pub tensors: usize,
    /// Bytes of its tensors (the file less its header).
    pub tensor_bytes: u64,
}

/// Tensors of one dtype.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Count {
    /// Number of tensors.
    pub tensors: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// A checkpoint summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// The path given.
    pub path: String,
    /// The index of a sharded checkpoint.
    pub index: Option<String>,
    /// Files (shards in file-name order).
    pub files: Vec<FileSummary>,
    /// Tensors in all files.
    pub tensors: usize,
    /// Bytes of all tensors.
    pub tensor_bytes: u64,
    /// Per dtype (description names: `bf16`, `f32`, …).
    pub dtypes: BTreeMap<String, Count>,
    /// The DiT component the description declares.
    pub component: String,
    /// Block lists, in execution order.
    pub block_lists: Vec<BlockList>,
    /// Tensors outside every block list.
    pub outside_blocks: Count,
    /// Per block list (same order): bytes of its blocks that `host_masters = "auto"` serves straight from the file
    /// (sections whose tensors lie there as packed: [`first_misplaced`]); the rest get pinned masters.
    pub served_from_file: Vec<u64>,
}

/// Bytes of `attr`'s blocks served straight from the file under `host_masters = "auto"`.
fn served_bytes(ckpt: &Checkpoint, attr: &str) -> u64 {
    let prefix = format!("{attr}.");
    // (block number, dtype) -> (file, offset, bytes) of its tensors.
    let mut sections: BTreeMap<(u64, &'static str), Vec<FileRange>> = BTreeMap::new();
    for (fi, file) in ckpt.files().iter().enumerate() {
        for t in file.tensors() {
            let Some(rest) = t.name.strip_prefix(&prefix) else { continue };
            let Some(n) = rest.split('.').next().and_then(|n| n.parse::<u64>().ok()) else { continue };
            sections.entry((n, t.dtype.name())).or_default().push((fi as u64, t.offset, t.len));
        }
    }
    sections
        .values_mut()
        .filter_map(|ranges| {
            ranges.sort_unstable();
            first_misplaced(ranges).is_none().then(|| ranges.iter().map(|r| r.2).sum::<u64>())
        })
        .sum()
}

impl Summary {
    /// Summarises `ckpt` and the description derived from it.
    pub fn of(ckpt: &Checkpoint, derived: &Derived) -> Summary {
        let files = ckpt
            .files()
            .iter()
            .map(|f| FileSummary {
                path: f.path().display().to_string(),
                bytes: f.len(),
                tensors: f.tensors().len(),
                tensor_bytes: f.tensors().iter().map(|t| t.len).sum(),
            })
            .collect();
        let mut dtypes: BTreeMap<String, Count> = BTreeMap::new();
        for (_, t) in ckpt.tensors() {
            let c = dtypes.entry(t.dtype.name().to_string()).or_default();
            c.tensors += 1;
            c.bytes += t.len;
        }
        let in_blocks = Count {
            tensors: derived.block_lists.iter().map(|b| b.tensors).sum(),
            bytes: derived.block_lists.iter().map(|b| b.bytes).sum(),
        };
        Summary {
            path: ckpt.path().display().to_string(),
            index: ckpt.index().map(|p| p.display().to_string()),
            files,
            tensors: ckpt.len(),
            tensor_bytes: ckpt.tensor_bytes(),
            dtypes,
            component: derived.component.clone(),
            block_lists: derived.block_lists.clone(),
            outside_blocks: Count {
                tensors: ckpt.len() - in_blocks.tensors,
                bytes: ckpt.tensor_bytes() - in_blocks.bytes,
            },
            served_from_file: derived.block_lists.iter().map(|b| served_bytes(ckpt, &b.attr)).collect(),
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "checkpoint: {}", self.path)?;
        if let Some(ix) = &self.index {
            writeln!(f, "index: {ix}")?;
        }
        writeln!(f, "files: {}", self.files.len())?;
        for file in &self.files {
            writeln!(f, "  {}  {} tensors, {}", file.path, file.tensors, human_bytes(file.bytes))?;
        }
        writeln!(f, "tensors: {}, {}", self.tensors, human_bytes(self.tensor_bytes))?;
        writeln!(f, "dtypes:")?;
        for (d, c) in &self.dtypes {
            writeln!(f, "  {d:<7} {} tensors, {}", c.tensors, human_bytes(c.bytes))?;
        }
        writeln!(f, "component: {} (one DiT)", self.component)?;
        if self.block_lists.is_empty() {
            writeln!(f, "block lists: none found (no `name.N.` key format); layerwise offload has nothing to stream")?;
        } else {
            writeln!(f, "block lists:")?;
            for (b, served) in self.block_lists.iter().zip(&self.served_from_file) {
                writeln!(
                    f,
                    "  {}  {} blocks, {} tensors, {}; served from the file (host_masters = auto): {}",
                    b.attr,
                    b.blocks,
                    b.tensors,
                    human_bytes(b.bytes),
                    human_bytes(*served)
                )?;
            }
        }
        writeln!(
            f,
            "outside blocks: {} tensors, {}",
            self.outside_blocks.tensors,
            human_bytes(self.outside_blocks.bytes)
        )
    }
}
