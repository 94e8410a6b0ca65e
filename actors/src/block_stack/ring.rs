//! The ring: which blocks stay resident, the slots the others stream through, the prefetch window and the victim
//! choice. Pure bookkeeping — no platform call, no lock, no load path — so what a hook decides (which block goes
//! into which slot, under which ticket, and which blocks to prefetch) is tested here, apart from how the bytes get
//! there.

use crate::slot::{SlotError, SlotState, SlotTable, Ticket};

/// What `pre_forward` found in the slot that holds its block (for the stack's counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// A released slot still holds the block: no copy needed.
    Reused,
    /// A prefetch filled (or is filling) the slot.
    Prefetched,
    /// A synchronous fetch filled the slot.
    Fetched,
}

/// Slots a stack of `streaming` streamed blocks needs at prefetch depth `depth`: `depth + 1` (the block in use and
/// `depth` prefetched), at most one per streamed block, none when nothing streams. With `static_slots`, the smallest
/// count of at least `depth + 1` that divides `streaming`, so that block `k` of the streamed blocks can take slot
/// `k mod slots` on every pass: the wrap into the next pass keeps the mapping (with 10 blocks, depth 2 takes 5
/// slots, depth 1 takes 2). The planner counts slots with this function too.
pub fn slot_count(streaming: usize, depth: usize, static_slots: bool) -> usize {
    if streaming == 0 {
        return 0;
    }
    let least = (depth + 1).min(streaming);
    if !static_slots {
        return least;
    }
    (least..=streaming).find(|s| streaming % s == 0).unwrap_or(streaming)
}

/// The residency of one stack's blocks and the slot table of its streamed ones.
#[derive(Debug)]
pub(super) struct Ring {
    /// Per block: kept resident (never streamed).
    resident: Vec<bool>,
    /// A static schedule: per block, the one slot it always takes (`None` for resident blocks); empty otherwise.
    static_slot: Vec<Option<usize>>,
    /// Streamed blocks prefetched ahead (0: staged, one slot, loads only on demand).
    depth: usize,
    /// The slots of the streamed blocks.
    pub(super) table: SlotTable,
    /// Per slot: filled by a prefetch (vs. a synchronous fetch) and not yet used.
    prefetched: Vec<bool>,
    /// The ticket the next load gets (resident-head loads included).
    next_ticket: Ticket,
}

impl Ring {
    /// Slots a ring over these blocks needs ([`slot_count`] of its streamed blocks).
    pub(super) fn slot_count(resident: &[bool], depth: usize, static_slots: bool) -> usize {
        slot_count(resident.iter().filter(|r| !**r).count(), depth, static_slots)
    }

