//! Tests of the simulated collective and the collective actor: ranks are threads of this process, each with its
//! own simulated platform. Blocks of odd sizes are sharded (`shard`), each rank uploads only its shard, the
//! collective actor gathers, and a kernel on a compute stream must see exactly the full block; the AllGather order
//! must be identical on every rank whatever order each rank submits its requests in; a tag mismatch, a rank that
//! never shows up, and an injected failure must fail every rank (poisoning), quickly and never by hanging. The
//! warm-up AllGather runs once on every rank, frees its buffers, and a failed warm-up poisons the group. Ranks that
//! place one AllGather differently in their shared allocations (symmetric windows) poison the group.

#![cfg(not(weightferry_loom))]

use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weightferry_actors::collective::{
    Collective, CollectiveError, Placement, SimCollective, SimCollectiveGroup, SimCollectiveOptions,
};
use weightferry_actors::collective_actor::{CollectiveHandle, GatherCmd, WARM_UP_TAG};
use weightferry_actors::messages::{Completion, TicketBoard};
use weightferry_actors::platform::{DeviceBufferId, EventId, HostMemoryKind, Platform, PlatformRef, StreamId};
use weightferry_actors::shard::ShardSpec;
use weightferry_actors::sim::{Access, SimConfig, SimPlatform};
use weightferry_actors::sync::mailbox::{self, Receiver};

/// Element size of every test block (bytes), so element counts, not byte counts, decide the padding.
const ELEM: u64 = 2;

struct Rank {
    sim: Arc<SimPlatform>,
    p: PlatformRef,
    copy: StreamId,
    compute: StreamId,
    actor: CollectiveHandle,
}

fn platforms(world: usize) -> Vec<Arc<SimPlatform>> {
    (0..world)
        .map(|_| Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap()))
        .collect()
}

/// `world` ranks, each with a copy stream, a compute stream and a collective actor on its own platform. `setup`
/// may arm faults on the communicators before the actors take them.
fn ranks(world: usize, options: SimCollectiveOptions, setup: impl Fn(&SimCollective)) -> Vec<Rank> {
    let sims = platforms(world);
    let comms = SimCollectiveGroup::with_options(sims.clone(), options);
    sims.into_iter()
        .zip(comms)
        .map(|(sim, comm)| {
            setup(&comm);
            let p: PlatformRef = sim.clone();
            let copy = p.create_stream("copy").unwrap();
            let compute = p.create_stream("compute").unwrap();
            let actor = CollectiveHandle::spawn(p.clone(), "comm", Box::new(move || Ok(Box::new(comm) as _))).unwrap();
            Rank { sim, p, copy, compute, actor }
        })
        .collect()
}

fn block_bytes(b: usize, elems: u64) -> Vec<u8> {
    (0..elems * ELEM).map(|i| ((i as u8).wrapping_mul(29) ^ (b as u8).wrapping_mul(71)) | 1).collect()
}

fn tag_of(b: usize) -> u64 {
    0xB10C_0000 + b as u64
}

/// splitmix64 step, for seeded shuffles and jitter.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut st = seed;
    for i in (1..n).rev() {
        order.swap(i, (next(&mut st) % (i as u64 + 1)) as usize);
    }
    order
}

