//! Deterministic fault injection: which operation fails, counted from platform creation.
//!
//! Invariant: a fault fires on exactly one operation, chosen by a 0-based count of the operations of its kind, so a
//! given plan and a given sequence of calls always fail at the same call; no randomness at run time.

use crate::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Which operations fail. Every count is 0-based and counts calls of that kind made on one platform.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// The Nth `copy_h2d` call (counting calls whose handles and ranges were valid) fails at enqueue with
    /// [`PlatformError::CopyFailed`](crate::platform::PlatformError::CopyFailed); nothing is enqueued.
    pub fail_h2d_copy: Option<u64>,
    /// The Nth `copy_h2d` call (same count) is enqueued but fails when executed: its stream enters a sticky error
    /// state, later ops on that stream are skipped, events recorded after it report `EventFailed`, and
    /// `stream_synchronize` returns the copy's error.
    pub fail_h2d_copy_async: Option<u64>,
    /// The Nth `alloc_device` call fails with `OutOfMemory` regardless of the capacity.
    pub oom_at_alloc: Option<u64>,
    /// Every copy and kernel on streams of this name takes this much longer.
    pub slow_stream: Option<(String, Duration)>,
    /// The Nth `event_synchronize` call (counting calls with a valid event) fails with `EventFailed` at once.
    pub fail_event_sync: Option<u64>,
    /// The Nth `copy_d2h` call (counting calls whose handles and ranges were valid) fails at enqueue with
    /// [`PlatformError::CopyFailed`](crate::platform::PlatformError::CopyFailed); nothing is enqueued.
    pub fail_d2h_copy: Option<u64>,
    /// The Nth `alloc_host` call fails with
    /// [`PlatformError::HostAllocFailed`](crate::platform::PlatformError::HostAllocFailed); nothing is allocated.
    pub fail_host_alloc: Option<u64>,
    /// Every `register_host` call fails with [`PlatformError::Driver`](crate::platform::PlatformError::Driver), as
    /// a driver refusing to pin a file's pages would.
    pub fail_register_host: bool,
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> FaultPlan {
        FaultPlan::default()
    }

    /// Picks one count-based fault (sync H2D failure, async H2D failure, OOM at allocation, failed event
    /// synchronisation) and its position in `0..max_ops` pseudo-randomly from `seed`. Deterministic: the same
    /// arguments always give the same plan. `max_ops == 0` is treated as 1.
    pub fn from_seed(seed: u64, max_ops: u64) -> FaultPlan {
        let mut state = seed;
        let kind = splitmix64(&mut state) % 4;
        let at = splitmix64(&mut state) % max_ops.max(1);
        let mut plan = FaultPlan::none();
        match kind {
            0 => plan.fail_h2d_copy = Some(at),
            1 => plan.fail_h2d_copy_async = Some(at),
            2 => plan.oom_at_alloc = Some(at),
            _ => plan.fail_event_sync = Some(at),
        }
        plan
    }

    /// Whether the plan injects nothing.
    pub fn is_empty(&self) -> bool {
        *self == FaultPlan::none()
    }
}

/// One step of splitmix64 (Steele, Lea, Flood 2014): advances `state` and returns the next output. Shared by the
/// fault plans and the root crate's synthetic weights.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The call counters the plan is matched against.
pub(crate) struct FaultCounters {
    h2d_copies: AtomicU64,
    d2h_copies: AtomicU64,
    allocs: AtomicU64,
    host_allocs: AtomicU64,
    event_syncs: AtomicU64,
}

impl FaultCounters {
    /// All counters at zero.
    pub(crate) fn new() -> Self {
        FaultCounters {
            h2d_copies: AtomicU64::new(0),
            d2h_copies: AtomicU64::new(0),
            allocs: AtomicU64::new(0),
            host_allocs: AtomicU64::new(0),
            event_syncs: AtomicU64::new(0),
        }
    }

    /// Index of this `copy_h2d` call.
    pub(crate) fn next_h2d(&self) -> u64 {
        self.h2d_copies.fetch_add(1, Ordering::SeqCst)
    }

    /// Index of this `copy_d2h` call.
    pub(crate) fn next_d2h(&self) -> u64 {
        self.d2h_copies.fetch_add(1, Ordering::SeqCst)
    }

    /// Index of this `alloc_host` call.
    pub(crate) fn next_host_alloc(&self) -> u64 {
        self.host_allocs.fetch_add(1, Ordering::SeqCst)
    }

    /// Index of this `alloc_device` call.
    pub(crate) fn next_alloc(&self) -> u64 {
        self.allocs.fetch_add(1, Ordering::SeqCst)
    }

    /// Index of this `event_synchronize` call.
    pub(crate) fn next_event_sync(&self) -> u64 {
        self.event_syncs.fetch_add(1, Ordering::SeqCst)
    }
}
