//! Sharded host masters of distributed layerwise offload (AllGather transfer, group of `N` ranks).
//!
//! For every unit (block) and every dtype section of its [`UnitLayout`], rank `r` keeps only its shard of the
//! section's flat bytes: `ceil(T / N)` elements of the section's dtype, taken from elements `[r·s, (r+1)·s)` and
//! zero-padded at the end (see [`weightferry_actors::shard`]). An AllGather of the ranks' shards rebuilds the
//! section followed by fewer than `N` zero elements, so across the group host memory totals one model copy plus
//! that padding. With a chunk size (chunked transport) the shards use the chunk-major layout of
//! [`ShardSpec::chunked`]: one AllGather per chunk rebuilds the chunk in place. The backend builds them for its
//! gathered stacks (`group.rs`).
//!
//! Invariant: [`build_sharded_masters`] either returns every shard of every section or fails having freed every
//! host buffer it allocated (it never changes the model's homes); the shards of ranks `0..N` of one section
//! reassemble bit-exactly into the section's master bytes.

use super::layout::{write_section_range, UnitLayout, MASTER_BOUNCE_BYTES};
use crate::model::{HostModel, ModelError};
use crate::pipeline::DType;
use weightferry_actors::platform::{HostBufferId, HostMemoryKind, PlatformError, PlatformRef};
use weightferry_actors::shard::{ShardError, ShardSpec};
use weightferry_actors::MAX_GATHERS_PER_BLOCK;

/// Why sharded masters could not be built or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DistributedError {
    /// The sharding request is invalid (zero ranks, rank outside the group, partial element).
    #[error("unit '{unit}' section {dtype:?}: {source}")]
    Shard {
        /// Module path of the unit.
        unit: String,
        /// Dtype of the section.
        dtype: DType,
        /// The sharding error.
        source: ShardError,
    },
    /// The platform failed to read the model or to allocate or fill a host buffer.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// The chunk size asks for more AllGathers per block than a gather stack holds events for.
    #[error(
        "unit '{unit}' needs {gathers} AllGathers with a chunk size of {chunk_bytes} bytes, more than {max}; use a \
         larger chunk size (allgather_chunk_size)"
    )]
    TooManyGathers {
        /// Module path of the unit.
        unit: String,
        /// AllGathers the unit would need.
        gathers: u64,
        /// The chunk size asked for.
        chunk_bytes: u64,
        /// Most AllGathers per block.
        max: usize,
    },
    /// A unit or section index outside the masters.
    #[error("no section {section} in unit {unit}")]
    NoSuchSection {
        /// Unit index.
        unit: usize,
        /// Section index.
        section: usize,
    },
    /// The model could not be read: a storage is already released to the shards of a distributed run. (A platform
    /// failure reading it is [`DistributedError::Platform`].)
    #[error(transparent)]
    Model(ModelError),
}

impl From<ModelError> for DistributedError {
    /// A platform failure stays one; every other model error is [`DistributedError::Model`].
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Platform(p) => DistributedError::Platform(p),
            other => DistributedError::Model(other),
        }
    }
}

/// One rank's shard of one dtype section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionShard {
    /// Dtype of the section.
    pub dtype: DType,
    /// Offset of the full section in the unit's device region (metadata stays relative to the full buffer).
    pub device_offset: u64,
    /// Shape of the sharding (full length, element size, group size).
    pub spec: ShardSpec,
    /// Host buffer holding this rank's shard (`spec.shard_bytes()` bytes, at least 1 byte allocated).
    pub host: HostBufferId,
}

/// One rank's shards of one unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedUnit {
    /// Module path of the unit.
    pub path: String,
    /// Shards in the layout's section order.
    pub sections: Vec<SectionShard>,
}

/// One rank's sharded host masters of a list of units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedMasters {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// Units in the order they were given.
    pub units: Vec<ShardedUnit>,
}

impl ShardedMasters {
    /// Bytes of shards this rank holds (padding included).
    pub fn host_bytes(&self) -> u64 {
        self.units.iter().flat_map(|u| &u.sections).map(|s| s.spec.shard_bytes()).sum()
    }

