//! Gather-path block stacks (`BlockStack::with_gather`) on simulated ranks: each rank holds only its shards of
//! two-section blocks of odd sizes; over several passes a kernel on each rank's compute stream reads every block
//! between its hooks and must see exactly the full block bytes; no hazard; every rank issues the same gathers in
//! the same order; invalid gather specs are typed errors, and with the slot's last-use wait skipped the hazard
//! check fires (the check can fail).

#![cfg(not(weightferry_loom))]

use std::sync::{Arc, Mutex};
use std::time::Duration;
use weightferry_actors::collective::{Collective, SimCollectiveGroup, SimCollectiveOptions};
use weightferry_actors::collective_actor::CollectiveHandle;
use weightferry_actors::platform::{HostMemoryKind, Platform, PlatformRef};
use weightferry_actors::shard::ShardSpec;
use weightferry_actors::sim::{Access, SimConfig, SimKernelCtx, SimPlatform};
use weightferry_actors::{
    BlockSpec, BlockStack, GatherBlock, GatherPath, GatherSection, GatherSequence, OrderingFault, SchedulerError,
    StackSpec, StreamHandle, StreamOptions,
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
}

fn run_rank(
    sim: Arc<SimPlatform>,
    comm: weightferry_actors::collective::SimCollective,
    blocks: usize,
    depth: usize,
    passes: usize,
    fault: OrderingFault,
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
            let spec = ShardSpec::new(bytes.len() as u64, ELEMS[k], world).unwrap();
            let shard = spec.shard(bytes, rank).unwrap();
            let host = p.alloc_host(spec.shard_bytes(), HostMemoryKind::Pinned).unwrap();
            p.write_host(host, 0, &shard).unwrap();
            hosts.push(host);
            secs.push(GatherSection {
                host,
                host_offset: 0,
                shard_bytes: spec.shard_bytes(),
                output_offset: k as u64 * SECOND_AT,
                tag: (b as u64) << 8 | k as u64,
            });
        }
        gather_blocks.push(GatherBlock { sections: secs });
    }
    let spec = StackSpec {
        name: format!("gathered-r{rank}"),
        blocks: (0..blocks).map(|_| BlockSpec { segments: Vec::new(), device_bytes: 2 * SECOND_AT }).collect(),
        resident_head: 0,
        prefetch_depth: depth,
        eager_prefetch: false,
        ordering_fault: fault,
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
    Outcome { reads, issued, violations: sim.violations().len() }
}

fn run_group(world: usize, blocks: usize, depth: usize, passes: usize, fault: OrderingFault) -> Vec<Outcome> {
    let sims: Vec<Arc<SimPlatform>> = (0..world)
        .map(|_| Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap()))
        .collect();
    let comms =
        SimCollectiveGroup::with_options(sims.clone(), SimCollectiveOptions { timeout: Duration::from_secs(20) });
    std::thread::scope(|s| {
        let hs: Vec<_> = sims
            .into_iter()
            .zip(comms)
            .map(|(sim, comm)| s.spawn(move || run_rank(sim, comm, blocks, depth, passes, fault)))
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
                assert_eq!(&o.issued[..2], &[(0, 0), (1, 1)], "{what}");
                assert!(o.issued.len() >= 30 && o.issued.len() % 2 == 0, "{what}: {}", o.issued.len());
            }
        }
    }
}

#[test]
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
        blocks: vec![BlockSpec { segments: Vec::new(), device_bytes: 64 }; 2],
        resident_head: 0,
        prefetch_depth: 1,
        eager_prefetch: eager,
        ordering_fault: OrderingFault::None,
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
    ];
    for (s, g) in cases {
        let r = BlockStack::with_gather(p.clone(), s, None, compute, stream.clone(), g);
        assert!(matches!(r, Err(SchedulerError::InvalidSpec { .. })), "{r:?}");
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
