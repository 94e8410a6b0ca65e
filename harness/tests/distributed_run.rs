//! Distributed layerwise runs end to end on simulated ranks (threads of this process, each with its own simulated
//! device): for flux-tiny and wan-tiny, 2 and 4 ranks, prefetch depths 1 and 2, every rank's output is
//! bit-identical to the fully resident single-rank output; every rank issues the same AllGathers (sequence numbers
//! and tags) in the same order; no rank sees a hazard; each rank's host shards are 1/N of the streamed sections
//! (plus padding) and each rank copies only its shards host → device. A failed AllGather on one rank makes every
//! rank's run fail — quickly, never by hanging — and the failing rank reports its collective poisoned; every rank
//! still frees all its device memory (the engine's activations too, on a failed compute stream). Chunked
//! transport (one AllGather per chunk) is bit-exact at chunk sizes that do not divide the sections and larger
//! than them. Under randomized per-rank timings (hooks sleeping, comm streams slowed differently) every rank still
//! issues the same gathers in the same order; the group-size matrix of the config (data / sequence / tensor
//! parallel sizes) sets the rank count of runs that are bit-exact on every rank. The public, platform-generic
//! `run_rank` gives the same results one rank at a time, warms the communicator up with the first AllGather, and
//! rejects a rank / world that does not match the spec or the communicator.

use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry::config::OffloadConfig;
use weightferry::model::{fnv1a, FNV_OFFSET};
use weightferry::pipeline::presets::preset;
use weightferry::scheduler::{
    Collective, CollectiveFactory, Platform, PlatformRef, SimCollective, SimCollectiveGroup, SimConfig, SimPlatform,
    WARM_UP_TAG,
};
use weightferry_harness::drivers::distributed::run_rank;
use weightferry_harness::drivers::distributed::{
    resident_output, run_distributed_sim, DistributedRunError, DistributedRunSpec, Jitter, RankRun,
};
use weightferry_harness::drivers::run::{run, RunSpec};
use weightferry_harness::engine::compute::{Compute, SimCompute};
use weightferry_harness::engine::synthetic::SyntheticWeights;

