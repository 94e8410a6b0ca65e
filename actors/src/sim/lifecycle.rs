//! Platform lifecycle: the shutdown flag and the interruptible sleep that models copy time and slow streams.
//!
//! Invariant: once [`Lifecycle::begin_shutdown`] returned, every sleeper has been woken and every later check of
//! [`Lifecycle::is_down`] sees `true`, so no worker or caller blocks forever on a platform that is going away.
//! Under `cfg(weightferry_loom)` sleeping is disabled (models do not measure time).

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{lock, Condvar, Mutex};
use std::time::Duration;

/// Shutdown flag plus a condition variable that sleepers wait on, so shutdown interrupts them.
pub(crate) struct Lifecycle {
    down: AtomicBool,
    sleep_lock: Mutex<()>,
    sleep_cond: Condvar,
}

impl Lifecycle {
    /// A running platform.
    pub(crate) fn new() -> Self {
        Lifecycle { down: AtomicBool::new(false), sleep_lock: Mutex::new(()), sleep_cond: Condvar::new() }
    }

    /// Whether shutdown has begun.
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// Sets the flag and wakes every sleeper. Returns `false` if shutdown had already begun.
    pub(crate) fn begin_shutdown(&self) -> bool {
        let first = !self.down.swap(true, Ordering::SeqCst);
        // Taking the lock orders this notification after any sleeper's flag check.
        drop(lock(&self.sleep_lock));
        self.sleep_cond.notify_all();
        first
    }

    /// Sleeps for `dur` unless shutdown begins first. Returns `false` when interrupted by shutdown.
    #[cfg(not(weightferry_loom))]
    pub(crate) fn sleep(&self, dur: Duration) -> bool {
        if dur.is_zero() {
            return !self.is_down();
        }
        let deadline = std::time::Instant::now().checked_add(dur);
        let mut guard = lock(&self.sleep_lock);
        loop {
            if self.is_down() {
                return false;
            }
            match deadline {
                Some(deadline) => {
                    let now = std::time::Instant::now();
                    if now >= deadline {
                        return true;
                    }
                    guard = match self.sleep_cond.wait_timeout(guard, deadline - now) {
                        Ok((g, _)) => g,
                        Err(poisoned) => poisoned.into_inner().0,
                    };
                }
                None => {
                    guard = match self.sleep_cond.wait(guard) {
                        Ok(g) => g,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                }
            }
        }
    }

    /// Under loom, time is not modelled: returns at once (`false` only if shut down).
    #[cfg(weightferry_loom)]
    pub(crate) fn sleep(&self, dur: Duration) -> bool {
        let _ = dur;
        !self.is_down()
    }
}

/// Waits on `cond`, recovering the guard if another thread panicked while holding the lock.
pub(crate) fn wait<'a, T>(cond: &Condvar, guard: crate::sync::MutexGuard<'a, T>) -> crate::sync::MutexGuard<'a, T> {
    match cond.wait(guard) {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// The error every call returns once the platform has shut down.
pub(crate) fn shut_down_error() -> crate::platform::PlatformError {
    crate::platform::PlatformError::Unavailable("the sim platform has shut down".to_string())
}
