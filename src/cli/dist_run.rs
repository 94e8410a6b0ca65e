//! `weightferry run` as one rank of a distributed run (the launch environment has `WORLD_SIZE > 1`, as set by
//! `weightferry launch`, torchrun or a job script): this process joins the TCP rendezvous, checks that every rank
//! runs the same spec, runs its rank of distributed layerwise offload on the simulated device through
//! [`run_rank`] with a [`TcpCollective`], compares its output with the fully resident run, and exchanges the
//! verdicts; rank 0 prints the report (text, or one JSON object with `--json`). Every rank exits 1 when any rank's
//! output differs or its hazard detector fired, and a rank whose run fails exits 1 naming itself — or exits
//! [`PEER_FAILED_EXIT`] (3) when it stopped only because another rank failed (a peer left, or rank 0 ended the
//! rendezvous), so `weightferry launch` can name the rank that failed first.
//!
//! Without `--config`, the DiT is gathered across a data-parallel group of `WORLD_SIZE` ranks; with `--config`,
//! the config's offload group must have `WORLD_SIZE` ranks.

use super::{emit, load_config, load_pipeline, CliError, PlatformArg, RunArgs, DEFAULT_PRESET};
use crate::config::OffloadConfig;
use crate::dist::launch::PEER_FAILED_EXIT;
use crate::dist::{LaunchEnv, Rendezvous, RendezvousError, RendezvousOptions, TcpCollective};
use crate::engine::compute::{Compute, SimCompute};
use crate::model::{fnv1a, FNV_OFFSET};
use crate::offload::distributed_backend::{resident_output, run_rank, DistributedRunSpec};
use crate::report::human_bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use weightferry_actors::collective::Collective;
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::platform::PlatformRef;
use weightferry_actors::sim::{SimConfig, SimPlatform};

/// The config a distributed `run` uses without `--config`: the DiT gathered across a data-parallel group of
/// `world` ranks, prefetch depth 2.
pub fn default_distributed_config(world: usize) -> String {
    format!(
        r#"{{"data_parallel_size": {world}, "diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
            "layer_options": {{"dit": {{"weight_transfer": "allgather"}}}}}}}}"#
    )
}

/// What one rank reports to rank 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSummary {
    /// The rank.
    pub rank: usize,
    /// Whether its output equals the fully resident run's, bit for bit.
    pub bit_exact: bool,
    /// FNV-1a checksum of its output.
    pub checksum: String,
    /// AllGathers its collective actor started (warm-up included).
    pub all_gathers: usize,
    /// Host bytes of its shard masters.
    pub shard_host_bytes: u64,
    /// Bytes it copied host to device (shards only).
    pub h2d_bytes: u64,
    /// Hazard violations its simulated device detected.
    pub hazard_violations: usize,
}

/// The report rank 0 prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DistributedReport {
    /// Preset name or pipeline file.
    pub pipeline: String,
    /// `"sim"`.
    pub platform: String,
    /// Ranks (processes).
    pub world: usize,
    /// DiT steps.
    pub steps: u32,
    /// Prefetch depth of the DiT stacks.
    pub depth: usize,
    /// Gathered bytes per AllGather (`null`: one AllGather per section).
    pub chunk_bytes: Option<u64>,
    /// FNV-1a checksum of the fully resident output.
    pub resident_checksum: String,
    /// Per rank, in rank order.
    pub ranks: Vec<RankSummary>,
    /// Whether every rank was bit-exact without hazards.
    pub all_bit_exact: bool,
}

