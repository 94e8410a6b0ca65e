//! [`StackPlan`]: what the plan decides for one block stack (its blocks and their device bytes, which stay
//! resident, how deep the ring prefetches) and what that costs on the device.

use serde::Serialize;

/// Default prefetch depth when the config sets none and no budget forces a choice.
pub(crate) const DEFAULT_PREFETCH_DEPTH: u32 = 2;

/// The plan of one block stack: an ordered list of blocks streamed through one ring, split into the blocks that
/// stay resident and those that stream, with the ring's prefetch depth. (The scheduler's running stack is
/// `weightferry_actors::BlockStack`; the plan report's row for it is [`PlanStack`](super::report::PlanStack).)
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StackPlan {
    /// Display name: the owning component path and its block-list attributes.
    pub name: String,
    /// Block-list attribute paths relative to the owner, in execution order.
    pub attrs: Vec<String>,
    /// Full dotted path of every block, in execution order.
    pub blocks: Vec<String>,
    /// Device bytes of each block (its distinct storages, each aligned as the device layout packs them; after
    /// budgeting, less the storages another unit holds too, which the backend pins to the fixed placement).
    pub block_bytes: Vec<u64>,
    /// Number of blocks kept resident on the device: the leading ones, unless `resident_mask` says which.
    pub resident_head: usize,
    /// Exactly which blocks stay resident, when the device-budget planner spread them along the stack (the
    /// explicit `resident_layers` always keeps a leading head and leaves this `None`).
    pub resident_mask: Option<Vec<bool>>,
    /// How many blocks ahead the ring prefetches.
    pub prefetch_depth: u32,
    /// A static schedule: every streamed block in the same slot on every pass (`static_slots`; the slot count then
    /// divides the streamed blocks).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub static_slots: bool,
}

impl StackPlan {
    /// Whether block `i` stays resident.
    pub fn is_resident(&self, i: usize) -> bool {
        match &self.resident_mask {
            Some(m) => m.get(i).copied().unwrap_or(false),
            None => i < self.resident_head,
        }
    }
    /// Per block: resident.
    pub fn resident_flags(&self) -> Vec<bool> {
        (0..self.blocks.len()).map(|i| self.is_resident(i)).collect()
    }
    /// Blocks kept resident.
    pub fn resident(&self) -> Vec<String> {
        self.blocks.iter().enumerate().filter(|(i, _)| self.is_resident(*i)).map(|(_, b)| b.clone()).collect()
    }
    /// Blocks streamed through the ring.
    pub fn streaming(&self) -> Vec<String> {
        self.blocks.iter().enumerate().filter(|(i, _)| !self.is_resident(*i)).map(|(_, b)| b.clone()).collect()
    }
    /// Largest streamed block, in bytes (0 when nothing streams).
    pub fn max_streaming_block_bytes(&self) -> u64 {
        self.block_bytes.iter().enumerate().filter(|(i, _)| !self.is_resident(*i)).map(|(_, b)| *b).max().unwrap_or(0)
    }
    /// Bytes of the resident blocks.
    pub fn resident_bytes(&self) -> u64 {
        self.block_bytes
            .iter()
            .enumerate()
            .filter(|(i, _)| self.is_resident(*i))
            .fold(0u64, |a, (_, &b)| a.saturating_add(b))
    }
    /// Device slots the ring needs: depth + 1 (capped by the streaming length), or 0 when nothing streams; under a
    /// static schedule the smallest count of at least that which divides the streamed blocks (the scheduler's own
    /// count: [`weightferry_actors::block_stack::slot_count`]).
    pub fn slot_count(&self) -> usize {
        let streaming = (0..self.blocks.len()).filter(|&i| !self.is_resident(i)).count();
        weightferry_actors::block_stack::slot_count(streaming, self.prefetch_depth as usize, self.static_slots)
    }
    /// Bytes the ring copies host-to-device on each forward pass once warm: every streamed block once when the ring
    /// has fewer slots than streamed blocks (each pass evicts the blocks the next one starts with), none when every
    /// streamed block keeps a slot of its own.
    pub fn pass_h2d_bytes(&self) -> u64 {
        let streaming = (0..self.blocks.len()).filter(|&i| !self.is_resident(i)).count();
        if self.slot_count() >= streaming {
            return 0;
        }
        self.block_bytes.iter().enumerate().filter(|(i, _)| !self.is_resident(*i)).map(|(_, b)| *b).sum()
    }
    /// Device bytes of the ring's slots.
    pub fn slot_bytes(&self) -> u64 {
        (self.slot_count() as u64).saturating_mul(self.max_streaming_block_bytes())
    }
}
