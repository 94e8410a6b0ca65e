//! Sharding math of distributed layerwise offload: how one flat buffer (one block's section of one dtype) is split
//! into equal per-rank shards and put back together, optionally in chunks (one AllGather per chunk, so the
//! AllGather of one chunk can overlap the host-to-device copy of the next).
//!
//! A buffer of `T` elements of `elem_size` bytes over `N` ranks gives every rank a shard of `s = ceil(T / N)`
//! elements; rank `r` holds elements `[r·s, (r+1)·s)` of the buffer, zero-padded at the end where that range runs
//! past `T`. An AllGather of the `N` shards (rank order) therefore yields the buffer followed by `N·s − T` zero
//! elements, and trimming to `T` gives the buffer back. Chunked, the same holds chunk by chunk (see
//! [`ShardSpec`]): the AllGather of chunk `j`'s slices lands exactly at the chunk's place in the buffer.
//!
//! Invariant: every shard of one [`ShardSpec`] has the same length (`shard_bytes`), and so has every rank's slice
//! of one chunk; `spec.reassemble(shards of ranks 0..n) == b` for every valid input, and padding stays below `N`
//! elements; bad input (zero element size, zero ranks, a rank outside the group, a length that is not a whole
//! number of elements, shards of unequal or too small length) is a [`ShardError`], never a panic.

/// Why a sharding request is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// The element size is zero.
    #[error("element size must be positive")]
    ZeroElemSize,
    /// The group has no ranks.
    #[error("a group needs at least one rank")]
    ZeroRanks,
    /// A rank outside `0..world`.
    #[error("rank {rank} is outside a group of {world}")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// Ranks in the group.
        world: usize,
    },
    /// The buffer is not a whole number of elements.
    #[error("{len} bytes are not a whole number of {elem_size}-byte elements")]
    PartialElement {
        /// Bytes in the buffer.
        len: u64,
        /// Bytes per element.
        elem_size: u64,
    },
    /// The shards handed to [`reassemble`] differ in length.
    #[error("shard {index} has {len} bytes, shard 0 has {expected}")]
    UnequalShards {
        /// Index of the first odd shard.
        index: usize,
        /// Its length.
        len: usize,
        /// Length of shard 0.
        expected: usize,
    },
    /// The shards handed to [`reassemble`] hold fewer bytes than the buffer they should rebuild.
    #[error("{available} bytes of shards cannot rebuild a buffer of {total} bytes")]
    TooShort {
        /// Bytes across all shards.
        available: u64,
        /// Bytes asked for.
        total: u64,
    },
    /// [`ShardSpec::gather`] was given a number of shards other than the group size.
    #[error("{got} shards given for a group of {world} ranks; pass one shard per rank, in rank order")]
    WrongShardCount {
        /// Shards given.
        got: usize,
        /// Ranks in the group.
        world: usize,
    },
    /// A size overflows the address space.
    #[error("sharding {total} bytes over {world} ranks overflows")]
    Overflow {
        /// Bytes in the buffer.
        total: u64,
        /// Ranks in the group.
        world: usize,
    },
}

/// Alignment of a chunk's per-rank slice: a requested chunk size is rounded down so that every rank's slice of a
/// full chunk is a multiple of this many bytes (when it is at least that large), keeping collective buffers
/// aligned.
pub const CHUNK_ALIGN: u64 = 256;

/// One chunk of a sharded buffer: one AllGather's worth. Every rank holds `shard_bytes` of it, at `shard_offset`
/// in its shard; the AllGather of the ranks' slices (rank order) is the buffer's bytes
/// `[gathered_offset, gathered_offset + shard_bytes · N)` (zero-padded past the buffer's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardChunk {
    /// Position of the chunk (0-based).
    pub index: u64,
    /// Offset of this chunk's slice in every rank's shard.
    pub shard_offset: u64,
    /// Bytes of the slice every rank holds (equal on every rank).
    pub shard_bytes: u64,
    /// Offset of the chunk in the unsharded (gathered) buffer.
    pub gathered_offset: u64,
}