impl fmt::Display for DistributedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let chunk = match self.chunk_bytes {
            Some(c) => format!("AllGather chunks of {}", human_bytes(c)),
            None => "one AllGather per section".to_string(),
        };
        writeln!(
            f,
            "weightferry distributed run: {} on {} {} ranks (one process each), {} steps, depth {}, {chunk}",
            self.pipeline, self.world, self.platform, self.steps, self.depth
        )?;
        for r in &self.ranks {
            writeln!(
                f,
                "rank {}: {} (checksum {}), {} AllGathers, {} of shards on host, {} copied host to device, {} hazards",
                r.rank,
                if r.bit_exact { "bit-exact with the resident run" } else { "DIFFERS from the resident run" },
                r.checksum,
                r.all_gathers,
                human_bytes(r.shard_host_bytes),
                human_bytes(r.h2d_bytes),
                r.hazard_violations
            )?;
        }
        if self.all_bit_exact {
            write!(f, "all {} ranks bit-exact with the resident run (checksum {})", self.world, self.resident_checksum)
        } else {
            write!(f, "NOT all ranks match the resident run (checksum {})", self.resident_checksum)
        }
    }
}

/// A failure of this rank (exit 1), or of the rendezvous because another rank failed ([`PEER_FAILED_EXIT`]).
fn rendezvous_error(rank: usize, e: RendezvousError) -> CliError {
    match e {
        RendezvousError::Io { .. } | RendezvousError::Refused { .. } | RendezvousError::Broken(_) => {
            peer_failed(rank, &format!("rendezvous: {e}"))
        }
        e => CliError::failed(format!("rank {rank}: rendezvous: {e}")),
    }
}

/// This rank stopped because another rank failed.
fn peer_failed(rank: usize, what: &str) -> CliError {
    let mut e = CliError::failed(format!("rank {rank}: stopped because another rank failed: {what}"));
    e.code = PEER_FAILED_EXIT;
    e
}

/// Parses `--inject-gather-failure RANK:N`.
fn parse_fault(text: &str) -> Result<(usize, u64), CliError> {
    let bad = || CliError::invalid(format!("--inject-gather-failure {text:?}: expected RANK:N, e.g. 1:5"));
    let (r, n) = text.split_once(':').ok_or_else(bad)?;
    Ok((r.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?))
}

