//! The arguments of every command (clap derive). What clap can check is declared here — conflicting and required
//! flags, ranges, the values a flag takes — so a bad argument fails while parsing (exit 2, one line); the checks that
//! depend on the input or the environment live with the commands.

use clap::ValueEnum;
use std::path::PathBuf;

/// Arguments of `bench-gather`.
#[derive(Debug, clap::Args)]
pub struct BenchGatherArgs {
    /// Full-block size in MiB (each of N ranks holds 1/N of it in pinned host memory).
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    pub block_mib: u64,
    /// Chunk sizes in MiB of full block (0 = the whole block as one chunk); rounded down to a multiple of
    /// N × 256 bytes.
    #[arg(long, value_name = "MIB", value_delimiter = ',', default_value = "16,64,256,0")]
    pub chunk_mib: Vec<u64>,
    /// Timed blocks per run.
    #[arg(long, value_name = "N", default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..))]
    pub blocks: u32,
    /// Untimed blocks before each configuration.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub warmup: u32,
    /// Timed runs per configuration (the median is reported).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Group sizes to measure, one thread per GPU 0..N (default: 1 and the number of visible GPUs).
    #[arg(long, value_name = "N", value_delimiter = ',')]
    pub worlds: Vec<usize>,
    /// Modes: gather (separate shard slots, the production layout), in-place, h2d-only (no collective).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "gather,in-place,h2d-only")]
    pub modes: Vec<GatherModeArg>,
    /// GEMM shape M,N,K of the compute-slowdown loop (bf16).
    #[arg(long, value_name = "M,N,K", value_delimiter = ',', default_value = "4096,12288,3072")]
    pub gemm: Vec<usize>,
    /// GEMMs per timed loop.
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    pub gemm_iters: u32,
    /// Chunk size (MiB, 0 = whole block) of the transfers running beside the GEMMs.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    pub compute_chunk_mib: u64,
    /// Mode of the gathering transfers beside the GEMMs (one that gathers: gather or in-place).
    #[arg(long, value_name = "MODE", default_value = "gather", value_parser = gathering_mode())]
    pub compute_mode: GatherModeArg,
    /// Use NCCL's copy-engine AllGather (symmetric windows, `NCCL_CTA_POLICY_ZERO`; NCCL 2.28 or later).
    #[arg(long)]
    pub nccl_copy_engine: bool,
    /// Skip the compute-slowdown measurement.
    #[arg(long)]
    pub skip_compute: bool,
    /// Print the report as one JSON object instead of markdown.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
}

/// `--compute-mode`: a [`GatherModeArg`] that gathers (not `h2d-only`).
fn gathering_mode() -> impl clap::builder::TypedValueParser<Value = GatherModeArg> {
    use clap::builder::{PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(["gather", "in-place"]).map(|s| {
        if s == "in-place" {
            GatherModeArg::InPlace
        } else {
            GatherModeArg::Gather
        }
    })
}

/// How `bench-gather` rebuilds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GatherModeArg {
    /// Host-to-device copies of the shard only.
    H2dOnly,
    /// Shard slot, then AllGather into the output slot.
    Gather,
    /// Shard copied into its place in the output slot, AllGather in place.
    InPlace,
}

