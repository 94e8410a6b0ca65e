//! Gather-path block stacks (`BlockStack::with_gather`) on simulated ranks: each rank holds only its shards of
//! two-section blocks of odd sizes, unchunked or chunked (one AllGather per chunk, chunk sizes that do not divide
//! the sections and larger than them); over several passes a kernel on each rank's compute stream reads every
//! block between its hooks and must see exactly the full block bytes; no hazard; every rank issues the same
//! gathers in the same order; with the shard copies slowed, the AllGather of chunk j starts before the copy of
//! chunk j + 1 finishes (the pipeline overlaps); invalid gather specs are typed errors, and with the slot's
//! last-use wait skipped the hazard check fires (the check can fail).

#![cfg(not(weightferry_loom))]

use std::sync::{Arc, Mutex};
use std::time::Duration;
use weightferry_actors::collective::{Collective, SimCollectiveGroup, SimCollectiveOptions};
use weightferry_actors::collective_actor::CollectiveHandle;
use weightferry_actors::platform::{HostMemoryKind, Platform, PlatformRef};
use weightferry_actors::shard::ShardSpec;
use weightferry_actors::sim::{Access, SimConfig, SimKernelCtx, SimPlatform, TraceEvent, TraceKind};
use weightferry_actors::{
    BlockSpec, BlockStack, GatherBlock, GatherPath, GatherSection, GatherSequence, OrderingFault, SchedulerError,
    StackSpec, StreamHandle, StreamOptions, Submission,
};

/// Section element sizes and the device offset of the second section.
const ELEMS: [u64; 2] = [2, 4];
const SECOND_AT: u64 = 512;

/// Block `b`'s two sections (odd element counts, so shards are padded for most group sizes).
fn sections(b: usize) -> [Vec<u8>; 2] {
    let n0 = 37 + 11 * b as u64;
    let n1 = 13 + 7 * b as u64;
    let fill = |len: u64, salt: u8| -> Vec<u8> {
        (0..len).map(|i| ((i as u8).wrapping_mul(37) ^ (b as u8).wrapping_mul(91) ^ salt) | 1).collect()
    };
    [fill(n0 * ELEMS[0], 0x11), fill(n1 * ELEMS[1], 0x5A)]
}

/// One kernel read: (block, first section bytes, second section bytes).
type Read = (usize, Vec<u8>, Vec<u8>);

struct Outcome {
    reads: Vec<Read>,
    issued: Vec<(u64, u64)>,
    violations: usize,
    trace: Vec<TraceEvent>,
}

/// Tag of chunk `j` of section `k` of block `b`.
fn tag(b: usize, k: usize, j: u64) -> u64 {
    (b as u64) << 16 | (k as u64) << 8 | j
}

/// Gathers per block: one per chunk of each section.
fn gathers_of(b: usize, world: usize, chunk: Option<u64>) -> u64 {
    sections(b)
        .iter()
        .enumerate()
        .map(|(k, bytes)| ShardSpec::chunked(bytes.len() as u64, ELEMS[k], world, chunk).unwrap().chunk_count())
        .sum()
}

