//! The simulated device's throttles from the command line (`--sim-h2d-gbps`, `--sim-copy-latency-us`), checked
//! against the range a run can finish in: a rate so low, or a latency so long, that one copy would take longer than
//! an hour is refused with exit 2 instead of leaving the run without progress.

use super::{CliError, RunArgs};
use std::time::Duration;

/// Slowest simulated host-to-device rate accepted, GB/s (a 1 GiB block then takes about 18 minutes).
pub const MIN_SIM_H2D_GBPS: f64 = 0.001;
/// Fastest simulated rate accepted, GB/s (beyond any link; faster is "unthrottled": leave the flag out).
pub const MAX_SIM_H2D_GBPS: f64 = 100_000.0;
/// Longest simulated per-copy latency accepted, µs (10 s).
pub const MAX_SIM_COPY_LATENCY_US: u64 = 10_000_000;

/// The simulated copy rate (bytes/s, `None`: unthrottled) and per-copy latency `a` asks for.
pub fn sim_throttles(a: &RunArgs) -> Result<(Option<f64>, Duration), CliError> {
    let rate = match a.sim_h2d_gbps {
        None => None,
        Some(g) if g.is_finite() && (MIN_SIM_H2D_GBPS..=MAX_SIM_H2D_GBPS).contains(&g) => Some(g * 1e9),
        Some(g) => {
            return Err(CliError::invalid(format!(
                "--sim-h2d-gbps {g}: choose a rate from {MIN_SIM_H2D_GBPS} to {MAX_SIM_H2D_GBPS} GB/s, or leave the \
                 flag out for unthrottled copies"
            )))
        }
    };
    if a.sim_copy_latency_us > MAX_SIM_COPY_LATENCY_US {
        return Err(CliError::invalid(format!(
            "--sim-copy-latency-us {}: choose at most {MAX_SIM_COPY_LATENCY_US} µs (10 s) per copy",
            a.sim_copy_latency_us
        )));
    }
    Ok((rate, Duration::from_micros(a.sim_copy_latency_us)))
}
