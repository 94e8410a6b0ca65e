//! NCCL symmetric memory for the copy-engine AllGather (feature `nccl`).
//!
//! A [`SymmetricHeap`] allocates the gather stacks' slot and shard buffers with `ncclMemAlloc`, installed as the
//! platform's shared device memory ([`crate::platform::cuda::CudaPlatform::set_shared_device_memory`]). A
//! communicator built with [`super::nccl::NcclOptions::copy_engine`] registers each such buffer as a symmetric
//! window (`ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`) the first time an AllGather uses it, and runs
//! under `NCCL_CTA_POLICY_ZERO`. NCCL then moves an AllGather between two registered buffers with the copy engines
//! over NVLink instead of with kernels on the SMs.
//!
//! With windows, a peer's copy engine writes into this rank's gather slot. It does so only while this rank's comm
//! stream executes that AllGather (NCCL's stream semantics for a collective's buffers). This rank's comm stream
//! reaches the AllGather only after the shard copy it waits for, and that copy waits for the slot's last-use event.
//! So the block stack's rule, that a slot is overwritten only after the compute that read it, holds for the peers'
//! writes too.
//!
//! Invariants: memory goes back to NCCL (`ncclMemFree`) only once no window maps it. Freeing a registered buffer
//! defers the release until its window is deregistered (the communicator deregisters every window before it is
//! destroyed, or forgets them when it aborts). The heap never frees memory it did not allocate.
//!
//! Cost of that rule: removing a window is a collective call, made at the communicator's drop. So the gather
//! stacks' buffers, freed when the stacks are disabled (before a distributed run's final restore), stay allocated
//! on the device until then. The platform's counters already show them as free: during the restore the device
//! holds up to the stacks' slot and shard bytes more than the counters say.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::nccl::sys;

use super::nccl_lib::{nccl_version, NcclError};
use super::resources::ExternalDeviceMemory;

/// `NCCL_WIN_COLL_SYMMETRIC`: every rank passes its buffers at the same offset of the same registration.
pub(crate) const NCCL_WIN_COLL_SYMMETRIC: i32 = 0x01;

/// NCCL entry points the heap and the windows need beyond the collective's own.
const SYMBOLS: &[&str] =
    &["ncclMemAlloc", "ncclMemFree", "ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclCommInitRankConfig"];

/// One allocation of the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    len: u64,
    /// Whether a communicator's window maps it.
    registered: bool,
    /// Freed by its owner while registered: released when deregistered.
    free_pending: bool,
}

/// Where a heap's memory comes from: NCCL in production, a fake in the unit tests.
trait HeapBackend: Send + Sync + std::fmt::Debug {
    fn alloc(&self, len: usize) -> Result<CUdeviceptr, String>;
    fn release(&self, ptr: CUdeviceptr) -> Result<(), String>;
}

/// `ncclMemAlloc` / `ncclMemFree`.
#[derive(Debug)]
struct NcclBackend;

impl HeapBackend for NcclBackend {
    fn alloc(&self, len: usize) -> Result<CUdeviceptr, String> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the platform made its device's context current (the
        // `ExternalDeviceMemory` contract), which is the device `ncclMemAlloc` allocates on.
        unsafe { sys::ncclMemAlloc(&mut ptr, len) }.result().map_err(|e| format!("ncclMemAlloc: {:?}", e.0))?;
        if ptr.is_null() {
            return Err("ncclMemAlloc returned success without memory".to_string());
        }
        Ok(ptr as CUdeviceptr)
    }

    fn release(&self, ptr: CUdeviceptr) -> Result<(), String> {
        // SAFETY: `ptr` came from `ncclMemAlloc` (the heap only releases its own entries), is released exactly once
        // (its entry was removed first), and no window maps it any more.
        unsafe { sys::ncclMemFree(ptr as *mut c_void) }
            .result()
            .map(drop)
            .map_err(|e| format!("ncclMemFree: {:?}", e.0))
    }
}

/// Device memory from `ncclMemAlloc`, for buffers that a communicator maps as symmetric windows.
#[derive(Debug)]
pub struct SymmetricHeap {
    live: Mutex<HashMap<CUdeviceptr, Entry>>,
    backend: Box<dyn HeapBackend>,
}

