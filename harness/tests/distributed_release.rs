//! Distributed runs that keep only their shards on host (the distributed backend releases the loaded DiT weights at enable), on simulated ranks
//! (threads of this process, each with its own simulated device and its own model).
//!
//! Covered: on 2 and 4 ranks (unchunked and chunked, untimed and timed) every rank's output is bit-identical to the
//! resident run; while the run executes every streamed DiT storage of every rank is released (`Home::Sharded`),
//! reading it is `ModelError::Sharded`, and the rank's host allocations for DiT weights (measured by the simulated
//! device's host accounting) are exactly its shard bytes, which the run reports as `dit_host_bytes_while_running`;
//! at the end every rank issues the same restore AllGathers (restore tags, numbered right after the run's gathers),
//! the model's checksum equals the one before the run, and no device or host memory is left behind. Without the
//! option the rank holds the full DiT besides its shards, issues no restore gather and changes no home. A failed
//! AllGather during the run makes every rank report `Poisoned` ("reload"), no restore AllGather reaches any
//! communicator, the released storages stay a typed error and nothing leaks. A device-to-host copy or host
//! allocation failing on one rank during the restore makes that rank alone fail with `RestoreFailed`: each of its
//! storages is either restored bit-exactly or still released, no host buffer is leaked, and its peer restores
//! everything.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weightferry::config::OffloadConfig;
use weightferry::model::{Home, HostModel, ModelError};
use weightferry::offload::shard_restore::{is_restore_tag, RESTORE_TAG};
use weightferry::offload::units::build_unit_plan;
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::plan::resolve_offload_plan;
use weightferry::scheduler::{
    Collective, CollectiveFactory, DeviceBufferId, FaultPlan, Platform, PlatformError, PlatformRef, SimCollective,
    SimCollectiveGroup, SimCollectiveOptions, SimConfig, SimPlatform, StreamId, WARM_UP_TAG,
};
use weightferry::session::Session;
use weightferry_harness::drivers::distributed::{
    rank_session, resident_output, run_distributed_sim, run_rank_in_session, DistributedRunError, DistributedRunSpec,
    RankRun, RunProbe, RunningRank,
};
use weightferry_harness::engine::compute::{Compute, SimCompute};
use weightferry_harness::engine::synthetic::{synthetic_bytes, SyntheticWeights};

const SEED: u64 = 5;

/// A communicator that records the tag of every AllGather it is asked for, then passes the call on.
#[derive(Debug)]
struct Recording {
    inner: SimCollective,
    tags: Arc<Mutex<Vec<u64>>>,
}

impl Collective for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_gather(
        &self,
        stream: StreamId,
        input: (DeviceBufferId, u64, u64),
        output: (DeviceBufferId, u64),
        tag: u64,
    ) -> Result<(), PlatformError> {
        self.tags.lock().unwrap().push(tag);
        self.inner.all_gather(stream, input, output, tag)
    }
    fn windowed_gathers(&self) -> u64 {
        self.inner.windowed_gathers()
    }
}

/// What one rank left behind.
struct Ranked {
    sim: Arc<SimPlatform>,
    /// The rank's library session, holding its model.
    session: Session,
    /// The model's checksum before the run.
    before: u64,
    result: Result<RankRun, DistributedRunError>,
    /// Tags of every AllGather its communicator was asked for.
    tags: Vec<u64>,
}

impl Ranked {
    fn model(&self) -> &HostModel {
        self.session.model()
    }
}

fn sims(world: usize, faults: &[(usize, FaultPlan)]) -> Vec<Arc<SimPlatform>> {
    (0..world)
        .map(|r| {
            let plan = faults.iter().find(|(fr, _)| *fr == r).map(|(_, p)| p.clone()).unwrap_or_default();
            Arc::new(SimPlatform::new(SimConfig { tracing: false, faults: plan, ..SimConfig::default() }).unwrap())
        })
        .collect()
}

