//! The synchronisation shim: every atomic, lock, thread and channel the scheduler uses comes from here.
//!
//! Normally these are `std` primitives and `crossbeam-channel` mailboxes (kanal was measured against it on the CPU
//! benches and not kept: `benches/RESULTS.md`, "Mailboxes: kanal against crossbeam-channel"). Under `--cfg weightferry_loom` they are
//! loom's primitives (and a mailbox built from loom's `Mutex` + `Condvar`), so the production scheduler code runs
//! unchanged inside loom models. Nothing outside this module may name `std::sync` or `std::thread` directly.

#[cfg(not(weightferry_loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};

#[cfg(weightferry_loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Atomic integers and booleans.
pub mod atomic {
    #[cfg(not(weightferry_loom))]
    pub use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

    #[cfg(weightferry_loom)]
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// Threads: spawning, yielding, the current thread.
pub mod thread {
    #[cfg(not(weightferry_loom))]
    pub use std::thread::{current, park, spawn, yield_now, JoinHandle, Thread};

    #[cfg(weightferry_loom)]
    pub use loom::thread::{current, park, spawn, yield_now, JoinHandle, Thread};

    /// Spawns a named thread (the name is ignored under loom, which does not name threads).
    pub fn spawn_named<F, T>(name: &str, f: F) -> std::io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        #[cfg(not(weightferry_loom))]
        {
            std::thread::Builder::new().name(name.to_string()).spawn(f)
        }
        #[cfg(weightferry_loom)]
        {
            let _ = name;
            Ok(loom::thread::spawn(f))
        }
    }
}

/// Locks a mutex, recovering the data if another thread panicked while holding it.
///
/// Scheduler state stays consistent across a panic because every mutation under a lock is a single table update;
/// a poisoned lock must not turn one failure into a cascade of panics.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Multi-producer mailboxes.
///
/// `unbounded` mailboxes carry completion notifications back to an actor (they never block a sender, so no cycle of
/// bounded channels can deadlock); `bounded` ones carry commands to a device actor and give back-pressure.
pub mod mailbox {
    /// The receiving side hung up, or every sender is gone.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Disconnected;

    #[cfg(not(weightferry_loom))]
    mod imp {
        use super::Disconnected;

        /// Sending half of a mailbox.
        #[derive(Debug)]
        pub struct Sender<T>(crossbeam_channel::Sender<T>);
        impl<T> Clone for Sender<T> {
            fn clone(&self) -> Self {
                Sender(self.0.clone())
            }
        }
        /// Receiving half of a mailbox.
        #[derive(Debug)]
        pub struct Receiver<T>(crossbeam_channel::Receiver<T>);