/// Runs this process's rank of the distributed run `env` describes; returns the exit code.
pub fn run_distributed(a: &RunArgs, env: &LaunchEnv) -> Result<i32, CliError> {
    let (rank, world) = (env.rank, env.world);
    let unsupported = |flag: &str| {
        CliError::invalid(format!(
            "{flag} is not supported in a distributed run (WORLD_SIZE={world}); remove it, or run one process \
             without WORLD_SIZE"
        ))
    };
    if a.platform == PlatformArg::Cuda && !cfg!(feature = "nccl") {
        return Err(CliError::invalid(format!(
            "a distributed run (WORLD_SIZE={world}) on --platform cuda needs the NCCL collective: rebuild with \
             --features nccl, or run with --platform sim"
        )));
    }
    if a.platform == PlatformArg::Cuda && a.inject_gather_failure.is_some() {
        return Err(unsupported("--inject-gather-failure on --platform cuda"));
    }
    if a.trace.is_some() {
        return Err(unsupported("--trace"));
    }
    if a.skip_seed.is_some() {
        return Err(unsupported("--skip-seed"));
    }
    if a.inject_ordering_fault.is_some() {
        return Err(unsupported("--inject-ordering-fault"));
    }
    let fault = a.inject_gather_failure.as_deref().map(parse_fault).transpose()?;
    let spec_name = a.preset.as_deref().or(a.pipeline.as_deref()).unwrap_or(DEFAULT_PRESET);
    let pipeline = load_pipeline(spec_name)?;
    let config = match &a.config {
        Some(_) => load_config(a.config.as_deref(), &pipeline.desc)?,
        None => OffloadConfig::from_json_str(&default_distributed_config(world))
            .map_err(|e| CliError::failed(format!("the built-in distributed config is invalid: {e}")))?,
    };
    let mut spec = DistributedRunSpec::from_config(pipeline.desc.clone(), &config)
        .map_err(|e| CliError::invalid(format!("invalid config for a distributed run: {e}")))?;
    if spec.world != world {
        return Err(CliError::invalid(format!(
            "the config gathers the DiT across an offload group of {} rank(s), but WORLD_SIZE={world}; set \
             data_parallel_size (or sequence_parallel_size) to {world} with \
             diffusion_offload_config.layer_options.dit.weight_transfer = \"allgather\", or launch {} process(es)",
            spec.world, spec.world
        )));
    }
    spec.steps = a.steps;
    spec.seed = a.seed;
    let mut sim_config = SimConfig { tracing: false, ..SimConfig::default() };
    if let Some(g) = a.sim_h2d_gbps {
        if !(g.is_finite() && g > 0.0) {
            return Err(CliError::invalid(format!("--sim-h2d-gbps must be a positive number, got {g}")));
        }
        sim_config.h2d_bytes_per_sec = Some(g * 1e9);
    }
    sim_config.copy_latency = Duration::from_micros(a.sim_copy_latency_us);

    let failed = |what: &str, e: &dyn fmt::Display| CliError::failed(format!("rank {rank}: {what}: {e}"));
    let rdv = Arc::new(Rendezvous::connect(env, RendezvousOptions::default()).map_err(|e| rendezvous_error(rank, e))?);
    // Every rank must run the same thing, or the AllGathers would not match.
    let fingerprint = format!(
        "{}|{:016x}|{}|{}|{}|{:?}|{:?}",
        pipeline.name,
        fnv1a(FNV_OFFSET, format!("{config:?}").as_bytes()),
        spec.steps,
        spec.seed,
        spec.depth,
        spec.chunk_bytes,
        fault
    );
    let all = rdv.all_gather_bytes(fingerprint.as_bytes()).map_err(|e| rendezvous_error(rank, e))?;
    if let Some(r) = all.iter().position(|f| f.as_slice() != all[0].as_slice()) {
        return Err(CliError::failed(format!(
            "rank {r} runs another pipeline, config, step count or seed than rank 0 ({} vs {}); launch every rank \
             with the same arguments",
            String::from_utf8_lossy(&all[r]),
            String::from_utf8_lossy(&all[0])
        )));
    }

    let (run, hazards, resident) = if a.platform == PlatformArg::Cuda {
        cuda_rank(a, env, &rdv, &pipeline.desc, &pipeline.name, &spec)?
    } else {
        let sim = Arc::new(SimPlatform::new(sim_config).map_err(|e| failed("simulated device", &e))?);
        let platform: PlatformRef = sim.clone();
        let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
        let collective = TcpCollective::new(rdv.clone(), sim.clone());
        let peer_flag = collective.peer_failed_flag();
        if let Some((r, n)) = fault {
            if r == rank {
                collective.fail_nth_call(n);
            }
        }
        let factory: CollectiveFactory = Box::new(move || Ok(Box::new(collective) as Box<dyn Collective>));
        let run = run_rank(platform, compute, factory, rank, world, &spec);
        let hazards = sim.violations().len();
        sim.shutdown();
        let run = run.map_err(|e| {
            if peer_flag.load(std::sync::atomic::Ordering::SeqCst) {
                peer_failed(rank, &format!("the distributed run failed: {e}"))
            } else {
                failed("the distributed run failed", &e)
            }
        })?;
        let resident =
            resident_output(&pipeline.desc, spec.steps, spec.seed).map_err(|e| failed("resident run", &e))?;
        (run, hazards, resident)
    };
    let summary = RankSummary {
        rank,
        bit_exact: run.output == resident,
        checksum: format!("{:016x}", fnv1a(FNV_OFFSET, &run.output)),
        all_gathers: run.issued.len(),
        shard_host_bytes: run.shard_host_bytes,
        h2d_bytes: run.h2d_bytes,
        hazard_violations: hazards,
    };
    let encoded = serde_json::to_vec(&summary).map_err(|e| failed("encode", &e))?;
    let all = rdv.all_gather_bytes(&encoded).map_err(|e| rendezvous_error(rank, e))?;
    let ranks: Vec<RankSummary> = all
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<Result<_, _>>()
        .map_err(|e| failed("decode the other ranks' results", &e))?;
    let all_bit_exact = ranks.iter().all(|r| r.bit_exact && r.hazard_violations == 0);
    let report = DistributedReport {
        pipeline: pipeline.name,
        platform: if a.platform == PlatformArg::Cuda { "cuda+nccl".into() } else { "sim".into() },
        world,
        steps: spec.steps,
        depth: spec.depth,
        chunk_bytes: spec.chunk_bytes,
        resident_checksum: format!("{:016x}", fnv1a(FNV_OFFSET, &resident)),
        ranks,
        all_bit_exact,
    };
    if rank == 0 {
        if a.json {
            let text =
                serde_json::to_string_pretty(&report).map_err(|e| CliError::failed(format!("cannot encode: {e}")))?;
            emit(&format!("{text}\n"));
        } else {
            emit(&format!("{report}\n"));
        }
    }
    if !all_bit_exact {
        let bad: Vec<usize> =
            report.ranks.iter().filter(|r| !r.bit_exact || r.hazard_violations > 0).map(|r| r.rank).collect();
        return Err(CliError::failed(format!(
            "ranks {bad:?} differ from the resident output or recorded hazards; see rank 0's report"
        )));
    }
    Ok(0)
}

