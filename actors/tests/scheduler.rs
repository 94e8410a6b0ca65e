//! Block-stack actor + stream actor on the simulated platform: bytes seen by compute, hazards, memory bounds,
//! skips, faults and teardown.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use weightferry_actors::platform::{HostMemoryKind, Platform, PlatformRef, StreamId};
#[cfg(weightferry_broken)]
use weightferry_actors::sim::HazardKind;
use weightferry_actors::sim::{Access, FaultPlan, SimConfig, SimPlatform};
use weightferry_actors::{
    BlockSpec, BlockStack, OrderingFault, SchedulerError, Segment, StackSpec, StreamHandle, StreamOptions, Submission,
};

struct Rig {
    sim: Arc<SimPlatform>,
    compute: StreamId,
    stream: StreamHandle,
    blocks: Vec<BlockSpec>,
    contents: Vec<Vec<u8>>,
}

/// `n` blocks of two segments each (like two dtypes), with distinct bytes.
fn rig(n: usize, config: SimConfig) -> Rig {
    let sim = Arc::new(SimPlatform::new(config).unwrap());
    let p: PlatformRef = sim.clone();
    let compute = p.create_stream("compute").unwrap();
    let stream = StreamHandle::spawn(p.clone(), "copy", StreamOptions::default()).unwrap();
    let mut blocks = Vec::new();
    let mut contents = Vec::new();
    for i in 0..n {
        let a_len = 512 + 64 * i as u64;
        let b_len = 256;
        let bytes: Vec<u8> =
            (0..a_len + b_len).map(|k| (k as u8).wrapping_mul(31).wrapping_add(i as u8 * 17 + 1)).collect();
        let ha = p.alloc_host(a_len, HostMemoryKind::Pinned).unwrap();
        let hb = p.alloc_host(b_len, HostMemoryKind::Pinned).unwrap();
        p.write_host(ha, 0, &bytes[..a_len as usize]).unwrap();
        p.write_host(hb, 0, &bytes[a_len as usize..]).unwrap();
        let b_off = 1024; // second "dtype" section, aligned
        blocks.push(BlockSpec {
            segments: vec![
                Segment { host: ha, host_offset: 0, len: a_len, device_offset: 0 },
                Segment { host: hb, host_offset: 0, len: b_len, device_offset: b_off },
            ],
            reads: Vec::new(),
            device_bytes: b_off + b_len,
        });
        let mut dev = vec![0u8; (b_off + b_len) as usize];
        dev[..a_len as usize].copy_from_slice(&bytes[..a_len as usize]);
        dev[b_off as usize..].copy_from_slice(&bytes[a_len as usize..]);
        contents.push(dev);
    }
    Rig { sim, compute, stream, blocks, contents }
}

fn spec(r: &Rig, head: usize, depth: usize, fault: OrderingFault) -> StackSpec {
    spec_in(r, Submission::Actor, head, depth, fault)
}

fn spec_in(r: &Rig, submission: Submission, head: usize, depth: usize, fault: OrderingFault) -> StackSpec {
    StackSpec {
        name: "dit".into(),
        blocks: r.blocks.clone(),
        resident_head: head,
        prefetch_depth: depth,
        static_slots: false,
        eager_prefetch: true,
        ordering_fault: fault,
        submission,
    }
}

/// Runs `passes` passes over the stack, skipping the blocks `skip(pass, block)` says; each block is one kernel that
/// checks it sees exactly the block's bytes. Returns the number of mismatching kernels.
fn drive(
    r: &Rig,
    stack: &BlockStack,
    passes: usize,
    skip: &dyn Fn(usize, usize) -> bool,
    kernel_delay: Duration,
) -> usize {
    let bad = Arc::new(Mutex::new(0usize));
    for pass in 0..passes {
        for i in 0..r.blocks.len() {
            if skip(pass, i) {
                continue;
            }
            let loc = stack.pre_forward(i).unwrap();
            let expect = r.contents[i].clone();
            let len = expect.len() as u64;
            let ranges: Vec<(usize, usize)> =
                r.blocks[i].segments.iter().map(|s| (s.device_offset as usize, s.len as usize)).collect();
            let bad = bad.clone();
            r.sim
                .launch(
                    r.compute,
                    &format!("block{i}"),
                    vec![Access::read(loc.buffer, loc.offset, len)],
                    Box::new(move |ctx| {
                        if !kernel_delay.is_zero() {
                            std::thread::sleep(kernel_delay);
                        }
                        let mut got = vec![0u8; len as usize];
                        ctx.read(loc.buffer, loc.offset, &mut got)?;
                        // Only the segments carry data; the padding between them may hold an earlier block's bytes.
                        let same = ranges.iter().all(|&(o, l)| got[o..o + l] == expect[o..o + l]);
                        if !same {
                            *bad.lock().unwrap() += 1;
                        }
                        Ok(())
                    }),
                )
                .unwrap();
            stack.post_forward(i).unwrap();
        }
    }
    r.sim.stream_synchronize(r.compute).unwrap();
    let n = *bad.lock().unwrap();
    n
}