fn ok_ranks(spec: &DistributedRunSpec) -> Vec<RankRun> {
    run_distributed_sim(spec)
        .expect("run")
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

#[test]
fn every_rank_is_bit_exact_with_the_resident_run() {
    for name in ["flux-tiny", "wan-tiny"] {
        let desc = preset(name).expect("preset");
        let resident = resident_output(&desc, 3, 0).expect("resident");
        assert!(!resident.is_empty());
        for world in [2usize, 4] {
            for depth in [1usize, 2] {
                let what = format!("{name} N={world} depth {depth}");
                let mut spec = DistributedRunSpec::new(desc.clone(), world);
                spec.depth = depth;
                spec.steps = 3;
                let runs = ok_ranks(&spec);
                assert_eq!(runs.len(), world, "{what}");
                for (r, run) in runs.iter().enumerate() {
                    assert_eq!(run.rank, r, "{what}");
                    assert!(run.output == resident, "{what}: rank {r} output differs from the resident run");
                    assert_eq!(run.hazard_violations, 0, "{what}: rank {r}");
                    // Every rank issues the same gathers in the same order, numbered 0, 1, 2, … without gaps.
                    assert_eq!(run.issued, runs[0].issued, "{what}: rank {r} gather sequence");
                    // The warm-up AllGather comes first.
                    assert_eq!(run.issued[0], (0, WARM_UP_TAG), "{what}");
                    let seqs: Vec<u64> = run.issued.iter().map(|(s, _)| *s).collect();
                    assert_eq!(seqs, (0..run.issued.len() as u64).collect::<Vec<_>>(), "{what}");
                    // At least one gather per section per pass (3 passes), none before the first forward.
                    assert!(run.issued.len() as u64 >= 3 * run.sections, "{what}: {} gathers", run.issued.len());
                    // 1/N of the streamed sections on host, padding < N elements (≤ 8 bytes) per section.
                    let n = world as u64;
                    assert!(run.shard_host_bytes * n >= run.full_section_bytes, "{what}");
                    assert!(run.shard_host_bytes * n - run.full_section_bytes < run.sections * n * 8, "{what}");
                    // Only shards travel host → device: every block's shards once per pass, plus at most one more
                    // pass of prefetches wrapped past the last step (a full copy per pass would be N times more).
                    assert!(run.h2d_bytes >= 3 * run.shard_host_bytes, "{what}: h2d {}", run.h2d_bytes);
                    assert!(run.h2d_bytes <= 4 * run.shard_host_bytes, "{what}: h2d {}", run.h2d_bytes);
                }
            }
        }
    }
}

#[test]
fn chunked_transport_is_bit_exact_at_several_chunk_sizes() {
    // 4000 and 12345 gathered bytes do not divide the tiny sections; 1 GiB is larger than every section (one chunk
    // each: the same gathers as unchunked).
    for name in ["flux-tiny", "wan-tiny"] {
        let desc = preset(name).expect("preset");
        let resident = resident_output(&desc, 2, 0).expect("resident");
        for world in [2usize, 4] {
            let mut spec = DistributedRunSpec::new(desc.clone(), world);
            spec.steps = 2;
            let unchunked = ok_ranks(&spec)[0].issued.len();
            for chunk in [Some(4000u64), Some(12_345), Some(1 << 30)] {
                let what = format!("{name} N={world} chunk {chunk:?}");
                spec.chunk_bytes = chunk;
                let runs = ok_ranks(&spec);
                for (r, run) in runs.iter().enumerate() {
                    assert!(run.output == resident, "{what}: rank {r} output differs from the resident run");
                    assert_eq!(run.hazard_violations, 0, "{what}: rank {r}");
                    assert_eq!(run.issued, runs[0].issued, "{what}: rank {r} gather sequence");
                    let n = world as u64;
                    assert!(run.shard_host_bytes * n - run.full_section_bytes < run.sections * n * 8, "{what}");
                }
                let gathers = runs[0].issued.len();
                if chunk == Some(1 << 30) {
                    assert_eq!(gathers, unchunked, "{what}: one chunk per section");
                } else {
                    assert!(gathers > unchunked, "{what}: {gathers} gathers, unchunked {unchunked}");
                }
                // Tags are distinct within one block load: no two gathers of a pass share a tag.
                let mut tags: Vec<u64> = runs[0].issued.iter().map(|x| x.1).collect();
                tags.sort_unstable();
                tags.dedup();
                assert!(tags.len() * 3 >= gathers, "{what}: tags repeat more than once per pass");
            }
        }
    }
}

#[test]
fn randomized_rank_timings_give_identical_gather_sequences() {
    // Each rank sleeps its own random amounts (< 300 µs) before every hook and its comm stream runs every op up to
    // 1 ms slower, so ranks reach their hooks and gathers at different times; the gather order still comes from
    // the hook order alone.
    let desc = preset("wan-tiny").expect("preset");
    let resident = resident_output(&desc, 2, 0).expect("resident");
    for seed in 0u64..4 {
        let world = [2usize, 3, 4][seed as usize % 3];
        let chunk = if seed % 2 == 0 { None } else { Some(4000) };
        let what = format!("seed {seed} N={world} chunk {chunk:?}");
        let mut spec = DistributedRunSpec::new(desc.clone(), world);
        spec.steps = 2;
        spec.depth = 1 + seed as usize % 2;
        spec.chunk_bytes = chunk;
        spec.jitter = Some(Jitter {
            seed,
            max_hook_sleep: Duration::from_micros(300),
            max_stream_delay: Duration::from_millis(1),
        });
        let delays: Vec<Duration> = (0..world).map(|r| spec.jitter.unwrap().stream_delay(r)).collect();
        assert!(delays.windows(2).any(|w| w[0] != w[1]), "{what}: ranks should be slowed differently: {delays:?}");
        let runs = ok_ranks(&spec);
        for (r, run) in runs.iter().enumerate() {
            assert!(run.output == resident, "{what}: rank {r} output differs from the resident run");
            assert_eq!(run.hazard_violations, 0, "{what}: rank {r}");
            assert_eq!(run.issued, runs[0].issued, "{what}: rank {r} gather sequence");
        }
        assert!(!runs[0].issued.is_empty(), "{what}");
    }
}

#[test]
fn the_group_size_matrix_drives_the_rank_count() {
    // (dp, sp, tp, allgather) -> group size, as in the config's group derivation matrix; the run uses that many
    // ranks and is bit-exact on each.
    let desc = preset("flux-tiny").expect("preset");
    let resident = resident_output(&desc, 2, 0).expect("resident");
    let matrix = [
        ((1, 1, 1, true), 1usize),
        ((2, 1, 1, true), 2),
        ((1, 4, 1, true), 4),
        ((2, 2, 2, true), 2),
        ((2, 2, 2, false), 1),
        ((1, 4, 2, false), 1),
        ((1, 1, 8, true), 1),
    ];
    for ((dp, sp, tp, ag), size) in matrix {
        for chunk in [None, Some("3KiB")] {
            if chunk.is_some() && !ag {
                continue;
            }
            let what = format!("(dp, sp, tp, allgather) = ({dp}, {sp}, {tp}, {ag}) chunk {chunk:?}");
            let transfer = if ag { "allgather" } else { "rank-local" };
            let mut dit = serde_json::json!({"weight_transfer": transfer, "prefetch_depth": 1});
            if let Some(c) = chunk {
                dit["allgather_chunk_size"] = c.into();
            }
            let text = serde_json::json!({
                "data_parallel_size": dp,
                "sequence_parallel_size": sp,
                "tensor_parallel_size": tp,
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"], "layer_options": {"dit": dit}},
            })
            .to_string();
            let config = OffloadConfig::from_json_str(&text).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(config.group.size as usize, size, "{what}");
            let mut spec = DistributedRunSpec::from_config(desc.clone(), &config).expect("spec");
            assert_eq!(spec.world, size, "{what}");
            assert_eq!(spec.depth, 1, "{what}");
            assert_eq!(spec.chunk_bytes, chunk.map(|_| 3072), "{what}");
            spec.steps = 2;
            let runs = ok_ranks(&spec);
            assert_eq!(runs.len(), size, "{what}");
            for (r, run) in runs.iter().enumerate() {
                assert!(run.output == resident, "{what}: rank {r} output differs from the resident run");
                assert_eq!(run.issued, runs[0].issued, "{what}: rank {r}");
            }
        }
    }
}

#[test]
fn configs_the_runner_cannot_run_are_named() {
    let desc = preset("flux-tiny").unwrap();
    let module =
        OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit"]}}"#)
            .unwrap();
    let e = DistributedRunSpec::from_config(desc.clone(), &module).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a distributed run needs layerwise offload, but the config selects model; set diffusion_offload_config.mode \
         = \"layer\""
    );
    let resident = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"resident_layers": 2}}}}"#,
    )
    .unwrap();
    let e = DistributedRunSpec::from_config(desc, &resident).unwrap_err();
    assert!(e.to_string().starts_with("resident DiT layers use rank-local transfer"), "{e}");
}