/// This rank on a GPU: device `LOCAL_RANK`, the GPU reference engine, an NCCL communicator whose unique id rank 0
/// generates and broadcasts over the rendezvous; then the resident run on the same GPU for the comparison.
#[cfg(feature = "nccl")]
fn cuda_rank(
    a: &RunArgs,
    env: &LaunchEnv,
    rdv: &Rendezvous,
    desc: &crate::plan::PipelineDesc,
    name: &str,
    spec: &DistributedRunSpec,
) -> Result<(crate::offload::distributed_backend::RankRun, usize, Vec<u8>), CliError> {
    use crate::engine::cuda::{CudaCompute, GpuShape};
    use crate::engine::gpu::default_tokens;
    use crate::platform::cuda::nccl::{factory, NcclUniqueId};
    use crate::platform::cuda::CudaPlatform;
    let rank = env.rank;
    let failed = |what: &str, e: &dyn fmt::Display| CliError::failed(format!("rank {rank}: {what}: {e}"));
    let cuda = Arc::new(CudaPlatform::new(env.local_rank).map_err(|e| {
        CliError::invalid(format!("rank {rank}: --platform cuda: GPU {} (LOCAL_RANK): {e}", env.local_rank))
    })?);
    let (mut tokens, context_tokens) = default_tokens(name);
    if let Some(t) = a.tokens {
        tokens = t;
    }
    let compute: Arc<dyn Compute> = Arc::new(
        CudaCompute::new(cuda.clone(), desc, GpuShape { tokens, context_tokens })
            .map_err(|e| failed("GPU engine", &e))?,
    );
    let id = if rank == 0 {
        let id = NcclUniqueId::generate().map_err(|e| failed("NCCL unique id", &e))?;
        rdv.broadcast(Some(id.as_bytes())).map_err(|e| rendezvous_error(rank, e))?
    } else {
        rdv.broadcast(None).map_err(|e| rendezvous_error(rank, e))?
    };
    let id = NcclUniqueId::from_bytes(&id).map_err(|e| failed("NCCL unique id", &e))?;
    let run =
        run_rank(cuda.clone(), compute.clone(), factory(cuda.clone(), id, rank, env.world), rank, env.world, spec)
            .map_err(|e| failed("the distributed run failed", &e))?;
    let resident = crate::offload::distributed_backend::resident_output_on(compute, desc, spec.steps, spec.seed)
        .map_err(|e| failed("resident run", &e))?;
    Ok((run, 0, resident))
}

#[cfg(not(feature = "nccl"))]
fn cuda_rank(
    _a: &RunArgs,
    _env: &LaunchEnv,
    _rdv: &Rendezvous,
    _desc: &crate::plan::PipelineDesc,
    _name: &str,
    _spec: &DistributedRunSpec,
) -> Result<(crate::offload::distributed_backend::RankRun, usize, Vec<u8>), CliError> {
    Err(CliError::invalid("--platform cuda needs a build with --features nccl".to_string()))
}