#[allow(clippy::too_many_arguments)]
fn run_rank(
    sim: Arc<SimPlatform>,
    comm: weightferry_actors::collective::SimCollective,
    blocks: usize,
    depth: usize,
    passes: usize,
    fault: OrderingFault,
    chunk: Option<u64>,
) -> Outcome {
    let (rank, world) = (comm.rank(), comm.world());
    let p: PlatformRef = sim.clone();
    let compute = p.create_stream("compute").unwrap();
    let collective = CollectiveHandle::spawn(p.clone(), "comm", Box::new(move || Ok(Box::new(comm) as _))).unwrap();
    let stream = StreamHandle::spawn(p.clone(), "copy", StreamOptions::default()).unwrap();
    let mut gather_blocks = Vec::new();
    let mut hosts = Vec::new();
    for b in 0..blocks {
        let mut secs = Vec::new();
        for (k, bytes) in sections(b).iter().enumerate() {
            let spec = ShardSpec::chunked(bytes.len() as u64, ELEMS[k], world, chunk).unwrap();
            let shard = spec.shard(bytes, rank).unwrap();
            let host = p.alloc_host(spec.shard_bytes(), HostMemoryKind::Pinned).unwrap();
            p.write_host(host, 0, &shard).unwrap();
            hosts.push(host);
            for c in spec.chunks() {
                secs.push(GatherSection {
                    host,
                    host_offset: c.shard_offset,
                    shard_bytes: c.shard_bytes,
                    output_offset: k as u64 * SECOND_AT + c.gathered_offset,
                    tag: tag(b, k, c.index),
                });
            }
        }
        gather_blocks.push(GatherBlock { sections: secs });
    }
    let spec = StackSpec {
        name: format!("gathered-r{rank}"),
        blocks: (0..blocks)
            .map(|_| BlockSpec { segments: Vec::new(), reads: Vec::new(), device_bytes: 2 * SECOND_AT })
            .collect(),
        resident_head: 0,
        prefetch_depth: depth,
        static_slots: false,
        eager_prefetch: false,
        ordering_fault: fault,
        submission: Default::default(),
    };
    let path = GatherPath { collective: collective.clone(), sequence: GatherSequence::new(), blocks: gather_blocks };
    let stack = BlockStack::with_gather(p.clone(), spec, None, compute, stream.clone(), path).unwrap();
    let sink: Arc<Mutex<Vec<Read>>> = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..passes {
        for b in 0..blocks {
            let loc = stack.pre_forward(b).unwrap();
            let [s0, s1] = sections(b);
            let (l0, l1) = (s0.len() as u64, s1.len() as u64);
            let (buf, off) = (loc.buffer, loc.offset);
            let sink = sink.clone();
            let kernel = Box::new(move |ctx: &SimKernelCtx| {
                if fault != OrderingFault::None {
                    // Slow compute keeps reads pending while the next loads into their slots start.
                    std::thread::sleep(Duration::from_millis(3));
                }
                let mut a = vec![0u8; l0 as usize];
                let mut c = vec![0u8; l1 as usize];
                ctx.read(buf, off, &mut a).map_err(|e| e.to_string())?;
                ctx.read(buf, off + SECOND_AT, &mut c).map_err(|e| e.to_string())?;
                sink.lock().unwrap().push((b, a, c));
                Ok(())
            });
            let access = vec![Access::read(buf, off, l0), Access::read(buf, off + SECOND_AT, l1)];
            sim.launch(compute, "read block", access, kernel).unwrap();
            stack.post_forward(b).unwrap();
        }
    }
    p.stream_synchronize(compute).unwrap();
    stack.fence().unwrap();
    stack.disable().unwrap();
    let issued = collective.issued();
    collective.shutdown();
    stream.shutdown();
    for h in hosts {
        p.free_host(h).unwrap();
    }
    let reads = sink.lock().unwrap().clone();
    Outcome { reads, issued, violations: sim.violations().len(), trace: sim.trace() }
}

fn run_group(world: usize, blocks: usize, depth: usize, passes: usize, fault: OrderingFault) -> Vec<Outcome> {
    run_group_with(world, blocks, depth, passes, fault, None, None)
}