/// Arguments of `launch`.
#[derive(Debug, clap::Args)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this machine, one per GPU.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub nproc: u32,
    /// Port rank 0 listens on for the rendezvous (default: a free port).
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,
    /// The weightferry command every rank runs, after `--` (e.g. `-- run --preset flux-tiny`).
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Arguments of `bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Presets to measure (repeatable). Default: flux-dev, wan-14b, qwen-image.
    #[arg(long, value_name = "P")]
    pub preset: Vec<String>,
    /// DiT tokens for every preset (default: 4608 for flux-dev and qwen-image at 1024², 32760 for wan-14b at
    /// 480p × 81 frames).
    #[arg(long, value_name = "N")]
    pub tokens: Option<usize>,
    /// Prefetch depths measured with every block streamed.
    #[arg(long, value_name = "D", value_delimiter = ',', default_value = "1,2,3,4")]
    pub depths: Vec<u32>,
    /// Device budgets as fractions of the DiT's bytes in (0, 1], comma-separated; `none` for no budget rows (only
    /// the resident and depth configurations).
    #[arg(long, value_name = "F,…|none", default_value = "0.25,0.5,0.75")]
    pub budgets: String,
    /// Also run depths 1 and 4 (with as many resident blocks as fit) at every budget.
    #[arg(long)]
    pub sweep: bool,
    /// Steps of the shorter and the longer timed execution (their difference gives the per-step time).
    #[arg(long, value_name = "LO,HI", value_delimiter = ',', default_value = "2,6")]
    pub steps: Vec<u32>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// After timing each configuration, run it once more with a device timeline (timing events around every
    /// kernel and copy), add where the DiT time went to the report and write one Chrome trace per configuration
    /// into DIR.
    #[arg(long, value_name = "DIR")]
    pub trace: Option<std::path::PathBuf>,
    /// Rounds over the configuration list, interleaved; each configuration reports its median step time.
    #[arg(long, value_name = "R", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Let the engine's host thread run at most K blocks ahead of the device (default: unbounded, like eager
    /// frameworks, until the driver's launch queue pushes back).
    #[arg(long, value_name = "K")]
    pub max_blocks_ahead: Option<u32>,
    /// Who enqueues the streamed blocks' copies: `actor` (the copy-stream actor thread, the default) or `hook` (the
    /// engine thread inside `pre_forward`; the config key `layer_options.dit.copy_submission`). `actor,hook` runs
    /// every streamed configuration in both modes, side by side in each round.
    #[arg(long, value_name = "MODES", value_enum, value_delimiter = ',', default_values_t = [CopySubmissionArg::Actor])]
    pub copy_submission: Vec<CopySubmissionArg>,
}

/// Who enqueues the copies of streamed blocks (`bench --copy-submission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CopySubmissionArg {
    /// The copy-stream actor thread.
    Actor,
    /// The engine thread, inside the hooks.
    Hook,
}

impl From<CopySubmissionArg> for weightferry::config::CopySubmission {
    fn from(a: CopySubmissionArg) -> Self {
        match a {
            CopySubmissionArg::Actor => weightferry::config::CopySubmission::Actor,
            CopySubmissionArg::Hook => weightferry::config::CopySubmission::Hook,
        }
    }
}

/// Where kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlatformArg {
    /// The simulated device (runs anywhere).
    Sim,
    /// A CUDA GPU (needs a build with the `cuda` feature and a GPU).
    Cuda,
}

