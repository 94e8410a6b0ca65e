//! `weightferry run` as one rank of a distributed run (the launch environment has `WORLD_SIZE > 1`, as set by
//! `weightferry launch`, torchrun or a job script): this process joins the TCP rendezvous, checks that every rank runs
//! the same spec, runs its rank of distributed layerwise offload on the simulated device through
//! [`run_rank`](crate::drivers::distributed::run_rank) with the simulated collective over the rendezvous, compares its
//! output with the fully resident run, and exchanges the verdicts; rank 0 prints the report (text, or one JSON object
//! with `--json`).
//! Every rank exits 1 when any rank's output differs or its hazard detector fired, and a rank whose run fails exits 1
//! naming itself — or exits [`PEER_FAILED_EXIT`] (3) when it stopped only because another rank failed (a peer left, or
//! rank 0 ended the rendezvous), so `weightferry launch` can name the rank that failed first.
//!
//! The bootstrap is the library's, the one the library session uses: [`weightferry::dist::rank`]. The rank joins
//! the rendezvous with [`rank::join`](weightferry::dist::rank::join) (its `RankFingerprint` as JSON; this file
//! compares every rank's with rank 0's and names the fields that differ) and builds its collective with
//! [`rank::collective`](weightferry::dist::rank::collective): the simulated collective over the rendezvous (with
//! `--inject-gather-failure`'s fault, and its peer-failed flag for the exit code), or on `--platform cuda` (feature
//! `nccl`) NCCL on GPU `LOCAL_RANK`, bootstrapped over the rendezvous with the `--allgather-engine` request (the
//! engine every rank agrees on, rank 0's unique id). The rank keeps the rendezvous for its barrier and its verdicts;
//! this file keeps the harness's part (the GPU engine, the resident run, the trace, the reports and the CLI's
//! messages).
//!
//! Without `--config`, the DiT is gathered across a data-parallel group of `WORLD_SIZE` ranks; with `--config`,
//! the config's offload group must have `WORLD_SIZE` ranks.
//!
//! With `--time-steps LO,HI` every rank times its run ([`DistributedRunSpec::timed_steps`]: a warm-up step, then
//! `LO` and `HI` steps through the same stacks), times the resident run on its device the same way (the compute
//! time), and on CUDA measures its pinned H2D bandwidth, every rank at once after a barrier (on the simulated
//! device: `--sim-h2d-gbps`, if given);
//! rank 0 reports per rank and for the group the step time against the bound `max(compute, shard bytes per step /
//! H2D bandwidth)`, and the single-GPU bound `max(compute, full-block bytes per step / H2D bandwidth)`.
//!
//! Every rank releases its loaded DiT weights: after the resident run (which needs every weight on
//! host), the distributed run keeps only the rank's shards of the DiT blocks on host while it runs — what the
//! report's `dit_host_bytes_while_running` shows — and restores the loaded weights by a final gather to host at its
//! end; the rank then checks that the model's checksum equals the one before the run and fails with an exact
//! message when it does not.

use super::{emit, load_config, load_pipeline, CliError, PlatformArg, RunArgs, DEFAULT_PRESET};
use crate::drivers::distributed::{
    rank_session, resident_run_with_model, run_rank_in_session, step_seconds, DistributedRunSpec, RankRun, ResidentRun,
};
use crate::drivers::launch::PEER_FAILED_EXIT;
use crate::drivers::run::{checkpoint_error, CheckpointWeights};
use crate::engine::compute::{Compute, SimCompute};
use crate::engine::synthetic::SyntheticWeights;
use crate::report::human_bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::dist::allgather_engine::AllGatherEngine;
use weightferry::dist::rank::{self as dist_rank, CollectiveOptions, RankDevice, RankJoin};
use weightferry::dist::{LaunchEnv, Rendezvous, RendezvousError};
use weightferry::model::HostModel;
use weightferry::model::{fnv1a, ModelError, FNV_OFFSET};
use weightferry::scheduler::{CollectiveFactory, PlatformRef, SimConfig, SimPlatform};

/// The config a distributed `run` uses without `--config`: the DiT gathered across a data-parallel group of
/// `world` ranks, prefetch depth 2.
pub fn default_distributed_config(world: usize) -> String {
    format!(
        r#"{{"data_parallel_size": {world}, "diffusion_offload_config": {{"mode": "layer", "components": ["dit"],
            "layer_options": {{"dit": {{"weight_transfer": "allgather"}}}}}}}}"#
    )
}

/// Parses `--time-steps LO,HI` (`1 <= LO < HI <= 100000`).
pub fn parse_time_steps(text: &str) -> Result<(u32, u32), CliError> {
    let bad = || {
        CliError::invalid(format!(
            "--time-steps {text:?}: expected two step counts LO,HI with 1 <= LO < HI <= 100000, e.g. 1,3"
        ))
    };
    let (lo, hi) = text.split_once(',').ok_or_else(bad)?;
    let lo: u32 = lo.trim().parse().map_err(|_| bad())?;
    let hi: u32 = hi.trim().parse().map_err(|_| bad())?;
    if lo == 0 || hi <= lo || hi > 100_000 {
        return Err(bad());
    }
    Ok((lo, hi))
}

/// `max(compute, bytes / bandwidth)` (just `compute` without a bandwidth).
fn bound_of(compute_s: f64, bytes: u64, bytes_per_s: Option<f64>) -> f64 {
    match bytes_per_s {
        Some(bw) if bw.is_finite() && bw > 0.0 => compute_s.max(bytes as f64 / bw),
        _ => compute_s,
    }
}

/// `step / bound`, when the bound is a positive number.
fn ratio_of(step_s: f64, bound_s: f64) -> Option<f64> {
    (bound_s.is_finite() && bound_s > 0.0 && step_s.is_finite()).then(|| step_s / bound_s)
}