/// Runs `spec` on `sims.len()` ranks through `run_rank_in_session`, each on a session over its own model of seed
/// `spec.seed`;
/// `fail_gather = (rank, n)` makes that rank's `n`-th AllGather call fail to start.
fn run_ranks(spec: &DistributedRunSpec, sims: &[Arc<SimPlatform>], fail_gather: Option<(usize, u64)>) -> Vec<Ranked> {
    let world = sims.len();
    let comms = SimCollectiveGroup::with_options(sims.to_vec(), SimCollectiveOptions { timeout: spec.timeout });
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                if let Some((r, n)) = fail_gather {
                    if r == rank {
                        comm.fail_nth_call(n);
                    }
                }
                let sim = sims[rank].clone();
                s.spawn(move || {
                    let platform: PlatformRef = sim.clone();
                    let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
                    let tags = Arc::new(Mutex::new(Vec::new()));
                    let recording = Recording { inner: comm, tags: tags.clone() };
                    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(recording) as Box<dyn Collective>));
                    let desc = Arc::new(spec.pipeline.clone());
                    let model = HostModel::synthetic(platform, desc, spec.seed).unwrap();
                    let before = model.checksum().unwrap();
                    let mut session = rank_session(model, factory, rank, world, spec).unwrap();
                    let result = run_rank_in_session(compute, &mut session, rank, world, spec);
                    let tags = tags.lock().unwrap().clone();
                    Ranked { sim, session, before, result, tags }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The storages of the DiT units a distributed run streams.
fn dit_storages(desc: &PipelineDesc) -> BTreeSet<StorageId> {
    let config =
        OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#)
            .unwrap();
    let plan = resolve_offload_plan(desc, &config).unwrap();
    build_unit_plan(desc, &config, &plan).stacks.iter().flat_map(|s| &s.units).flat_map(|u| u.storages()).collect()
}

/// Host bytes the model's loaded storages outside `except` hold (every loaded buffer is at least one byte).
fn loaded_alloc_bytes(model: &HostModel, except: &[StorageId]) -> u64 {
    model
        .desc()
        .storages
        .keys()
        .filter(|s| matches!(model.home(**s), Some(Home::Loaded { .. })) && !except.contains(s))
        .map(|s| model.storage_bytes(*s).max(1))
        .sum()
}

/// What the probe saw on one rank while it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    rank: usize,
    dit_storages: usize,
    not_released: usize,
    /// Released storages whose read was not exactly `ModelError::Sharded`.
    bad_reads: usize,
    checksum_refused: bool,
    shard_host_bytes: u64,
    dit_host_bytes: u64,
    /// Simulated host bytes held minus the loaded non-DiT storages: the host allocation for DiT weights.
    dit_alloc_bytes: u64,
    pinned: u64,
}

fn probe_into(sims: Vec<Arc<SimPlatform>>, seen: Arc<Mutex<Vec<Seen>>>) -> RunProbe {
    RunProbe(Arc::new(move |r: &RunningRank<'_>| {
        let model = r.model;
        let mem = sims[r.rank].host_memory();
        let released = |s: &&StorageId| model.home(**s) == Some(Home::Sharded);
        let bad_reads = r
            .dit_storages
            .iter()
            .filter(released)
            .filter(|s| {
                let mut one = [0u8; 1];
                let typed = ModelError::Sharded { storage: s.0 };
                model.read_storage(**s) != Err(typed.clone())
                    || model.read_storage_range(**s, 0, &mut one) != Err(typed)
            })
            .count();
        seen.lock().unwrap().push(Seen {
            rank: r.rank,
            dit_storages: r.dit_storages.len(),
            not_released: r.dit_storages.iter().filter(|s| !released(s)).count(),
            bad_reads,
            checksum_refused: matches!(model.checksum(), Err(ModelError::Sharded { .. })),
            shard_host_bytes: r.shard_host_bytes,
            dit_host_bytes: r.dit_host_bytes,
            dit_alloc_bytes: mem.in_use - loaded_alloc_bytes(model, r.dit_storages),
            pinned: mem.pinned,
        });
    }))
}

