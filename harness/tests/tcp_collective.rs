//! The TCP collective (simulated-device ranks exchanging over the rendezvous), with ranks as threads of this
//! process: `run_rank` over it is bit-exact with the resident run and issues the same gathers on every rank (also
//! when it keeps only shards on host and restores the weights by gathers at its end); an
//! AllGather rebuilds exact bytes; ranks gathering different tags fail with a tag mismatch; a rank whose
//! AllGather fails to start is poisoned, and its peer fails as soon as it leaves, knowing a peer failed.

use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry::dist::{Rendezvous, RendezvousOptions, TcpCollective};
use weightferry::pipeline::presets::preset;
use weightferry::scheduler::{Collective, CollectiveError, CollectiveFactory, PlatformRef, SimConfig, SimPlatform};
use weightferry_harness::drivers::distributed::{resident_output, run_rank, DistributedRunSpec};
use weightferry_harness::engine::compute::{Compute, SimCompute};

/// Joins `world` rendezvous ranks on a fresh loopback port; runs `f(rank, rendezvous)` on a thread per rank.
fn ranks<T: Send>(world: usize, f: impl Fn(usize, Arc<Rendezvous>) -> T + Sync) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut listener = Some(listener);
    let opts = RendezvousOptions { timeout: Duration::from_secs(10), ..RendezvousOptions::default() };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (addr, f, l) = (addr.clone(), &f, if rank == 0 { listener.take() } else { None });
                s.spawn(move || {
                    let rdv = match l {
                        Some(l) => Rendezvous::root(l, world, opts),
                        None => Rendezvous::peer(&addr, rank, world, opts),
                    };
                    f(rank, Arc::new(rdv.unwrap()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn sim() -> Arc<SimPlatform> {
    Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap())
}

#[test]
fn run_rank_over_tcp_is_bit_exact_on_every_rank() {
    let desc = preset("wan-tiny").unwrap();
    let resident = resident_output(&desc, 2, 0).unwrap();
    {
        let release = true;
        let mut spec = DistributedRunSpec::new(desc.clone(), 3);
        spec.steps = 2;
        spec.chunk_bytes = Some(5000);
        let runs = ranks(3, |rank, rdv| {
            let sim = sim();
            let platform: PlatformRef = sim.clone();
            let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
            let tcp = TcpCollective::new(rdv, sim.clone());
            let factory: CollectiveFactory = Box::new(move || Ok(Box::new(tcp) as Box<dyn Collective>));
            let run = run_rank(platform, compute, factory, rank, 3, &spec).unwrap();
            assert!(sim.violations().is_empty(), "rank {rank}");
            assert_eq!(sim.host_memory().in_use, 0, "rank {rank} release {release}: host memory left behind");
            run
        });
        for (r, run) in runs.iter().enumerate() {
            assert!(run.output == resident, "release {release}: rank {r} output differs from the resident run");
            assert_eq!(run.issued, runs[0].issued, "release {release}: rank {r}");
            // Released, the ranks also restore the weights by the same gathers over TCP.
            assert_eq!(run.restore_issued, runs[0].restore_issued, "release {release}: rank {r}");
            assert_eq!(run.restore_issued.is_empty(), !release, "release {release}: rank {r}");
            assert_eq!(run.dit_host_bytes_while_running == run.shard_host_bytes, release, "rank {r}");
        }
    }
}

/// One AllGather of `input` (per rank) through the TCP collective; returns the gathered bytes or the error.
fn gather_once(rank: usize, rdv: Arc<Rendezvous>, input: Vec<u8>, tag: u64) -> Result<Vec<u8>, String> {
    let sim = sim();
    let p: PlatformRef = sim.clone();
    let world = rdv.world();
    let comm = TcpCollective::new(rdv, sim.clone());
    let stream = p.create_stream("comm").unwrap();
    let len = input.len() as u64;
    let (inp, out) = (p.alloc_device(len).unwrap(), p.alloc_device(len * world as u64).unwrap());
    sim.write_device(inp, 0, &input).unwrap();
    comm.all_gather(stream, (inp, 0, len), (out, 0), tag).map_err(|e| e.to_string())?;
    p.stream_synchronize(stream).map_err(|e| e.to_string())?;
    let mut bytes = vec![0u8; (len * world as u64) as usize];
    sim.read_device(out, 0, &mut bytes).unwrap();
    assert_eq!(comm.rank(), rank);
    Ok(bytes)
}

#[test]
fn an_all_gather_concatenates_in_rank_order() {
    let out = ranks(3, |rank, rdv| gather_once(rank, rdv, vec![rank as u8 + 10; 5], 42));
    let expected: Vec<u8> = [10u8, 11, 12].iter().flat_map(|&b| [b; 5]).collect();
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.as_ref().unwrap(), &expected, "rank {r}");
    }
}

#[test]
fn ranks_gathering_different_tags_fail_with_a_tag_mismatch() {
    let out = ranks(2, |rank, rdv| gather_once(rank, rdv, vec![1; 4], 100 + rank as u64));
    assert!(out[0].as_ref().unwrap_err().contains("AllGather #0: rank 0 issued tag 0x64, rank 1 issued tag 0x65"));
    assert!(out[1].as_ref().unwrap_err().contains("AllGather #0: rank 1 issued tag 0x65, rank 0 issued tag 0x64"));
}

#[test]
fn a_failed_start_poisons_the_rank_and_its_peer_fails_when_it_leaves() {
    let t = Instant::now();
    let out = ranks(2, |rank, rdv| {
        let sim = sim();
        let p: PlatformRef = sim.clone();
        let comm = TcpCollective::new(rdv, sim.clone());
        let peer_failed = comm.peer_failed_flag();
        let stream = p.create_stream("comm").unwrap();
        let (inp, out) = (p.alloc_device(8).unwrap(), p.alloc_device(16).unwrap());
        if rank == 1 {
            comm.fail_nth_call(0);
            let e = comm.all_gather(stream, (inp, 0, 8), (out, 0), 7).unwrap_err().to_string();
            // Poisoned: a later call fails at once, without entering the rendezvous.
            let again = comm.all_gather(stream, (inp, 0, 8), (out, 0), 8).unwrap_err().to_string();
            assert_eq!(
                comm.poison_reason(),
                Some(CollectiveError::RankFailed { rank: 1, seq: 0, reason: "injected AllGather failure".into() })
            );
            drop(comm); // leaves the rendezvous
            (e, again, peer_failed.load(Ordering::SeqCst))
        } else {
            comm.all_gather(stream, (inp, 0, 8), (out, 0), 7).unwrap();
            let e = p.stream_synchronize(stream).unwrap_err().to_string();
            (e, String::new(), peer_failed.load(Ordering::SeqCst))
        }
    });
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert!(out[1].0.contains("AllGather #0 failed on rank 1: injected AllGather failure"), "{}", out[1].0);
    assert!(out[1].1.contains("injected AllGather failure"), "{}", out[1].1);
    assert!(!out[1].2, "rank 1 failed on its own");
    assert!(out[0].0.contains("AllGather #0 failed on rank 0: rank 0: operation #0 (all_gather) with rank 1 failed"));
    assert!(out[0].2, "rank 0 knows a peer failed");
}