/// One rank's timed run (`--time-steps`). Seconds per step are `(t(HI) − t(LO)) / (HI − LO)`, bytes per step the
/// same difference of the stacks' copy counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankTimingReport {
    /// Wall time of the `LO`-step execution, s.
    pub lo_s: f64,
    /// Wall time of the `HI`-step execution, s.
    pub hi_s: f64,
    /// Rounds of `LO` / `HI` executions (`--time-rounds`); the figures are the median round's.
    #[serde(default = "one_round")]
    pub rounds: u32,
    /// Shortest step time of a round, s.
    #[serde(default)]
    pub step_min_s: f64,
    /// Longest step time of a round, s.
    #[serde(default)]
    pub step_max_s: f64,
    /// Seconds per step of the distributed run.
    pub step_s: f64,
    /// Seconds per step of the resident run on the same device (the compute time).
    pub resident_step_s: f64,
    /// Pinned H2D bandwidth of this rank, bytes/s (CUDA: measured with 256 MiB copies; simulated device: the
    /// `--sim-h2d-gbps` throttle; `null` when unthrottled).
    pub h2d_bytes_per_s: Option<f64>,
    /// Shard bytes this rank copied host → device per step.
    pub shard_bytes_per_step: u64,
    /// Bytes the AllGathers wrote on this rank per step (shard bytes × ranks, padding included).
    pub gathered_bytes_per_step: u64,
    /// Full-block bytes rebuilt per step (what one GPU alone would copy host → device per step).
    pub full_bytes_per_step: u64,
    /// `max(resident_step_s, shard_bytes_per_step / h2d_bytes_per_s)`.
    pub bound_s: f64,
    /// `step_s / bound_s` (`null` when the bound is not positive).
    pub ratio: Option<f64>,
    /// The single-GPU bound of the same work: `max(resident_step_s, full_bytes_per_step / h2d_bytes_per_s)`.
    pub single_gpu_bound_s: f64,
}

fn one_round() -> u32 {
    1
}

impl RankTimingReport {
    /// The report of a timed `run` and the timed resident run on the same device.
    pub fn new(run: &RankRun, resident: &ResidentRun, h2d_bytes_per_s: Option<f64>) -> Option<Self> {
        let t = run.timing.as_ref()?;
        let (steps, lo, hi) = resident.timing?;
        let step_s = t.step_s();
        let resident_step_s = step_seconds(steps, lo, hi);
        let bound_s = bound_of(resident_step_s, t.shard_bytes_per_step, h2d_bytes_per_s);
        Some(RankTimingReport {
            lo_s: t.lo.as_secs_f64(),
            hi_s: t.hi.as_secs_f64(),
            rounds: t.rounds,
            step_min_s: t.step_range_s.0,
            step_max_s: t.step_range_s.1,
            step_s,
            resident_step_s,
            h2d_bytes_per_s,
            shard_bytes_per_step: t.shard_bytes_per_step,
            gathered_bytes_per_step: t.gathered_bytes_per_step,
            full_bytes_per_step: t.full_bytes_per_step,
            bound_s,
            ratio: ratio_of(step_s, bound_s),
            single_gpu_bound_s: bound_of(resident_step_s, t.full_bytes_per_step, h2d_bytes_per_s),
        })
    }
}

/// The group's timing: the slowest rank's figures (the ranks wait for each other at every AllGather).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupTiming {
    /// `[LO, HI]` steps of the timed executions.
    pub steps: [u32; 2],
    /// Seconds per step: the largest of the ranks'.
    pub step_s: f64,
    /// Resident seconds per step (the compute time): the largest of the ranks'.
    pub compute_s: f64,
    /// Pinned H2D bandwidth, bytes/s: the smallest of the ranks' (`null` when no rank has one).
    pub h2d_bytes_per_s: Option<f64>,
    /// Shard bytes copied host → device per step and rank: the largest of the ranks'.
    pub shard_bytes_per_step: u64,
    /// Bytes the AllGathers wrote per step and rank: the largest of the ranks'.
    pub gathered_bytes_per_step: u64,
    /// Full-block bytes rebuilt per step on each rank.
    pub full_bytes_per_step: u64,
    /// The group's bound: the largest of the ranks' bounds.
    pub bound_s: f64,
    /// `step_s / bound_s` (`null` when the bound is not positive).
    pub ratio: Option<f64>,
    /// The single-GPU bound of the same work: the largest of the ranks' `single_gpu_bound_s`.
    pub single_gpu_bound_s: f64,
    /// `step_s / single_gpu_bound_s`: below 1 when the group beats any single-GPU layerwise run.
    pub ratio_to_single_gpu_bound: Option<f64>,
    /// The command that measures single-GPU layerwise of the same preset and depth (`null` for a pipeline file).
    pub single_gpu_command: Option<String>,
}

impl GroupTiming {
    /// The group's figures from every rank's; `None` when a rank has no timing.
    pub fn new(steps: (u32, u32), ranks: &[RankSummary], single_gpu_command: Option<String>) -> Option<Self> {
        let t: Vec<&RankTimingReport> = ranks.iter().map(|r| r.timing.as_ref()).collect::<Option<_>>()?;
        let fmax = |f: fn(&RankTimingReport) -> f64| t.iter().map(|r| f(r)).fold(f64::NEG_INFINITY, f64::max);
        let umax = |f: fn(&RankTimingReport) -> u64| t.iter().map(|r| f(r)).max().unwrap_or(0);
        if t.is_empty() {
            return None;
        }
        let step_s = fmax(|r| r.step_s);
        let bound_s = fmax(|r| r.bound_s);
        let single_gpu_bound_s = fmax(|r| r.single_gpu_bound_s);
        Some(GroupTiming {
            steps: [steps.0, steps.1],
            step_s,
            compute_s: fmax(|r| r.resident_step_s),
            h2d_bytes_per_s: t.iter().filter_map(|r| r.h2d_bytes_per_s).reduce(f64::min),
            shard_bytes_per_step: umax(|r| r.shard_bytes_per_step),
            gathered_bytes_per_step: umax(|r| r.gathered_bytes_per_step),
            full_bytes_per_step: umax(|r| r.full_bytes_per_step),
            bound_s,
            ratio: ratio_of(step_s, bound_s),
            single_gpu_bound_s,
            ratio_to_single_gpu_bound: ratio_of(step_s, single_gpu_bound_s),
            single_gpu_command,
        })
    }
}

/// The single-GPU bench command for the same preset, steps, depth and tokens (`None` for a pipeline file).
pub fn single_gpu_command(pipeline: &str, steps: (u32, u32), depth: usize, tokens: Option<usize>) -> Option<String> {
    weightferry::pipeline::presets::preset(pipeline)?;
    let tokens = tokens.map_or_else(String::new, |t| format!(" --tokens {t}"));
    Some(format!(
        "weightferry bench --preset {pipeline} --steps {},{} --depths {depth} --budgets none{tokens}",
        steps.0, steps.1
    ))
}

/// Decimal bytes: GB or MB with two decimals, or plain bytes below 1 MB.
fn gb(bytes: u64) -> String {
    match bytes {
        b if b >= 1_000_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.2} MB", b as f64 / 1e6),
        b => format!("{b} B"),
    }
}

