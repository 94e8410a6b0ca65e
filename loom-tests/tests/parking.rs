//! Mailbox / parking: no lost wake-up and no deadlock between the engine thread, the block-stack actor (which parks
//! on its ticket board until the stream actor has enqueued a load) and the stream actor (which parks on its
//! mailbox). Loom reports a deadlock when every thread is parked.
//!
//! Models:
//! - staged (depth 0, 1 slot), 2 blocks: every `pre_forward` issues its own load and parks on the board until the
//!   stream actor publishes it; the second load reuses the slot behind the first block's last use.
//!   Threads: engine, stream actor, device.
//! - stop race: a second thread stops the stream actor while the engine's `pre_forward` issues a load and parks on
//!   the board; the engine must get an answer (the block, or `ActorGone`), never park forever.
//!   Threads: engine, stopper, stream actor, device.
#![cfg(weightferry_loom)]

use weightferry_actors::sync::thread;
use weightferry_actors::{OrderingFault, SchedulerError, StreamOptions};
use weightferry_loom::{model, ModelConfig, Rig};

#[test]
fn staged_loads_never_lose_a_wake_up() {
    model(|| {
        let rig = Rig::new(2, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack(0, 0, OrderingFault::None);
        rig.run_block(&stack, 0);
        rig.run_block(&stack, 1);
        assert_eq!(stack.stats().sync_fetches, 2);
        rig.finish();
        assert_eq!(rig.platform.kernels_run(), 2);
    });
}

fn stop_race(fault: OrderingFault) {
    model(move || {
        let rig = Rig::new(1, StreamOptions { watch_completions: false }, ModelConfig::default());
        let stack = rig.stack(0, 0, fault);
        let stream = rig.stream.clone();
        let stopper = thread::spawn(move || stream.shutdown());
        match stack.pre_forward(0) {
            Ok(_) | Err(SchedulerError::ActorGone { .. }) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
        stopper.join().expect("stopper");
        drop(stack);
        rig.finish();
    });
}

#[test]
fn stopping_the_stream_actor_never_strands_a_waiting_hook() {
    stop_race(OrderingFault::None);
}

#[test]
#[cfg(weightferry_broken)]
#[should_panic(expected = "deadlock")]
fn broken_wait_ignoring_actor_stop_is_caught() {
    stop_race(OrderingFault::IgnoreActorStop);
}