/// Receives completions until `count` arrived or `within` passed.
fn completions(rx: &Receiver<Completion>, count: usize, within: Duration) -> BTreeMap<u64, Completion> {
    let deadline = Instant::now() + within;
    let mut got = BTreeMap::new();
    while got.len() < count && Instant::now() < deadline {
        match rx.try_recv() {
            Ok(Some(c)) => {
                got.insert(c.ticket, c);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => break,
        }
    }
    got
}

/// What one rank saw: the bytes a compute kernel read from each gathered output, and each gather's completion.
struct RankRun {
    read: Vec<Vec<u8>>,
    done: BTreeMap<u64, Completion>,
}

/// Uploads this rank's shard of every block, submits the gathers in `order` (with jitter from `seed`), then reads
/// every output from a kernel on the compute stream ordered behind the gather's ready event.
fn run_rank(r: &Rank, rank: usize, world: usize, blocks: &[Vec<u8>], order: &[usize], seed: u64) -> RankRun {
    let p = &r.p;
    let board = Arc::new(TicketBoard::new());
    let (ntx, nrx) = mailbox::unbounded();
    let mut outputs: Vec<(DeviceBufferId, u64, EventId)> = Vec::new();
    let mut cmds: Vec<Option<GatherCmd>> = Vec::new();
    for (b, bytes) in blocks.iter().enumerate() {
        let spec = ShardSpec::new(bytes.len() as u64, ELEM, world).unwrap();
        let shard = spec.shard(bytes, rank).unwrap();
        let host = p.alloc_host(spec.shard_bytes(), HostMemoryKind::Pinned).unwrap();
        p.write_host(host, 0, &shard).unwrap();
        let input = p.alloc_device(spec.shard_bytes()).unwrap();
        let output = p.alloc_device(spec.padded_bytes()).unwrap();
        p.copy_h2d(r.copy, host, 0, input, 0, spec.shard_bytes()).unwrap();
        let shard_done = p.create_event().unwrap();
        p.record_event(shard_done, r.copy).unwrap();
        let ready = p.create_event().unwrap();
        outputs.push((output, spec.padded_bytes(), ready));
        cmds.push(Some(GatherCmd {
            seq: b as u64,
            ticket: b as u64 + 1,
            target: b,
            block: b,
            waits: vec![shard_done],
            input: (input, 0, spec.shard_bytes()),
            output: (output, 0),
            ready,
            tag: tag_of(b),
            board: Some(board.clone()),
            notify: Some(ntx.clone()),
        }));
    }
    let mut jitter = seed;
    for &b in order {
        std::thread::sleep(Duration::from_micros(next(&mut jitter) % 300));
        r.actor.gather(cmds[b].take().unwrap()).unwrap();
    }
    let sink: Arc<Mutex<Vec<Vec<u8>>>> = Arc::new(Mutex::new(vec![Vec::new(); blocks.len()]));
    for (b, &(output, padded, ready)) in outputs.iter().enumerate() {
        let alive = r.actor.clone();
        assert_eq!(board.wait(b as u64 + 1, &|| alive.is_alive()), Some(Ok(())), "gather {b} was not issued");
        p.stream_wait_event(r.compute, ready).unwrap();
        let sink = sink.clone();
        let kernel = Box::new(move |ctx: &weightferry_actors::sim::SimKernelCtx| {
            let mut out = vec![0u8; padded as usize];
            ctx.read(output, 0, &mut out).map_err(|e| e.to_string())?;
            sink.lock().unwrap()[b] = out;
            Ok(())
        });
        r.sim.launch(r.compute, "read gathered block", vec![Access::read(output, 0, padded)], kernel).unwrap();
    }
    p.stream_synchronize(r.compute).unwrap();
    r.actor.fence().unwrap();
    let done = completions(&nrx, blocks.len(), Duration::from_secs(10));
    let read = sink.lock().unwrap().clone();
    RankRun { read, done }
}

/// Runs every rank on its own thread with its own submission order; checks full blocks, clean hazards, equal
/// orders.
fn gather_blocks(world: usize, elems: &[u64], seed: u64) {
    let blocks: Vec<Vec<u8>> = elems.iter().enumerate().map(|(b, &n)| block_bytes(b, n)).collect();
    let group = ranks(world, SimCollectiveOptions { timeout: Duration::from_secs(20) }, |_| {});
    let orders: Vec<Vec<usize>> =
        (0..world).map(|r| shuffled(blocks.len(), seed ^ (r as u64 + 1).wrapping_mul(0x5151))).collect();
    let runs: Vec<RankRun> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let (blocks, order) = (&blocks, &orders[rank]);
                s.spawn(move || run_rank(r, rank, world, blocks, order, seed.wrapping_add(rank as u64)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected_order: Vec<(u64, u64)> = (0..blocks.len()).map(|b| (b as u64, tag_of(b))).collect();
    for (rank, (r, run)) in group.iter().zip(&runs).enumerate() {
        for (b, bytes) in blocks.iter().enumerate() {
            let spec = ShardSpec::new(bytes.len() as u64, ELEM, world).unwrap();
            let got = &run.read[b];
            assert_eq!(got.len() as u64, spec.padded_bytes(), "rank {rank} block {b}");
            assert_eq!(&got[..bytes.len()], &bytes[..], "rank {rank} block {b} differs from the full block");
            assert!(got[bytes.len()..].iter().all(|&x| x == 0), "rank {rank} block {b}: padding is not zero");
        }
        assert_eq!(r.actor.issued(), expected_order, "rank {rank} issued gathers out of the global order");
        assert_eq!(run.done.len(), blocks.len(), "rank {rank} missed completions");
        for (t, c) in &run.done {
            assert_eq!(c.result, Ok(()), "rank {rank} ticket {t}");
            assert_eq!((c.block as u64, c.target as u64), (t - 1, t - 1));
        }
        assert_eq!(r.sim.violations(), vec![], "rank {rank} hazards");
    }
    for r in &group {
        r.actor.shutdown();
    }
}

#[test]
fn two_ranks_rebuild_full_blocks_with_odd_sizes() {
    // 7 and 501 elements are odd (rank 1's shard is padded); 1 element leaves rank 1 nothing but padding.
    gather_blocks(2, &[7, 501, 2049, 1, 64], 11);
}

#[test]
fn four_ranks_rebuild_full_blocks_with_odd_sizes() {
    // 7 → shards of 2 (1 padding element), 501 → 126 (3), 2049 → 513 (3), 1 → 1 (3 ranks all padding), 64 → 16.
    gather_blocks(4, &[7, 501, 2049, 1, 64], 12);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn gather_order_is_identical_whatever_the_submission_order(
        world in 2usize..=4,
        elems in prop::collection::vec(1u64..300, 1..10),
        seed in any::<u64>(),
    ) {
        gather_blocks(world, &elems, seed);
    }
}

/// Two ranks' communicators on fresh platforms, each with a comm stream, a 4-byte input and an 8-byte output.
struct Pair {
    sims: Vec<Arc<SimPlatform>>,
    comms: Vec<SimCollective>,
    streams: Vec<StreamId>,
    bufs: Vec<(DeviceBufferId, DeviceBufferId)>,
}

fn pair(timeout: Duration) -> Pair {
    let sims = platforms(2);
    let comms = SimCollectiveGroup::with_options(sims.clone(), SimCollectiveOptions { timeout });
    let streams = sims.iter().map(|s| s.create_stream("comm").unwrap()).collect();
    let bufs = sims
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let input = s.alloc_device(4).unwrap();
            s.write_device(input, 0, &[r as u8 + 1; 4]).unwrap();
            (input, s.alloc_device(8).unwrap())
        })
        .collect();
    Pair { sims, comms, streams, bufs }
}

impl Pair {
    fn gather(&self, rank: usize, tag: u64) -> Result<(), weightferry_actors::platform::PlatformError> {
        let (input, output) = self.bufs[rank];
        self.comms[rank].all_gather(self.streams[rank], (input, 0, 4), (output, 0), tag)
    }
}

#[test]
fn matching_direct_all_gather_concatenates_in_rank_order() {
    let p = pair(Duration::from_secs(10));
    assert_eq!((p.comms[1].rank(), p.comms[1].world()), (1, 2));
    p.gather(0, 5).unwrap();
    p.gather(1, 5).unwrap();
    for r in 0..2 {
        p.sims[r].stream_synchronize(p.streams[r]).unwrap();
        let mut out = [0u8; 8];
        p.sims[r].read_device(p.bufs[r].1, 0, &mut out).unwrap();
        assert_eq!(out, [1, 1, 1, 1, 2, 2, 2, 2], "rank {r}");
    }
    assert_eq!(p.comms[0].group_issued_tags(), vec![vec![5], vec![5]]);
    assert_eq!(p.comms[0].poison_reason(), None);
}

#[test]
fn placements_round_trip_through_their_bytes_and_junk_is_refused() {
    for p in [
        Placement::Unshared,
        Placement::Windows { input: (0, 0), output: (1, 4096) },
        Placement::Windows { input: (7, u64::MAX), output: (usize::MAX >> 1, 3) },
    ] {
        assert_eq!(Placement::from_bytes(&p.to_bytes()), Some(p));
    }
    let mut junk = Placement::Unshared.to_bytes();
    junk[5] = 1;
    assert_eq!(Placement::from_bytes(&junk), None, "an unshared placement carries no windows");
    junk[0] = 2;
    assert_eq!(Placement::from_bytes(&junk), None);
    assert_eq!(Placement::from_bytes(&[1; 32]), None, "wrong length");
}

#[test]
fn symmetric_placements_gather_and_an_asymmetric_one_poisons_the_group() {
    let sims = platforms(2);
    let comms =
        SimCollectiveGroup::with_options(sims.clone(), SimCollectiveOptions { timeout: Duration::from_secs(30) });
    // Every rank allocates two shared buffers (windows 0 and 1) and one ordinary buffer.
    let bufs: Vec<[DeviceBufferId; 3]> = sims
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let a = s.alloc_device_shared(16).unwrap();
            let b = s.alloc_device_shared(16).unwrap();
            s.write_device(a, 0, &[r as u8 + 1; 16]).unwrap();
            s.write_device(b, 0, &[r as u8 + 5; 16]).unwrap();
            [a, b, s.alloc_device(16).unwrap()]
        })
        .collect();
    assert_eq!(sims[1].window_index(bufs[1][1]), Some(1));
    assert_eq!(sims[1].window_index(bufs[1][2]), None);
    let streams: Vec<StreamId> = sims.iter().map(|s| s.create_stream("comm").unwrap()).collect();
    // The same windows at the same offsets: gathered.
    for r in 0..2 {
        comms[r].all_gather(streams[r], (bufs[r][0], 4, 4), (bufs[r][1], 8), 1).unwrap();
    }
    // Unshared memory on every rank: not checked, gathered.
    for r in 0..2 {
        comms[r].all_gather(streams[r], (bufs[r][2], 0, 4), (bufs[r][2], 8), 2).unwrap();
    }
    for r in 0..2 {
        sims[r].stream_synchronize(streams[r]).unwrap();
        let mut out = [0u8; 8];
        sims[r].read_device(bufs[r][1], 8, &mut out).unwrap();
        assert_eq!(out, [1, 1, 1, 1, 2, 2, 2, 2], "rank {r}");
    }
    // Rank 1 reads from another offset of window 0: the copy engines would read the wrong bytes.
    comms[0].all_gather(streams[0], (bufs[0][0], 0, 4), (bufs[0][1], 0), 3).unwrap();
    let err = comms[1].all_gather(streams[1], (bufs[1][0], 4, 4), (bufs[1][1], 0), 3).unwrap_err();
    let expected = CollectiveError::AsymmetricPlacement {
        seq: 2,
        first_rank: 0,
        first: Placement::Windows { input: (0, 0), output: (1, 0) },
        rank: 1,
        got: Placement::Windows { input: (0, 4), output: (1, 0) },
    };
    assert_eq!(err, expected.clone().into());
    assert_eq!(
        expected.to_string(),
        "AllGather #2: rank 0 gathers from window 0 +0 into window 1 +0, rank 1 gathers from window 0 +4 into \
         window 1 +0"
    );
    assert!(sims[0].stream_synchronize(streams[0]).is_err(), "rank 0's pending AllGather fails");
    assert_eq!(comms[1].poison_reason(), Some(expected));
    // Shared on one rank, ordinary on the other, is asymmetric too.
    let sims = platforms(2);
    let comms = SimCollectiveGroup::new(sims.clone());
    let ins = [sims[0].alloc_device_shared(8).unwrap(), sims[1].alloc_device(8).unwrap()];
    let outs = [sims[0].alloc_device_shared(16).unwrap(), sims[1].alloc_device_shared(16).unwrap()];
    let streams: Vec<StreamId> = sims.iter().map(|s| s.create_stream("comm").unwrap()).collect();
    comms[0].all_gather(streams[0], (ins[0], 0, 8), (outs[0], 0), 9).unwrap();
    let err = comms[1].all_gather(streams[1], (ins[1], 0, 8), (outs[1], 0), 9).unwrap_err();
    assert!(err.to_string().contains("rank 1 gathers outside the shared allocations"), "{err}");
}