/// One rank's platform, compute and communicator on the simulated device, for `run_rank`.
fn sim_rank(comm: SimCollective) -> (Arc<SimPlatform>, PlatformRef, Arc<dyn Compute>, CollectiveFactory) {
    let sim = comm.platform().clone();
    let platform: PlatformRef = sim.clone();
    let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
    (sim, platform, compute, factory)
}

fn sims(world: usize) -> Vec<Arc<SimPlatform>> {
    (0..world)
        .map(|_| Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap()))
        .collect()
}

#[test]
fn run_rank_runs_one_rank_on_any_platform_handle() {
    // Two ranks driven through the public `run_rank`, each on its own thread with its own platform: the same
    // outputs and gathers as `run_distributed_sim`.
    let desc = preset("flux-tiny").unwrap();
    let mut spec = DistributedRunSpec::new(desc.clone(), 2);
    spec.steps = 2;
    let expected = ok_ranks(&spec);
    let comms = SimCollectiveGroup::new(sims(2));
    let runs: Vec<RankRun> = std::thread::scope(|s| {
        let spec = &spec;
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    let (sim, platform, compute, factory) = sim_rank(comm);
                    let run = run_rank(platform, compute, factory, rank, 2, spec).unwrap();
                    assert!(sim.violations().is_empty(), "rank {rank}");
                    assert_eq!(sim.device_memory().in_use, 0, "rank {rank} leaked device memory");
                    run
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(run.output, expected[r].output, "rank {r}");
        assert_eq!(run.issued, expected[r].issued, "rank {r}");
        assert_eq!(run.hazard_violations, 0, "run_rank leaves hazard counting to the caller");
    }
}

#[test]
fn run_rank_rejects_a_mismatched_rank_or_world() {
    let desc = preset("flux-tiny").unwrap();
    let spec = DistributedRunSpec::new(desc, 1);
    // world differs from the spec's.
    let comm = SimCollectiveGroup::new(sims(1)).pop().unwrap();
    let (_sim, platform, compute, factory) = sim_rank(comm);
    let e = run_rank(platform, compute, factory, 0, 2, &spec).unwrap_err();
    assert_eq!(
        e.to_string(),
        "rank 0 of 2 ranks does not fit a run of 1 ranks; give every rank the same world size and a rank below it"
    );
    // The communicator reports another group.
    let mut comms = SimCollectiveGroup::new(sims(2));
    let other = comms.pop().unwrap();
    let (sim, platform, compute, factory) = sim_rank(other);
    let e = run_rank(platform, compute, factory, 0, 1, &spec).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the collective is rank 1 of 2 ranks, but the config's offload group has 1 ranks; build the communicator \
         over the config's group (data_parallel_size, or sequence_parallel_size when that is 1)"
    );
    assert_eq!(sim.device_memory().in_use, 0, "a refused rank leaked device memory");
}