/// `ratio` with three decimals, or `n/a`.
fn ratio_text(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".to_string(), |r| format!("{r:.3}"))
}

/// A bandwidth in GB/s, or `unthrottled`.
fn bw_text(b: Option<f64>) -> String {
    b.map_or_else(|| "unthrottled".to_string(), |b| format!("{:.1} GB/s", b / 1e9))
}

/// What one rank reports to rank 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    /// The rank.
    pub rank: usize,
    /// Whether its output equals the fully resident run's, bit for bit (the name a single-process run uses).
    pub outputs_match: bool,
    /// FNV-1a checksum of its output.
    pub checksum: String,
    /// AllGathers its collective actor started (warm-up included; the final restore's not).
    pub all_gathers: usize,
    /// AllGathers of the final restore of its released DiT weights to host.
    #[serde(default)]
    pub restore_all_gathers: usize,
    /// Host bytes of its shard masters.
    pub shard_host_bytes: u64,
    /// Host bytes it held for DiT weights while the distributed run executed (its shards, plus any DiT weights it
    /// kept loaded: none, since the run releases them).
    #[serde(default)]
    pub dit_host_bytes_while_running: u64,
    /// Bytes it copied host to device (shards only).
    pub h2d_bytes: u64,
    /// AllGathers that went between symmetric windows: NCCL's copy-engine path on GPUs (0 with kernels), the
    /// simulated group's model of it on the simulated device.
    #[serde(default)]
    pub windowed_all_gathers: u64,
    /// Hazard violations its simulated device detected.
    pub hazard_violations: usize,
    /// With `--time-steps`: its timed run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<RankTimingReport>,
    /// With `--trace`: where the DiT time of its traced execution went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<RankTimelineReport>,
}

/// One rank's traced execution (`--trace`), per DiT step: the DiT window (first to last DiT kernel), the compute
/// stream's busy time and stalls (gaps of at least 20 µs), the shard copies' and the AllGathers' busy time and how
/// much of each ran beside compute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankTimelineReport {
    /// Steps of the traced execution.
    pub steps: u32,
    /// Per step.
    #[serde(flatten)]
    pub per_step: crate::engine::timeline::StepTimeline,
    /// The Chrome trace this rank wrote.
    pub trace_file: String,
}

impl RankTimelineReport {
    /// The per-step report of a rank's trace, written to `trace_file`.
    pub fn new(t: &crate::drivers::distributed::RankTrace, trace_file: String) -> Self {
        let per_step = crate::engine::timeline::StepTimeline::per_step(t.summary.clone(), t.steps, t.dropped);
        RankTimelineReport { steps: t.steps, per_step, trace_file }
    }
}

/// Where rank `rank` writes its trace: `FILE` with `.rank<r>` before its extension (`t.json` → `t.rank1.json`).
pub fn rank_trace_path(file: &std::path::Path, rank: usize) -> std::path::PathBuf {
    let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match file.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    file.with_file_name(name)
}

/// The report rank 0 prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    /// On GPUs: the NCCL AllGather the ranks used, `"copy-engine"` or `"kernel"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allgather_engine: Option<String>,
    /// With `--allgather-engine auto` and kernels used: why the copy engines were not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allgather_engine_note: Option<String>,
    /// FNV-1a checksum of the fully resident output.
    pub resident_checksum: String,
    /// Per rank, in rank order.
    pub ranks: Vec<RankSummary>,
    /// Whether every rank's output equals the resident run's, bit for bit.
    pub outputs_match: bool,
    /// Ordering hazards the simulated devices recorded, all ranks together.
    pub hazard_violations: usize,
    /// With `--time-steps`: the group's timing (each rank's is in `ranks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timing: Option<GroupTiming>,
}

impl fmt::Display for DistributedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut chunk = match self.chunk_bytes {
            Some(c) => format!("AllGather chunks of {}", human_bytes(c)),
            None => "one AllGather per section".to_string(),
        };
        if let Some(e) = &self.allgather_engine {
            chunk.push_str(&format!(" ({e} AllGather"));
            if let Some(note) = &self.allgather_engine_note {
                chunk.push_str(&format!(": {note}"));
            }
            chunk.push(')');
        }
        let steps = match &self.timing {
            Some(t) => format!("timed steps {},{} after a warm-up step", t.steps[0], t.steps[1]),
            None => format!("{} steps", self.steps),
        };
        writeln!(
            f,
            "weightferry distributed run: {} on {} {} ranks (one process each), {steps}, depth {}, {chunk}",
            self.pipeline, self.world, self.platform, self.depth
        )?;
        for r in &self.ranks {
            writeln!(
                f,
                "rank {}: {} (checksum {}), {} AllGathers (+{} restoring the weights to host; {} between symmetric \
                 windows), {} of shards on host ({} of DiT weights on host while running), {} copied host to device, \
                 {} hazards",
                r.rank,
                if r.outputs_match { "bit-exact with the resident run" } else { "DIFFERS from the resident run" },
                r.checksum,
                r.all_gathers,
                r.restore_all_gathers,
                r.windowed_all_gathers,
                human_bytes(r.shard_host_bytes),
                human_bytes(r.dit_host_bytes_while_running),
                human_bytes(r.h2d_bytes),
                r.hazard_violations
            )?;
        }
        for r in &self.ranks {
            let Some(t) = &r.timing else { continue };
            writeln!(
                f,
                "rank {} timing: {:.4} s/step (LO {:.3} s, HI {:.3} s{}), resident {:.4} s/step, shards {}/step at {} \
                 pinned H2D, AllGather {}/step, full blocks {}/step, bound {:.4} s, ratio {}, single-GPU bound {:.4} s",
                r.rank,
                t.step_s,
                t.lo_s,
                t.hi_s,
                if t.rounds > 1 {
                    format!("; median of {} rounds, {:.4}–{:.4} s/step", t.rounds, t.step_min_s, t.step_max_s)
                } else {
                    String::new()
                },
                t.resident_step_s,
                gb(t.shard_bytes_per_step),
                bw_text(t.h2d_bytes_per_s),
                gb(t.gathered_bytes_per_step),
                gb(t.full_bytes_per_step),
                t.bound_s,
                ratio_text(t.ratio),
                t.single_gpu_bound_s
            )?;
        }
        for r in &self.ranks {
            let Some(t) = &r.timeline else { continue };
            writeln!(
                f,
                "rank {} timeline (per DiT step of a traced {}-step execution): window {:.2} ms, compute busy {:.2} ms, \
                 {:.1} stalls ({:.2} ms, longest {:.2} ms), shard copies {:.2} ms ({:.2} ms beside compute), \
                 AllGathers {:.2} ms ({:.2} ms beside compute), {} spans dropped; trace {}",
                r.rank,
                t.steps,
                t.per_step.window_ms,
                t.per_step.compute_busy_ms,
                t.per_step.stalls,
                t.per_step.stall_ms,
                t.per_step.longest_stall_ms,
                t.per_step.copy_busy_ms,
                t.per_step.overlap_ms,
                t.per_step.comm_busy_ms,
                t.per_step.comm_overlap_ms,
                t.per_step.dropped,
                t.trace_file
            )?;
        }
        if self.outputs_match && self.hazard_violations == 0 {
            write!(
                f,
                "all {} ranks bit-exact with the resident run (checksum {})",
                self.world, self.resident_checksum
            )?;
        } else {
            write!(f, "NOT all ranks match the resident run (checksum {})", self.resident_checksum)?;
        }
        if let Some(t) = &self.timing {
            write!(
                f,
                "\ngroup: {:.4} s/step, bound {:.4} s = max(compute {:.4} s, {} shards / {}), ratio {}; single-GPU \
                 bound {:.4} s = max(compute, {} full blocks / {}), step / single-GPU bound {}",
                t.step_s,
                t.bound_s,
                t.compute_s,
                gb(t.shard_bytes_per_step),
                bw_text(t.h2d_bytes_per_s),
                ratio_text(t.ratio),
                t.single_gpu_bound_s,
                gb(t.full_bytes_per_step),
                bw_text(t.h2d_bytes_per_s),
                ratio_text(t.ratio_to_single_gpu_bound)
            )?;
            if let Some(cmd) = &t.single_gpu_command {
                write!(f, "\nsingle-GPU layerwise of the same preset: {cmd} (its depth={} row)", self.depth)?;
            }
        }
        Ok(())
    }
}

