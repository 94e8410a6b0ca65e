//! The deliberately broken orderings ([`OrderingFault`]), compiled only into builds with
//! `RUSTFLAGS="--cfg weightferry_broken"` (test builds: `tests/all.sh` runs the fault tests that way, in
//! `target/broken`, and the loom models in `target/loom`). They exist to prove that the hazard checks, the loom
//! models and the bit-exact comparisons can fail.
//!
//! The stack reaches them only through its fault points (the `fault_point!` macro in `mod.rs`), one per fault:
//!
//! | fault | fault point | broken behaviour |
//! | --- | --- | --- |
//! | `SkipReadyWait` | `pre_forward` | compute is not ordered behind the slot's ready event |
//! | `SkipLastUseWait` | `issue_load` | the load's waits are empty, on every load path |
//! | `FenceOnRecord` | `fence` | [`fence_on_record`] replaces the loads part of the fence |
//! | `FreeWithoutSync` | `release_all` | nothing is synchronised before the memory is freed |
//! | `IgnoreActorStop` | `wait_ticket` | a wait on a ticket board never gives up on a stopped actor |
//!
//! Without the cfg this module does not exist, the macro expands to the correct branch alone, and a [`StackSpec`]
//! asking for a fault is refused at construction ([`SchedulerError::FaultNotBuilt`]).
//!
//! [`StackSpec`]: super::StackSpec

use super::{actor_path, BlockStack, LoadPath, OrderingFault};
use crate::error::SchedulerError;
use crate::sync::lock;

/// The ordering fault a stack was built with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Faults(OrderingFault);

impl Faults {
    /// The stack's fault (`OrderingFault::None` for a correct stack).
    pub(super) fn new(fault: OrderingFault) -> Self {
        Faults(fault)
    }
    /// Whether the stack was built with `fault`.
    pub(super) fn is(self, fault: OrderingFault) -> bool {
        self.0 == fault
    }
}

/// `FenceOnRecord`: the loads part of a fence waits until the loads issued so far are recorded (enqueued) instead
/// of completed. Hook submission records a load before its hook returns, so there it waits for nothing.
pub(super) fn fence_on_record(st: &BlockStack) -> Result<(), SchedulerError> {
    match st.path {
        LoadPath::Hook => Ok(()),
        LoadPath::Actor | LoadPath::Gather(_) | LoadPath::Disk(_) => {
            let last = lock(&st.inner).ring.last_ticket();
            actor_path::wait_recorded(st, last, usize::MAX)
        }
    }
}
