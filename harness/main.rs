//! The `weightferry` command line (see [`weightferry_harness::cli`]): runs, plans, checkpoints, launches and benches.
//!
//! Logging goes to stderr, filtered by `RUST_LOG` (default: errors only, so a failing command prints one line).

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    std::process::exit(weightferry_harness::cli::main_with_args(std::env::args_os()));
}