/// The shape of one sharded buffer: its length, its element size, the group size and its chunking.
///
/// Unchunked (one chunk): rank `r` holds elements `[r·s, (r+1)·s)`, `s = ceil(T / N)`. Chunked (chunk-major
/// layout): the buffer is cut into full chunks of `c · N` elements (the last one shorter), and every chunk is
/// sharded like an unchunked buffer of its own: rank `r` holds elements `[r·c, (r+1)·c)` of each full chunk and
/// `ceil(R / N)` elements of the last chunk of `R` elements, zero-padded. A rank's shard is the concatenation of
/// its slices in chunk order, so every rank's shard has the same length and padding stays below `N` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    total_bytes: u64,
    elem_size: u64,
    world: usize,
    /// Elements of a full chunk that each rank holds (`ceil(T / N)` when unchunked).
    chunk_elems: u64,
}

impl ShardSpec {
    /// A buffer of `total_bytes` bytes of `elem_size`-byte elements sharded over `world` ranks, in one chunk.
    pub fn new(total_bytes: u64, elem_size: u64, world: usize) -> Result<ShardSpec, ShardError> {
        Self::chunked(total_bytes, elem_size, world, None)
    }

    /// Like [`ShardSpec::new`], cut into chunks of about `chunk_bytes` gathered bytes each (the chunk-major layout
    /// of the type docs). Each rank's slice of a full chunk is `chunk_bytes / N` rounded down to a multiple of
    /// [`CHUNK_ALIGN`] (when at least that large) and to whole elements, and at least one element. `None`, `0`, or
    /// a chunk at least as large as the buffer give one chunk (the unchunked layout).
    pub fn chunked(
        total_bytes: u64,
        elem_size: u64,
        world: usize,
        chunk_bytes: Option<u64>,
    ) -> Result<ShardSpec, ShardError> {
        if elem_size == 0 {
            return Err(ShardError::ZeroElemSize);
        }
        if world == 0 {
            return Err(ShardError::ZeroRanks);
        }
        if total_bytes % elem_size != 0 {
            return Err(ShardError::PartialElement { len: total_bytes, elem_size });
        }
        let whole = (total_bytes / elem_size).div_ceil(world as u64);
        let chunk_elems = match chunk_bytes {
            None | Some(0) => whole,
            Some(c) => {
                let mut per_rank = c / world as u64;
                if per_rank >= CHUNK_ALIGN {
                    per_rank -= per_rank % CHUNK_ALIGN;
                }
                (per_rank / elem_size).max(1).min(whole)
            }
        };
        // Every later size computation stays below one full chunk's gathered bytes or below `(T + N) · elem_size`
        // (padding is less than `N` elements), so checking both once makes them all safe.
        let n = world as u64;
        let full_chunk = chunk_elems.checked_mul(n).and_then(|x| x.checked_mul(elem_size));
        let padded_bound = (total_bytes / elem_size).checked_add(n).and_then(|x| x.checked_mul(elem_size));
        if full_chunk.is_none() || padded_bound.is_none() {
            return Err(ShardError::Overflow { total: total_bytes, world });
        }
        Ok(ShardSpec { total_bytes, elem_size, world, chunk_elems })
    }

    /// Bytes in the unsharded buffer (`T · elem_size`).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes per element.
    pub fn elem_size(&self) -> u64 {
        self.elem_size
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Elements in the unsharded buffer.
    pub fn total_elems(&self) -> u64 {
        self.total_bytes / self.elem_size
    }

    /// Number of chunks (AllGathers that rebuild the buffer); 1 when unchunked, also for an empty buffer.
    pub fn chunk_count(&self) -> u64 {
        let full = self.chunk_elems * self.world as u64;
        if full == 0 {
            1
        } else {
            self.total_elems().div_ceil(full).max(1)
        }
    }

    /// Elements each rank holds of the last chunk.
    fn tail_elems(&self) -> u64 {
        let before = (self.chunk_count() - 1) * self.chunk_elems * self.world as u64;
        (self.total_elems() - before).div_ceil(self.world as u64)
    }

    /// The chunks in order (one when unchunked).
    pub fn chunks(&self) -> impl Iterator<Item = ShardChunk> + '_ {
        let k = self.chunk_count();
        let e = self.elem_size;
        let n = self.world as u64;
        (0..k).map(move |j| {
            let elems = if j + 1 == k { self.tail_elems() } else { self.chunk_elems };
            ShardChunk {
                index: j,
                shard_offset: j * self.chunk_elems * e,
                shard_bytes: elems * e,
                gathered_offset: j * self.chunk_elems * n * e,
            }
        })
    }