/// What every rank must agree on before its first AllGather, all-gathered at the rendezvous as JSON. The
/// pipeline and the config enter by the digest of their serialized form (their content, not their name).
#[derive(Debug, Serialize)]
struct RankFingerprint {
    pipeline: String,
    pipeline_content: String,
    config: String,
    steps: u32,
    seed: u64,
    depth: usize,
    chunk_bytes: Option<u64>,
    inject_gather_failure: Option<(usize, u64)>,
    timed_steps: Option<(u32, u32)>,
    timed_rounds: u32,
    tokens: Option<usize>,
    allgather_engine: String,
}

/// `pipeline_content differs (rank 1: …, rank 0: …)` for every field of two serialized [`RankFingerprint`]s
/// that differs.
fn fingerprint_differences(theirs: &[u8], ours: &[u8], r: usize) -> String {
    let parse = |b: &[u8]| serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(b).ok();
    let (Some(t), Some(o)) = (parse(theirs), parse(ours)) else {
        return format!("its rank check is not one of this version ({} bytes)", theirs.len());
    };
    let diffs: Vec<String> = o
        .iter()
        .filter(|(k, v)| t.get(*k) != Some(v))
        .map(|(k, v)| {
            let theirs = t.get(k).map_or_else(|| "missing".to_string(), |x| x.to_string());
            format!("{k} differs (rank {r}: {theirs}, rank 0: {v})")
        })
        .collect();
    if diffs.is_empty() {
        "its rank check differs".to_string()
    } else {
        diffs.join("; ")
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

/// A failure of the library's rank bootstrap ([`weightferry::dist::rank`]): the rendezvous's as
/// [`rendezvous_error`], NCCL's as [`bootstrap_error`], anything else this rank's (exit 1).
fn bootstrap_failure(rank: usize, e: dist_rank::RankError) -> CliError {
    match e {
        dist_rank::RankError::Connect { source, .. } | dist_rank::RankError::Exchange(source) => {
            rendezvous_error(rank, source)
        }
        #[cfg(feature = "nccl")]
        dist_rank::RankError::Nccl { source, .. } => bootstrap_error(rank, source),
        e => CliError::failed(format!("rank {rank}: {e}")),
    }
}

/// This rank stopped because another rank failed.
fn peer_failed(rank: usize, what: &str) -> CliError {
    let mut e = CliError::failed(format!("rank {rank}: stopped because another rank failed: {what}"));
    e.code = PEER_FAILED_EXIT;
    e
}

/// This rank failed at `what` (exit 1).
fn rank_failed(rank: usize, what: &str, e: &dyn fmt::Display) -> CliError {
    CliError::failed(format!("rank {rank}: {what}: {e}"))
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
    let fault = check_distributed_args(a, world)?;
    let timed = a.time_steps.as_deref().map(parse_time_steps).transpose()?;
    let (pipeline, weights, config, mut spec) = load_rank_inputs(a, world)?;
    spec.steps = timed.map_or(a.steps, |(_, hi)| hi);
    spec.timed_steps = timed;
    spec.timed_rounds = a.time_rounds;
    spec.seed = a.seed;
    // Measure the contract: only the shards stay on host while the run executes.
    let (h2d_bytes_per_sec, copy_latency) = super::sim_args::sim_throttles(a)?;
    let sim_config = SimConfig { tracing: false, h2d_bytes_per_sec, copy_latency, ..SimConfig::default() };

    let joined = join_ranks(a, env, &pipeline, &config, &spec, fault)?;
    let outcome = if a.platform == PlatformArg::Cuda {
        cuda_rank(a, &joined, &pipeline.desc, &pipeline.name, &spec, weights.as_ref())?
    } else {
        sim_rank(&joined, sim_config, &spec, weights.as_ref(), fault)?
    };
    let ctx = RankContext { a, rank, world, name: &pipeline.name, spec: &spec, timed };
    let (summary, resident, engine) = rank_summary(&ctx, outcome)?;
    report_group(&ctx, &joined.rendezvous, summary, &resident, engine)
}

/// Refuses the flags a distributed run does not support, and parses `--inject-gather-failure`.
fn check_distributed_args(a: &RunArgs, world: usize) -> Result<Option<(usize, u64)>, CliError> {
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
    if AllGatherEngine::from(a.allgather_engine) == AllGatherEngine::CopyEngine && a.platform != PlatformArg::Cuda {
        return Err(CliError::invalid(
            "--allgather-engine copy-engine needs --platform cuda (the simulated device has no NCCL): remove it, or \
             run on GPUs"
                .to_string(),
        ));
    }
    if a.platform == PlatformArg::Cuda && a.inject_gather_failure.is_some() {
        return Err(unsupported("--inject-gather-failure on --platform cuda"));
    }
    if a.trace.is_some() && a.platform != PlatformArg::Cuda {
        return Err(CliError::invalid(
            "--trace in a distributed run needs --platform cuda (it records the GPU's timing events; the simulated \
             device has none): remove --trace, or run on GPUs"
                .to_string(),
        ));
    }
    if a.time_rounds != 1 && a.time_steps.is_none() {
        return Err(CliError::invalid(
            "--time-rounds repeats the timed executions of --time-steps LO,HI: add --time-steps, or remove \
             --time-rounds"
                .to_string(),
        ));
    }
    if a.trace.is_some() && a.time_steps.is_none() {
        return Err(CliError::invalid(
            "--trace in a distributed run needs --time-steps LO,HI (it traces one more LO-step execution after the \
             timed ones)"
                .to_string(),
        ));
    }
    if a.skip_seed.is_some() {
        return Err(unsupported("--skip-seed"));
    }
    if a.inject_ordering_fault.is_some() {
        return Err(unsupported("--inject-ordering-fault"));
    }
    let fault = a.inject_gather_failure.as_deref().map(parse_fault).transpose()?;
    if let Some((r, _)) = fault {
        if r >= world {
            return Err(CliError::invalid(format!(
                "--inject-gather-failure {r}:…: rank {r} is not in this run of {world} ranks (0..{}); name a rank below \
                 {world}",
                world - 1
            )));
        }
    }
    Ok(fault)
}

/// The pipeline (a preset, a file, or derived from `--checkpoint` with its weights), the config (given, or the
/// built-in distributed one) and the run spec they make, checked against the launch's world.
fn load_rank_inputs(
    a: &RunArgs,
    world: usize,
) -> Result<(super::LoadedPipeline, Option<CheckpointWeights>, OffloadConfig, DistributedRunSpec), CliError> {
    let loaded = a.checkpoint.as_deref().map(|p| super::load_checkpoint(p, &a.component)).transpose()?;
    let (pipeline, weights) = match (&a.checkpoint, loaded) {
        (Some(path), Some(l)) => {
            let weights = CheckpointWeights { checkpoint: l.checkpoint.clone(), component: l.derived.component };
            (super::LoadedPipeline { name: path.display().to_string(), desc: l.derived.desc }, Some(weights))
        }
        _ => (load_pipeline(a.preset.as_deref().or(a.pipeline.as_deref()).unwrap_or(DEFAULT_PRESET))?, None),
    };
    let config = match &a.config {
        Some(_) => load_config(a.config.as_deref(), &pipeline.desc)?,
        None => OffloadConfig::from_json_str(&default_distributed_config(world))
            .map_err(|e| CliError::failed(format!("the built-in distributed config is invalid: {e}")))?,
    };
    let spec = DistributedRunSpec::from_config(pipeline.desc.clone(), &config)
        .map_err(|e| CliError::invalid(format!("invalid config for a distributed run: {e}")))?;
    if spec.world != world {
        return Err(CliError::invalid(format!(
            "the config gathers the DiT across an offload group of {} rank(s), but WORLD_SIZE={world}; set \
             data_parallel_size (or sequence_parallel_size) to {world} with \
             diffusion_offload_config.layer_options.dit.weight_transfer = \"allgather\", or launch {} process(es)",
            spec.world, spec.world
        )));
    }
    Ok((pipeline, weights, config, spec))
}

/// Joins the rendezvous ([`dist_rank::join`]) and checks that every rank runs what rank 0 runs (or the AllGathers
/// would not match).
fn join_ranks(
    a: &RunArgs,
    env: &LaunchEnv,
    pipeline: &super::LoadedPipeline,
    config: &OffloadConfig,
    spec: &DistributedRunSpec,
    fault: Option<(usize, u64)>,
) -> Result<RankJoin, CliError> {
    let rank = env.rank;
    let content = |what: &str, json: serde_json::Result<Vec<u8>>| {
        json.map(|b| format!("{:016x}", fnv1a(FNV_OFFSET, &b)))
            .map_err(|e| CliError::failed(format!("rank {rank}: cannot serialize the {what} for the rank check: {e}")))
    };
    let fingerprint = RankFingerprint {
        pipeline: pipeline.name.clone(),
        pipeline_content: content("pipeline", serde_json::to_vec(&pipeline.desc))?,
        config: content("config", serde_json::to_vec(config))?,
        steps: spec.steps,
        seed: spec.seed,
        depth: spec.depth,
        chunk_bytes: spec.chunk_bytes,
        inject_gather_failure: fault,
        timed_steps: spec.timed_steps,
        timed_rounds: spec.timed_rounds,
        tokens: a.tokens,
        allgather_engine: clap::ValueEnum::to_possible_value(&a.allgather_engine)
            .map_or_else(String::new, |v| v.get_name().to_string()),
    };
    let mine = serde_json::to_vec(&fingerprint)
        .map_err(|e| CliError::failed(format!("rank {rank}: cannot serialize the rank check: {e}")))?;
    // Its digest goes in the hello: without a run id, rank 0 drops a hello of another fingerprint as a stranger's.
    let joined = dist_rank::join(env, &mine).map_err(|e| bootstrap_failure(rank, e))?;
    let all = &joined.fingerprints;
    if let Some(r) = joined.first_disagreeing(&all[0]) {
        return Err(CliError::failed(format!(
            "rank {r} does not run what rank 0 runs: {}; launch every rank with the same arguments and the same \
             pipeline and config files",
            fingerprint_differences(&all[r], &all[0], r)
        )));
    }
    Ok(joined)
}

/// This rank on the simulated device: the library's simulated collective over the rendezvous
/// ([`dist_rank::collective`]; `fault` fails one of its AllGathers).
fn sim_rank(
    joined: &RankJoin,
    sim_config: SimConfig,
    spec: &DistributedRunSpec,
    weights: Option<&CheckpointWeights>,
    fault: Option<(usize, u64)>,
) -> Result<RankOutcome, CliError> {
    let (rank, world) = (joined.env.rank, joined.env.world);
    let failed = |what: &str, e: &dyn fmt::Display| rank_failed(rank, what, e);
    let sim = Arc::new(SimPlatform::new(sim_config.clone()).map_err(|e| failed("simulated device", &e))?);
    let platform: PlatformRef = sim.clone();
    let compute: Arc<dyn Compute> = Arc::new(SimCompute::new(sim.clone()));
    let fail_all_gather = fault.and_then(|(r, n)| (r == rank).then_some(n));
    let options = CollectiveOptions { fail_all_gather, ..CollectiveOptions::default() };
    let built = match dist_rank::collective(joined, RankDevice::Sim(&sim), options) {
        Ok(built) => built,
        Err(e) => {
            sim.shutdown();
            return Err(bootstrap_failure(rank, e));
        }
    };
    let outcome = rank_with_model(platform, compute, built.factory, (rank, world), spec, weights);
    let hazards = sim.violations().len();
    sim.shutdown();
    let peer_failed = built.peer_failed.is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst));
    let (run, resident) = outcome.map_err(|e| e.into_cli(rank, peer_failed))?;
    Ok(RankOutcome { run, hazards, resident, h2d_bytes_per_s: sim_config.h2d_bytes_per_sec, engine: None })
}