impl SymmetricHeap {
    /// A heap; fails with [`NcclError::Unavailable`] when libnccl lacks the calls of symmetric memory (NCCL before
    /// 2.27).
    pub fn new() -> Result<Arc<SymmetricHeap>, NcclError> {
        let version = nccl_version()?;
        // SAFETY: `nccl_version` succeeded, so the library is loaded; `get` only resolves addresses.
        let lib = unsafe { sys::culib() };
        for name in SYMBOLS {
            // SAFETY: as above; the resolved symbol is dropped without being called.
            if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                return Err(NcclError::Unavailable(format!(
                    "NCCL {version} lacks {name}: the copy-engine AllGather needs NCCL 2.28 or later"
                )));
            }
        }
        Ok(Arc::new(SymmetricHeap::with_backend(Box::new(NcclBackend))))
    }

    /// A heap for the copy-engine AllGather on `platform`'s device, after checking what a rank can check alone:
    /// NCCL 2.28 or later, `NCCL_CUMEM_ENABLE` and `NCCL_WIN_ENABLE` not `0` (NCCL then has no cuMem memory or no
    /// windows), and one `ncclMemAlloc` / `ncclMemFree` of 2 MiB on the device. The error says which check failed.
    pub fn for_copy_engine(platform: &super::CudaPlatform) -> Result<Arc<SymmetricHeap>, String> {
        if let Some(why) = env_obstacle(|var| std::env::var(var).ok()) {
            return Err(why);
        }
        let version = nccl_version().map_err(|e| e.to_string())?;
        if version < 22800 {
            return Err(format!("NCCL {version} has no copy-engine AllGather (it needs 2.28 or later)"));
        }
        let heap = SymmetricHeap::new().map_err(|e| e.to_string())?;
        platform.bind_to_thread().map_err(|e| e.to_string())?;
        let probe = heap.alloc(2 << 20).map_err(|e| format!("a 2 MiB probe allocation failed: {e}"))?;
        heap.free(probe).map_err(|e| format!("freeing the probe allocation failed: {e}"))?;
        Ok(heap)
    }

    fn with_backend(backend: Box<dyn HeapBackend>) -> SymmetricHeap {
        SymmetricHeap { live: Mutex::new(HashMap::new()), backend }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CUdeviceptr, Entry>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Length of the live allocation starting at `ptr`, if the heap made it.
    pub fn allocation_len(&self, ptr: CUdeviceptr) -> Option<u64> {
        self.lock().get(&ptr).filter(|e| !e.free_pending).map(|e| e.len)
    }

    /// Number of allocations the heap still holds (those freed while registered included).
    pub fn allocations(&self) -> usize {
        self.lock().len()
    }

    /// Records that a window now maps `ptr`.
    pub(crate) fn mark_registered(&self, ptr: CUdeviceptr) {
        if let Some(e) = self.lock().get_mut(&ptr) {
            e.registered = true;
        }
    }

    /// Records that no window maps `ptr` any more, releasing it if its owner already freed it.
    pub(crate) fn mark_deregistered(&self, ptr: CUdeviceptr) {
        let release = {
            let mut live = self.lock();
            match live.get_mut(&ptr) {
                Some(e) if e.free_pending => {
                    live.remove(&ptr);
                    true
                }
                Some(e) => {
                    e.registered = false;
                    false
                }
                None => false,
            }
        };
        if release {
            if let Err(e) = self.backend.release(ptr) {
                tracing::warn!(target: "weightferry::nccl", "releasing memory after deregistration failed: {e}");
            }
        }
    }
}

impl ExternalDeviceMemory for SymmetricHeap {
    fn alloc(&self, len: u64) -> Result<CUdeviceptr, String> {
        let bytes = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit this machine's address space"))?;
        let addr = self.backend.alloc(bytes)?;
        self.lock().insert(addr, Entry { len, registered: false, free_pending: false });
        Ok(addr)
    }

    fn free(&self, ptr: CUdeviceptr) -> Result<(), String> {
        {
            let mut live = self.lock();
            match live.get_mut(&ptr) {
                None => return Err(format!("device address {ptr:#x} was not allocated by the symmetric heap")),
                Some(e) if e.registered => {
                    e.free_pending = true;
                    return Ok(());
                }
                Some(_) => {
                    live.remove(&ptr);
                }
            }
        }
        self.backend.release(ptr)
    }
}

