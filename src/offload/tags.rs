//! The tags of a distributed backend's AllGathers: every rank computes the same tag for the same gather from the
//! plan alone, so the ranks' gathers pair up (invariant 4). A block gather's tag numbers its stack, unit, section
//! and chunk ([`tag_of`]); a restore gather's is the same with [`RESTORE_TAG`] set ([`restore_tag`]), which no
//! block gather sets while a run has at most [`MAX_STACKS`] gathered stacks.

use weightferry_actors::collective_actor::WARM_UP_TAG;

/// Tag of chunk `j` of section `k` of unit `ui` of gathered stack `gi`: equal on every rank, distinct per gather
/// (chunks stay below 2^20, sections below 2^8, units below 2^24).
pub(crate) fn tag_of(gi: usize, ui: usize, k: usize, j: u64) -> u64 {
    ((gi as u64 + 1) << 52) | ((ui as u64) << 28) | ((k as u64) << 20) | j
}

/// Bit set in the tag of every restore AllGather (block gathers of fewer than 1023 stacks never set it).
pub const RESTORE_TAG: u64 = 1 << 62;

/// Most DiT stacks a run may have so that block-gather tags never carry [`RESTORE_TAG`].
pub(crate) const MAX_STACKS: usize = 1022;

/// Tag of the restore AllGather of chunk `j` of section `k` of unit `ui` of stack `si`: the block gather's tag with
/// [`RESTORE_TAG`] set; equal on every rank.
pub(crate) fn restore_tag(si: usize, ui: usize, k: usize, j: u64) -> u64 {
    tag_of(si, ui, k, j) | RESTORE_TAG
}

/// Whether `tag` is the tag of a restore AllGather (not a block gather, not the warm-up).
pub fn is_restore_tag(tag: u64) -> bool {
    tag != WARM_UP_TAG && tag & RESTORE_TAG != 0
}