fn slow_copies() -> SimConfig {
    SimConfig { h2d_bytes_per_sec: Some(2.0e6), copy_latency: Duration::from_micros(200), ..SimConfig::default() }
}

fn every_depth_and_head_sees_exact_bytes_without_hazards_in(sub: Submission) {
    for depth in 1..=4 {
        for head in [0usize, 2] {
            let r = rig(6, slow_copies());
            let stack = BlockStack::new(
                r.sim.clone(),
                spec_in(&r, sub, head, depth, OrderingFault::None),
                r.compute,
                r.stream.clone(),
            )
            .unwrap();
            let bad = drive(&r, &stack, 3, &|_, _| false, Duration::ZERO);
            assert_eq!(bad, 0, "depth {depth} head {head}: kernels saw wrong bytes");
            assert!(r.sim.violations().is_empty(), "depth {depth} head {head}: {:?}", r.sim.violations());
            let st = stack.stats();
            assert_eq!(st.sync_fetches, 0, "depth {depth} head {head}: every block should have been prefetched");
            // Memory: head blocks + min(depth+1, streaming) slots of the largest streamed block.
            let streaming = 6 - head;
            let slot = r.blocks[head..].iter().map(|b| b.device_bytes).max().unwrap();
            let expect = r.blocks[..head].iter().map(|b| b.device_bytes).sum::<u64>()
                + ((depth + 1).min(streaming) as u64) * slot;
            assert_eq!(st.device_bytes, expect);
            assert!(r.sim.device_memory().peak <= expect, "peak {} > planned {expect}", r.sim.device_memory().peak);
            stack.disable().unwrap();
            assert_eq!(r.sim.device_memory().in_use, 0, "disable must free everything");
            r.stream.shutdown();
        }
    }
}

#[test]
fn every_depth_and_head_sees_exact_bytes_without_hazards() {
    every_depth_and_head_sees_exact_bytes_without_hazards_in(Submission::Actor);
}

#[test]
fn every_depth_and_head_sees_exact_bytes_without_hazards_in_hook_mode() {
    every_depth_and_head_sees_exact_bytes_without_hazards_in(Submission::Hook);
}

fn slots_that_hold_every_streamed_block_are_reused_without_copies_in(sub: Submission) {
    let r = rig(3, SimConfig::default());
    // 1 resident + 2 streamed blocks with depth 4: the two slots hold both streamed blocks forever.
    let stack =
        BlockStack::new(r.sim.clone(), spec_in(&r, sub, 1, 4, OrderingFault::None), r.compute, r.stream.clone())
            .unwrap();
    assert_eq!(drive(&r, &stack, 4, &|_, _| false, Duration::ZERO), 0);
    let st = stack.stats();
    assert_eq!(st.loads, 3, "1 resident load + 2 streamed loads, then reuse");
    assert_eq!(st.reuse_hits, 6);
    stack.disable().unwrap();
}

#[test]
fn slots_that_hold_every_streamed_block_are_reused_without_copies() {
    slots_that_hold_every_streamed_block_are_reused_without_copies_in(Submission::Actor);
}

#[test]
fn slots_that_hold_every_streamed_block_are_reused_without_copies_in_hook_mode() {
    slots_that_hold_every_streamed_block_are_reused_without_copies_in(Submission::Hook);
}