    /// Elements per shard: `ceil(T / N)` unchunked; the sum of the rank's chunk slices when chunked.
    pub fn shard_elems(&self) -> u64 {
        (self.chunk_count() - 1) * self.chunk_elems + self.tail_elems()
    }

    /// Bytes per shard.
    pub fn shard_bytes(&self) -> u64 {
        self.shard_elems() * self.elem_size
    }

    /// Bytes of the gathered buffer (`N` shards, padding included).
    pub fn padded_bytes(&self) -> u64 {
        self.shard_bytes() * self.world as u64
    }

    /// Zero bytes appended to the buffer by the padding of the last shards.
    pub fn padding_bytes(&self) -> u64 {
        self.padded_bytes() - self.total_bytes
    }

    /// Per chunk, the byte range of the unsharded buffer that rank `rank` holds in it (shorter than the chunk's
    /// `shard_bytes`, possibly empty, where the rank's slice is padded); it sits at the chunk's `shard_offset` in
    /// the rank's shard.
    pub fn byte_ranges(&self, rank: usize) -> Result<Vec<std::ops::Range<u64>>, ShardError> {
        if rank >= self.world {
            return Err(ShardError::RankOutOfRange { rank, world: self.world });
        }
        Ok(self
            .chunks()
            .map(|c| {
                let start = (c.gathered_offset + rank as u64 * c.shard_bytes).min(self.total_bytes);
                let end = (c.gathered_offset + (rank as u64 + 1) * c.shard_bytes).min(self.total_bytes);
                start..end
            })
            .collect())
    }

    /// Rank `rank`'s shard of `bytes` (which must be `total_bytes` long), zero-padded to `shard_bytes`.
    pub fn shard(&self, bytes: &[u8], rank: usize) -> Result<Vec<u8>, ShardError> {
        if bytes.len() as u64 != self.total_bytes {
            return Err(ShardError::TooShort { available: bytes.len() as u64, total: self.total_bytes });
        }
        let ranges = self.byte_ranges(rank)?;
        let mut out = vec![0u8; self.shard_bytes() as usize];
        for (c, range) in self.chunks().zip(ranges) {
            let held = &bytes[range.start as usize..range.end as usize];
            let at = c.shard_offset as usize;
            out[at..at + held.len()].copy_from_slice(held);
        }
        Ok(out)
    }

    /// What the AllGathers of the ranks' shards (rank order, chunk by chunk) produce: the buffer followed by its
    /// zero padding, `padded_bytes` long. The shards must all be `shard_bytes` long, one per rank.
    pub fn gather<S: AsRef<[u8]>>(&self, shards: &[S]) -> Result<Vec<u8>, ShardError> {
        if shards.len() != self.world {
            return Err(ShardError::WrongShardCount { got: shards.len(), world: self.world });
        }
        let expected = self.shard_bytes() as usize;
        if let Some((index, s)) = shards.iter().enumerate().find(|(_, s)| s.as_ref().len() != expected) {
            return Err(ShardError::UnequalShards { index, len: s.as_ref().len(), expected });
        }
        let mut out = Vec::with_capacity(self.padded_bytes() as usize);
        for c in self.chunks() {
            for s in shards {
                let at = c.shard_offset as usize;
                out.extend_from_slice(&s.as_ref()[at..at + c.shard_bytes as usize]);
            }
        }
        Ok(out)
    }

    /// The inverse of [`ShardSpec::shard`]: [`ShardSpec::gather`] trimmed to `total_bytes`.
    pub fn reassemble<S: AsRef<[u8]>>(&self, shards: &[S]) -> Result<Vec<u8>, ShardError> {
        let mut out = self.gather(shards)?;
        out.truncate(self.total_bytes as usize);
        Ok(out)
    }
}

/// Rank `rank`'s shard of `bytes` (elements of `elem_size` bytes) in a group of `world` ranks: elements
/// `[rank·s, (rank+1)·s)` with `s = ceil(T / world)`, zero-padded at the end to `s` elements.
pub fn shard_of(bytes: &[u8], elem_size: usize, world: usize, rank: usize) -> Result<Vec<u8>, ShardError> {
    ShardSpec::new(bytes.len() as u64, elem_size as u64, world)?.shard(bytes, rank)
}

