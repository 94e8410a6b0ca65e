//! Sharding math of distributed layerwise offload: how one flat buffer (one block's section of one dtype) is split
//! into equal per-rank shards and put back together.
//!
//! A buffer of `T` elements of `elem_size` bytes over `N` ranks gives every rank a shard of `s = ceil(T / N)`
//! elements; rank `r` holds elements `[r·s, (r+1)·s)` of the buffer, zero-padded at the end where that range runs
//! past `T`. An AllGather of the `N` shards (rank order) therefore yields the buffer followed by `N·s − T` zero
//! elements, and trimming to `T` gives the buffer back.
//!
//! Invariant: every shard of one [`ShardSpec`] has the same length (`shard_bytes`), and
//! `reassemble(shard_of(b, e, n, 0..n), b.len()) == b` for every valid input; bad input (zero element size, zero
//! ranks, a rank outside the group, a length that is not a whole number of elements, shards of unequal or too small
//! length) is a [`ShardError`], never a panic.

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
    /// A size overflows the address space.
    #[error("sharding {total} bytes over {world} ranks overflows")]
    Overflow {
        /// Bytes in the buffer.
        total: u64,
        /// Ranks in the group.
        world: usize,
    },
}

/// The shape of one sharded buffer: its length, its element size and the group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    total_bytes: u64,
    elem_size: u64,
    world: usize,
}

impl ShardSpec {
    /// A buffer of `total_bytes` bytes of `elem_size`-byte elements sharded over `world` ranks.
    pub fn new(total_bytes: u64, elem_size: u64, world: usize) -> Result<ShardSpec, ShardError> {
        if elem_size == 0 {
            return Err(ShardError::ZeroElemSize);
        }
        if world == 0 {
            return Err(ShardError::ZeroRanks);
        }
        if total_bytes % elem_size != 0 {
            return Err(ShardError::PartialElement { len: total_bytes, elem_size });
        }
        let spec = ShardSpec { total_bytes, elem_size, world };
        // Every later size computation stays below `padded_bytes`, so checking it once makes them all safe.
        spec.shard_elems()
            .checked_mul(elem_size)
            .and_then(|b| b.checked_mul(world as u64))
            .ok_or(ShardError::Overflow { total: total_bytes, world })?;
        Ok(spec)
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

    /// Elements per shard: `ceil(T / N)`.
    pub fn shard_elems(&self) -> u64 {
        self.total_elems().div_ceil(self.world as u64)
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

    /// The byte range of the unsharded buffer that rank `rank` holds (shorter than `shard_bytes`, possibly
    /// empty, for ranks whose shard is padded).
    pub fn byte_range(&self, rank: usize) -> Result<std::ops::Range<u64>, ShardError> {
        if rank >= self.world {
            return Err(ShardError::RankOutOfRange { rank, world: self.world });
        }
        let start = (rank as u64 * self.shard_bytes()).min(self.total_bytes);
        let end = ((rank as u64 + 1) * self.shard_bytes()).min(self.total_bytes);
        Ok(start..end)
    }

    /// Rank `rank`'s shard of `bytes` (which must be `total_bytes` long), zero-padded to `shard_bytes`.
    pub fn shard(&self, bytes: &[u8], rank: usize) -> Result<Vec<u8>, ShardError> {
        if bytes.len() as u64 != self.total_bytes {
            return Err(ShardError::TooShort { available: bytes.len() as u64, total: self.total_bytes });
        }
        let range = self.byte_range(rank)?;
        let mut out = vec![0u8; self.shard_bytes() as usize];
        let held = &bytes[range.start as usize..range.end as usize];
        out[..held.len()].copy_from_slice(held);
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
        assert_eq!(ShardSpec::new(32, 4, 4).unwrap().byte_range(1).unwrap(), 8..16);
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
        assert_eq!(spec.byte_range(2).unwrap(), 8..8);
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
                let range = spec.byte_range(r).unwrap();
                let held = (range.end - range.start) as usize;
                prop_assert_eq!(&s[..held], &bytes[range.start as usize..range.end as usize]);
                prop_assert!(s[held..].iter().all(|&b| b == 0));
            }
            prop_assert_eq!(spec.shard_elems(), (elems as u64).div_ceil(world as u64));
            prop_assert!(spec.padding_bytes() < world as u64 * elem_size as u64);
            let gathered: Vec<u8> = shards.concat();
            prop_assert_eq!(gathered.len() as u64, spec.padded_bytes());
            prop_assert!(gathered[bytes.len()..].iter().all(|&b| b == 0));
            prop_assert_eq!(reassemble(&shards, bytes.len()).unwrap(), bytes);
        }
    }
}
