//! Distributed layerwise offload through the library's one factory, with no engine: groups of 2 and 4 simulated
//! ranks (threads, one simulated device each, a simulated collective) each call `get_offload_backend` with their
//! communicator, enable, run `pre_forward` / `post_forward` over every DiT block for two passes, and read each block's
//! device bytes at the `Residency` its `pre_forward` returned: every byte equals the loaded weight's. Every rank
//! issues the same AllGathers; `disable` restores the released weights (checksum as before) and frees all device
//! memory. A failed AllGather on one rank poisons the group: every rank's hooks fail with the scheduler's typed
//! error within seconds (no hang), `disable` says the pipeline must be reloaded, and no device memory is left.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry::config::OffloadConfig;
use weightferry::hooks::{HookError, HookFailure, HookRegistry};
use weightferry::model::HostModel;
use weightferry::offload::units::build_unit_plan;
use weightferry::offload::{get_offload_backend, OffloadError, WeightSource};
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::collective::{Collective, SimCollective, SimCollectiveGroup};
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::platform::{Platform, PlatformRef};
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

/// What one rank saw.
struct RankResult {
    /// `(sequence, tag)` of every AllGather this rank issued (read after disable, when every one completed).
    gathers: Vec<(u64, u64)>,
    /// Blocks whose device bytes were checked.
    blocks_checked: usize,
    /// Host bytes of this rank's shards.
    shard_host_bytes: u64,
    /// Loaded bytes released to the shards at enable.
    released_bytes: u64,
}

fn group(world: usize) -> Vec<SimCollective> {
    let sims = (0..world)
        .map(|_| Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap()))
        .collect();
    SimCollectiveGroup::new(sims)
}

/// The DiT block paths in stack order.
fn block_paths(desc: &PipelineDesc, config: &OffloadConfig) -> Vec<String> {
    let plan = resolve_offload_plan(desc, config).unwrap();
    build_unit_plan(desc, config, &plan).stacks.iter().flat_map(|s| s.units.iter().map(|u| u.path.clone())).collect()
}

/// One rank: enable, two passes of hooks over the blocks checking their device bytes, disable.
fn rank(
    rank: usize,
    world: usize,
    comm: SimCollective,
    desc: Arc<PipelineDesc>,
    chunk: Option<u64>,
) -> Result<RankResult, String> {
    let sim = comm.platform().clone();
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let mut model = HostModel::synthetic(platform.clone(), desc.clone(), 11).unwrap();
    let before = model.checksum().unwrap();
    let loaded: HashMap<StorageId, Vec<u8>> =
        desc.storages.keys().map(|&s| (s, model.read_storage(s).unwrap())).collect();
    let config = OffloadConfig::distributed_dit(world as u32, 2, chunk);
    let paths = block_paths(&desc, &config);
    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
    let mut b = get_offload_backend(&config, platform.clone(), Some(factory)).unwrap().expect("offload is on");
    let hooks = HookRegistry::new();
    b.enable(&mut model, &hooks, compute).map_err(|e| format!("enable: {e}"))?;
    let report = b.report().group.expect("a distributed backend reports its group");
    let walk = (|| {
        let mut checked = 0;
        for _pass in 0..2 {
            for path in &paths {
                let placed = hooks.pre_forward(path).map_err(|e| e.to_string())?.expect("a streamed block is placed");
                platform.stream_synchronize(compute).map_err(|e| e.to_string())?;
                for (&s, &off) in placed.offsets.iter() {
                    let want = &loaded[&s];
                    let mut got = vec![0u8; want.len()];
                    sim.read_device(placed.buffer, placed.base + off, &mut got).unwrap();
                    assert!(got == *want, "rank {rank}: storage {s:?} of {path} differs on the device");
                    assert_eq!(b.locate(s).unwrap(), placed.locate(s).unwrap(), "rank {rank}: {path}");
                }
                hooks.post_forward(path).map_err(|e| e.to_string())?;
                checked += 1;
            }
        }
        Ok::<usize, String>(checked)
    })();
    let disabled = b.disable(&mut model, &hooks);
    let gathers = b.gather_log();
    let in_use = sim.device_memory().in_use;
    let checked = match (walk, disabled) {
        (Ok(n), Ok(())) => n,
        (walk, disabled) => {
            assert_eq!(in_use, 0, "rank {rank}: a failed rank leaked device memory");
            return Err(format!(
                "rank {rank}: hooks {:?}; disable {:?}",
                walk.err(),
                disabled.err().map(|e| e.to_string())
            ));
        }
    };
    assert_eq!(in_use, 0, "rank {rank}: device memory left after disable");
    assert_eq!(model.checksum().unwrap(), before, "rank {rank}: the restored weights differ");
    assert!(hooks.hook_names().is_empty(), "rank {rank}: hooks left after disable");
    model.release();
    Ok(RankResult {
        gathers,
        blocks_checked: checked,
        shard_host_bytes: report.shard_host_bytes,
        released_bytes: report.released_bytes,
    })
}