#[test]
fn released_runs_hold_only_shards_while_running_and_restore_the_model_bit_exactly() {
    let cases = [
        ("flux-tiny", 2usize, 1usize, None, None),
        ("flux-tiny", 4, 2, Some(4000u64), None),
        ("wan-tiny", 2, 2, Some(12_345), Some((1u32, 3u32))),
        ("wan-tiny", 4, 1, None, None),
    ];
    for (name, world, depth, chunk, timed) in cases {
        let what = format!("{name} N={world} depth {depth} chunk {chunk:?} timed {timed:?}");
        let desc = preset(name).unwrap();
        let resident = resident_output(&desc, 3, SEED).unwrap();
        let dit = dit_storages(&desc);
        let mut spec = DistributedRunSpec::new(desc.clone(), world);
        (spec.depth, spec.chunk_bytes, spec.timed_steps, spec.seed, spec.steps) = (depth, chunk, timed, SEED, 3);
        let sims = sims(world, &[]);
        let seen = Arc::new(Mutex::new(Vec::new()));
        spec.probe = Some(probe_into(sims.clone(), seen.clone()));
        let ranks = run_ranks(&spec, &sims, None);
        let runs: Vec<RankRun> =
            ranks.iter().map(|r| r.result.clone().unwrap_or_else(|e| panic!("{what}: {e}"))).collect();

        // While running: every DiT storage released and a typed error to read; DiT host memory = the shards.
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_by_key(|s| s.rank);
        assert_eq!(seen.iter().map(|s| s.rank).collect::<Vec<_>>(), (0..world).collect::<Vec<_>>(), "{what}");
        for (s, run) in seen.iter().zip(&runs) {
            assert_eq!((s.dit_storages, s.not_released, s.bad_reads), (dit.len(), 0, 0), "{what}: {s:?}");
            assert!(s.checksum_refused, "{what}: {s:?}");
            assert_eq!(s.shard_host_bytes, run.shard_host_bytes, "{what}");
            assert_eq!(s.dit_alloc_bytes, run.shard_host_bytes, "{what}: host allocation for DiT weights: {s:?}");
            assert_eq!(s.pinned, run.shard_host_bytes, "{what}: {s:?}");
            assert_eq!((s.dit_host_bytes, run.dit_host_bytes_while_running), (s.pinned, s.pinned), "{what}");
            // 1/N of the streamed sections (padding below N elements per section), not the DiT plus its shards.
            let n = world as u64;
            assert!(run.shard_host_bytes * n >= run.full_section_bytes, "{what}");
            assert!(run.shard_host_bytes * n - run.full_section_bytes < run.sections * n * 8, "{what}");
        }
        let dit_bytes: u64 = dit.iter().map(|s| desc.storages[s].byte_size()).sum();
        for (r, (ranked, run)) in ranks.iter().zip(&runs).enumerate() {
            assert!(run.output == resident, "{what}: rank {r} output differs from the resident run");
            assert_eq!(run.released_bytes, dit_bytes, "{what}: rank {r}");
            // The restore: the same gathers on every rank, right after the run's, all with restore tags.
            assert_eq!(run.restore_issued, runs[0].restore_issued, "{what}: rank {r}");
            assert_eq!(run.issued, runs[0].issued, "{what}: rank {r}");
            let next = run.issued.len() as u64;
            let seqs: Vec<u64> = run.restore_issued.iter().map(|x| x.0).collect();
            assert_eq!(seqs, (next..next + seqs.len() as u64).collect::<Vec<_>>(), "{what}");
            assert!(run.restore_issued.iter().all(|x| is_restore_tag(x.1)), "{what}");
            assert!(run.issued.iter().all(|x| !is_restore_tag(x.1)), "{what}");
            assert!(run.restore_issued.len() as u64 >= run.sections, "{what}: one gather per section at least");
            assert_eq!(ranked.tags.iter().filter(|t| is_restore_tag(**t)).count(), run.restore_issued.len(), "{what}");
            // The block gathers went between the stacks' shared buffers; the warm-up and the restore did not.
            let warm_ups = run.issued.iter().filter(|(_, t)| *t == WARM_UP_TAG).count();
            assert_eq!(run.windowed_all_gathers, (run.issued.len() - warm_ups) as u64, "{what}");
            // After: restored bit-exactly, nothing left behind.
            assert!(ranked.model().sharded().is_empty(), "{what}: rank {r}");
            assert_eq!(ranked.model().checksum().unwrap(), ranked.before, "{what}: rank {r} weights changed");
            assert_eq!(ranked.sim.device_memory().in_use, 0, "{what}: rank {r} leaked device memory");
            assert_eq!(ranked.sim.host_memory().in_use, loaded_alloc_bytes(ranked.model(), &[]), "{what}: rank {r}");
            assert!(ranked.sim.violations().is_empty(), "{what}: rank {r}: {:?}", ranked.sim.violations());
        }
        for r in ranks {
            drop(r.session);
            r.sim.shutdown();
        }
    }
}

