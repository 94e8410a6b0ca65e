//! Invariant 2b, no early refill: a staging buffer of the disk tier is read into again only after the copies that
//! read it completed (the reader waits until the buffer's last load is published, then for its staging event).
//!
//! Model (one pass): 2 blocks, both read from a file, depth 1, one staging buffer: both load at creation, so the
//! second read refills the buffer the first load's copy reads. The model platform panics with
//! `hazard host-overwrite-before-copy` when a host write lands in bytes an enqueued copy has not read yet, and each
//! kernel checks it reads its own block's bytes. (More blocks or buffers multiply the executions past what CI can
//! explore; the sim's hazard detector covers those in `actors/tests/scheduler.rs` and `reader.rs`.)
//!
//! Threads: engine, reader, stream actor, device; explored with a preemption bound of 1.
#![cfg(weightferry_loom)]

use weightferry_actors::StreamOptions;
use weightferry_loom::{model_bounded, ModelConfig, Rig};

fn pass(n: usize, depth: usize, staging: usize, broken: bool) {
    // Preemption bound 1: the reader is a fourth thread (see `model_bounded`).
    model_bounded(1, move || {
        let rig = Rig::new(n, StreamOptions { watch_completions: false }, ModelConfig::default());
        let (stack, reader) = rig.disk_stack(depth, staging, broken);
        for b in 0..n {
            rig.run_block(&stack, b);
        }
        reader.shutdown();
        rig.finish();
        assert_eq!(rig.platform.kernels_run(), n as u32);
    });
}

#[test]
fn refill_waits_for_the_copies_that_read_the_staging_buffer() {
    pass(2, 1, 1, false);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard host-overwrite-before-copy")]
fn broken_refill_without_the_staging_wait_is_caught() {
    pass(2, 1, 1, true);
}