#[test]
fn tag_mismatch_is_an_error_on_both_ranks_without_waiting_for_the_timeout() {
    let p = pair(Duration::from_secs(30));
    let t0 = Instant::now();
    p.gather(0, 1).unwrap();
    let err = p.gather(1, 2).unwrap_err();
    let expected = CollectiveError::TagMismatch { seq: 0, first_rank: 0, first_tag: 1, rank: 1, tag: 2 };
    assert_eq!(err, expected.clone().into());
    // Rank 0's AllGather was enqueued; it fails on its stream.
    let sync0 = p.sims[0].stream_synchronize(p.streams[0]).unwrap_err();
    assert!(sync0.to_string().contains(&expected.to_string()), "rank 0 stream error: {sync0}");
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    for r in 0..2 {
        assert_eq!(p.comms[r].poison_reason(), Some(expected.clone()));
        // Poisoned: later calls fail at once and enqueue nothing.
        assert_eq!(p.gather(r, 3), Err(expected.clone().into()));
    }
    assert_eq!(p.comms[0].group_issued_tags(), vec![vec![1], vec![2]]);
    // The outputs were never written.
    let mut out = [9u8; 8];
    p.sims[0].read_device(p.bufs[0].1, 0, &mut out).unwrap();
    assert_eq!(out, [0; 8]);
}