#[test]
fn run_distributed_sim_with_release_is_bit_exact_and_its_probe_sees_typed_errors() {
    let desc = preset("wan-tiny").unwrap();
    let resident = resident_output(&desc, 2, 0).unwrap();
    let mut spec = DistributedRunSpec::new(desc, 3);
    spec.steps = 2;
    let seen = Arc::new(Mutex::new(Vec::<(usize, usize, usize)>::new()));
    let log = seen.clone();
    spec.probe = Some(RunProbe(Arc::new(move |r: &RunningRank<'_>| {
        let typed = r
            .dit_storages
            .iter()
            .filter(|s| r.model.read_storage(**s) == Err(ModelError::Sharded { storage: s.0 }))
            .count();
        log.lock().unwrap().push((r.rank, r.dit_storages.len(), typed));
    })));
    let runs = run_distributed_sim(&spec).unwrap();
    for (r, run) in runs.iter().enumerate() {
        let run = run.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(run.output == resident, "rank {r}");
        assert_eq!(run.hazard_violations, 0, "rank {r}");
        assert_eq!(run.dit_host_bytes_while_running, run.shard_host_bytes, "rank {r}");
        assert!(!run.restore_issued.is_empty());
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|(_, n, typed)| *n > 0 && typed == n), "{seen:?}");
}

#[test]
fn a_failed_gather_during_a_released_run_is_poisoned_and_issues_no_restore_gather() {
    let desc = preset("wan-tiny").unwrap();
    let dit = dit_storages(&desc);
    // The last AllGather of a run: a peer's gather then fails on its device after it issued everything, so only
    // the fence before the restore (not a refused gather) tells it that its collective is unusable.
    let last =
        run_distributed_sim(&DistributedRunSpec::new(desc.clone(), 2)).unwrap()[0].as_ref().unwrap().issued.len();
    for (world, nth) in [(2usize, 7u64), (4, 20), (2, last as u64 - 1), (3, last as u64 - 1)] {
        let what = format!("N={world} failing call {nth}");
        let mut spec = DistributedRunSpec::new(desc.clone(), world);
        (spec.seed, spec.timeout) = (SEED, Duration::from_secs(20));
        let sims = sims(world, &[]);
        let ranks = run_ranks(&spec, &sims, Some((1, nth)));
        for (r, ranked) in ranks.iter().enumerate() {
            let err = ranked.result.as_ref().err().unwrap_or_else(|| panic!("{what}: rank {r} succeeded"));
            match err {
                DistributedRunError::Poisoned { rank, .. } => assert_eq!(*rank, r, "{what}"),
                other => panic!("{what}: rank {r} should be poisoned, got {other}"),
            }
            assert!(err.to_string().contains("the pipeline must be reloaded"), "{what}: {err}");
            if r == 1 {
                assert!(err.to_string().contains("injected AllGather failure"), "{what}: {err}");
            }
            // No restore AllGather reached the communicator: the failing call ended the rank's gathers.
            assert!(ranked.tags.iter().all(|t| !is_restore_tag(*t)), "{what}: rank {r} tags {:x?}", ranked.tags);
            assert!(ranked.tags.len() as u64 <= nth + 1 || r != 1, "{what}: rank 1 gathered past its failure");
            assert_eq!(ranked.tags.first(), Some(&WARM_UP_TAG), "{what}");
            // The released storages stay released: a typed error, never bytes.
            let model = ranked.model();
            assert_eq!(model.sharded().into_iter().collect::<BTreeSet<_>>(), dit, "{what}: rank {r}");
            for s in &dit {
                assert_eq!(model.read_storage(*s), Err(ModelError::Sharded { storage: s.0 }), "{what}");
            }
            assert!(matches!(model.checksum(), Err(ModelError::Sharded { .. })), "{what}");
            // Nothing leaks: no device memory, no shard, only the non-DiT storages' loaded buffers.
            assert_eq!(ranked.sim.device_memory().in_use, 0, "{what}: rank {r}");
            let mem = ranked.sim.host_memory();
            assert_eq!((mem.in_use, mem.pinned), (loaded_alloc_bytes(model, &[]), 0), "{what}: rank {r}");
        }
        for r in ranks {
            drop(r.session);
            r.sim.shutdown();
        }
    }
}