    /// A ring over `resident.len()` blocks with [`Ring::slot_count`] free slots; tickets start at 1. With
    /// `static_slots` block `k` of the streamed blocks always takes slot `k mod slots`.
    pub(super) fn new(resident: Vec<bool>, depth: usize, static_slots: bool) -> Ring {
        let slots = Self::slot_count(&resident, depth, static_slots);
        let static_slot = if static_slots && slots > 0 {
            let mut k = 0;
            resident
                .iter()
                .map(|r| {
                    (!r).then(|| {
                        k += 1;
                        (k - 1) % slots
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        let prefetched = vec![false; slots];
        Ring { resident, static_slot, depth, table: SlotTable::new(slots), prefetched, next_ticket: 1 }
    }

    /// Whether block `i` is kept resident.
    pub(super) fn is_resident(&self, i: usize) -> bool {
        self.resident[i]
    }

    /// Whether any block is kept resident.
    pub(super) fn has_resident(&self) -> bool {
        self.resident.iter().any(|r| *r)
    }

    /// Takes the next ticket.
    pub(super) fn take_ticket(&mut self) -> Ticket {
        let t = self.next_ticket;
        self.next_ticket += 1;
        t
    }

    /// The last ticket taken (0 before any).
    #[cfg(any(test, weightferry_broken))]
    pub(super) fn last_ticket(&self) -> Ticket {
        self.next_ticket - 1
    }

    /// Streamed blocks after `from` (or from the start of the ring when `None`), wrapping into the next pass, at
    /// most `depth` of them and never `from` itself.
    pub(super) fn upcoming(&self, from: Option<usize>) -> Vec<usize> {
        let n = self.resident.len();
        let streaming = self.resident.iter().filter(|r| !**r).count();
        let mut out = Vec::new();
        if streaming == 0 || self.depth == 0 {
            return out;
        }
        let mut i = from.unwrap_or(n - 1);
        for _ in 0..n {
            i = (i + 1) % n;
            if self.resident[i] {
                continue;
            }
            if Some(i) == from {
                break;
            }
            out.push(i);
            if out.len() == self.depth || out.len() == streaming {
                break;
            }
        }
        out
    }

    /// The prefetch window after `from` and the blocks whose slots a prefetch must keep (the window and `from`).
    pub(super) fn window(&self, from: Option<usize>) -> (Vec<usize>, Vec<usize>) {
        let window = self.upcoming(from);
        let mut keep = window.clone();
        keep.extend(from);
        (window, keep)
    }

    /// The slot a load of `block` would go into, keeping the slots of `keep`: under a static schedule the block's
    /// own slot when no block of `keep` holds it and it is neither in use nor loading (always, when the engine runs
    /// the blocks in order); otherwise the table's choice ([`SlotTable::choose_victim`]), so a block called out of
    /// order still loads (into another slot: that pass is not static).
    pub(super) fn victim(&self, block: usize, keep: &[usize]) -> Option<usize> {
        if let Some(&Some(s)) = self.static_slot.get(block) {
            let state = self.table.state(s);
            let reusable = matches!(state, SlotState::Free | SlotState::Ready { .. } | SlotState::Releasing { .. });
            if reusable && state.block().is_none_or(|b| !keep.contains(&b)) {
                return Some(s);
            }
        }
        self.table.choose_victim(keep)
    }

    /// `Loading → Ready` for every slot whose load `recorded` says is enqueued: a prefetched block the engine then
    /// skipped must become a victim candidate again.
    pub(super) fn promote(&mut self, recorded: impl Fn(Ticket) -> bool) {
        for s in 0..self.table.len() {
            if let SlotState::Loading { ticket, .. } = self.table.state(s) {
                if recorded(ticket) {
                    let _ = self.table.mark_ready(s, ticket);
                }
            }
        }
    }

    /// Starts a load of `block` into slot `s` under a new ticket (a prefetch or a synchronous fetch).
    pub(super) fn begin(&mut self, s: usize, block: usize, prefetch: bool) -> Result<Ticket, SlotError> {
        let ticket = self.take_ticket();
        self.table.begin_load(s, block, ticket)?;
        self.prefetched[s] = prefetch;
        Ok(ticket)
    }

    /// The oldest `Loading` slot's ticket outside `keep`, if any (a synchronous fetch can wait for it).
    pub(super) fn oldest_loading(&self, keep: &[usize]) -> Option<Ticket> {
        self.table
            .states()
            .iter()
            .filter_map(|st| match *st {
                SlotState::Loading { block, ticket } if !keep.contains(&block) => Some(ticket),
                _ => None,
            })
            .min()
    }

    /// The slot holding (or loading) `block` for `pre_forward`, and how it was filled; the slot's prefetch mark is
    /// cleared (it is about to be used). A block already in use is a protocol error.
    pub(super) fn claim(&mut self, block: usize) -> Result<Option<(usize, Found)>, SlotError> {
        let Some(s) = self.table.slot_of(block) else { return Ok(None) };
        let found = match self.table.state(s) {
            state @ SlotState::InUse { .. } => {
                return Err(SlotError {
                    slot: s,
                    action: "be acquired twice (pre_forward without post_forward)",
                    state,
                })
            }
            SlotState::Releasing { .. } => Found::Reused,
            _ if self.prefetched[s] => Found::Prefetched,
            _ => Found::Fetched,
        };
        Ok(Some((s, found)))
    }

    /// Clears slot `s`'s prefetch mark.
    pub(super) fn unmark_prefetched(&mut self, s: usize) {
        self.prefetched[s] = false;
    }

    /// Every slot back to `Free` (a slot in use is released first): the caller observed every completion, or
    /// deliberately did not (`OrderingFault::FreeWithoutSync`).
    pub(super) fn free_all(&mut self) {
        for s in 0..self.table.len() {
            if let SlotState::InUse { block, .. } = self.table.state(s) {
                let _ = self.table.release(s, block);
            }
            let _ = self.table.free(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(resident: &[bool], depth: usize) -> Ring {
        Ring::new(resident.to_vec(), depth, false)
    }

    #[test]
    fn slot_count_is_depth_plus_one_bounded_by_the_streamed_blocks() {
        assert_eq!(Ring::slot_count(&[false; 5], 2, false), 3);
        assert_eq!(Ring::slot_count(&[false; 2], 4, false), 2);
        assert_eq!(Ring::slot_count(&[true, false, false], 0, false), 1);
        assert_eq!(Ring::slot_count(&[true, true], 3, false), 0);
    }

    #[test]
    fn a_static_slot_count_divides_the_streamed_blocks() {
        assert_eq!(slot_count(10, 1, true), 2);
        assert_eq!(slot_count(10, 2, true), 5);
        assert_eq!(slot_count(10, 2, false), 3);
        assert_eq!(slot_count(6, 2, true), 3);
        assert_eq!(slot_count(7, 1, true), 7, "a prime count: one slot per block");
        assert_eq!(slot_count(4, 6, true), 4);
        assert_eq!(slot_count(3, 0, true), 1, "staged");
        assert_eq!(slot_count(0, 2, true), 0);
        assert_eq!(Ring::slot_count(&[true, false, false, false, false], 1, true), 2);
    }

    /// Runs `passes` passes of `r`'s blocks in order as the stack does (a load into the victim slot for every block
    /// of the window, then the block's use): the slot each block was loaded into, per load.
    fn run_passes(r: &mut Ring, passes: usize) -> Vec<(usize, usize)> {
        let mut loads = Vec::new();
        let streamed: Vec<usize> = (0..r.resident.len()).filter(|&b| !r.is_resident(b)).collect();
        for _ in 0..passes {
            for &b in &streamed {
                let (window, keep) = r.window(Some(b));
                for j in std::iter::once(b).chain(window) {
                    if r.table.slot_of(j).is_none() {
                        let s = r.victim(j, &keep).expect("a slot for every load of an in-order pass");
                        let ticket = r.begin(s, j, j != b).unwrap();
                        r.table.mark_ready(s, ticket).unwrap();
                        loads.push((j, s));
                    }
                }
                let (s, _) = r.claim(b).unwrap().unwrap();
                r.table.acquire(s, b).unwrap();
                r.table.release(s, b).unwrap();
            }
        }
        loads
    }

    #[test]
    fn under_a_static_schedule_every_block_takes_its_own_slot_on_every_pass() {
        // A resident head and 6 streamed blocks at depth 1 (2 slots) and 2 (3 slots): block k of the streamed ones
        // always in slot k mod slots, the prefetch wrapping into the next pass included.
        for (depth, slots) in [(1, 2), (2, 3)] {
            let mut r = Ring::new(vec![true, false, false, false, false, false, false], depth, true);
            assert_eq!(r.table.len(), slots);
            let loads = run_passes(&mut r, 3);
            assert!(loads.len() >= 18, "{loads:?}");
            assert!(loads.iter().all(|&(b, s)| s == (b - 1) % slots), "depth {depth}: {loads:?}");
        }
        // The same ring without the static schedule: 6 blocks in 3 slots still cycle, but 4 in 3 do not.
        let mut r = Ring::new(vec![false; 4], 2, false);
        let loads = run_passes(&mut r, 3);
        assert!(loads.iter().any(|&(b, s)| s != b % 3), "{loads:?}");
        let mut r = Ring::new(vec![false; 4], 2, true);
        assert_eq!(r.table.len(), 4);
        assert!(run_passes(&mut r, 3).iter().all(|&(b, s)| s == b));
    }

    #[test]
    fn a_block_whose_static_slot_is_busy_loads_elsewhere() {
        let mut r = Ring::new(vec![false; 4], 1, true);
        // Block 0 in use in slot 0: block 2 (also slot 0's) called out of order takes the free slot 1.
        let t = r.begin(0, 0, false).unwrap();
        r.table.mark_ready(0, t).unwrap();
        r.table.acquire(0, 0).unwrap();
        assert_eq!(r.victim(2, &[0]), Some(1));
        assert_eq!(r.victim(1, &[0]), Some(1));
    }

    #[test]
    fn the_window_wraps_into_the_next_pass_and_skips_resident_blocks() {
        let r = ring(&[true, false, false, true, false], 2);
        assert_eq!(r.upcoming(None), vec![1, 2]);
        assert_eq!(r.upcoming(Some(2)), vec![4, 1]);
        assert_eq!(r.upcoming(Some(4)), vec![1, 2]);
        // From a resident block: the next streamed ones.
        assert_eq!(r.upcoming(Some(3)), vec![4, 1]);
        // Never the block itself, even when the depth covers the whole ring.
        let r = ring(&[false, false, false], 5);
        assert_eq!(r.upcoming(Some(1)), vec![2, 0]);
        assert_eq!(r.upcoming(None), vec![0, 1, 2]);
        assert_eq!(r.window(Some(1)), (vec![2, 0], vec![2, 0, 1]));
        assert_eq!(r.window(None), (vec![0, 1, 2], vec![0, 1, 2]));
    }

    #[test]
    fn a_staged_or_fully_resident_ring_prefetches_nothing() {
        assert!(ring(&[false, false], 0).upcoming(None).is_empty());
        assert!(ring(&[true, true], 2).upcoming(Some(0)).is_empty());
    }

    #[test]
    fn loads_take_increasing_tickets_and_claims_report_how_a_slot_was_filled() {
        let mut r = ring(&[true, false, false], 1);
        assert_eq!(r.take_ticket(), 1, "the resident head's load");
        let s = r.victim(2, &[1]).unwrap();
        assert_eq!(r.begin(s, 1, true), Ok(2));
        assert_eq!(r.last_ticket(), 2);
        assert_eq!(r.claim(1), Ok(Some((s, Found::Prefetched))));
        r.unmark_prefetched(s);
        assert_eq!(r.claim(1), Ok(Some((s, Found::Fetched))));
        assert_eq!(r.claim(2), Ok(None));
        r.table.mark_ready(s, 2).unwrap();
        r.table.acquire(s, 1).unwrap();
        let e = r.claim(1).unwrap_err();
        assert_eq!(e.action, "be acquired twice (pre_forward without post_forward)");
        r.table.release(s, 1).unwrap();
        assert_eq!(r.claim(1), Ok(Some((s, Found::Reused))));
    }

    #[test]
    fn recorded_loads_become_victims_again_and_the_oldest_loading_is_found() {
        let mut r = ring(&[false, false, false], 1);
        let a = r.begin(0, 0, true).unwrap();
        let b = r.begin(1, 1, true).unwrap();
        assert_eq!(r.victim(2, &[2]), None, "both slots are loading");
        assert_eq!(r.oldest_loading(&[2]), Some(a));
        assert_eq!(r.oldest_loading(&[0]), Some(b));
        r.promote(|t| t == a);
        assert_eq!(r.table.state(0), SlotState::Ready { block: 0, ticket: a });
        assert_eq!(r.victim(2, &[2]), Some(0));
        r.table.mark_ready(1, b).unwrap();
        r.table.acquire(1, 1).unwrap();
        r.free_all();
        assert!(r.table.states().iter().all(|s| *s == SlotState::Free));
    }
}
