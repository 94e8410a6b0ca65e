//! Invariant 3, fence: a fence reply never precedes completion of the loads issued before it.
//!
//! Models (depth 1, eager prefetch; when the fence returns nothing may be pending on the copy or compute stream):
//! - watcher off (the stream actor synchronizes the stream itself): 2 streamed blocks; the engine runs block 0
//!   (which prefetches block 1), then fences. Threads: engine, stream actor, device.
//! - watcher on (the fence travels through the completion watcher, behind the load's completion): 1 block; the
//!   engine fences right after the eager prefetch. Threads: engine, stream actor, watcher, device.
#![cfg(weightferry_loom)]

use weightferry_actors::{OrderingFault, StreamOptions};
use weightferry_loom::{model, ModelConfig, Rig};

/// `blocks` streamed blocks at depth 1; the engine runs `steps` blocks, then fences.
fn fence_after_prefetch(blocks: usize, steps: usize, watch_completions: bool, fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(blocks, StreamOptions { watch_completions }, ModelConfig::default());
        let stack = rig.stack(0, 1, fault);
        for b in 0..steps {
            rig.run_block(&stack, b);
        }
        stack.fence().expect("fence");
        let copy = rig.stream.stream();
        assert_eq!(rig.platform.pending_ops(copy), 0, "fence replied before earlier loads completed");
        assert_eq!(rig.platform.pending_ops(rig.compute), 0, "fence replied before the last use completed");
        rig.finish();
    });
}

#[test]
fn fence_follows_earlier_loads() {
    fence_after_prefetch(2, 1, false, OrderingFault::None);
}

#[test]
fn fence_follows_earlier_loads_through_the_watcher() {
    fence_after_prefetch(1, 0, true, OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "fence replied before earlier loads completed")]
fn broken_fence_replying_on_record_is_caught() {
    fence_after_prefetch(2, 1, false, OrderingFault::FenceOnRecord);
}