/// The inverse of [`shard_of`]: concatenates `shards` in rank order and trims the result to `total_bytes`.
/// The shards must all have one length and together cover `total_bytes`.
pub fn reassemble<S: AsRef<[u8]>>(shards: &[S], total_bytes: usize) -> Result<Vec<u8>, ShardError> {
    let Some(first) = shards.first() else {
        return Err(ShardError::ZeroRanks);
    };
    let expected = first.as_ref().len();
    if let Some((index, s)) = shards.iter().enumerate().find(|(_, s)| s.as_ref().len() != expected) {
        return Err(ShardError::UnequalShards { index, len: s.as_ref().len(), expected });
    }
    let available = expected as u64 * shards.len() as u64;
    if available < total_bytes as u64 {
        return Err(ShardError::TooShort { available, total: total_bytes as u64 });
    }
    let mut out = Vec::with_capacity(total_bytes);
    for s in shards {
        let take = (total_bytes - out.len()).min(expected);
        out.extend_from_slice(&s.as_ref()[..take]);
        if out.len() == total_bytes {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Elements numbered 100, 101, … (element i holds 100 + i) as little-endian `u32`s, as in the inventory.
    fn numbered(n: u32) -> Vec<u8> {
        (0..n).flat_map(|i| (100 + i).to_le_bytes()).collect()
    }

    fn elems(bytes: &[u8]) -> Vec<u32> {
        bytes.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    #[test]
    fn eight_elements_over_four_ranks() {
        let buf = numbered(8);
        let shards: Vec<Vec<u32>> = (0..4).map(|r| elems(&shard_of(&buf, 4, 4, r).unwrap())).collect();
        assert_eq!(shards, vec![vec![100, 101], vec![102, 103], vec![104, 105], vec![106, 107]]);
        // Rank 1 holds elements 2 and 3.
        assert_eq!(elems(&shard_of(&buf, 4, 4, 1).unwrap()), vec![102, 103]);
        assert_eq!(ShardSpec::new(32, 4, 4).unwrap().byte_ranges(1).unwrap(), vec![8..16]);
    }

    #[test]
    fn three_elements_over_two_ranks_pads_rank_one() {
        let buf = numbered(3);
        assert_eq!(elems(&shard_of(&buf, 4, 2, 0).unwrap()), vec![100, 101]);
        assert_eq!(elems(&shard_of(&buf, 4, 2, 1).unwrap()), vec![102, 0]);
        let spec = ShardSpec::new(12, 4, 2).unwrap();
        assert_eq!((spec.shard_elems(), spec.shard_bytes(), spec.padded_bytes(), spec.padding_bytes()), (2, 8, 16, 4));
        let shards = [shard_of(&buf, 4, 2, 0).unwrap(), shard_of(&buf, 4, 2, 1).unwrap()];
        assert_eq!(reassemble(&shards, 12).unwrap(), buf);
    }

    #[test]
    fn ranks_past_the_data_get_all_zero_shards() {
        // 2 elements over 4 ranks: s = 1; ranks 2 and 3 hold only padding.
        let buf = numbered(2);
        let spec = ShardSpec::new(8, 4, 4).unwrap();
        assert_eq!(spec.byte_ranges(2).unwrap(), vec![8..8]);
        assert_eq!(elems(&shard_of(&buf, 4, 4, 2).unwrap()), vec![0]);
        assert_eq!(elems(&shard_of(&buf, 4, 4, 3).unwrap()), vec![0]);
    }

    #[test]
    fn empty_buffer_gives_empty_shards() {
        assert_eq!(shard_of(&[], 2, 3, 2).unwrap(), Vec::<u8>::new());
        assert_eq!(reassemble(&[Vec::<u8>::new(), Vec::new()], 0).unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn bad_input_is_an_error() {
        assert_eq!(shard_of(&[1, 2, 3], 0, 2, 0), Err(ShardError::ZeroElemSize));
        assert_eq!(shard_of(&[1, 2, 3], 1, 0, 0), Err(ShardError::ZeroRanks));
        assert_eq!(shard_of(&[1, 2, 3], 1, 2, 2), Err(ShardError::RankOutOfRange { rank: 2, world: 2 }));
        assert_eq!(shard_of(&[1, 2, 3], 2, 2, 0), Err(ShardError::PartialElement { len: 3, elem_size: 2 }));
        assert_eq!(ShardSpec::new(u64::MAX - 1, 1, 4), Err(ShardError::Overflow { total: u64::MAX - 1, world: 4 }));
        assert_eq!(
            reassemble(&[vec![1, 2], vec![3]], 3),
            Err(ShardError::UnequalShards { index: 1, len: 1, expected: 2 })
        );
        assert_eq!(reassemble(&[vec![1], vec![3]], 3), Err(ShardError::TooShort { available: 2, total: 3 }));
        assert_eq!(reassemble::<Vec<u8>>(&[], 0), Err(ShardError::ZeroRanks));
        assert_eq!(
            ShardSpec::new(4, 1, 2).unwrap().shard(&[1, 2, 3], 0),
            Err(ShardError::TooShort { available: 3, total: 4 })
        );
    }

    proptest! {
        #[test]
        fn shards_round_trip(
            elem_size in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
            elems in 0usize..200,
            world in 1usize..=8,
            seed in any::<u8>(),
        ) {
            let bytes: Vec<u8> =
                (0..elems * elem_size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect();
            let spec = ShardSpec::new(bytes.len() as u64, elem_size as u64, world).unwrap();
            let shards: Vec<Vec<u8>> = (0..world).map(|r| shard_of(&bytes, elem_size, world, r).unwrap()).collect();
            for (r, s) in shards.iter().enumerate() {
                prop_assert_eq!(s.len() as u64, spec.shard_bytes());
                let range = spec.byte_ranges(r).unwrap()[0].clone();
                let held = (range.end - range.start) as usize;
                prop_assert_eq!(&s[..held], &bytes[range.start as usize..range.end as usize]);
                prop_assert!(s[held..].iter().all(|&b| b == 0));
            }
            prop_assert_eq!(spec.shard_elems(), (elems as u64).div_ceil(world as u64));
            prop_assert!(spec.padding_bytes() < world as u64 * elem_size as u64);
            let gathered: Vec<u8> = shards.concat();
            prop_assert_eq!(gathered.len() as u64, spec.padded_bytes());
            prop_assert!(gathered[bytes.len()..].iter().all(|&b| b == 0));
            prop_assert_eq!(reassemble(&shards, bytes.len()).unwrap(), bytes.clone());
            prop_assert_eq!(spec.chunk_count(), 1);
            prop_assert_eq!(spec.reassemble(&shards).unwrap(), bytes);
        }

        /// Chunked sharding: every rank's slice of a chunk has one length, each chunk's AllGather lands at the
        /// chunk's place, the padding is below `N` elements, and the shards reassemble exactly.
        #[test]
        fn chunked_shards_round_trip(
            elem_size in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
            elems in 0usize..300,
            world in 1usize..=8,
            chunk in prop::option::of(0u64..2000),
            seed in any::<u8>(),
        ) {
            let bytes: Vec<u8> =
                (0..elems * elem_size).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) | 1).collect();
            let spec = ShardSpec::chunked(bytes.len() as u64, elem_size as u64, world, chunk).unwrap();
            let shards: Vec<Vec<u8>> = (0..world).map(|r| spec.shard(&bytes, r).unwrap()).collect();
            let chunks: Vec<ShardChunk> = spec.chunks().collect();
            prop_assert_eq!(chunks.len() as u64, spec.chunk_count());
            prop_assert_eq!(chunks.iter().map(|c| c.shard_bytes).sum::<u64>(), spec.shard_bytes());
            let gathered = spec.gather(&shards).unwrap();
            prop_assert_eq!(gathered.len() as u64, spec.padded_bytes());
            for c in &chunks {
                // The AllGather of chunk c's slices (rank order) is the buffer's bytes at the chunk's place.
                let one: Vec<u8> = shards
                    .iter()
                    .flat_map(|s| s[c.shard_offset as usize..(c.shard_offset + c.shard_bytes) as usize].to_vec())
                    .collect();
                let at = c.gathered_offset as usize;
                prop_assert_eq!(&gathered[at..at + one.len()], &one[..]);
                prop_assert_eq!(c.shard_bytes % elem_size as u64, 0);
            }
            prop_assert!(spec.padding_bytes() < world as u64 * elem_size as u64);
            prop_assert!(gathered[bytes.len()..].iter().all(|&b| b == 0));
            prop_assert_eq!(spec.reassemble(&shards).unwrap(), bytes);
        }
    }

    #[test]
    fn chunked_layout_is_chunk_major() {
        // 10 u32 elements (100..110) over 2 ranks in chunks of 3 elements per rank (24 gathered bytes): chunks of
        // 6, then 4 elements; rank 0 holds [100 101 102 | 106 107], rank 1 [103 104 105 | 108 109].
        let buf = numbered(10);
        let spec = ShardSpec::chunked(40, 4, 2, Some(24)).unwrap();
        assert_eq!(spec.chunk_count(), 2);
        let chunks: Vec<ShardChunk> = spec.chunks().collect();
        assert_eq!(
            chunks,
            vec![
                ShardChunk { index: 0, shard_offset: 0, shard_bytes: 12, gathered_offset: 0 },
                ShardChunk { index: 1, shard_offset: 12, shard_bytes: 8, gathered_offset: 24 },
            ]
        );
        assert_eq!(elems(&spec.shard(&buf, 0).unwrap()), vec![100, 101, 102, 106, 107]);
        assert_eq!(elems(&spec.shard(&buf, 1).unwrap()), vec![103, 104, 105, 108, 109]);
        assert_eq!(spec.byte_ranges(1).unwrap(), vec![12..24, 32..40]);
        // 11 elements: the last chunk (5 elements) pads rank 1's slice with one zero element.
        let spec = ShardSpec::chunked(44, 4, 2, Some(24)).unwrap();
        let buf = numbered(11);
        assert_eq!(elems(&spec.shard(&buf, 1).unwrap()), vec![103, 104, 105, 109, 110, 0]);
        assert_eq!((spec.shard_bytes(), spec.padding_bytes()), (24, 4));
        let shards = [spec.shard(&buf, 0).unwrap(), spec.shard(&buf, 1).unwrap()];
        assert_eq!(spec.reassemble(&shards).unwrap(), buf);
    }

    #[test]
    fn chunk_sizes_round_down_to_aligned_whole_elements() {
        // 4096 gathered bytes over 3 ranks: 1365 bytes per rank, rounded down to 1280 (5 × 256), 640 bf16 elements.
        let spec = ShardSpec::chunked(2 * 10_000, 2, 3, Some(4096)).unwrap();
        assert_eq!(spec.chunks().next().unwrap().shard_bytes, 1280);
        // Below the alignment: whole elements, at least one.
        assert_eq!(ShardSpec::chunked(400, 4, 2, Some(20)).unwrap().chunks().next().unwrap().shard_bytes, 8);
        assert_eq!(ShardSpec::chunked(400, 4, 2, Some(1)).unwrap().chunks().next().unwrap().shard_bytes, 4);
        assert_eq!(ShardSpec::chunked(400, 4, 2, Some(1)).unwrap().chunk_count(), 50);
        // No chunk, a zero chunk, or a chunk larger than the buffer: the unchunked layout.
        for chunk in [None, Some(0), Some(400), Some(1 << 40)] {
            assert_eq!(ShardSpec::chunked(400, 4, 2, chunk).unwrap(), ShardSpec::new(400, 4, 2).unwrap(), "{chunk:?}");
        }
        assert_eq!(ShardSpec::chunked(0, 4, 2, Some(8)).unwrap().chunk_count(), 1);
    }

    #[test]
    fn gather_rejects_bad_shards() {
        let spec = ShardSpec::chunked(40, 4, 2, Some(24)).unwrap();
        assert_eq!(spec.gather(&[vec![0u8; 20]]), Err(ShardError::WrongShardCount { got: 1, world: 2 }));
        assert_eq!(
            spec.gather(&[vec![0u8; 20], vec![0u8; 16]]),
            Err(ShardError::UnequalShards { index: 1, len: 16, expected: 20 })
        );
    }
}