/// `slow_shard`: every shard copy takes this much longer (and tracing is on).
fn run_group_with(
    world: usize,
    blocks: usize,
    depth: usize,
    passes: usize,
    fault: OrderingFault,
    chunk: Option<u64>,
    slow_shard: Option<Duration>,
) -> Vec<Outcome> {
    let sims: Vec<Arc<SimPlatform>> = (0..world)
        .map(|rank| {
            let mut config = SimConfig { tracing: slow_shard.is_some(), ..SimConfig::default() };
            config.faults.slow_stream = slow_shard.map(|d| (format!("gathered-r{rank}-shard"), d));
            Arc::new(SimPlatform::new(config).unwrap())
        })
        .collect();
    let comms =
        SimCollectiveGroup::with_options(sims.clone(), SimCollectiveOptions { timeout: Duration::from_secs(20) });
    std::thread::scope(|s| {
        let hs: Vec<_> = sims
            .into_iter()
            .zip(comms)
            .map(|(sim, comm)| s.spawn(move || run_rank(sim, comm, blocks, depth, passes, fault, chunk)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn kernels_read_exact_gathered_blocks_on_every_rank() {
    for world in [2usize, 3, 4] {
        for depth in [1usize, 2, 3] {
            let what = format!("N={world} depth {depth}");
            let outs = run_group(world, 5, depth, 3, OrderingFault::None);
            for (r, o) in outs.iter().enumerate() {
                assert_eq!(o.reads.len(), 15, "{what}: rank {r}");
                for (i, (b, a, c)) in o.reads.iter().enumerate() {
                    assert_eq!(*b, i % 5, "{what}");
                    let [s0, s1] = sections(*b);
                    assert!(*a == s0 && *c == s1, "{what}: rank {r} read {i} (block {b}) is not the full block");
                }
                assert_eq!(o.violations, 0, "{what}: rank {r}");
                assert_eq!(o.issued, outs[0].issued, "{what}: rank {r} gather order");
                // Two gathers per block load, numbered without gaps; the first gathers are block 0's sections.
                let seqs: Vec<u64> = o.issued.iter().map(|x| x.0).collect();
                assert_eq!(seqs, (0..o.issued.len() as u64).collect::<Vec<_>>(), "{what}");
                assert_eq!(&o.issued[..2], &[(0, tag(0, 0, 0)), (1, tag(0, 1, 0))], "{what}");
                assert!(o.issued.len() >= 30 && o.issued.len() % 2 == 0, "{what}: {}", o.issued.len());
            }
        }
    }
}

#[test]
fn chunked_gathers_rebuild_exact_blocks_on_every_rank() {
    // Section sizes: 74..162 and 52..164 bytes (blocks 0..4). Chunks of 40 and 100 gathered bytes do not divide
    // them; 4096 is larger than every section (one chunk each).
    for world in [2usize, 3, 4] {
        for chunk in [Some(40u64), Some(100), Some(4096)] {
            for depth in [1usize, 2] {
                let what = format!("N={world} chunk {chunk:?} depth {depth}");
                let outs = run_group_with(world, 5, depth, 3, OrderingFault::None, chunk, None);
                let per_pass: u64 = (0..5).map(|b| gathers_of(b, world, chunk)).sum();
                if chunk == Some(4096) {
                    assert_eq!(per_pass, 10, "{what}: one gather per section");
                } else {
                    assert!(per_pass > 10, "{what}: chunks should split the sections ({per_pass} gathers)");
                }
                for (r, o) in outs.iter().enumerate() {
                    assert_eq!(o.reads.len(), 15, "{what}: rank {r}");
                    for (i, (b, a, c)) in o.reads.iter().enumerate() {
                        let [s0, s1] = sections(*b);
                        assert!(*a == s0 && *c == s1, "{what}: rank {r} read {i} (block {b}) is not the full block");
                    }
                    assert_eq!(o.violations, 0, "{what}: rank {r}");
                    assert_eq!(o.issued, outs[0].issued, "{what}: rank {r} gather order");
                    // Block 0's gathers come first: section 0's chunks in order, then section 1's.
                    let first: Vec<u64> =
                        o.issued.iter().take(gathers_of(0, world, chunk) as usize).map(|x| x.1).collect();
                    let mut expected = Vec::new();
                    for (k, bytes) in sections(0).iter().enumerate() {
                        let spec = ShardSpec::chunked(bytes.len() as u64, ELEMS[k], world, chunk).unwrap();
                        expected.extend(spec.chunks().map(|c| tag(0, k, c.index)));
                    }
                    assert_eq!(first, expected, "{what}");
                    assert!(o.issued.len() as u64 >= 3 * per_pass, "{what}: {}", o.issued.len());
                }
            }
        }
    }
}

#[test]
fn the_gather_of_a_chunk_overlaps_the_copy_of_the_next() {
    // Every shard copy takes 40 ms longer. Block 0's section 0 (37 two-byte elements) in chunks of 20 gathered
    // bytes over 2 ranks (5 elements per rank): 4 chunks of 10, 10, 10 and 7 elements.
    let slow = Duration::from_millis(40);
    let world = 2;
    let chunk = Some(20u64);
    let outs = run_group_with(world, 2, 1, 1, OrderingFault::None, chunk, Some(slow));
    let chunks0 = ShardSpec::chunked(sections(0)[0].len() as u64, ELEMS[0], world, chunk).unwrap().chunk_count();
    assert!(chunks0 >= 3, "{chunks0} chunks");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.violations, 0, "rank {r}");
        let copies: Vec<&TraceEvent> =
            o.trace.iter().filter(|e| e.kind == TraceKind::H2d && e.stream_name.ends_with("-shard")).collect();
        let gathers: Vec<&TraceEvent> =
            o.trace.iter().filter(|e| e.kind == TraceKind::Kernel && e.label.starts_with("all_gather")).collect();
        // The first block's first section: copies 0..chunks0 in order, gathers 0..chunks0 in order.
        assert!(copies.len() as u64 >= chunks0 && gathers.len() as u64 >= chunks0, "rank {r}");
        for j in 0..chunks0 as usize - 1 {
            assert!(
                gathers[j].label.ends_with(&format!("tag {:#x}", tag(0, 0, j as u64))),
                "rank {r}: gather {j} is {}",
                gathers[j].label
            );
            let next_copy_end = copies[j + 1].start + copies[j + 1].duration;
            assert!(
                gathers[j].start < next_copy_end,
                "rank {r}: the gather of chunk {j} started at {:?}, after the copy of chunk {} ended at {:?}",
                gathers[j].start,
                j + 1,
                next_copy_end
            );
            // ... and only after its own copy ended.
            assert!(gathers[j].start >= copies[j].start + copies[j].duration, "rank {r}: chunk {j}");
        }
    }
}

#[test]
#[cfg(weightferry_broken)] // needs RUSTFLAGS="--cfg weightferry_broken" (tests/all.sh runs it so)
fn skipping_the_last_use_wait_is_caught() {
    let outs = run_group(2, 5, 1, 3, OrderingFault::SkipLastUseWait);
    assert!(outs.iter().any(|o| o.violations > 0), "the hazard check never fired");
}

#[test]
fn invalid_gather_specs_are_errors() {
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let p: PlatformRef = sim.clone();
    let comm = SimCollectiveGroup::new(vec![sim.clone()]).pop().unwrap();
    let collective = CollectiveHandle::spawn(p.clone(), "comm", Box::new(move || Ok(Box::new(comm) as _))).unwrap();
    let stream = StreamHandle::spawn(p.clone(), "copy", StreamOptions::default()).unwrap();
    let compute = p.create_stream("compute").unwrap();
    let host = p.alloc_host(64, HostMemoryKind::Pinned).unwrap();
    let sec = GatherSection { host, host_offset: 0, shard_bytes: 64, output_offset: 0, tag: 1 };
    let spec = |eager| StackSpec {
        name: "g".into(),
        blocks: vec![BlockSpec { segments: Vec::new(), reads: Vec::new(), device_bytes: 64 }; 2],
        resident_head: 0,
        prefetch_depth: 1,
        static_slots: false,
        eager_prefetch: eager,
        ordering_fault: OrderingFault::None,
        submission: Default::default(),
    };
    let path = |blocks: Vec<GatherBlock>| GatherPath {
        collective: collective.clone(),
        sequence: GatherSequence::new(),
        blocks,
    };
    let one = GatherBlock { sections: vec![sec] };
    let cases = [
        (spec(false), path(vec![one.clone()])),
        (spec(true), path(vec![one.clone(), one.clone()])),
        (spec(false), path(vec![one.clone(), GatherBlock::default()])),
        // A gather stack submits through its actors: hook submission is refused.
        (StackSpec { submission: Submission::Hook, ..spec(false) }, path(vec![one.clone(), one.clone()])),
    ];
    for (s, g) in cases {
        let r = BlockStack::with_gather(p.clone(), s, None, compute, stream.clone(), g);
        assert!(matches!(r, Err(SchedulerError::InvalidSpec { .. })), "{r:?}");
    }
    // Without the broken orderings compiled in, a gather stack asking for one is refused too.
    #[cfg(not(weightferry_broken))]
    {
        let s = StackSpec { ordering_fault: OrderingFault::SkipLastUseWait, ..spec(false) };
        let r =
            BlockStack::with_gather(p.clone(), s, None, compute, stream.clone(), path(vec![one.clone(), one.clone()]));
        let want = SchedulerError::FaultNotBuilt { stack: "g".into(), fault: OrderingFault::SkipLastUseWait };
        assert_eq!(r.unwrap_err(), want);
    }
    assert_eq!(sim.device_memory().in_use, 0, "a refused stack allocated device memory");
    let ok =
        BlockStack::with_gather(p.clone(), spec(false), None, compute, stream.clone(), path(vec![one.clone(), one]));
    let stack = ok.unwrap();
    assert_eq!(collective.issued(), Vec::<(u64, u64)>::new(), "no gather before the first forward");
    stack.disable().unwrap();
    collective.shutdown();
    stream.shutdown();
}
