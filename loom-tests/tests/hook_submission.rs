//! Invariants 1–3 with hook submission (`Submission::Hook`): the engine thread enqueues every streamed load itself
//! (GPU-side wait on the slot's last-use event, the copy, the record of the ready event) under the stack's lock,
//! and completions are polled at the hooks instead of watched. The stream actor still runs (it would load a
//! resident head) but gets no streamed load.
//!
//! Models (eager prefetch, one pass):
//! - readiness and reuse, depth 1: 3 streamed blocks, 2 slots; the engine runs blocks 0, 1, 2. Every kernel reads
//!   its block's bytes (use follows readiness), and `pre_forward(1)` enqueues block 2 into block 0's released slot
//!   (no early reuse).
//! - reuse, depth 2: 4 streamed blocks, 3 slots; blocks 0–1 run, and `pre_forward(1)` enqueues block 3 into block 0's
//!   released slot.
//! - fence: 2 streamed blocks, depth 1; the fence right after the eager prefetch, or after block 0 ran (prefetching
//!   block 1): nothing may be pending on the copy or compute stream when it returns, and every load's completion
//!   has been observed.
//! - broken: `SkipReadyWait` → `hazard read-before-ready`; `SkipLastUseWait` → `hazard overwrite-before-last-use`;
//!   `FenceOnRecord` (the fence stops once the loads are recorded, which in hook mode is at once; right after the
//!   eager prefetch, when no last-use event is there to wait on) → "fence replied before earlier loads completed".
//!
//! Threads: engine, stream actor (idle), device.
#![cfg(weightferry_loom)]

use weightferry_actors::{OrderingFault, StreamOptions, Submission};
use weightferry_loom::{model, ModelConfig, Rig};

/// Runs blocks `0..steps` of an `n`-block stack at `depth` in hook mode; checks every kernel read its own bytes.
fn pass(n: usize, depth: usize, steps: usize, fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(n, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack_in(Submission::Hook, 0, depth, fault);
        for b in 0..steps {
            rig.run_block(&stack, b);
        }
        rig.finish();
        assert_eq!(rig.platform.kernels_run(), steps as u32);
    });
}

/// 2 streamed blocks at depth 1 in hook mode: the engine runs `steps` blocks, then fences.
fn fence_after_prefetch(steps: usize, fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(2, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack_in(Submission::Hook, 0, 1, fault);
        for b in 0..steps {
            rig.run_block(&stack, b);
        }
        stack.fence().expect("fence");
        let pending_copies = rig.platform.pending_ops(rig.stream.stream());
        let pending_compute = rig.platform.pending_ops(rig.compute);
        let st = stack.stats();
        // Let every other loom thread exit before a failed check unwinds this one.
        rig.finish();
        assert_eq!(pending_copies, 0, "fence replied before earlier loads completed");
        assert_eq!(pending_compute, 0, "fence replied before the last use completed");
        if fault == OrderingFault::None {
            assert_eq!(st.completions, st.loads, "the fence observed every load's completion");
        }
    });
}

#[test]
fn hook_mode_use_follows_readiness_and_reuse_waits_for_last_use_depth_1() {
    pass(3, 1, 3, OrderingFault::None);
}

#[test]
fn hook_mode_reuse_waits_for_last_use_depth_2() {
    pass(4, 2, 2, OrderingFault::None);
}

#[test]
fn hook_mode_fence_follows_earlier_loads() {
    fence_after_prefetch(1, OrderingFault::None);
}

#[test]
fn hook_mode_fence_right_after_the_eager_prefetch_follows_it() {
    fence_after_prefetch(0, OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard read-before-ready")]
fn broken_hook_mode_compute_skipping_the_ready_wait_is_caught() {
    pass(3, 1, 3, OrderingFault::SkipReadyWait);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard overwrite-before-last-use")]
fn broken_hook_mode_reuse_without_last_use_wait_is_caught() {
    pass(3, 1, 3, OrderingFault::SkipLastUseWait);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "fence replied before earlier loads completed")]
fn broken_hook_mode_fence_replying_on_record_is_caught() {
    fence_after_prefetch(0, OrderingFault::FenceOnRecord);
}