/// Runs a 2-rank released flux-tiny run with `fault` on rank 1's device and checks the outcome: rank 1 fails with
/// `RestoreFailed`, every one of its DiT storages is either restored bit-exactly or still released, it leaks no
/// buffer; rank 0 restores everything.
fn check_restore_fault(fault: FaultPlan, what: &str) -> usize {
    let desc = preset("flux-tiny").unwrap();
    let dit = dit_storages(&desc);
    let mut spec = DistributedRunSpec::new(desc.clone(), 2);
    (spec.seed, spec.chunk_bytes) = (SEED, Some(4000));
    let sims = sims(2, &[(1, fault)]);
    let ranks = run_ranks(&spec, &sims, None);
    let peer = ranks[0].result.as_ref().unwrap_or_else(|e| panic!("{what}: rank 0: {e}"));
    assert!(!peer.restore_issued.is_empty(), "{what}");
    assert_eq!(ranks[0].model().checksum().unwrap(), ranks[0].before, "{what}: rank 0 not restored");
    let failed = &ranks[1];
    let unrestored = match &failed.result {
        Err(e @ DistributedRunError::RestoreFailed { rank: 1, unrestored, cause, run }) => {
            assert!(cause.contains("injected failure"), "{what}: {e}");
            assert!(run.is_empty(), "{what}: {e}");
            assert!(e.to_string().contains("the pipeline must be reloaded"), "{what}: {e}");
            *unrestored
        }
        other => panic!("{what}: rank 1 should fail its restore, got {other:?}"),
    };
    // Every gather was still issued on the failing rank, so its peer could restore.
    assert_eq!(failed.tags, ranks[0].tags, "{what}: rank 1 stopped gathering");
    let model = failed.model();
    let sharded: BTreeSet<StorageId> = model.sharded().into_iter().collect();
    assert_eq!(sharded.len(), unrestored, "{what}");
    assert!(unrestored > 0 && sharded.is_subset(&dit), "{what}: {sharded:?}");
    for s in &dit {
        if sharded.contains(s) {
            assert_eq!(model.read_storage(*s), Err(ModelError::Sharded { storage: s.0 }), "{what}");
        } else {
            let d = &desc.storages[s];
            let want = synthetic_bytes(d.dtype, d.numel, SEED, *s);
            assert_eq!(model.read_storage(*s).unwrap(), want, "{what}: storage {s:?} restored wrong");
        }
    }
    assert_eq!(failed.sim.device_memory().in_use, 0, "{what}");
    let mem = failed.sim.host_memory();
    assert_eq!((mem.in_use, mem.pinned), (loaded_alloc_bytes(model, &[]), 0), "{what}: a host buffer leaked");
    let loaded = model.desc().storages.keys().filter(|s| matches!(model.home(**s), Some(Home::Loaded { .. })));
    assert_eq!(mem.buffers, loaded.count() as u64, "{what}: a host buffer leaked");
    for r in ranks {
        drop(r.session);
        r.sim.shutdown();
    }
    unrestored
}

#[test]
fn a_failed_restore_copy_or_host_allocation_leaves_typed_storages_and_no_leak() {
    // On the simulated device only the restore copies device → host, so the Nth D2H copy is the restore's Nth.
    let mut unrestored = Vec::new();
    for n in [0u64, 9] {
        let fault = FaultPlan { fail_d2h_copy: Some(n), ..FaultPlan::none() };
        unrestored.push(check_restore_fault(fault, &format!("d2h copy #{n} fails")));
    }
    // Host allocations before the restore: one per storage (the model), one per shard section.
    let desc = preset("flux-tiny").unwrap();
    let mut spec = DistributedRunSpec::new(desc.clone(), 2);
    spec.chunk_bytes = Some(4000);
    let sections = run_distributed_sim(&spec).unwrap()[0].as_ref().unwrap().sections;
    let before_restore = desc.storages.len() as u64 + sections;
    for k in [0u64, 5] {
        let fault = FaultPlan { fail_host_alloc: Some(before_restore + k), ..FaultPlan::none() };
        unrestored.push(check_restore_fault(fault, &format!("host allocation #{k} of the restore fails")));
    }
    // One unit's storages stay released each time, never the whole DiT.
    let dit = dit_storages(&desc).len();
    assert!(unrestored.iter().all(|u| *u < dit), "{unrestored:?} of {dit}");
    assert_eq!(RESTORE_TAG, 1 << 62);
}