/// Why NCCL's environment (read through `get`) rules the copy-engine AllGather out, if it does: windows need NCCL's
/// cuMem allocations and its window support, which `NCCL_CUMEM_ENABLE=0` and `NCCL_WIN_ENABLE=0` turn off.
fn env_obstacle(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    ["NCCL_CUMEM_ENABLE", "NCCL_WIN_ENABLE"].into_iter().find_map(|var| {
        get(var)
            .filter(|v| v.trim() == "0")
            .map(|_| format!("{var}=0 turns off the symmetric windows the copy-engine AllGather needs"))
    })
}

/// The windows one communicator registered, in registration order (the same on every rank).
#[derive(Debug, Default)]
pub(crate) struct Windows {
    /// (buffer address, window).
    pub(crate) list: Vec<(CUdeviceptr, sys::ncclWindow_t)>,
}

impl Windows {
    /// Whether a window maps the buffer at `ptr`.
    pub(crate) fn contains(&self, ptr: CUdeviceptr) -> bool {
        self.list.iter().any(|(p, _)| *p == ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Hands out addresses 0x1000, 0x2000, … and records releases.
    #[derive(Debug, Default)]
    struct Fake {
        next: AtomicU64,
        released: Mutex<Vec<CUdeviceptr>>,
    }

    impl HeapBackend for Arc<Fake> {
        fn alloc(&self, _len: usize) -> Result<CUdeviceptr, String> {
            Ok((self.next.fetch_add(1, Ordering::SeqCst) + 1) * 0x1000)
        }
        fn release(&self, ptr: CUdeviceptr) -> Result<(), String> {
            self.released.lock().unwrap().push(ptr);
            Ok(())
        }
    }

    fn heap() -> (SymmetricHeap, Arc<Fake>) {
        let fake = Arc::new(Fake::default());
        (SymmetricHeap::with_backend(Box::new(fake.clone())), fake)
    }

    #[test]
    fn nccl_settings_that_turn_windows_off_rule_the_copy_engines_out() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |var: &str| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string())
        };
        assert_eq!(env_obstacle(env(&[])), None);
        assert_eq!(env_obstacle(env(&[("NCCL_CUMEM_ENABLE", "1"), ("NCCL_WIN_ENABLE", " 1")])), None);
        assert_eq!(
            env_obstacle(env(&[("NCCL_CUMEM_ENABLE", " 0 ")])),
            Some("NCCL_CUMEM_ENABLE=0 turns off the symmetric windows the copy-engine AllGather needs".into())
        );
        assert_eq!(
            env_obstacle(env(&[("NCCL_CUMEM_ENABLE", "1"), ("NCCL_WIN_ENABLE", "0")])),
            Some("NCCL_WIN_ENABLE=0 turns off the symmetric windows the copy-engine AllGather needs".into())
        );
    }

    #[test]
    fn an_unregistered_buffer_is_released_at_once() {
        let (h, fake) = heap();
        let a = h.alloc(4096).unwrap();
        assert_eq!(h.allocation_len(a), Some(4096));
        h.free(a).unwrap();
        assert_eq!(*fake.released.lock().unwrap(), vec![a]);
        assert_eq!((h.allocation_len(a), h.allocations()), (None, 0));
    }

    #[test]
    fn a_registered_buffer_is_released_only_after_its_window_is_gone() {
        let (h, fake) = heap();
        let (a, b) = (h.alloc(100).unwrap(), h.alloc(200).unwrap());
        h.mark_registered(a);
        h.mark_registered(b);
        h.free(a).unwrap();
        assert!(fake.released.lock().unwrap().is_empty(), "freed while a window maps it");
        assert_eq!(h.allocation_len(a), None, "a freed buffer is not offered for new windows");
        assert_eq!(h.allocations(), 2);
        h.mark_deregistered(a);
        assert_eq!(*fake.released.lock().unwrap(), vec![a]);
        // Deregistered first, freed later: released at the free.
        h.mark_deregistered(b);
        assert_eq!(fake.released.lock().unwrap().len(), 1);
        h.free(b).unwrap();
        assert_eq!(*fake.released.lock().unwrap(), vec![a, b]);
        assert_eq!(h.allocations(), 0);
    }

    #[test]
    fn foreign_addresses_are_refused_and_never_released() {
        let (h, fake) = heap();
        assert_eq!(
            h.free(0xdead000),
            Err("device address 0xdead000 was not allocated by the symmetric heap".to_string())
        );
        h.mark_deregistered(0xdead000);
        h.mark_registered(0xdead000);
        assert!(fake.released.lock().unwrap().is_empty());
        assert_eq!(h.allocation_len(0xdead000), None);
    }
}