fn skipped_blocks_are_fetched_synchronously_and_stay_correct_in(sub: Submission) {
    let r = rig(7, slow_copies());
    let stack =
        BlockStack::new(r.sim.clone(), spec_in(&r, sub, 0, 1, OrderingFault::None), r.compute, r.stream.clone())
            .unwrap();
    let skip = |pass: usize, i: usize| (pass * 7 + i * 3) % 5 == 0;
    assert_eq!(drive(&r, &stack, 4, &skip, Duration::ZERO), 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
    assert!(stack.stats().sync_fetches > 0, "skips must force synchronous fetches");
    stack.disable().unwrap();
}

#[test]
fn skipped_blocks_are_fetched_synchronously_and_stay_correct() {
    skipped_blocks_are_fetched_synchronously_and_stay_correct_in(Submission::Actor);
}

#[test]
fn skipped_blocks_are_fetched_synchronously_and_stay_correct_in_hook_mode() {
    skipped_blocks_are_fetched_synchronously_and_stay_correct_in(Submission::Hook);
}

// Needs a build with the broken orderings: RUSTFLAGS="--cfg weightferry_broken" (tests/all.sh runs it so).
#[cfg(weightferry_broken)]
fn skipping_the_ready_wait_is_caught_as_read_before_ready_in(sub: Submission) {
    let r = rig(4, SimConfig { h2d_bytes_per_sec: Some(2.0e5), ..SimConfig::default() });
    let stack = BlockStack::new(
        r.sim.clone(),
        spec_in(&r, sub, 0, 1, OrderingFault::SkipReadyWait),
        r.compute,
        r.stream.clone(),
    )
    .unwrap();
    drive(&r, &stack, 1, &|_, _| false, Duration::ZERO);
    let kinds: Vec<HazardKind> = r.sim.violations().iter().map(|v| v.kind).collect();
    assert!(kinds.contains(&HazardKind::ReadBeforeReady), "expected ReadBeforeReady, got {kinds:?}");
    stack.disable().unwrap();
}

#[test]
#[cfg(weightferry_broken)]
fn skipping_the_ready_wait_is_caught_as_read_before_ready() {
    skipping_the_ready_wait_is_caught_as_read_before_ready_in(Submission::Actor);
}

#[test]
#[cfg(weightferry_broken)]
fn skipping_the_ready_wait_is_caught_as_read_before_ready_in_hook_mode() {
    skipping_the_ready_wait_is_caught_as_read_before_ready_in(Submission::Hook);
}

// Needs a build with the broken orderings: RUSTFLAGS="--cfg weightferry_broken" (tests/all.sh runs it so).
#[cfg(weightferry_broken)]
fn skipping_the_last_use_wait_is_caught_as_overwrite_before_last_use_in(sub: Submission) {
    let r = rig(4, SimConfig::default());
    let stack = BlockStack::new(
        r.sim.clone(),
        spec_in(&r, sub, 0, 1, OrderingFault::SkipLastUseWait),
        r.compute,
        r.stream.clone(),
    )
    .unwrap();
    drive(&r, &stack, 2, &|_, _| false, Duration::from_millis(5));
    let kinds: Vec<HazardKind> = r.sim.violations().iter().map(|v| v.kind).collect();
    assert!(kinds.contains(&HazardKind::OverwriteBeforeLastUse), "expected OverwriteBeforeLastUse, got {kinds:?}");
    stack.disable().unwrap();
}

#[test]
#[cfg(weightferry_broken)]
fn skipping_the_last_use_wait_is_caught_as_overwrite_before_last_use() {
    skipping_the_last_use_wait_is_caught_as_overwrite_before_last_use_in(Submission::Actor);
}

#[test]
#[cfg(weightferry_broken)]
fn skipping_the_last_use_wait_is_caught_as_overwrite_before_last_use_in_hook_mode() {
    skipping_the_last_use_wait_is_caught_as_overwrite_before_last_use_in(Submission::Hook);
}

/// Without `--cfg weightferry_broken` the broken orderings are not compiled in: a stack asking for one is refused at
/// construction, with a typed error that says which build it needs, before anything is allocated or loaded.
#[test]
#[cfg(not(weightferry_broken))]
fn an_ordering_fault_is_refused_in_a_build_without_the_broken_cfg() {
    use OrderingFault::*;
    for sub in [Submission::Actor, Submission::Hook] {
        for fault in [SkipReadyWait, SkipLastUseWait, FenceOnRecord, FreeWithoutSync, IgnoreActorStop] {
            let r = rig(3, SimConfig::default());
            let err =
                BlockStack::new(r.sim.clone(), spec_in(&r, sub, 1, 1, fault), r.compute, r.stream.clone()).unwrap_err();
            assert_eq!(err, SchedulerError::FaultNotBuilt { stack: "dit".into(), fault });
            assert_eq!(
                err.to_string(),
                format!(
                    "stack 'dit': ordering fault {fault:?} needs a build with RUSTFLAGS=\"--cfg weightferry_broken\" \
                     (test builds only)"
                )
            );
            assert_eq!(r.sim.device_memory().in_use, 0, "refused before allocating");
            assert_eq!(r.sim.violations().len(), 0);
        }
    }
    // The refusal comes before every other check of the spec.
    let r = rig(0, SimConfig::default());
    let err = BlockStack::new(r.sim.clone(), spec(&r, 0, 1, SkipReadyWait), r.compute, r.stream.clone()).unwrap_err();
    assert!(matches!(err, SchedulerError::FaultNotBuilt { fault: SkipReadyWait, .. }), "{err}");
}

fn the_correct_ordering_survives_slow_kernels_in(sub: Submission) {
    let r = rig(4, SimConfig::default());
    let stack =
        BlockStack::new(r.sim.clone(), spec_in(&r, sub, 0, 1, OrderingFault::None), r.compute, r.stream.clone())
            .unwrap();
    assert_eq!(drive(&r, &stack, 2, &|_, _| false, Duration::from_millis(5)), 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
    stack.disable().unwrap();
}

#[test]
fn the_correct_ordering_survives_slow_kernels() {
    the_correct_ordering_survives_slow_kernels_in(Submission::Actor);
}

#[test]
fn the_correct_ordering_survives_slow_kernels_in_hook_mode() {
    the_correct_ordering_survives_slow_kernels_in(Submission::Hook);
}

fn out_of_memory_at_creation_frees_what_was_allocated_in(sub: Submission) {
    // Allocations: 2 resident blocks, then slots; fail the third allocation (the first slot).
    let r =
        rig(5, SimConfig { faults: FaultPlan { oom_at_alloc: Some(2), ..FaultPlan::none() }, ..SimConfig::default() });
    let err = BlockStack::new(r.sim.clone(), spec_in(&r, sub, 2, 1, OrderingFault::None), r.compute, r.stream.clone())
        .unwrap_err();
    assert!(
        matches!(err, SchedulerError::Platform(weightferry_actors::platform::PlatformError::OutOfMemory { .. })),
        "{err}"
    );
    assert_eq!(r.sim.device_memory().in_use, 0);
}

#[test]
fn out_of_memory_at_creation_frees_what_was_allocated() {
    out_of_memory_at_creation_frees_what_was_allocated_in(Submission::Actor);
}

#[test]
fn out_of_memory_at_creation_frees_what_was_allocated_in_hook_mode() {
    out_of_memory_at_creation_frees_what_was_allocated_in(Submission::Hook);
}

#[test]
fn a_failed_copy_surfaces_as_a_load_error_on_the_hook() {
    // Copies: 2 segments per block. Eager prefetch of blocks 0 and 1 = copies 0..4; fail copy 5 (block 2's second
    // segment, issued by pre_forward(1)).
    let r =
        rig(4, SimConfig { faults: FaultPlan { fail_h2d_copy: Some(5), ..FaultPlan::none() }, ..SimConfig::default() });
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap();
    stack.pre_forward(0).unwrap();
    stack.post_forward(0).unwrap();
    stack.pre_forward(1).unwrap(); // issues the failing prefetch of block 2
                                   // The copy actor runs the prefetch on its own thread: the failure reaches the next hook call after it is
                                   // observed, post_forward(1) on a busy machine, else pre_forward(2); either way it names block 2.
    let err = match stack.post_forward(1) {
        Err(e) => e,
        Ok(()) => stack.pre_forward(2).unwrap_err(),
    };
    assert!(matches!(err, SchedulerError::LoadFailed { block: 2, .. }), "{err}");
    stack.disable().unwrap();
    assert_eq!(r.sim.device_memory().in_use, 0);
}

fn an_async_copy_failure_is_reported_by_fence_in(sub: Submission) {
    let r = rig(
        3,
        SimConfig { faults: FaultPlan { fail_h2d_copy_async: Some(1), ..FaultPlan::none() }, ..SimConfig::default() },
    );
    let stack =
        BlockStack::new(r.sim.clone(), spec_in(&r, sub, 0, 1, OrderingFault::None), r.compute, r.stream.clone())
            .unwrap();
    assert!(stack.fence().is_err());
    assert!(stack.disable().is_err(), "disable reports the failed work");
    assert_eq!(r.sim.device_memory().in_use, 0, "and still frees the memory once nothing is pending");
}

#[test]
fn an_async_copy_failure_is_reported_by_fence() {
    an_async_copy_failure_is_reported_by_fence_in(Submission::Actor);
}

#[test]
fn an_async_copy_failure_is_reported_by_fence_in_hook_mode() {
    an_async_copy_failure_is_reported_by_fence_in(Submission::Hook);
}

fn protocol_misuse_is_an_error_not_a_panic_in(sub: Submission) {
    let r = rig(3, SimConfig::default());
    let stack =
        BlockStack::new(r.sim.clone(), spec_in(&r, sub, 0, 1, OrderingFault::None), r.compute, r.stream.clone())
            .unwrap();
    assert!(matches!(stack.post_forward(1), Err(SchedulerError::NotInUse { block: 1, .. })));
    assert!(matches!(stack.pre_forward(9), Err(SchedulerError::NoSuchBlock { block: 9, len: 3, .. })));
    stack.pre_forward(0).unwrap();
    assert!(stack.pre_forward(0).is_err(), "acquiring a block twice");
    stack.post_forward(0).unwrap();
    stack.disable().unwrap();
    assert!(matches!(stack.pre_forward(0), Err(SchedulerError::Disabled { .. })));
}

#[test]
fn protocol_misuse_is_an_error_not_a_panic() {
    protocol_misuse_is_an_error_not_a_panic_in(Submission::Actor);
}

#[test]
fn protocol_misuse_is_an_error_not_a_panic_in_hook_mode() {
    protocol_misuse_is_an_error_not_a_panic_in(Submission::Hook);
}

fn a_spread_resident_set_streams_only_the_other_blocks_in(sub: Submission) {
    for depth in 1..=3 {
        let r = rig(7, slow_copies());
        let mask = vec![false, true, false, false, true, false, true];
        let stack = BlockStack::with_resident_set(
            r.sim.clone(),
            spec_in(&r, sub, 0, depth, OrderingFault::None),
            Some(mask.clone()),
            r.compute,
            r.stream.clone(),
        )
        .unwrap();
        assert_eq!(drive(&r, &stack, 3, &|_, _| false, Duration::ZERO), 0);
        assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
        let st = stack.stats();
        assert_eq!(st.resident_blocks, 3);
        assert_eq!(st.sync_fetches, 0, "depth {depth}");
        // Resident blocks load once; the 4 streamed blocks load every pass (plus the `depth` blocks the last pass
        // prefetches for a next pass) unless the slots hold them all.
        let streamed = 4u64;
        let slots = (depth as u64 + 1).min(streamed);
        let expect_loads = 3 + if slots == streamed { streamed } else { 3 * streamed + depth as u64 };
        assert_eq!(st.loads, expect_loads, "depth {depth}");
        let slot = r.blocks.iter().zip(&mask).filter(|(_, m)| !**m).map(|(b, _)| b.device_bytes).max().unwrap();
        let head: u64 = r.blocks.iter().zip(&mask).filter(|(_, m)| **m).map(|(b, _)| b.device_bytes).sum();
        assert_eq!(st.device_bytes, head + slots * slot);
        stack.disable().unwrap();
        assert_eq!(r.sim.device_memory().in_use, 0);
        r.stream.shutdown();
    }
    let r = rig(3, SimConfig::default());
    let err = BlockStack::with_resident_set(
        r.sim.clone(),
        spec_in(&r, sub, 0, 1, OrderingFault::None),
        Some(vec![true]),
        r.compute,
        r.stream.clone(),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "invalid stack 'dit': resident set has 1 entries for 3 blocks");
}

#[test]
fn a_spread_resident_set_streams_only_the_other_blocks() {
    a_spread_resident_set_streams_only_the_other_blocks_in(Submission::Actor);
}

#[test]
fn a_spread_resident_set_streams_only_the_other_blocks_in_hook_mode() {
    a_spread_resident_set_streams_only_the_other_blocks_in(Submission::Hook);
}

#[test]
fn a_failed_copy_at_enqueue_in_hook_mode_fails_the_hook_that_issued_it_and_frees_the_slot() {
    // As `a_failed_copy_surfaces_as_a_load_error_on_the_hook`: copy 5 is block 2's second segment, enqueued by
    // pre_forward(1). In hook mode the hook enqueues it itself, so that hook already reports the load error.
    let r =
        rig(4, SimConfig { faults: FaultPlan { fail_h2d_copy: Some(5), ..FaultPlan::none() }, ..SimConfig::default() });
    let stack = BlockStack::new(
        r.sim.clone(),
        spec_in(&r, Submission::Hook, 0, 1, OrderingFault::None),
        r.compute,
        r.stream.clone(),
    )
    .unwrap();
    stack.pre_forward(0).unwrap();
    stack.post_forward(0).unwrap();
    let err = stack.pre_forward(1).unwrap_err();
    assert!(matches!(err, SchedulerError::LoadFailed { block: 2, .. }), "{err}");
    // The slot is left free (nothing holds or loads block 2), and the stack stays poisoned with the same error.
    assert!(stack.slot_states().iter().all(|st| st.block() != Some(2)), "{:?}", stack.slot_states());
    assert_eq!(stack.pre_forward(2).unwrap_err(), err);
    assert_eq!(stack.post_forward(1).unwrap_err(), err);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
    stack.disable().unwrap();
    assert_eq!(r.sim.device_memory().in_use, 0);
}

/// An asynchronous copy failure (the first copy: block 0's, eager prefetch) reaches the hooks as a load error
/// naming block 0, in both modes: through the watcher (actor) or the hooks' polling (hook).
fn an_async_copy_failure_reaches_the_hooks_naming_its_block_in(sub: Submission) {
    let r = rig(
        3,
        SimConfig {
            faults: FaultPlan { fail_h2d_copy_async: Some(1), ..FaultPlan::none() },
            copy_latency: Duration::from_millis(2),
            ..SimConfig::default()
        },
    );
    let stack =
        BlockStack::new(r.sim.clone(), spec_in(&r, sub, 0, 1, OrderingFault::None), r.compute, r.stream.clone())
            .unwrap();
    let mut first_err = None;
    'passes: for _ in 0..50 {
        for i in 0..3 {
            if let Err(e) = stack.pre_forward(i) {
                first_err = Some(e);
                break 'passes;
            }
            std::thread::sleep(Duration::from_millis(1));
            if let Err(e) = stack.post_forward(i) {
                first_err = Some(e);
                break 'passes;
            }
        }
    }
    let err = first_err.expect("the failure reached a hook");
    assert!(matches!(err, SchedulerError::LoadFailed { block: 0, .. }), "{sub:?}: {err}");
    assert!(stack.fence().is_err());
    let _ = stack.disable();
    assert_eq!(r.sim.device_memory().in_use, 0);
}

#[test]
fn an_async_copy_failure_reaches_the_hooks_naming_its_block() {
    an_async_copy_failure_reaches_the_hooks_naming_its_block_in(Submission::Actor);
}

#[test]
fn an_async_copy_failure_reaches_the_hooks_naming_its_block_in_hook_mode() {
    an_async_copy_failure_reaches_the_hooks_naming_its_block_in(Submission::Hook);
}

#[test]
fn hook_mode_streams_without_the_stream_actor_and_observes_every_completion() {
    let r = rig(6, slow_copies());
    let stack = BlockStack::new(
        r.sim.clone(),
        spec_in(&r, Submission::Hook, 1, 2, OrderingFault::None),
        r.compute,
        r.stream.clone(),
    )
    .unwrap();
    // The resident head went through the actor at creation; after that the hooks alone enqueue the loads.
    r.stream.shutdown();
    assert_eq!(drive(&r, &stack, 3, &|pass, i| pass == 1 && (2..=4).contains(&i), Duration::ZERO), 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
    stack.fence().unwrap();
    let st = stack.stats();
    assert_eq!(st.record_waits, 0, "a hook-submitted load is recorded when its hook returns");
    assert!(st.sync_fetches > 0, "the skip forced a synchronous fetch");
    // Every streamed load's completion was observed without a watcher (the resident head reports none).
    assert_eq!(st.completions, st.loads - 1, "{st:?}");
    stack.disable().unwrap();
    assert_eq!(r.sim.device_memory().in_use, 0);
}

/// A checkpoint file in memory (the disk tier's `BlockFile`).
#[derive(Debug)]
struct MemFile(Vec<u8>);

impl weightferry_actors::platform::BlockFile for MemFile {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let o = offset as usize;
        out.copy_from_slice(self.0.get(o..o + out.len()).ok_or("past the end of the file")?);
        Ok(())
    }
}

/// `r`'s blocks with every odd one moved to the disk tier: its segments' bytes written to a file, read into a
/// staging buffer (each segment into its own aligned window) and copied from there. Returns the blocks and the
/// staging size.
fn odd_blocks_on_disk(r: &Rig) -> (Vec<BlockSpec>, u64) {
    use weightferry_actors::messages::FileRead;
    use weightferry_actors::platform::{read_window_len, DIRECT_READ_ALIGN};
    let mut file = Vec::new();
    let mut placed = Vec::new();
    for (i, b) in r.blocks.iter().enumerate() {
        let mut reads = Vec::new();
        let mut window = 0u64; // each read fills its own aligned window of the staging buffer
        for s in &b.segments {
            let mut bytes = vec![0u8; s.len as usize];
            r.sim.read_host(s.host, s.host_offset, &mut bytes).unwrap();
            let offset = file.len() as u64;
            reads.push((offset, s.len, window + offset % DIRECT_READ_ALIGN));
            file.extend_from_slice(&bytes);
            window += read_window_len(offset, s.len);
        }
        placed.push((i % 2 == 1).then_some(reads));
    }
    let file = Arc::new(MemFile(file));
    let mut staging = 0;
    let blocks = r
        .blocks
        .iter()
        .zip(placed)
        .map(|(b, reads)| match reads {
            None => b.clone(),
            Some(reads) => {
                let mut b = b.clone();
                for (s, &(_, _, at)) in b.segments.iter_mut().zip(&reads) {
                    (s.host, s.host_offset) = (weightferry_actors::messages::STAGING_HOST, at);
                }
                staging = staging.max(
                    reads.iter().map(|r| r.2 - r.0 % DIRECT_READ_ALIGN + read_window_len(r.0, r.1)).max().unwrap_or(0),
                );
                b.reads = reads
                    .into_iter()
                    .map(|(offset, len, staging_offset)| FileRead { file: file.clone(), offset, len, staging_offset })
                    .collect();
                b
            }
        })
        .collect();
    (blocks, staging)
}

#[test]
fn blocks_on_disk_arrive_through_the_reader_at_every_depth_and_head_without_hazards() {
    use weightferry_actors::ReaderHandle;
    for depth in 1..=3 {
        for head in [0usize, 2] {
            let mut r = rig(6, slow_copies());
            let (blocks, staging) = odd_blocks_on_disk(&r);
            r.blocks = blocks;
            let reader =
                ReaderHandle::spawn(r.sim.clone(), "disk", r.stream.clone(), 2, staging, HostMemoryKind::Pinned)
                    .unwrap();
            let spec = spec(&r, head, depth, OrderingFault::None);
            let stack = BlockStack::with_reader(r.sim.clone(), spec, None, r.compute, r.stream.clone(), reader.clone())
                .unwrap();
            let bad = drive(&r, &stack, 3, &|_, _| false, Duration::ZERO);
            assert_eq!(bad, 0, "depth {depth} head {head}: kernels saw wrong bytes");
            assert!(r.sim.violations().is_empty(), "depth {depth} head {head}: {:?}", r.sim.violations());
            assert_eq!(stack.stats().sync_fetches, 0, "depth {depth} head {head}");
            stack.disable().unwrap();
            reader.destroy().unwrap();
            assert_eq!(r.sim.device_memory().in_use, 0, "disable must free everything");
            r.stream.shutdown();
        }
    }
}

#[test]
fn a_stack_with_blocks_on_disk_and_no_reader_is_refused() {
    let mut r = rig(3, SimConfig::default());
    let (blocks, _) = odd_blocks_on_disk(&r);
    r.blocks = blocks;
    let err =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap_err();
    assert_eq!(err.to_string(), "invalid stack 'dit': block 1 is read from disk, and the stack has no reader");
    r.stream.shutdown();
}