/// What every step after a rank's run needs to know about it.
struct RankContext<'a> {
    a: &'a RunArgs,
    rank: usize,
    world: usize,
    /// Preset name or pipeline file.
    name: &'a str,
    spec: &'a DistributedRunSpec,
    timed: Option<(u32, u32)>,
}

/// This rank's summary (its trace written, when asked for), with its resident run and the agreed AllGather engine.
fn rank_summary(
    ctx: &RankContext<'_>,
    outcome: RankOutcome,
) -> Result<(RankSummary, ResidentRun, Option<weightferry::dist::allgather_engine::EngineChoice>), CliError> {
    let RankContext { a, rank, world, timed, .. } = *ctx;
    let failed = |what: &str, e: &dyn fmt::Display| rank_failed(rank, what, e);
    let RankOutcome { run, hazards, resident, h2d_bytes_per_s, engine } = outcome;
    let timeline = match (&run.trace, &a.trace) {
        (Some(t), Some(file)) => {
            let path = rank_trace_path(file, rank);
            let title = format!("{} rank {rank} of {world}", ctx.name);
            let text = crate::engine::timeline::to_chrome_json(&t.spans, &title).to_string();
            std::fs::write(&path, text).map_err(|e| failed(&format!("writing trace `{}`", path.display()), &e))?;
            Some(RankTimelineReport::new(t, path.display().to_string()))
        }
        _ => None,
    };
    let summary = RankSummary {
        rank,
        outputs_match: run.output == resident.output,
        checksum: format!("{:016x}", fnv1a(FNV_OFFSET, &run.output)),
        all_gathers: run.issued.len(),
        restore_all_gathers: run.restore_issued.len(),
        shard_host_bytes: run.shard_host_bytes,
        dit_host_bytes_while_running: run.dit_host_bytes_while_running,
        h2d_bytes: run.h2d_bytes,
        windowed_all_gathers: run.windowed_all_gathers,
        hazard_violations: hazards,
        timing: RankTimingReport::new(&run, &resident, h2d_bytes_per_s),
        timeline,
    };
    if timed.is_some() && summary.timing.is_none() {
        return Err(failed("timing", &"the timed run returned no timing"));
    }
    Ok((summary, resident, engine))
}