/// Runs every rank of a group on its own thread; a failing call `nth` on rank 1 when asked.
fn run_group(world: usize, name: &str, chunk: Option<u64>, fail: Option<u64>) -> Vec<Result<RankResult, String>> {
    let desc = Arc::new(preset(name).unwrap());
    let comms = group(world);
    if let Some(nth) = fail {
        comms[1].fail_nth_call(nth);
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let desc = desc.clone();
                s.spawn(move || rank(r, world, comm, desc, chunk))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

#[test]
fn every_rank_of_2_and_4_sees_each_block_bit_exact_and_gets_its_weights_back() {
    for (world, name, chunk) in [(2usize, "flux-tiny", None), (4, "flux-tiny", None), (2, "wan-tiny", Some(4096u64))] {
        let what = format!("{name} N={world} chunk {chunk:?}");
        let desc = preset(name).unwrap();
        let blocks = block_paths(&desc, &OffloadConfig::distributed_dit(world as u32, 2, chunk)).len();
        let results: Vec<RankResult> = run_group(world, name, chunk, None)
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
            .collect();
        for (r, res) in results.iter().enumerate() {
            assert_eq!(res.blocks_checked, 2 * blocks, "{what}: rank {r}");
            assert_eq!(res.gathers, results[0].gathers, "{what}: rank {r} issued other AllGathers than rank 0");
            assert!(res.shard_host_bytes > 0, "{what}: rank {r}");
            // Each rank keeps about 1/N of what it released (the shards are padded to the alignment).
            let share = res.released_bytes / world as u64;
            assert!(res.shard_host_bytes >= share, "{what}: rank {r} shards {} < {share}", res.shard_host_bytes);
            assert!(res.shard_host_bytes < share + share / 4, "{what}: rank {r} shards {}", res.shard_host_bytes);
        }
        // Every block's AllGathers, both passes: at least one per block per pass.
        assert!(results[0].gathers.len() >= 2 * blocks, "{what}: {} AllGathers", results[0].gathers.len());
    }
}

#[test]
fn a_failed_allgather_poisons_every_rank_without_a_hang_and_frees_the_devices() {
    for world in [2usize, 4] {
        for nth in [1u64, 9] {
            let what = format!("N={world} failing call {nth}");
            let t = Instant::now();
            let results = run_group(world, "flux-tiny", None, Some(nth));
            assert!(t.elapsed() < Duration::from_secs(20), "{what}: took {:?}", t.elapsed());
            for (r, res) in results.iter().enumerate() {
                let err = res.as_ref().err().unwrap_or_else(|| panic!("{what}: rank {r} succeeded"));
                assert!(err.contains("the pipeline must be reloaded"), "{what}: rank {r}: {err}");
                if r == 1 {
                    assert!(err.contains("injected AllGather failure"), "{what}: rank 1: {err}");
                }
            }
        }
    }
}

#[test]
fn the_failing_hook_carries_the_scheduler_error_typed() {
    let desc = Arc::new(preset("flux-tiny").unwrap());
    let mut comms = group(1);
    let comm = comms.pop().unwrap();
    comm.fail_nth_call(2);
    let sim = comm.platform().clone();
    let platform: PlatformRef = sim.clone();
    let compute = platform.create_stream("compute").unwrap();
    let mut model = HostModel::synthetic(platform.clone(), desc.clone(), 11).unwrap();
    let config = OffloadConfig::distributed_dit(1, 2, None);
    let paths = block_paths(&desc, &config);
    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
    let mut b = get_offload_backend(&config, platform.clone(), Some(factory)).unwrap().unwrap();
    let hooks = HookRegistry::new();
    b.enable(&mut model, &hooks, compute).unwrap();
    let err = paths
        .iter()
        .find_map(|p| hooks.pre_forward(p).and_then(|_| hooks.post_forward(p)).err())
        .expect("a hook fails once the AllGather failed");
    let HookError::Failed { source, .. } = &err else { panic!("{err:?}") };
    assert!(matches!(source.as_ref(), HookFailure::Scheduler(_)), "{err:?}");
    assert!(b.poisoned().is_some(), "the backend knows its collective is poisoned");
    let e = b.disable(&mut model, &hooks).unwrap_err();
    assert!(matches!(e, OffloadError::Poisoned { rank: 0, .. }), "{e}");
    assert_eq!(sim.device_memory().in_use, 0);
}

/// Enable → hooks → disable cycles on every rank of a group of 2 leave no stream behind: while enabled a rank holds
/// its compute stream, the copy stream, the placement stream, the gather stack's shard stream and the comm stream;
/// after each disable only the compute and comm streams (the communicator lives with the backend, its gather
/// numbering continuing across cycles); once the backend is dropped, the compute stream alone.
#[test]
fn enable_disable_cycles_leave_each_rank_only_its_compute_and_comm_streams() {
    const CYCLES: usize = 20;
    let desc = Arc::new(preset("flux-tiny").unwrap());
    let config = OffloadConfig::distributed_dit(2, 2, None);
    let paths = block_paths(&desc, &config);
    std::thread::scope(|s| {
        let hs: Vec<_> = group(2)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (desc, config, paths) = (desc.clone(), config.clone(), paths.clone());
                s.spawn(move || {
                    let sim = comm.platform().clone();
                    let platform: PlatformRef = sim.clone();
                    let compute = platform.create_stream("compute").unwrap();
                    let mut model = HostModel::synthetic(platform.clone(), desc, 11).unwrap();
                    let before = model.checksum().unwrap();
                    let factory: CollectiveFactory = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
                    let mut b = get_offload_backend(&config, platform.clone(), Some(factory)).unwrap().unwrap();
                    let hooks = HookRegistry::new();
                    for cycle in 0..CYCLES {
                        b.enable(&mut model, &hooks, compute).unwrap_or_else(|e| panic!("rank {r} cycle {cycle}: {e}"));
                        assert_eq!(sim.stream_count(), 5, "rank {r} cycle {cycle}: streams while enabled");
                        for path in &paths {
                            hooks.pre_forward(path).unwrap();
                            hooks.post_forward(path).unwrap();
                        }
                        b.disable(&mut model, &hooks).unwrap_or_else(|e| panic!("rank {r} cycle {cycle}: {e}"));
                        assert_eq!(sim.stream_count(), 2, "rank {r} cycle {cycle}: streams after disable");
                        assert_eq!(sim.device_memory().in_use, 0, "rank {r} cycle {cycle}");
                    }
                    assert_eq!(model.checksum().unwrap(), before, "rank {r}");
                    drop(b);
                    assert_eq!(sim.stream_count(), 1, "rank {r}: streams after the backend dropped");
                    assert_eq!(sim.violations(), Vec::new(), "rank {r}");
                })
            })
            .collect();
        for h in hs {
            h.join().expect("a rank panicked");
        }
    });
}
