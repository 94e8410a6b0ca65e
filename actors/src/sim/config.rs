//! Configuration of the simulated platform: capacity, copy throttling, injected faults, tracing.
//!
//! Invariant: a config accepted by [`SimConfig::validate`] yields finite, non-negative copy durations for every
//! copy size (an absurd size saturates instead of overflowing).

use super::fault::FaultPlan;
use std::time::Duration;

/// How the simulated device behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Device memory in bytes; allocations beyond it fail with `OutOfMemory`.
    pub device_capacity: u64,
    /// Host→device bandwidth in bytes per second; `None` copies as fast as memory allows.
    pub h2d_bytes_per_sec: Option<f64>,
    /// Device→host bandwidth in bytes per second; `None` copies as fast as memory allows.
    pub d2h_bytes_per_sec: Option<f64>,
    /// Fixed time added to every copy.
    pub copy_latency: Duration,
    /// Copies touching pageable host memory run at bandwidth / this factor (only when a bandwidth is set).
    pub pageable_slowdown: f64,
    /// Faults to inject.
    pub faults: FaultPlan,
    /// Whether executed ops are recorded in the trace from the start (see `SimPlatform::set_tracing`).
    pub tracing: bool,
}

impl Default for SimConfig {
    /// 64 GiB, no throttling, zero latency, no faults, tracing on.
    fn default() -> Self {
        SimConfig {
            device_capacity: 64 << 30,
            h2d_bytes_per_sec: None,
            d2h_bytes_per_sec: None,
            copy_latency: Duration::ZERO,
            pageable_slowdown: 1.0,
            faults: FaultPlan::none(),
            tracing: true,
        }
    }
}

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    H2d,
    D2h,
}

impl SimConfig {
    /// Checks that bandwidths and the pageable factor are finite and positive.
    pub fn validate(&self) -> Result<(), String> {
        for (name, bw) in [("h2d_bytes_per_sec", self.h2d_bytes_per_sec), ("d2h_bytes_per_sec", self.d2h_bytes_per_sec)]
        {
            if let Some(bw) = bw {
                if !(bw.is_finite() && bw > 0.0) {
                    return Err(format!("{name} must be finite and positive, got {bw}"));
                }
            }
        }
        if !(self.pageable_slowdown.is_finite() && self.pageable_slowdown > 0.0) {
            return Err(format!("pageable_slowdown must be finite and positive, got {}", self.pageable_slowdown));
        }
        Ok(())
    }

    /// How long a copy of `bytes` takes: latency plus bytes / bandwidth (bandwidth divided by the pageable factor
    /// when the host side is pageable).
    pub(crate) fn copy_time(&self, dir: Direction, bytes: u64, pageable: bool) -> Duration {
        let bw = match dir {
            Direction::H2d => self.h2d_bytes_per_sec,
            Direction::D2h => self.d2h_bytes_per_sec,
        };
        let transfer = match bw {
            Some(bw) => {
                let bw = if pageable { bw / self.pageable_slowdown } else { bw };
                Duration::try_from_secs_f64(bytes as f64 / bw).unwrap_or(Duration::MAX)
            }
            None => Duration::ZERO,
        };
        self.copy_latency.saturating_add(transfer)
    }
}