    /// The bytes of this rank's shard of section `section` of unit `unit`.
    pub fn read_shard(&self, platform: &PlatformRef, unit: usize, section: usize) -> Result<Vec<u8>, DistributedError> {
        let s = self
            .units
            .get(unit)
            .and_then(|u| u.sections.get(section))
            .ok_or(DistributedError::NoSuchSection { unit, section })?;
        let mut out = vec![0u8; s.spec.shard_bytes() as usize];
        platform.read_host(s.host, 0, &mut out)?;
        Ok(out)
    }

    /// Frees every shard buffer.
    pub fn free(self, platform: &PlatformRef) -> Result<(), PlatformError> {
        let mut first = Ok(());
        for s in self.units.into_iter().flat_map(|u| u.sections) {
            if let Err(e) = platform.free_host(s.host) {
                first = first.and(Err(e));
            }
        }
        first
    }
}

/// The sharding of one section over `world` ranks, in chunks of about `chunk_bytes` gathered bytes (`None` or 0:
/// one chunk).
pub(crate) fn section_spec(
    unit: &str,
    dtype: DType,
    len: u64,
    world: usize,
    chunk_bytes: Option<u64>,
) -> Result<ShardSpec, DistributedError> {
    ShardSpec::chunked(len, dtype.size_bytes(), world, chunk_bytes).map_err(|source| DistributedError::Shard {
        unit: unit.to_string(),
        dtype,
        source,
    })
}

/// Builds rank `rank`'s sharded masters of `units` (in a group of `world` ranks) from the model's current bytes,
/// in host buffers of `kind`, chunked by `chunk_bytes` (`None` or 0: one chunk per section). On failure every
/// buffer allocated so far is freed.
pub fn build_sharded_masters(
    model: &HostModel,
    units: &[UnitLayout],
    world: usize,
    rank: usize,
    kind: HostMemoryKind,
    chunk_bytes: Option<u64>,
) -> Result<ShardedMasters, DistributedError> {
    let platform = model.platform().clone();
    let mut made: Vec<HostBufferId> = Vec::new();
    let result = build_into(model, &platform, units, (world, rank), kind, chunk_bytes, &mut made);
    if result.is_err() {
        for buf in made {
            let _ = platform.free_host(buf);
        }
    }
    result
}

fn build_into(
    model: &HostModel,
    platform: &PlatformRef,
    units: &[UnitLayout],
    (world, rank): (usize, usize),
    kind: HostMemoryKind,
    chunk_bytes: Option<u64>,
    made: &mut Vec<HostBufferId>,
) -> Result<ShardedMasters, DistributedError> {
    let mut out = Vec::with_capacity(units.len());
    let longest = units.iter().flat_map(|u| &u.sections).map(|s| s.len).max().unwrap_or(0);
    let mut bounce = vec![0u8; usize::try_from(longest).unwrap_or(usize::MAX).clamp(1, MASTER_BOUNCE_BYTES)];
    for unit in units {
        let mut specs = Vec::with_capacity(unit.sections.len());
        for sec in &unit.sections {
            specs.push(section_spec(&unit.path, sec.dtype, sec.len, world, chunk_bytes)?);
        }
        let gathers: u64 = specs.iter().map(ShardSpec::chunk_count).sum();
        if gathers > MAX_GATHERS_PER_BLOCK as u64 {
            return Err(DistributedError::TooManyGathers {
                unit: unit.path.clone(),
                gathers,
                chunk_bytes: chunk_bytes.unwrap_or(0),
                max: MAX_GATHERS_PER_BLOCK,
            });
        }
        let mut sections = Vec::with_capacity(unit.sections.len());
        for (sec, spec) in unit.sections.iter().zip(specs) {
            let ranges = spec.byte_ranges(rank).map_err(|source| DistributedError::Shard {
                unit: unit.path.clone(),
                dtype: sec.dtype,
                source,
            })?;
            let host = platform.alloc_host(spec.shard_bytes().max(1), kind)?;
            made.push(host);
            // Only this rank's slices of the section are read: chunk c's slice sits at `shard_offset` in the shard,
            // `shard_bytes` long, zero past the section's end (the padding of the last chunk).
            for (c, range) in spec.chunks().zip(ranges) {
                let slice = range.start..range.start + c.shard_bytes;
                write_section_range(platform, host, c.shard_offset, model, sec, slice, &mut bounce)?;
            }
            sections.push(SectionShard { dtype: sec.dtype, device_offset: sec.device_offset, spec, host });
        }
        out.push(ShardedUnit { path: unit.path.clone(), sections });
    }
    Ok(ShardedMasters { rank, world, units: out })
}
