//! Operation counters of the simulated platform.
//!
//! Invariant: a copy or kernel is counted once, when it completes successfully; an allocation or free once, when
//! it succeeds. Skipped and failed ops are not counted.

use crate::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A snapshot of the platform's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Host→device copies completed.
    pub h2d_copies: u64,
    /// Bytes moved by those copies.
    pub h2d_bytes: u64,
    /// Device→host copies completed.
    pub d2h_copies: u64,
    /// Bytes moved by those copies.
    pub d2h_bytes: u64,
    /// Kernels completed without error.
    pub kernels: u64,
    /// Successful device allocations.
    pub allocs: u64,
    /// Successful device frees.
    pub frees: u64,
    /// Time each live (not destroyed) stream spent blocked in event waits, by stream name, in stream creation order.
    pub wait_time_per_stream: Vec<(String, Duration)>,
}

/// Host buffers the simulated platform holds now (allocated by `alloc_host` and not yet freed), in bytes as
/// requested from `alloc_host`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimHostMemory {
    /// Bytes of every live host buffer.
    pub in_use: u64,
    /// Bytes of the live pinned host buffers (the rest are pageable).
    pub pinned: u64,
    /// Bytes of the live mapped buffers (lent by their regions; not in `in_use`).
    pub mapped: u64,
    /// Live host buffers.
    pub buffers: u64,
    /// Largest `in_use` since the platform was created.
    pub peak: u64,
}

/// Live counters (atomics, so workers update them without a lock).
pub(crate) struct StatCounters {
    pub(crate) h2d_copies: AtomicU64,
    pub(crate) h2d_bytes: AtomicU64,
    pub(crate) d2h_copies: AtomicU64,
    pub(crate) d2h_bytes: AtomicU64,
    pub(crate) kernels: AtomicU64,
    pub(crate) allocs: AtomicU64,
    pub(crate) frees: AtomicU64,
}

impl StatCounters {
    /// All zero.
    pub(crate) fn new() -> Self {
        StatCounters {
            h2d_copies: AtomicU64::new(0),
            h2d_bytes: AtomicU64::new(0),
            d2h_copies: AtomicU64::new(0),
            d2h_bytes: AtomicU64::new(0),
            kernels: AtomicU64::new(0),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
        }
    }

    /// Adds one to `counter`.
    pub(crate) fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    /// The counters as a [`SimStats`] with the given per-stream wait times.
    pub(crate) fn snapshot(&self, waits: Vec<(String, Duration)>) -> SimStats {
        SimStats {
            h2d_copies: self.h2d_copies.load(Ordering::Relaxed),
            h2d_bytes: self.h2d_bytes.load(Ordering::Relaxed),
            d2h_copies: self.d2h_copies.load(Ordering::Relaxed),
            d2h_bytes: self.d2h_bytes.load(Ordering::Relaxed),
            kernels: self.kernels.load(Ordering::Relaxed),
            allocs: self.allocs.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            wait_time_per_stream: waits,
        }
    }
}
