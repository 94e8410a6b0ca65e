//! Lifecycle: disable racing with in-flight prefetches leaves no slot in use, nothing allocated and no lost
//! completion; a failed enable (the platform failing an allocation or a resident-head copy) leaves nothing allocated
//! and frees nothing that a pending copy still touches.
//!
//! Threads: engine, stream actor, device.
#![cfg(weightferry_loom)]

use weightferry_actors::platform::Platform;
use weightferry_actors::slot::SlotState;
use weightferry_actors::{BlockStack, OrderingFault, SchedulerError, StreamOptions};
use weightferry_loom::{model, ModelConfig, Rig};

/// 2 streamed blocks, depth 1: block 0 runs (block 1's prefetch is then in flight), then the stack is disabled.
fn disable_during_prefetch(fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(2, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack(0, 1, fault);
        rig.run_block(&stack, 0);
        stack.disable().expect("disable");
        assert!(stack.slot_states().iter().all(|s| *s == SlotState::Free), "a slot survived disable");
        assert_eq!(rig.platform.device_memory().in_use, 0, "disable frees every device byte");
        assert_eq!(rig.platform.live_device_buffers(), 0);
        assert_eq!(rig.platform.live_events(), 0, "disable destroys every event");
        assert!(matches!(stack.pre_forward(1), Err(SchedulerError::Disabled { .. })));
        // Every load issued reported exactly one completion (none lost, none duplicated).
        stack.fence().expect("fence after disable");
        let stats = stack.stats();
        assert_eq!((stats.loads, stats.completions), (2, 2), "{stats:?}");
        rig.finish();
    });
}

#[test]
fn disable_racing_with_prefetches_frees_everything() {
    disable_during_prefetch(OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard free-before-last-use")]
fn broken_disable_freeing_without_sync_is_caught() {
    disable_during_prefetch(OrderingFault::FreeWithoutSync);
}

/// Enables a stack of `blocks` with a resident head of `head` and depth 1 on a platform that fails as `config`
/// says; the enable must fail with `expect` and leave nothing allocated.
fn failed_enable(blocks: usize, head: usize, config: ModelConfig, fault: OrderingFault, expect: &'static str) {
    model(move || {
        let rig = Rig::new(blocks, StreamOptions { watch_completions: false }, config);
        let err = BlockStack::new(rig.platform_ref(), rig.spec(head, 1, fault), rig.compute, rig.stream.clone())
            .expect_err("the enable must fail");
        assert!(err.to_string().contains(expect), "{err}");
        assert_eq!(rig.platform.device_memory().in_use, 0, "a failed enable frees every device byte");
        assert_eq!(rig.platform.live_device_buffers(), 0);
        assert_eq!(rig.platform.live_events(), 0, "a failed enable destroys every event");
        rig.finish();
    });
}

#[test]
fn failed_slot_allocation_leaves_nothing_allocated() {
    failed_enable(2, 0, ModelConfig { fail_alloc_at: Some(2), ..Default::default() }, OrderingFault::None, "memory");
}

#[test]
fn failed_first_head_copy_leaves_nothing_allocated() {
    let config = ModelConfig { fail_copy_at: Some(1), ..Default::default() };
    failed_enable(3, 2, config, OrderingFault::None, "injected by the model");
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "hazard free-before-last-use")]
fn broken_failed_enable_freeing_without_sync_is_caught() {
    let config = ModelConfig { fail_copy_at: Some(2), ..Default::default() };
    failed_enable(3, 2, config, OrderingFault::FreeWithoutSync, "injected by the model");
}