#[test]
fn a_rank_that_never_shows_up_times_out_and_poisons_the_group() {
    let p = pair(Duration::from_millis(200));
    let t0 = Instant::now();
    p.gather(0, 7).unwrap();
    let err = p.sims[0].stream_synchronize(p.streams[0]).unwrap_err();
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(5), "waited {waited:?}");
    match p.comms[1].poison_reason() {
        Some(CollectiveError::Timeout { rank: 0, seq: 0, missing, waited }) => {
            assert_eq!(missing, vec![1]);
            assert!(waited >= Duration::from_millis(200));
        }
        other => panic!("expected a timeout of rank 0 at #0, got {other:?}"),
    }
    assert!(err.to_string().contains("waited"), "{err}");
    assert!(p.gather(1, 7).is_err());
}

#[test]
fn a_dropped_rank_poisons_its_peers() {
    let mut p = pair(Duration::from_secs(30));
    p.gather(0, 1).unwrap();
    let t0 = Instant::now();
    drop(p.comms.pop());
    assert!(p.sims[0].stream_synchronize(p.streams[0]).is_err());
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(p.comms[0].poison_reason(), Some(CollectiveError::RankLeft { rank: 1 }));
}

#[test]
fn tag_mismatch_through_actors_fails_every_rank() {
    let group = ranks(2, SimCollectiveOptions { timeout: Duration::from_secs(30) }, |_| {});
    let t0 = Instant::now();
    let rxs: Vec<Receiver<Completion>> = group
        .iter()
        .enumerate()
        .map(|(rank, r)| {
            let input = r.p.alloc_device(4).unwrap();
            let output = r.p.alloc_device(8).unwrap();
            let (ntx, nrx) = mailbox::unbounded();
            r.actor
                .gather(GatherCmd {
                    seq: 0,
                    ticket: 1,
                    target: 0,
                    block: 0,
                    waits: vec![],
                    input: (input, 0, 4),
                    output: (output, 0),
                    ready: r.p.create_event().unwrap(),
                    tag: 100 + rank as u64,
                    board: None,
                    notify: Some(ntx),
                })
                .unwrap();
            nrx
        })
        .collect();
    for (rank, rx) in rxs.iter().enumerate() {
        let done = completions(rx, 1, Duration::from_secs(10));
        let result = &done.get(&1).unwrap_or_else(|| panic!("rank {rank}: no completion")).result;
        let msg = result.as_ref().expect_err("a mismatched gather must fail").to_string();
        assert!(msg.contains("issued tag"), "rank {rank}: {msg}");
        assert!(group[rank].actor.fence().is_err(), "rank {rank}: fence after a failed gather");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    for r in &group {
        r.actor.shutdown();
    }
}

#[test]
fn an_injected_failure_on_one_rank_fails_every_rank_and_poisons_later_gathers() {
    const WORLD: usize = 4;
    const FAILING: usize = 2;
    let failing_set = std::sync::atomic::AtomicUsize::new(0);
    let group = ranks(WORLD, SimCollectiveOptions { timeout: Duration::from_secs(60) }, |c| {
        if c.rank() == FAILING {
            c.fail_nth_call(1);
            failing_set.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    assert_eq!(failing_set.load(std::sync::atomic::Ordering::SeqCst), 1);
    let t0 = Instant::now();
    let barrier = std::sync::Barrier::new(WORLD);
    let results: Vec<BTreeMap<u64, Completion>> = std::thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let barrier = &barrier;
                s.spawn(move || {
                    let (ntx, nrx) = mailbox::unbounded();
                    let board = Arc::new(TicketBoard::new());
                    let mut done = BTreeMap::new();
                    for seq in 0..3u64 {
                        if seq == 1 {
                            // Every rank has completed gather #0 before anyone starts #1, so #0 succeeds everywhere.
                            done = completions(&nrx, 1, Duration::from_secs(10));
                            barrier.wait();
                        }
                        let input = r.p.alloc_device(6).unwrap();
                        r.sim.write_device(input, 0, &[rank as u8; 6]).unwrap();
                        let output = r.p.alloc_device(6 * WORLD as u64).unwrap();
                        r.actor
                            .gather(GatherCmd {
                                seq,
                                ticket: seq + 1,
                                target: 0,
                                block: seq as usize,
                                waits: vec![],
                                input: (input, 0, 6),
                                output: (output, 0),
                                ready: r.p.create_event().unwrap(),
                                tag: seq,
                                board: Some(board.clone()),
                                notify: Some(ntx.clone()),
                            })
                            .unwrap();
                    }
                    done.extend(completions(&nrx, 2, Duration::from_secs(10)));
                    done
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    for (rank, done) in results.iter().enumerate() {
        let outcome: Vec<bool> = (1..=3).map(|t| done.get(&t).map(|c| c.result.is_ok()).unwrap_or(true)).collect();
        assert_eq!(done.len(), 3, "rank {rank}: {done:?}");
        assert_eq!(outcome, vec![true, false, false], "rank {rank}: {done:?}");
        let fence = group[rank].actor.fence();
        assert!(fence.is_err(), "rank {rank}: fence after a failed gather: {fence:?}");
    }
    // Rank 2 never started gather #2 (its actor is poisoned); the others started it at most once.
    assert_eq!(group[FAILING].actor.issued(), vec![(0, 0), (1, 1)]);
    for r in &group {
        r.actor.shutdown();
    }
}

#[test]
fn the_poison_reason_names_the_injected_failure() {
    let p = pair(Duration::from_secs(30));
    p.comms[1].fail_nth_call(0);
    p.gather(0, 4).unwrap();
    let err = p.gather(1, 4).unwrap_err();
    let expected =
        CollectiveError::RankFailed { rank: 1, seq: 0, reason: "driver error: injected AllGather failure".to_string() };
    assert_eq!(err, expected.clone().into());
    assert_eq!(p.comms[0].poison_reason(), Some(expected));
    assert!(p.sims[0].stream_synchronize(p.streams[0]).is_err());
}

#[test]
fn warm_up_gathers_once_on_every_rank_and_frees_its_buffers() {
    for world in [1usize, 2, 3] {
        let rs = ranks(world, SimCollectiveOptions { timeout: Duration::from_secs(10) }, |_| {});
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = rs.iter().map(|r| s.spawn(move || r.actor.warm_up(0))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (r, res)) in rs.iter().zip(results).enumerate() {
            assert_eq!(res, Ok(()), "N={world} rank {rank}");
            assert_eq!(r.actor.issued(), vec![(0, WARM_UP_TAG)], "N={world} rank {rank}");
            assert_eq!(r.sim.device_memory().in_use, 0, "N={world} rank {rank}: warm-up buffers leaked");
            assert!(r.sim.violations().is_empty());
            assert_eq!(r.actor.fence(), Ok(()));
            r.actor.shutdown();
        }
    }
}

#[test]
fn a_failed_warm_up_poisons_the_group() {
    let rs = ranks(2, SimCollectiveOptions { timeout: Duration::from_secs(10) }, |c| {
        if c.rank() == 1 {
            c.fail_nth_call(0);
        }
    });
    let t = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = rs.iter().map(|r| s.spawn(move || r.actor.warm_up(0))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    for (rank, res) in results.iter().enumerate() {
        let e = res.as_ref().expect_err("warm-up should fail");
        assert!(e.to_string().contains("injected AllGather failure"), "rank {rank}: {e}");
    }
    assert!(rs[1].actor.poisoned().is_some(), "rank 1 started no collective and is poisoned");
    for r in &rs {
        assert_eq!(r.sim.device_memory().in_use, 0);
        r.actor.shutdown();
    }
}
