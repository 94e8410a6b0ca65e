//! Invariant 2, no early reuse: a slot is not overwritten before the last use of the compute that read it completed
//! (the copy into a released slot waits on the device for the slot's last-use event).
//!
//! Models (one pass, stopped once the first slot has been re-targeted):
//! - depth 1: 3 streamed blocks, 2 slots; `pre_forward(1)` prefetches block 2 into block 0's released slot.
//! - depth 2: 4 streamed blocks, 3 slots; `pre_forward(1)` prefetches block 3 into block 0's released slot.
//! - resident head: 1 resident block (loaded and fenced at creation) + 3 streamed blocks, depth 1; the engine runs
//!   blocks 1 and 2, and `pre_forward(2)` prefetches block 3 into block 1's released slot.
//!
//! Threads: engine, stream actor, device.
#![cfg(weightferry_loom)]

use weightferry_actors::{OrderingFault, StreamOptions};
use weightferry_loom::{model, ModelConfig, Rig};

/// Runs blocks `first..first + steps` of an `n`-block stack, then checks every kernel read its own block's bytes.
fn pass(n: usize, head: usize, depth: usize, first: usize, steps: usize, fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(n, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack(head, depth, fault);
        for b in first..first + steps {
            rig.run_block(&stack, b);
        }
        rig.finish();
        assert_eq!(rig.platform.kernels_run(), steps as u32);
    });
}

#[test]
fn reuse_waits_for_last_use_depth_1() {
    pass(3, 0, 1, 0, 2, OrderingFault::None);
}

#[test]
fn reuse_waits_for_last_use_depth_2() {
    pass(4, 0, 2, 0, 2, OrderingFault::None);
}

#[test]
fn reuse_waits_for_last_use_with_resident_head() {
    pass(4, 1, 1, 1, 2, OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard overwrite-before-last-use")]
fn broken_reuse_without_last_use_wait_is_caught_depth_1() {
    pass(3, 0, 1, 0, 2, OrderingFault::SkipLastUseWait);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard overwrite-before-last-use")]
fn broken_reuse_without_last_use_wait_is_caught_depth_2() {
    pass(4, 0, 2, 0, 2, OrderingFault::SkipLastUseWait);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard overwrite-before-last-use")]
fn broken_reuse_without_last_use_wait_is_caught_with_resident_head() {
    pass(4, 1, 1, 1, 2, OrderingFault::SkipLastUseWait);
}