/// Arguments of `run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// A safetensors checkpoint (a `.safetensors` file, a `*.safetensors.index.json`, or a folder with either): the
    /// pipeline is derived from it and runs over its bytes.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["preset", "pipeline"])]
    pub checkpoint: Option<PathBuf>,
    /// Name of the DiT component a checkpoint becomes (with --checkpoint).
    #[arg(long, value_name = "NAME", default_value = "transformer", requires = "checkpoint")]
    pub component: String,
    /// Built-in pipeline (default flux-tiny): flux-tiny, wan-tiny, qwen-tiny (and their full-size twins).
    #[arg(long, value_name = "P", conflicts_with = "pipeline")]
    pub preset: Option<String>,
    /// Pipeline description file (weightferry-pipeline/1 JSON), or a preset name.
    #[arg(long, value_name = "FILE.json")]
    pub pipeline: Option<String>,
    /// Offload config (.json or .toml). Default: mode = "layer", components = ["dit", "text_encoder"].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// DiT steps (passes).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: u32,
    /// Device to run on.
    #[arg(long, value_enum, default_value_t = PlatformArg::Sim)]
    pub platform: PlatformArg,
    /// Write a Chrome / Perfetto trace (JSON) of the offloaded run: copies, kernels, waits, hooks. In a distributed
    /// run on `--platform cuda` with `--time-steps`: each rank traces one more LO-step execution with the GPU's
    /// timing events (kernels, shard copies, AllGathers), writes FILE with `.rank<r>` before its extension and adds
    /// where its DiT time went to the report.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Print the report as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Seed of the synthetic weights and inputs.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Seed of a block-skip pattern emulating a step cache (some blocks of later passes are skipped, identically
    /// in both runs).
    #[arg(long, value_name = "S")]
    pub skip_seed: Option<u64>,
    /// Throttle simulated host-to-device copies to this many GB/s (default: unthrottled).
    #[arg(long, value_name = "GBPS")]
    pub sim_h2d_gbps: Option<f64>,
    /// Fixed latency added to every simulated copy, in microseconds.
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub sim_copy_latency_us: u64,
    /// DiT tokens of the GPU reference engine (`--platform cuda`; default per preset).
    #[arg(long, value_name = "N")]
    pub tokens: Option<usize>,
    /// Testing aid: run the scheduler with a deliberately broken ordering to prove the checks fail.
    #[arg(long, value_enum, hide = true)]
    pub inject_ordering_fault: Option<FaultArg>,
    /// Distributed runs only: time the run (replaces --steps). Each rank runs a warm-up step, then LO and then HI
    /// steps through the same stacks, and the resident run on its device the same way; rank 0 reports per rank
    /// and for the group the step time, the resident step time, the bytes per step and the ratio to the bound.
    #[arg(long, value_name = "LO,HI")]
    pub time_steps: Option<String>,
    /// Distributed runs with --time-steps: repeat the LO and HI executions this many rounds, alternating (and the
    /// resident run's the same way); the report gives the median round and the range of the rounds' step times.
    #[arg(long, value_name = "R", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub time_rounds: u32,
    /// Testing aid (distributed runs): `RANK:N` makes that rank's N-th AllGather (0-based, the warm-up is 0) fail
    /// to start.
    #[arg(long, value_name = "RANK:N", hide = true)]
    pub inject_gather_failure: Option<String>,
    /// Distributed runs on `--platform cuda`: the NCCL AllGather that rebuilds blocks. `copy-engine` (NCCL 2.28 or
    /// later, every rank on one node): slot and shard buffers come from `ncclMemAlloc` and are registered as
    /// symmetric windows, the communicator runs under `NCCL_CTA_POLICY_ZERO`, and the AllGathers run on the copy
    /// engines, taking no SMs from the compute. `kernel`: NCCL's kernels. `auto`: the copy engines when every rank
    /// can use them, else kernels.
    #[arg(long, value_enum, value_name = "E", default_value_t = AllGatherEngineArg::Auto)]
    pub allgather_engine: AllGatherEngineArg,
}

/// Deliberately broken orderings (testing aid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FaultArg {
    /// Compute does not wait for the copy that fills its slot.
    SkipReadyWait,
    /// A load overwrites a slot without waiting for its last use.
    SkipLastUseWait,
}

/// Arguments of `plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// A safetensors checkpoint (a `.safetensors` file, a `*.safetensors.index.json`, or a folder with either) to
    /// derive the pipeline from.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["preset", "pipeline"])]
    pub checkpoint: Option<PathBuf>,
    /// Name of the DiT component a checkpoint becomes (with --checkpoint).
    #[arg(long, value_name = "NAME", default_value = "transformer", requires = "checkpoint")]
    pub component: String,
    /// Preset name or pipeline description file (default flux-tiny).
    #[arg(long, value_name = "PRESET|FILE.json")]
    pub pipeline: Option<String>,
    /// Built-in pipeline (same as --pipeline with a preset name).
    #[arg(long, value_name = "P", conflicts_with = "pipeline")]
    pub preset: Option<String>,
    /// Offload config (.json or .toml). Default: mode = "layer", components = ["dit", "text_encoder"].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the plan as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// A `.safetensors` or `.gguf` file, a `*.safetensors.index.json`, or a folder holding one index or one file.
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
    /// Name of the DiT component the checkpoint becomes.
    #[arg(long, value_name = "NAME", default_value = "transformer")]
    pub component: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `--allgather-engine`: the library's [`AllGatherEngine`](weightferry::dist::allgather_engine::AllGatherEngine) as a
/// command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AllGatherEngineArg {
    /// The copy engines when every rank can use them on one node, else kernels.
    #[default]
    Auto,
    /// NCCL's copy-engine AllGather; an error when some rank cannot use it.
    CopyEngine,
    /// NCCL's kernel AllGather.
    Kernel,
}

impl From<AllGatherEngineArg> for weightferry::dist::allgather_engine::AllGatherEngine {
    fn from(a: AllGatherEngineArg) -> Self {
        use weightferry::dist::allgather_engine::AllGatherEngine as E;
        match a {
            AllGatherEngineArg::Auto => E::Auto,
            AllGatherEngineArg::CopyEngine => E::CopyEngine,
            AllGatherEngineArg::Kernel => E::Kernel,
        }
    }
}
