//! Invariants 1 and 2 where a static schedule wraps into its next pass (what a captured or compiled forward
//! replays): with `static_slots` block `k` always takes slot `k mod slots`, so the first block of the next pass is
//! copied into the slot the last blocks of this pass read, and that copy still waits for their last use, and its
//! compute for the copy.
//!
//! Model: 4 streamed blocks, depth 1, static (2 slots: blocks 0 and 2 in slot 0, 1 and 3 in slot 1); the engine runs
//! block 2 (which prefetches block 3 into slot 1), then block 0 of the next pass: block 0's copy goes into slot 0,
//! which block 2's kernel read. Block 0 must land where block 2 did. (Running block 3 between
//! them as well explores 839k executions in 66 s; this shape keeps the same reuse at a fraction.)
//!
//! Threads: engine, stream actor, device.
#![cfg(weightferry_loom)]

use weightferry_actors::{OrderingFault, StreamOptions};
use weightferry_loom::{model, ModelConfig, Rig};

/// Runs blocks 2 and 0 of a 4-block static stack, checking every kernel read its own block's bytes (the platform's
/// hazard check) and that block 0 of the next pass landed in block 2's slot.
fn wrap(fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(4, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.static_stack(1, fault);
        let mut places = Vec::new();
        for b in [2, 0] {
            let loc = stack.pre_forward(b).expect("pre_forward");
            rig.platform.enqueue_kernel(rig.compute, loc, Rig::bytes_of(b), format!("block {b}"));
            stack.post_forward(b).expect("post_forward");
            places.push(loc);
        }
        rig.finish();
        assert_eq!(places[0], places[1], "blocks 2 and 0 share slot 0 in a static schedule");
        assert_eq!(rig.platform.kernels_run(), 2);
    });
}

#[test]
fn the_next_pass_reuses_a_static_slot_after_its_last_use() {
    wrap(OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard overwrite-before-last-use")]
fn broken_wrap_without_last_use_wait_is_caught() {
    wrap(OrderingFault::SkipLastUseWait);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard read-before-ready")]
fn broken_wrap_reading_before_the_copy_is_caught() {
    wrap(OrderingFault::SkipReadyWait);
}
