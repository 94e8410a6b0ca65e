//! [`OrderingFault`]: which deliberately broken ordering a test stack runs (`faults.rs` holds the orderings).

/// Deliberately broken orderings, for tests that prove the hazard checks can fail. Never set in production.
///
/// Every variant exists in every build, so callers compile anywhere, but only a build with
/// `RUSTFLAGS="--cfg weightferry_broken"` contains the broken orderings: elsewhere a stack asking for anything but
/// `None` is refused at construction with [`SchedulerError::FaultNotBuilt`](crate::SchedulerError::FaultNotBuilt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderingFault {
    /// Correct behaviour.
    #[default]
    None,
    /// Compute does not wait for the ready event of a slot it reads.
    SkipReadyWait,
    /// A load overwrites a slot without waiting for its last-use event.
    SkipLastUseWait,
    /// `fence` replies once earlier loads are enqueued (recorded) instead of completed.
    FenceOnRecord,
    /// `disable` frees slot memory without observing completion of the copies and reads touching it.
    FreeWithoutSync,
    /// Waits for a load to be recorded ignore that the stream actor stopped (a lost wake-up when it stops).
    IgnoreActorStop,
}