        /// A mailbox that never blocks its senders.
        pub fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
            let (s, r) = crossbeam_channel::unbounded();
            (Sender(s), Receiver(r))
        }
        /// A mailbox holding at most `cap` messages; senders block when it is full.
        pub fn bounded<T>(cap: usize) -> (Sender<T>, Receiver<T>) {
            let (s, r) = crossbeam_channel::bounded(cap);
            (Sender(s), Receiver(r))
        }
        impl<T> Sender<T> {
            /// Sends, blocking while a bounded mailbox is full.
            pub fn send(&self, msg: T) -> Result<(), Disconnected> {
                self.0.send(msg).map_err(|_| Disconnected)
            }
        }
        impl<T> Receiver<T> {
            /// Receives, blocking until a message arrives or every sender is gone.
            pub fn recv(&self) -> Result<T, Disconnected> {
                self.0.recv().map_err(|_| Disconnected)
            }
            /// Receives without blocking; `Ok(None)` when empty.
            pub fn try_recv(&self) -> Result<Option<T>, Disconnected> {
                match self.0.try_recv() {
                    Ok(m) => Ok(Some(m)),
                    Err(crossbeam_channel::TryRecvError::Empty) => Ok(None),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => Err(Disconnected),
                }
            }
        }
    }

    #[cfg(weightferry_loom)]
    mod imp {
        use super::Disconnected;
        use loom::sync::{Arc, Condvar, Mutex};
        use std::collections::VecDeque;

        struct State<T> {
            queue: VecDeque<T>,
            senders: usize,
            receiver_alive: bool,
        }
        struct Shared<T> {
            state: Mutex<State<T>>,
            cond: Condvar,
            cap: Option<usize>,
        }
        /// Sending half of a mailbox.
        pub struct Sender<T>(Arc<Shared<T>>);
        /// Receiving half of a mailbox.
        pub struct Receiver<T>(Arc<Shared<T>>);

        impl<T> std::fmt::Debug for Sender<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Sender")
            }
        }
        impl<T> std::fmt::Debug for Receiver<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Receiver")
            }
        }

        fn make<T>(cap: Option<usize>) -> (Sender<T>, Receiver<T>) {
            let shared = Arc::new(Shared {
                state: Mutex::new(State { queue: VecDeque::new(), senders: 1, receiver_alive: true }),
                cond: Condvar::new(),
                cap,
            });
            (Sender(shared.clone()), Receiver(shared))
        }
        /// A mailbox that never blocks its senders.
        pub fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
            make(None)
        }
        /// A mailbox holding at most `cap` messages; senders block when it is full.
        pub fn bounded<T>(cap: usize) -> (Sender<T>, Receiver<T>) {
            make(Some(cap.max(1)))
        }
        impl<T> Clone for Sender<T> {
            fn clone(&self) -> Self {
                self.0.state.lock().unwrap().senders += 1;
                Sender(self.0.clone())
            }
        }
        impl<T> Drop for Sender<T> {
            fn drop(&mut self) {
                let mut st = self.0.state.lock().unwrap();
                st.senders -= 1;
                drop(st);
                self.0.cond.notify_all();
            }
        }
        impl<T> Drop for Receiver<T> {
            fn drop(&mut self) {
                let mut st = self.0.state.lock().unwrap();
                st.receiver_alive = false;
                drop(st);
                self.0.cond.notify_all();
            }
        }
        impl<T> Sender<T> {
            /// Sends, blocking while a bounded mailbox is full.
            pub fn send(&self, msg: T) -> Result<(), Disconnected> {
                let mut st = self.0.state.lock().unwrap();
                loop {
                    if !st.receiver_alive {
                        return Err(Disconnected);
                    }
                    match self.0.cap {
                        Some(cap) if st.queue.len() >= cap => st = self.0.cond.wait(st).unwrap(),
                        _ => break,
                    }
                }
                st.queue.push_back(msg);
                drop(st);
                self.0.cond.notify_all();
                Ok(())
            }
        }
        impl<T> Receiver<T> {
            /// Receives, blocking until a message arrives or every sender is gone.
            pub fn recv(&self) -> Result<T, Disconnected> {
                let mut st = self.0.state.lock().unwrap();
                loop {
                    if let Some(m) = st.queue.pop_front() {
                        drop(st);
                        self.0.cond.notify_all();
                        return Ok(m);
                    }
                    if st.senders == 0 {
                        return Err(Disconnected);
                    }
                    st = self.0.cond.wait(st).unwrap();
                }
            }
            /// Receives without blocking; `Ok(None)` when empty.
            pub fn try_recv(&self) -> Result<Option<T>, Disconnected> {
                let mut st = self.0.state.lock().unwrap();
                if let Some(m) = st.queue.pop_front() {
                    drop(st);
                    self.0.cond.notify_all();
                    return Ok(Some(m));
                }
                if st.senders == 0 {
                    return Err(Disconnected);
                }
                Ok(None)
            }
        }
    }

    pub use imp::{bounded, unbounded, Receiver, Sender};
}

#[cfg(all(test, not(weightferry_loom)))]
mod tests {
    //! The mailbox contract of the non-loom backend (the loom mailbox keeps it too; the loom models exercise it).
    use super::mailbox::{bounded, unbounded, Disconnected};

    #[test]
    fn queued_messages_are_delivered_after_every_sender_is_gone() {
        let (tx, rx) = unbounded();
        let tx2 = tx.clone();
        tx.send(1).unwrap();
        tx2.send(2).unwrap();
        drop((tx, tx2));
        assert_eq!(rx.try_recv(), Ok(Some(1)));
        assert_eq!(rx.recv(), Ok(2));
        assert_eq!(rx.recv(), Err(Disconnected));
        assert_eq!(rx.try_recv(), Err(Disconnected));
    }

    #[test]
    fn an_empty_mailbox_is_not_disconnected_and_a_dropped_receiver_refuses_sends() {
        let (tx, rx) = bounded::<u32>(2);
        assert_eq!(rx.try_recv(), Ok(None));
        drop(rx);
        assert_eq!(tx.send(7), Err(Disconnected));
    }

    #[test]
    fn a_full_bounded_mailbox_blocks_its_sender_until_a_receive() {
        let (tx, rx) = bounded(1);
        tx.send(0u32).unwrap();
        let t = std::thread::spawn(move || tx.send(1).map(|_| ()));
        assert_eq!(rx.recv(), Ok(0));
        assert_eq!(rx.recv(), Ok(1));
        assert_eq!(t.join().unwrap(), Ok(()));
        assert_eq!(rx.recv(), Err(Disconnected));
    }
}
