//! Block-stack actor + stream actor on the simulated platform: bytes seen by compute, hazards, memory bounds,
//! skips, faults and teardown.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use weightferry_actors::platform::{HostMemoryKind, Platform, PlatformRef, StreamId};
use weightferry_actors::sim::{Access, FaultPlan, HazardKind, SimConfig, SimPlatform};
use weightferry_actors::{
    BlockSpec, BlockStack, OrderingFault, SchedulerError, Segment, StackSpec, StreamHandle, StreamOptions,
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
    StackSpec {
        name: "dit".into(),
        blocks: r.blocks.clone(),
        resident_head: head,
        prefetch_depth: depth,
        eager_prefetch: true,
        ordering_fault: fault,
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

#[test]
fn every_depth_and_head_sees_exact_bytes_without_hazards() {
    for depth in 1..=4 {
        for head in [0usize, 2] {
            let r = rig(6, slow_copies());
            let stack =
                BlockStack::new(r.sim.clone(), spec(&r, head, depth, OrderingFault::None), r.compute, r.stream.clone())
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
fn slots_that_hold_every_streamed_block_are_reused_without_copies() {
    let r = rig(3, SimConfig::default());
    // 1 resident + 2 streamed blocks with depth 4: the two slots hold both streamed blocks forever.
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 1, 4, OrderingFault::None), r.compute, r.stream.clone()).unwrap();
    assert_eq!(drive(&r, &stack, 4, &|_, _| false, Duration::ZERO), 0);
    let st = stack.stats();
    assert_eq!(st.loads, 3, "1 resident load + 2 streamed loads, then reuse");
    assert_eq!(st.reuse_hits, 6);
    stack.disable().unwrap();
}

#[test]
fn skipped_blocks_are_fetched_synchronously_and_stay_correct() {
    let r = rig(7, slow_copies());
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap();
    let skip = |pass: usize, i: usize| (pass * 7 + i * 3) % 5 == 0;
    assert_eq!(drive(&r, &stack, 4, &skip, Duration::ZERO), 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
    assert!(stack.stats().sync_fetches > 0, "skips must force synchronous fetches");
    stack.disable().unwrap();
}

#[test]
fn skipping_the_ready_wait_is_caught_as_read_before_ready() {
    let r = rig(4, SimConfig { h2d_bytes_per_sec: Some(2.0e5), ..SimConfig::default() });
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::SkipReadyWait), r.compute, r.stream.clone())
            .unwrap();
    drive(&r, &stack, 1, &|_, _| false, Duration::ZERO);
    let kinds: Vec<HazardKind> = r.sim.violations().iter().map(|v| v.kind).collect();
    assert!(kinds.contains(&HazardKind::ReadBeforeReady), "expected ReadBeforeReady, got {kinds:?}");
    stack.disable().unwrap();
}

#[test]
fn skipping_the_last_use_wait_is_caught_as_overwrite_before_last_use() {
    let r = rig(4, SimConfig::default());
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::SkipLastUseWait), r.compute, r.stream.clone())
            .unwrap();
    drive(&r, &stack, 2, &|_, _| false, Duration::from_millis(5));
    let kinds: Vec<HazardKind> = r.sim.violations().iter().map(|v| v.kind).collect();
    assert!(kinds.contains(&HazardKind::OverwriteBeforeLastUse), "expected OverwriteBeforeLastUse, got {kinds:?}");
    stack.disable().unwrap();
}

#[test]
fn the_correct_ordering_survives_slow_kernels() {
    let r = rig(4, SimConfig::default());
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap();
    assert_eq!(drive(&r, &stack, 2, &|_, _| false, Duration::from_millis(5)), 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
    stack.disable().unwrap();
}

#[test]
fn out_of_memory_at_creation_frees_what_was_allocated() {
    // Allocations: 2 resident blocks, then slots; fail the third allocation (the first slot).
    let r =
        rig(5, SimConfig { faults: FaultPlan { oom_at_alloc: Some(2), ..FaultPlan::none() }, ..SimConfig::default() });
    let err =
        BlockStack::new(r.sim.clone(), spec(&r, 2, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap_err();
    assert!(
        matches!(err, SchedulerError::Platform(weightferry_actors::platform::PlatformError::OutOfMemory { .. })),
        "{err}"
    );
    assert_eq!(r.sim.device_memory().in_use, 0);
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
    stack.post_forward(1).unwrap();
    let err = stack.pre_forward(2).unwrap_err();
    assert!(matches!(err, SchedulerError::LoadFailed { block: 2, .. }), "{err}");
    stack.disable().unwrap();
    assert_eq!(r.sim.device_memory().in_use, 0);
}

#[test]
fn an_async_copy_failure_is_reported_by_fence() {
    let r = rig(
        3,
        SimConfig { faults: FaultPlan { fail_h2d_copy_async: Some(1), ..FaultPlan::none() }, ..SimConfig::default() },
    );
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap();
    assert!(stack.fence().is_err());
    assert!(stack.disable().is_err(), "disable reports the failed work");
    assert_eq!(r.sim.device_memory().in_use, 0, "and still frees the memory once nothing is pending");
}

#[test]
fn protocol_misuse_is_an_error_not_a_panic() {
    let r = rig(3, SimConfig::default());
    let stack =
        BlockStack::new(r.sim.clone(), spec(&r, 0, 1, OrderingFault::None), r.compute, r.stream.clone()).unwrap();
    assert!(matches!(stack.post_forward(1), Err(SchedulerError::NotInUse { block: 1, .. })));
    assert!(matches!(stack.pre_forward(9), Err(SchedulerError::NoSuchBlock { block: 9, len: 3, .. })));
    stack.pre_forward(0).unwrap();
    assert!(stack.pre_forward(0).is_err(), "acquiring a block twice");
    stack.post_forward(0).unwrap();
    stack.disable().unwrap();
    assert!(matches!(stack.pre_forward(0), Err(SchedulerError::Disabled { .. })));
}

#[test]
fn a_spread_resident_set_streams_only_the_other_blocks() {
    for depth in 1..=3 {
        let r = rig(7, slow_copies());
        let mask = vec![false, true, false, false, true, false, true];
        let stack = BlockStack::with_resident_set(
            r.sim.clone(),
            spec(&r, 0, depth, OrderingFault::None),
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
        spec(&r, 0, 1, OrderingFault::None),
        Some(vec![true]),
        r.compute,
        r.stream.clone(),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "invalid stack 'dit': resident set has 1 entries for 3 blocks");
}