#[test]
fn the_resident_reference_matches_the_run_driver() {
    // The reference output is the run driver's resident baseline: same checksum.
    let desc = preset("flux-tiny").unwrap();
    let config =
        OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#)
            .unwrap();
    let mut spec = RunSpec::new("flux-tiny", desc.clone(), config);
    spec.steps = 3;
    let report = run(&spec, &mut |_, _| {}).unwrap().report;
    let out = resident_output(&desc, 3, 0).unwrap();
    assert_eq!(format!("{:016x}", fnv1a(FNV_OFFSET, &out)), report.resident_checksum);
    // And the comparison can fail: another seed gives another output.
    assert_ne!(resident_output(&desc, 3, 1).unwrap(), out);
}

#[test]
fn a_failed_gather_fails_every_rank_without_hanging() {
    for world in [2usize, 4] {
        for nth in [0u64, 7] {
            let what = format!("N={world} failing call {nth}");
            let mut spec = DistributedRunSpec::new(preset("wan-tiny").unwrap(), world);
            spec.fail_gather = Some((1, nth));
            spec.timeout = Duration::from_secs(20);
            let t = Instant::now();
            let results = run_distributed_sim(&spec).expect("run");
            assert!(t.elapsed() < Duration::from_secs(15), "{what}: took {:?}", t.elapsed());
            assert_eq!(results.len(), world);
            for (r, res) in results.iter().enumerate() {
                let err = res.as_ref().err().unwrap_or_else(|| panic!("{what}: rank {r} succeeded"));
                if r == 1 {
                    match err {
                        DistributedRunError::Poisoned { rank, cause, .. } => {
                            assert_eq!(*rank, 1, "{what}");
                            assert!(cause.to_string().contains("injected AllGather failure"), "{what}: {cause}");
                            assert!(err.to_string().contains("the pipeline must be reloaded"), "{what}: {err}");
                        }
                        other => panic!("{what}: rank 1 should be poisoned, got {other}"),
                    }
                }
            }
        }
    }
}