/// Gathers every rank's summary, prints the group's report on rank 0, and fails unless every rank matched the
/// resident output without hazards.
fn report_group(
    ctx: &RankContext<'_>,
    rdv: &Rendezvous,
    summary: RankSummary,
    resident: &ResidentRun,
    engine: Option<weightferry::dist::allgather_engine::EngineChoice>,
) -> Result<i32, CliError> {
    let RankContext { a, rank, world, spec, timed, .. } = *ctx;
    let failed = |what: &str, e: &dyn fmt::Display| rank_failed(rank, what, e);
    let encoded = serde_json::to_vec(&summary).map_err(|e| failed("encode", &e))?;
    let all = rdv.all_gather_bytes(&encoded).map_err(|e| rendezvous_error(rank, e))?;
    let ranks: Vec<RankSummary> = all
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<Result<_, _>>()
        .map_err(|e| failed("decode the other ranks' results", &e))?;
    let outputs_match = ranks.iter().all(|r| r.outputs_match);
    let hazard_violations = ranks.iter().map(|r| r.hazard_violations).sum::<usize>();
    let group_timing = timed.and_then(|steps| {
        let cmd = single_gpu_command(ctx.name, steps, spec.depth, a.tokens);
        GroupTiming::new(steps, &ranks, cmd)
    });
    let report = DistributedReport {
        pipeline: ctx.name.to_string(),
        platform: if a.platform == PlatformArg::Cuda { "cuda+nccl".into() } else { "sim".into() },
        world,
        steps: spec.steps,
        depth: spec.depth,
        chunk_bytes: spec.chunk_bytes,
        allgather_engine: engine.as_ref().map(|e| e.to_string()),
        allgather_engine_note: engine.and_then(|e| e.note),
        resident_checksum: format!("{:016x}", fnv1a(FNV_OFFSET, &resident.output)),
        timing: group_timing,
        ranks,
        outputs_match,
        hazard_violations,
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
    if !outputs_match || hazard_violations > 0 {
        let bad: Vec<usize> =
            report.ranks.iter().filter(|r| !r.outputs_match || r.hazard_violations > 0).map(|r| r.rank).collect();
        return Err(CliError::failed(format!(
            "ranks {bad:?} differ from the resident output or recorded hazards; see rank 0's report"
        )));
    }
    Ok(0)
}

/// What this rank ran: the distributed run, the hazards its simulated device saw (0 on a GPU), the resident run
/// on the same device, and its pinned H2D bandwidth when known.
struct RankOutcome {
    run: RankRun,
    hazards: usize,
    resident: ResidentRun,
    h2d_bytes_per_s: Option<f64>,
    /// On GPUs: the AllGather engine the ranks agreed on.
    engine: Option<weightferry::dist::allgather_engine::EngineChoice>,
}

/// Which part of a rank's run failed.
enum RankError {
    Resident(crate::engine::EngineError),
    Run(crate::drivers::distributed::DistributedRunError),
    /// The weights after the run are not the ones before ([`check_restored_weights`]'s message).
    Weights(String),
}

impl RankError {
    /// The rank's error; `peer_failed`: its collective saw another rank fail first.
    fn into_cli(self, rank: usize, peer_failed: bool) -> CliError {
        match self {
            RankError::Resident(e) => rank_failed(rank, "resident run", &e),
            RankError::Weights(m) => CliError::failed(format!("rank {rank}: {m}")),
            RankError::Run(e) if peer_failed => self::peer_failed(rank, &format!("the distributed run failed: {e}")),
            RankError::Run(e) => rank_failed(rank, "the distributed run failed", &e),
        }
    }
}

/// The check after a distributed run that released its loaded weights: the model's checksum (`after`) must equal
/// the one before the run. The error is the exact message the rank fails with.
pub fn check_restored_weights(before: u64, after: Result<u64, ModelError>) -> Result<(), String> {
    match after {
        Ok(after) if after == before => Ok(()),
        Ok(after) => Err(format!(
            "the weights restored after the distributed run differ from the loaded ones (model checksum {after:016x}, \
             {before:016x} before the run)"
        )),
        Err(e) => Err(format!("the model cannot be read after the distributed run: {e}")),
    }
}

/// This rank's runs on its device (simulated or GPU): one model (synthetic, or over `weights`, the checkpoint's
/// mapped files, from which the distributed run reads only this rank's shards) serves the resident run (first: it also
/// warms the engine up, and it needs every weight on host) and the distributed run (both timed with
/// `spec.timed_steps`), which releases the model's DiT weights while it runs and restores them at its end; the
/// model's checksum after the run must be the one before.
fn rank_with_model(
    platform: PlatformRef,
    compute: Arc<dyn Compute>,
    factory: CollectiveFactory,
    (rank, world): (usize, usize),
    spec: &DistributedRunSpec,
    weights: Option<&CheckpointWeights>,
) -> Result<(RankRun, ResidentRun), RankError> {
    let desc = Arc::new(spec.pipeline.clone());
    let model = match weights {
        None => HostModel::synthetic(platform.clone(), desc, spec.seed).map_err(|e| RankError::Resident(e.into()))?,
        Some(w) => HostModel::from_checkpoint(platform.clone(), desc, &w.checkpoint, &w.component)
            .map_err(|e| RankError::Resident(checkpoint_error(e)))?,
    };
    let mut session = rank_session(model, factory, rank, world, spec).map_err(RankError::Run)?;
    let resident = resident_run_with_model(
        compute.clone(),
        session.model(),
        &spec.pipeline,
        spec.steps,
        spec.seed,
        spec.timed_steps,
        spec.timed_rounds,
    )
    .map_err(RankError::Resident)?;
    let before = session.model().checksum().map_err(|e| RankError::Resident(e.into()))?;
    let run = run_rank_in_session(compute, &mut session, rank, world, spec).map_err(RankError::Run)?;
    check_restored_weights(before, session.model().checksum()).map_err(RankError::Weights)?;
    Ok((run, resident))
}

/// This rank on a GPU: device `LOCAL_RANK`, the library's NCCL bootstrap over the rendezvous
/// ([`dist_rank::collective`]: the AllGather engine every rank agrees on, rank 0's unique id), the GPU reference
/// engine, then [`rank_with_model`].
#[cfg(feature = "nccl")]
fn cuda_rank(
    a: &RunArgs,
    joined: &RankJoin,
    desc: &weightferry::pipeline::PipelineDesc,
    name: &str,
    spec: &DistributedRunSpec,
    weights: Option<&CheckpointWeights>,
) -> Result<RankOutcome, CliError> {
    use crate::engine::cuda::default_tokens;
    use crate::engine::cuda::{CudaCompute, GpuShape};
    use weightferry::dist::nccl_bootstrap::open_rank_gpu;
    let (env, rdv) = (&joined.env, &joined.rendezvous);
    let rank = env.rank;
    let cuda = open_rank_gpu(env).map_err(|e| CliError::invalid(format!("rank {rank}: --platform cuda: {e}")))?;
    let options = CollectiveOptions { allgather_engine: a.allgather_engine.into(), fail_all_gather: None };
    let built =
        dist_rank::collective(joined, RankDevice::Cuda(&cuda), options).map_err(|e| bootstrap_failure(rank, e))?;
    let platform: PlatformRef = cuda.clone();
    // Timed: this rank's pinned H2D bandwidth, measured as the single-GPU bench does, by every rank at once (after
    // a barrier): the ranks copy their shards at the same time, and two GPUs copying at once share the host side.
    let h2d_bytes_per_s = match spec.timed_steps {
        Some(_) => {
            rdv.barrier().map_err(|e| rendezvous_error(rank, e))?;
            Some(cuda.measure_h2d_bandwidth(256 << 20, 16).map_err(|e| rank_failed(rank, "pinned H2D bandwidth", &e))?)
        }
        None => None,
    };
    let (mut tokens, context_tokens) = default_tokens(name);
    if let Some(t) = a.tokens {
        tokens = t;
    }
    let compute: Arc<dyn Compute> = Arc::new(
        CudaCompute::new(cuda.clone(), desc, GpuShape { tokens, context_tokens })
            .map_err(|e| rank_failed(rank, "GPU engine", &e))?,
    );
    let mut spec = spec.clone();
    if a.trace.is_some() {
        spec.trace = Some(crate::drivers::distributed::RunTracer(cuda.clone()));
    }
    let (run, resident) = rank_with_model(platform, compute, built.factory, (rank, env.world), &spec, weights)
        .map_err(|e| e.into_cli(rank, false))?;
    Ok(RankOutcome { run, hazards: 0, resident, h2d_bytes_per_s, engine: built.engine })
}

/// A failed NCCL bootstrap: an invalid request (exit 2) for a refused copy-engine AllGather, a peer's failure
/// ([`PEER_FAILED_EXIT`]) when the exchange broke or rank 0 sent no unique id, else this rank's failure.
#[cfg(feature = "nccl")]
fn bootstrap_error(rank: usize, e: weightferry::dist::BootstrapError) -> CliError {
    use weightferry::dist::{BootstrapError, ExchangeError};
    match e {
        BootstrapError::Exchange { source: ExchangeError::Rendezvous(e), .. } => rendezvous_error(rank, e),
        e @ BootstrapError::NoUniqueId => peer_failed(rank, &e.to_string()),
        e @ BootstrapError::CopyEngine(_) => CliError::invalid(e.to_string()),
        e => rank_failed(rank, "NCCL bootstrap", &e),
    }
}

#[cfg(not(feature = "nccl"))]
fn cuda_rank(
    _a: &RunArgs,
    _joined: &RankJoin,
    _desc: &weightferry::pipeline::PipelineDesc,
    _name: &str,
    _spec: &DistributedRunSpec,
    _weights: Option<&CheckpointWeights>,
) -> Result<RankOutcome, CliError> {
    Err(CliError::invalid("--platform cuda needs a build with --features nccl".to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_writes_its_own_trace_file() {
        use std::path::Path;
        assert_eq!(rank_trace_path(Path::new("/tmp/t.json"), 1), Path::new("/tmp/t.rank1.json"));
        assert_eq!(rank_trace_path(Path::new("out/flux"), 0), Path::new("out/flux.rank0"));
        assert_eq!(rank_trace_path(Path::new("a.b.json"), 12), Path::new("a.b.rank12.json"));
    }

    #[test]
    fn the_timeline_report_is_per_step_and_flat_in_json() {
        use crate::drivers::distributed::RankTrace;
        use crate::engine::timeline::TimelineSummary;
        let summary = TimelineSummary { window_us: 4000.0, comm_busy_us: 1000.0, ..Default::default() };
        let t = RankTrace { steps: 2, spans: Vec::new(), dropped: 1, summary };
        let r = RankTimelineReport::new(&t, "t.rank0.json".into());
        assert_eq!((r.steps, r.per_step.window_ms, r.per_step.comm_busy_ms, r.per_step.dropped), (2, 2.0, 0.5, 1));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            (v["steps"].as_u64(), v["window_ms"].as_f64(), v["comm_busy_ms"].as_f64()),
            (Some(2), Some(2.0), Some(0.5))
        );
        assert_eq!(v["trace_file"], "t.rank0.json");
        let back: RankTimelineReport = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn time_steps_parse_lo_below_hi() {
        assert_eq!(parse_time_steps("1,3").unwrap(), (1, 3));
        assert_eq!(parse_time_steps(" 2 , 6 ").unwrap(), (2, 6));
        for bad in ["", "3", "3,1", "2,2", "0,2", "a,b", "1,2,3", "-1,2", "1,100001"] {
            let e = parse_time_steps(bad).unwrap_err();
            assert_eq!(e.code, 2, "{bad:?}");
            assert_eq!(
                e.message,
                format!("--time-steps {bad:?}: expected two step counts LO,HI with 1 <= LO < HI <= 100000, e.g. 1,3")
            );
        }
    }

    fn timing(step_s: f64, resident_step_s: f64, shard: u64, full: u64, bw: Option<f64>) -> RankTimingReport {
        let bound_s = bound_of(resident_step_s, shard, bw);
        RankTimingReport {
            lo_s: 1.0,
            hi_s: 1.0 + 2.0 * step_s,
            rounds: 1,
            step_min_s: step_s,
            step_max_s: step_s,
            step_s,
            resident_step_s,
            h2d_bytes_per_s: bw,
            shard_bytes_per_step: shard,
            gathered_bytes_per_step: shard * 2,
            full_bytes_per_step: full,
            bound_s,
            ratio: ratio_of(step_s, bound_s),
            single_gpu_bound_s: bound_of(resident_step_s, full, bw),
        }
    }

    fn summary(rank: usize, t: Option<RankTimingReport>) -> RankSummary {
        RankSummary {
            rank,
            outputs_match: true,
            checksum: "0".into(),
            all_gathers: 1,
            restore_all_gathers: 1,
            shard_host_bytes: 1,
            dit_host_bytes_while_running: 1,
            h2d_bytes: 1,
            windowed_all_gathers: 0,
            hazard_violations: 0,
            timing: t,
            timeline: None,
        }
    }

    #[test]
    fn bounds_and_group_timing_take_the_slowest_rank() {
        // flux-dev-like: 11.8 GB of shards per step and rank at 55 GB/s, 0.2 s of compute.
        let a = timing(0.25, 0.20, 11_835_000_000, 23_670_000_000, Some(55e9));
        assert!((a.bound_s - 0.215_181_818).abs() < 1e-6, "{}", a.bound_s);
        assert!((a.single_gpu_bound_s - 0.430_363_636).abs() < 1e-6, "{}", a.single_gpu_bound_s);
        let b = timing(0.26, 0.21, 11_835_000_000, 23_670_000_000, Some(50e9));
        let g = GroupTiming::new((1, 3), &[summary(0, Some(a.clone())), summary(1, Some(b.clone()))], None).unwrap();
        assert_eq!(g.steps, [1, 3]);
        assert_eq!(g.step_s, 0.26);
        assert_eq!(g.compute_s, 0.21);
        assert_eq!(g.h2d_bytes_per_s, Some(50e9));
        assert_eq!(g.bound_s, b.bound_s);
        assert_eq!(g.ratio, Some(0.26 / b.bound_s));
        assert_eq!(g.single_gpu_bound_s, b.single_gpu_bound_s);
        assert_eq!(g.ratio_to_single_gpu_bound, Some(0.26 / b.single_gpu_bound_s));
        // A rank without timing: no group timing.
        assert!(GroupTiming::new((1, 3), &[summary(0, Some(a)), summary(1, None)], None).is_none());
        // Unthrottled and no compute: no ratio rather than a division by zero.
        let z = timing(0.1, 0.0, 5, 10, None);
        assert_eq!(z.bound_s, 0.0);
        assert_eq!(z.ratio, None);
    }

    #[test]
    fn restored_weights_must_have_the_checksum_from_before_the_run() {
        assert_eq!(check_restored_weights(0xABCD, Ok(0xABCD)), Ok(()));
        assert_eq!(
            check_restored_weights(0xABCD, Ok(0x1234)),
            Err("the weights restored after the distributed run differ from the loaded ones (model checksum \
                 0000000000001234, 000000000000abcd before the run)"
                .to_string())
        );
        let e = check_restored_weights(1, Err(ModelError::Sharded { storage: 7 })).unwrap_err();
        assert!(e.starts_with("the model cannot be read after the distributed run: storage 7 is released"), "{e}");
    }

    #[test]
    fn the_single_gpu_command_names_the_preset_steps_depth_and_tokens() {
        assert_eq!(
            single_gpu_command("flux-dev", (1, 3), 2, None).as_deref(),
            Some("weightferry bench --preset flux-dev --steps 1,3 --depths 2 --budgets none")
        );
        assert_eq!(
            single_gpu_command("wan-14b", (1, 2), 2, Some(1000)).as_deref(),
            Some("weightferry bench --preset wan-14b --steps 1,2 --depths 2 --budgets none --tokens 1000")
        );
        assert_eq!(single_gpu_command("my/pipeline.json", (1, 2), 2, None), None);
    }

    #[test]
    fn a_rank_summary_with_timing_round_trips_and_one_without_keeps_the_old_json() {
        let s = summary(1, Some(timing(0.25, 0.2, 10, 20, Some(1e9))));
        let back: RankSummary = serde_json::from_slice(&serde_json::to_vec(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        let plain = serde_json::to_value(summary(0, None)).unwrap();
        assert!(plain.get("timing").is_none(), "{plain}");
        let back: RankSummary = serde_json::from_value(plain).unwrap();
        assert_eq!(back.timing, None);
    }
}
