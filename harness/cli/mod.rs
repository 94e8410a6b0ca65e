//! The `weightferry` command line: it parses the arguments ([`args`], clap derive, with clap's constraints), loads
//! the inputs ([`input`]), dispatches each command to its module, and keeps the exit-code contract.
//!
//! Commands: `inspect` ([`inspect`]) prints what a safetensors checkpoint holds; `run` ([`run`]) executes a pipeline resident and offloaded on the simulated platform and reports —
//! or, when the launch environment has `WORLD_SIZE > 1`, runs this process's rank of a distributed run
//! ([`dist_run`]); `plan` ([`plan`]) prints the resolved offload plan without running anything; `launch`
//! ([`launch`]) starts `N` local ranks of a command with the launch environment set; `bench` ([`mod@bench`],
//! feature `cuda`) and `bench-gather` ([`bench_gather`], feature `nccl`) measure GPUs.
//!
//! Exit codes: 0 success; 1 a run whose checks failed (outputs or host weights differ, hazard violations) or a
//! runtime failure; 2 invalid input — bad arguments, an unreadable or invalid config or pipeline file, an unknown
//! preset, an unsupported platform, a config the pipeline cannot use; 3 a rank of a distributed run that stopped
//! because another rank failed. Every failure prints exactly one line on stderr, starting with `error: `.

pub mod args;
pub mod bench;
pub mod bench_gather;
pub mod dist_run;
pub mod input;
pub mod inspect;
pub mod launch;
pub mod plan;
pub mod run;
pub mod sim_args;

pub use args::{
    AllGatherEngineArg, BenchArgs, BenchGatherArgs, CopySubmissionArg, FaultArg, GatherModeArg, InspectArgs,
    LaunchArgs, PlanArgs, PlatformArg, RunArgs,
};
pub use input::{
    check_blockless, load_checkpoint, load_config, load_pipeline, LoadedCheckpoint, LoadedPipeline,
    DEFAULT_CONFIG_JSON, DEFAULT_DIT_ONLY_CONFIG_JSON, DEFAULT_PRESET,
};

use clap::{Parser, Subcommand};
use std::ffi::OsString;

/// `weightferry -h`: what the tool does for its user.
pub const ABOUT: &str =
    "Runs a diffusion model larger than the GPU by streaming its weights between host and GPU memory";

/// `weightferry --help`: [`ABOUT`], then what each command is for.
pub const LONG_ABOUT: &str = "\
Runs a diffusion model larger than the GPU by streaming its weights between host and GPU memory, block by block,
while it computes.

Try it on a pipeline (a built-in preset, a pipeline file or a safetensors checkpoint) and an offload config:
`run` runs it fully resident, then offloaded, and checks that the outputs are identical bit for bit; `plan` shows
what the config does (what streams, what stays resident, the GPU memory it needs) without running anything;
`inspect` shows what a checkpoint holds and what can be streamed from it; `launch` starts the ranks of a
distributed run on this machine; `bench` and `bench-gather` measure offload on GPUs. Runs use a simulated device
unless given `--platform cuda`.";

/// The command line.
#[derive(Debug, Parser)]
#[command(name = "weightferry", version = VERSION, about = ABOUT, long_about = LONG_ABOUT)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a pipeline fully resident, then offloaded, check the outputs are bit-identical, and report.
    Run(RunArgs),
    /// Print the resolved offload plan of a pipeline under a config.
    Plan(PlanArgs),
    /// Print what a checkpoint (safetensors or GGUF) holds: files, tensors, dtypes, bytes, block lists.
    Inspect(InspectArgs),
    /// Measure step time against the physical bound on a GPU (needs the `cuda` feature).
    Bench(BenchArgs),
    /// Run N copies of a weightferry command on this machine as the ranks of one distributed run.
    Launch(LaunchArgs),
    /// Measure the block-rebuild rate of shard H2D + NCCL AllGather on 1 and N GPUs, and the compute slowdown it
    /// causes (needs the `nccl` feature). NVLink multicast stays off: NCCL_NVLS_ENABLE must be unset (it is then
    /// set to 0) or 0.
    BenchGather(BenchGatherArgs),
    /// Print a shell completion script (e.g. `weightferry completions bash > /etc/bash_completion.d/weightferry`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// A failure of the command line: an exit code and one line for stderr.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CliError {
    /// Process exit code.
    pub code: i32,
    /// The message (one line).
    pub message: String,
}

impl CliError {
    /// Invalid input (exit code 2).
    pub fn invalid(message: impl Into<String>) -> Self {
        CliError { code: 2, message: one_line(&message.into()) }
    }
    /// A runtime failure or a failed check (exit code 1).
    pub fn failed(message: impl Into<String>) -> Self {
        CliError { code: 1, message: one_line(&message.into()) }
    }
}

/// Collapses a message onto one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Writes `text` to stdout. A closed pipe (e.g. `| head`) is not an error worth a panic: the rest is dropped.
pub fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
}

/// `--version`: the package version and the git revision it was built from (`build.rs`).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("WEIGHTFERRY_GIT_REV"), ")");

/// Parses `args` and runs the command; returns the process exit code. Prints results on stdout and one error line
/// on stderr (followed by clap's suggestions for a mistyped argument).
pub fn main_with_args<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                emit(&e.to_string());
                return 0;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                eprintln!(
                    "error: no command given; use `weightferry run`, `weightferry plan` or `weightferry launch` (see \
                     weightferry --help)"
                );
                return 2;
            }
            let text = e.to_string();
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("invalid arguments");
            let first = first.trim().strip_prefix("error: ").unwrap_or(first.trim());
            if e.kind() == ErrorKind::MissingRequiredArgument {
                // clap lists the missing arguments on the lines below its header: name them on the error line.
                let missing: Vec<&str> = text
                    .lines()
                    .skip_while(|l| !l.contains("required arguments were not provided"))
                    .skip(1)
                    .map(str::trim)
                    .take_while(|l| !l.is_empty())
                    .collect();
                eprintln!("error: {first} {} (see weightferry --help)", missing.join(", "));
                return 2;
            }
            eprintln!("error: {first} (see weightferry --help)");
            // clap's own suggestions ("tip: a similar argument exists: '--steps'") stay with the error.
            for tip in text.lines().map(str::trim).filter(|l| l.starts_with("tip:")) {
                eprintln!("  {tip}");
            }
            return 2;
        }
    };
    let result = match &cli.command {
        Command::Run(a) => run::run(a),
        Command::Plan(a) => plan::plan(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Bench(a) => bench::bench(a),
        Command::Launch(a) => launch::launch(a),
        Command::BenchGather(a) => bench_gather::bench_gather(a),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut <Cli as clap::CommandFactory>::command(), "weightferry", &mut script);
            emit(&String::from_utf8_lossy(&script));
            Ok(0)
        }
    };
    // With --json an error is one JSON object on stderr too (`{"error": …, "exit_code": …}`), so a script reads
    // every outcome the same way.
    let json = match &cli.command {
        Command::Run(a) => a.json,
        Command::Plan(a) => a.json,
        Command::Inspect(a) => a.json,
        Command::Bench(a) => a.json,
        _ => false,
    };
    match result {
        Ok(code) => code,
        Err(e) if json => {
            eprintln!("{}", serde_json::json!({"error": e.message, "exit_code": e.code}));
            e.code
        }
        Err(e) => {
            eprintln!("error: {}", e.message);
            e.code
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_line() {
        assert_eq!(CliError::invalid("a\n  b").message, "a b");
    }
}
