//! Invariant 1, use follows readiness: the engine's compute never reads a slot before the copy filling it completed.
//!
//! Model: 2 streamed blocks, prefetch depth 1 (2 slots), eager prefetch, one pass (each block: `pre_forward`, a
//! kernel on the compute stream reading the slot, `post_forward`). Threads: engine, stream actor, copy-stream worker,
//! compute-stream worker.
#![cfg(weightferry_loom)]

use weightferry_actors::{OrderingFault, StreamOptions};
use weightferry_loom::{model, ModelConfig, Rig};

fn one_pass(fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(2, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack(0, 1, fault);
        rig.run_block(&stack, 0);
        rig.run_block(&stack, 1);
        rig.finish();
        assert_eq!(rig.platform.kernels_run(), 2, "both kernels ran and read their block's bytes");
    });
}

#[test]
fn compute_waits_for_the_copy_depth_1() {
    one_pass(OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard read-before-ready")]
fn broken_compute_skipping_the_ready_wait_is_caught() {
    one_pass(OrderingFault::SkipReadyWait);
}