#[test]
fn a_poisoned_run_leaves_no_device_memory_behind() {
    // A failed AllGather leaves the compute streams in their error state; every rank still frees everything.
    let spec = DistributedRunSpec::new(preset("wan-tiny").unwrap(), 2);
    let comms = SimCollectiveGroup::new(sims(2));
    comms[1].fail_nth_call(7);
    std::thread::scope(|s| {
        let spec = &spec;
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    let (sim, platform, compute, factory) = sim_rank(comm);
                    let e = run_rank(platform, compute, factory, rank, 2, spec).unwrap_err();
                    assert!(e.to_string().contains("injected AllGather failure"), "rank {rank}: {e}");
                    assert_eq!(sim.device_memory().in_use, 0, "rank {rank} leaked device memory");
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

#[test]
fn bad_requests_are_errors() {
    let desc = preset("flux-tiny").unwrap();
    let mut spec = DistributedRunSpec::new(desc.clone(), 0);
    assert!(matches!(run_distributed_sim(&spec), Err(DistributedRunError::Invalid(_))));
    spec.world = 2;
    spec.depth = 0;
    assert!(matches!(run_distributed_sim(&spec), Err(DistributedRunError::Invalid(_))));
    spec.depth = 1;
    spec.fail_gather = Some((2, 0));
    assert!(matches!(run_distributed_sim(&spec), Err(DistributedRunError::Invalid(_))));
}

#[test]
fn a_timed_run_reports_per_step_bytes_of_one_pass_and_the_hi_output() {
    // Timing mode: warm-up, lo and hi executions through the same stacks; the output is the hi run's, and one
    // step moves exactly one pass of shards (every block once).
    for (name, world, depth, chunk) in [("flux-tiny", 2usize, 2usize, None), ("wan-tiny", 3, 1, Some(4096u64))] {
        let what = format!("{name} N={world} depth {depth} chunk {chunk:?}");
        let desc = preset(name).unwrap();
        let mut spec = DistributedRunSpec::new(desc.clone(), world);
        spec.depth = depth;
        spec.chunk_bytes = chunk;
        spec.steps = 7; // ignored when timed
        spec.timed_steps = Some((1, 3));
        let resident = resident_output(&desc, 3, 0).unwrap();
        let runs = ok_ranks(&spec);
        for (r, run) in runs.iter().enumerate() {
            assert!(run.output == resident, "{what}: rank {r} differs from the resident 3-step run");
            assert_eq!(run.issued, runs[0].issued, "{what}: rank {r} gather sequence");
            // Every block gather ran between the stacks' shared buffers (windows); the warm-up did not.
            let warm_ups = run.issued.iter().filter(|(_, tag)| *tag == WARM_UP_TAG).count();
            assert_eq!(warm_ups, 1, "{what}");
            assert_eq!(run.windowed_all_gathers, (run.issued.len() - warm_ups) as u64, "{what}: rank {r}");
            let t = run.timing.unwrap_or_else(|| panic!("{what}: rank {r} has no timing"));
            assert_eq!(t.steps, (1, 3), "{what}");
            assert!(t.hi > Duration::ZERO && t.lo > Duration::ZERO, "{what}");
            assert_eq!(t.shard_bytes_per_step, run.shard_host_bytes, "{what}: rank {r}");
            assert_eq!(t.gathered_bytes_per_step, run.shard_host_bytes * world as u64, "{what}");
            assert_eq!(t.full_bytes_per_step, run.full_section_bytes, "{what}");
            // warm-up (1) + lo (1) + hi (3) steps of copies, plus at most one pass prefetched ahead.
            assert!(run.h2d_bytes >= 5 * run.shard_host_bytes, "{what}: h2d {}", run.h2d_bytes);
            assert!(run.h2d_bytes <= 6 * run.shard_host_bytes, "{what}: h2d {}", run.h2d_bytes);
        }
    }
}

#[test]
fn timed_rounds_repeat_the_lo_and_hi_executions_and_report_the_median_round() {
    let desc = preset("flux-tiny").unwrap();
    let resident = resident_output(&desc, 3, 0).unwrap();
    let mut issued = Vec::new();
    for rounds in 1..=3u32 {
        let mut spec = DistributedRunSpec::new(desc.clone(), 2);
        spec.timed_steps = Some((1, 3));
        spec.timed_rounds = rounds;
        let runs = ok_ranks(&spec);
        for (r, run) in runs.iter().enumerate() {
            assert!(run.output == resident, "rounds {rounds}: rank {r} differs from the resident 3-step run");
            let t = run.timing.unwrap();
            assert_eq!(t.rounds, rounds);
            let (min, max) = t.step_range_s;
            assert!(min <= t.step_s() && t.step_s() <= max, "rounds {rounds}: {min} <= {} <= {max}", t.step_s());
            if rounds == 1 {
                assert_eq!(min, max);
            }
            // Bytes per step come from the first round alone: the same whatever the rounds.
            assert_eq!(t.shard_bytes_per_step, run.shard_host_bytes);
        }
        issued.push(runs[0].issued.len());
    }
    // Each extra round adds the same lo + hi executions, so the same number of AllGathers.
    assert!(issued[1] > issued[0], "{issued:?}");
    assert_eq!(issued[2] - issued[1], issued[1] - issued[0], "{issued:?}");
    let mut spec = DistributedRunSpec::new(desc, 2);
    for (rounds, timed, msg) in [
        (0, Some((1, 3)), "timed rounds 0: need 1 to 50"),
        (51, Some((1, 3)), "timed rounds 51: need 1 to 50"),
        (2, None, "timed rounds 2: rounds repeat the timed executions, so they need timed steps"),
    ] {
        spec.timed_rounds = rounds;
        spec.timed_steps = timed;
        assert_eq!(run_distributed_sim(&spec).unwrap_err().to_string(), msg);
    }
}

#[test]
fn an_untimed_run_has_no_timing_and_bad_timed_steps_are_refused() {
    let desc = preset("flux-tiny").unwrap();
    let mut spec = DistributedRunSpec::new(desc, 2);
    spec.steps = 1;
    assert!(ok_ranks(&spec).iter().all(|r| r.timing.is_none()));
    for bad in [(0, 2), (3, 3), (4, 2)] {
        spec.timed_steps = Some(bad);
        let e = run_distributed_sim(&spec).unwrap_err();
        assert_eq!(e.to_string(), format!("timed steps ({}, {}): need 1 <= lo < hi, e.g. (1, 3)", bad.0, bad.1));
    }
}

#[test]
fn step_seconds_is_the_difference_over_the_extra_steps() {
    use weightferry_harness::drivers::distributed::step_seconds;
    let s = step_seconds((1, 3), Duration::from_millis(500), Duration::from_millis(900));
    assert!((s - 0.2).abs() < 1e-12, "{s}");
    assert_eq!(step_seconds((2, 2), Duration::from_secs(1), Duration::from_secs(2)), 0.0);
}

#[test]
fn the_timed_resident_run_on_a_shared_model_matches_the_resident_output() {
    use weightferry::model::HostModel;
    use weightferry_harness::drivers::distributed::{rank_session, resident_run_with_model, run_rank_in_session};
    let desc = preset("flux-tiny").unwrap();
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
    let model = HostModel::synthetic(platform, Arc::new(desc.clone()), 0).unwrap();
    // The same model serves the resident runs and a one-rank distributed run through a session, and stays loaded
    // afterwards.
    let comm = SimCollectiveGroup::new(vec![sim.clone()]).pop().unwrap();
    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
    let mut spec = DistributedRunSpec::new(desc.clone(), 1);
    spec.timed_steps = Some((1, 3));
    let mut session = rank_session(model, factory, 0, 1, &spec).unwrap();
    let r = resident_run_with_model(compute.clone(), session.model(), &desc, 9, 0, Some((1, 3)), 1).unwrap();
    assert!(r.output == resident_output(&desc, 3, 0).unwrap());
    let (steps, lo, hi) = r.timing.unwrap();
    assert_eq!(steps, (1, 3));
    assert!(lo > Duration::ZERO && hi > Duration::ZERO);
    let e = resident_run_with_model(compute.clone(), session.model(), &desc, 9, 0, Some((2, 1)), 1).unwrap_err();
    assert_eq!(e.to_string(), "timed steps (2, 1): need 1 <= lo < hi, e.g. (1, 3)");
    let run = run_rank_in_session(compute.clone(), &mut session, 0, 1, &spec).unwrap();
    assert!(run.output == r.output);
    let again = resident_run_with_model(compute, session.model(), &desc, 3, 0, None, 1).unwrap();
    assert!(again.output == r.output && again.timing.is_none());
    drop(session);
    assert!(sim.violations().is_empty());
    assert_eq!(sim.device_memory().in_use, 0);
    sim.shutdown();
}

#[test]
fn the_dist_sh_config_gives_two_ranks_depth_2_and_whole_sections_for_the_full_size_presets() {
    // The config `benches/gpu/dist.sh` writes for the GPU run (keep the two in step).
    let script = include_str!("../../benches/gpu/dist.sh");
    let start = script.find("{\"data_parallel_size\"").expect("config in dist.sh");
    let end = start + script[start..].find("\nEOF").expect("end of the config");
    let config = OffloadConfig::from_json_str(&script[start..end]).expect("config");
    for name in ["flux-dev", "wan-14b"] {
        let spec = DistributedRunSpec::from_config(preset(name).unwrap(), &config).expect(name);
        assert_eq!((spec.world, spec.depth, spec.chunk_bytes), (2, 2, None), "{name}");
        assert!(spec.timed_steps.is_none());
    }
}

/// A device tracer that hands back fixed spans and counts its calls (the CUDA platform's timeline on a GPU).
struct FakeTracer {
    armed: std::sync::atomic::AtomicUsize,
    collected: std::sync::atomic::AtomicUsize,
    spans: Vec<weightferry_harness::engine::timeline::DeviceSpan>,
    fail_arm: bool,
    /// What each rank named its spans by: copy names, and the AllGather namer.
    named: std::sync::Mutex<Vec<(Vec<String>, Option<weightferry::platform::timeline::GatherNamer>)>>,
}

impl weightferry_harness::engine::timeline::DeviceTracer for FakeTracer {
    fn arm(
        &self,
        _stream: weightferry::scheduler::StreamId,
        capacity: usize,
    ) -> Result<(), weightferry::scheduler::PlatformError> {
        assert_eq!(capacity, weightferry_harness::drivers::distributed::TRACE_CAPACITY);
        if self.fail_arm {
            return Err(weightferry::scheduler::PlatformError::Driver("no timing events left".into()));
        }
        self.armed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    fn collect(
        &self,
    ) -> Result<(Vec<weightferry_harness::engine::timeline::DeviceSpan>, u64), weightferry::scheduler::PlatformError>
    {
        self.collected.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok((self.spans.clone(), 3))
    }

    fn name_spans(
        &self,
        copies: Vec<(weightferry::scheduler::HostBufferId, String)>,
        gathers: Option<weightferry::platform::timeline::GatherNamer>,
    ) {
        self.named.lock().unwrap().push((copies.into_iter().map(|(_, n)| n).collect(), gathers));
    }
}

#[test]
fn a_traced_timed_run_traces_one_more_lo_execution_and_summarises_the_dit_window() {
    use weightferry_harness::drivers::distributed::RunTracer;
    use weightferry_harness::engine::timeline::{DeviceSpan, COMM_LANE, COMPUTE_LANE, COPY_LANE};
    let desc = preset("flux-tiny").unwrap();
    let root = desc.components.as_ref().unwrap().dit[0].clone();
    let span =
        |lane: &str, label: String, a: f64, b: f64| DeviceSpan { lane: lane.into(), label, start_us: a, end_us: b };
    let spans = vec![
        span(COMPUTE_LANE, "text_encoder.layers.0".into(), 0.0, 50.0),
        span(COMPUTE_LANE, format!("{root}.blocks.0"), 100.0, 200.0),
        span(COMPUTE_LANE, format!("{root}.blocks.1"), 260.0, 300.0), // a 60 µs stall
        span(COMPUTE_LANE, format!("{root}x.not_the_dit"), 400.0, 500.0),
        span(COPY_LANE, "h2d 64".into(), 90.0, 150.0),
        span(COMM_LANE, "allgather 128".into(), 150.0, 260.0),
    ];
    let fake = Arc::new(FakeTracer {
        armed: Default::default(),
        collected: Default::default(),
        spans: spans.clone(),
        fail_arm: false,
        named: Default::default(),
    });
    let world = 2;
    let mut spec = DistributedRunSpec::new(desc.clone(), world);
    spec.timed_steps = Some((1, 3));
    spec.trace = Some(RunTracer(fake.clone()));
    let resident = resident_output(&desc, 3, 0).unwrap();
    let runs = ok_ranks(&spec);
    // One arm and one collect per rank.
    assert_eq!(fake.armed.load(std::sync::atomic::Ordering::SeqCst), world);
    assert_eq!(fake.collected.load(std::sync::atomic::Ordering::SeqCst), world);
    for (r, run) in runs.iter().enumerate() {
        assert!(run.output == resident, "rank {r}: the output is still the hi run's");
        let t = run.trace.as_ref().unwrap_or_else(|| panic!("rank {r} has no trace"));
        assert_eq!((t.steps, t.dropped), (1, 3));
        assert_eq!(t.spans, spans);
        let s = &t.summary;
        assert_eq!((s.window_us, s.compute_busy_us, s.kernels), (200.0, 140.0, 2), "rank {r}");
        assert_eq!((s.stalls, s.stall_us), (1, 60.0));
        assert_eq!((s.copy_busy_us, s.overlap_us), (50.0, 50.0));
        assert_eq!((s.comm_busy_us, s.comm_overlap_us, s.collectives), (110.0, 50.0, 1));
        // The traced execution ran: warm-up (1) + lo (1) + hi (3) + traced lo (1) passes of shards, plus at most
        // one pass prefetched ahead.
        assert!(run.h2d_bytes >= 6 * run.shard_host_bytes, "rank {r}: h2d {}", run.h2d_bytes);
        assert!(run.h2d_bytes <= 7 * run.shard_host_bytes, "rank {r}: h2d {}", run.h2d_bytes);
    }
    // Each rank named its copies by the DiT blocks whose shards it holds, and every block AllGather by its block.
    let named = std::mem::take(&mut *fake.named.lock().unwrap());
    assert_eq!(named.len(), world);
    let config = OffloadConfig::distributed_dit(world as u32, 2, None);
    let plan = weightferry::plan::resolve_offload_plan(&desc, &config).unwrap();
    let blocks: std::collections::BTreeSet<String> =
        weightferry::offload::units::build_unit_plan(&desc, &config, &plan)
            .stacks
            .iter()
            .flat_map(|s| s.units.iter().map(|u| u.path.clone()))
            .collect();
    assert!(blocks.len() > 2);
    for (copies, gathers) in named {
        let copies: std::collections::BTreeSet<String> = copies.into_iter().collect();
        assert_eq!(copies, blocks);
        let gathers = gathers.expect("a distributed rank names its AllGathers");
        for &(_, tag) in runs[0].issued.iter().filter(|(_, t)| *t != WARM_UP_TAG) {
            let name = gathers(tag).unwrap_or_else(|| panic!("AllGather tag {tag:#x} has no name"));
            assert!(blocks.contains(&name), "{name}");
        }
        assert_eq!(gathers(WARM_UP_TAG), None);
    }
    // Without timed steps a trace is refused before anything runs.
    spec.timed_steps = None;
    let e = run_distributed_sim(&spec).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a traced distributed run needs timed steps (it traces one more execution of the timed lo steps)"
    );
    // A tracer that cannot arm fails the rank's run with its error.
    let failing = Arc::new(FakeTracer {
        armed: Default::default(),
        collected: Default::default(),
        spans,
        fail_arm: true,
        named: Default::default(),
    });
    spec.timed_steps = Some((1, 2));
    spec.trace = Some(RunTracer(failing.clone()));
    let results = run_distributed_sim(&spec).expect("the group ran");
    for (r, res) in results.into_iter().enumerate() {
        let e = res.expect_err("a rank whose tracer cannot arm fails");
        assert!(e.to_string().contains("no timing events left"), "rank {r}: {e}");
    }
    assert_eq!(failing.collected.load(std::sync::atomic::Ordering::SeqCst), 0);
}
