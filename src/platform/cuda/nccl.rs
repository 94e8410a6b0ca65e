//! NCCL AllGather on a [`CudaPlatform`]: the [`Collective`] contract on real GPUs (feature `nccl`).
//!
//! [`NcclCollective`] is one rank of an NCCL communicator on one device. Its AllGather moves bytes
//! (`ncclUint8`) between device buffers of its platform, named by the platform's handles, and is enqueued on the
//! platform stream the caller names (the collective actor's comm stream). libnccl is loaded at run time through
//! cudarc (`dynamic-loading`): a machine without it gets [`NcclError::Unavailable`], never a panic.
//!
//! Ranks meet through an [`NcclUniqueId`]: rank 0 generates it ([`NcclUniqueId::generate`]), ships its 128 bytes
//! to the other ranks by any means ([`NcclUniqueId::to_bytes`] / [`NcclUniqueId::from_bytes`]), and every rank
//! calls [`NcclCollective::new`] with it (which blocks until all `world` ranks joined). The communicator is not
//! `Send`: it is built on the thread that uses it, by [`factory`] on the collective actor's thread.
//!
//! Invariant (the same contract as `SimCollective`): a collective never enters an unmatched AllGather after a
//! failure. The first failure of a call — a range outside its buffer, an unknown handle, an overlap of input and
//! output, an error NCCL reported asynchronously ([`ncclCommGetAsyncError`], checked before every enqueue) or the
//! failed `ncclAllGather` itself — *poisons* the collective before anything is enqueued for that call; every later
//! call fails at once with [`NcclError::Poisoned`] and enqueues nothing. (A rank that stopped cannot stop its
//! peers, which then wait in their AllGather: the caller must abort the whole group — dropping a poisoned
//! collective calls `ncclCommAbort`.) Tags of every call not refused for an earlier poisoning are recorded in call
//! order.
//!
//! [`ncclCommGetAsyncError`]: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/comms.html

use std::cell::RefCell;
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;
use weightferry_actors::collective::Collective;
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::platform::{DeviceBufferId, PlatformError, StreamId};

use super::nccl_lib::{call_error, describe};
pub use super::nccl_lib::{nccl_version, NcclError, NCCL_UNIQUE_ID_BYTES};
use super::symmetric::{SymmetricHeap, Windows, NCCL_WIN_COLL_SYMMETRIC};
use super::CudaPlatform;

/// The 128-byte id by which the ranks of one communicator find each other.
///
/// Generated once, on rank 0, and shipped to the other ranks as bytes. It holds a bootstrap address, not a
/// secret, and is only meaningful until the communicator is built.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NcclUniqueId([u8; NCCL_UNIQUE_ID_BYTES]);

impl fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclUniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl NcclUniqueId {
    /// Generates a fresh id (`ncclGetUniqueId`; opens the bootstrap listener). Call it on rank 0 only.
    pub fn generate() -> Result<NcclUniqueId, NcclError> {
        nccl_version()?;
        let id = nccl::get_uniqueid().map_err(|e| call_error("ncclGetUniqueId", e, None))?;
        Ok(NcclUniqueId(id.internal.map(|c| c as u8)))
    }

    /// The id from exactly [`NCCL_UNIQUE_ID_BYTES`] bytes; any other length is [`NcclError::InvalidUniqueId`].
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclUniqueId, NcclError> {
        let arr: [u8; NCCL_UNIQUE_ID_BYTES] =
            bytes.try_into().map_err(|_| NcclError::InvalidUniqueId { len: bytes.len() })?;
        Ok(NcclUniqueId(arr))
    }

    /// The id's bytes, to ship to the other ranks.
    pub fn to_bytes(&self) -> [u8; NCCL_UNIQUE_ID_BYTES] {
        self.0
    }

    /// The id's bytes, borrowed.
    pub fn as_bytes(&self) -> &[u8; NCCL_UNIQUE_ID_BYTES] {
        &self.0
    }

    fn to_sys(self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: self.0.map(|b| b as std::ffi::c_char) }
    }
}

impl From<[u8; NCCL_UNIQUE_ID_BYTES]> for NcclUniqueId {
    fn from(bytes: [u8; NCCL_UNIQUE_ID_BYTES]) -> NcclUniqueId {
        NcclUniqueId(bytes)
    }
}

/// Mutable bookkeeping of one rank.
#[derive(Default)]
struct State {
    poison: Option<NcclError>,
    issued: Vec<u64>,
    enqueued: u64,
    /// Set by [`NcclCollective::abort`]: drop aborts instead of destroying.
    abort: bool,
    /// AllGathers enqueued between two symmetric windows (NCCL may run them on the copy engines).
    windowed: u64,
}

/// How a communicator is built.
#[derive(Debug, Clone, Default)]
pub struct NcclOptions {
    /// The copy-engine AllGather: the communicator runs under `NCCL_CTA_POLICY_ZERO` and registers every buffer of
    /// this heap that an AllGather uses as a symmetric window, at its first use. Install the same heap as the
    /// platform's shared device memory before the gather stacks allocate. Every rank must pick the same slot for
    /// the same gather (the block stack's docs say when), and every rank of the group must use the option alike.
    pub copy_engine: Option<Arc<SymmetricHeap>>,
}

/// `NCCL_CONFIG_MAGIC`.
const NCCL_CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: the field keeps NCCL's default.
const UNDEF: i32 = i32::MIN;
/// `NCCL_CTA_POLICY_ZERO`.
const NCCL_CTA_POLICY_ZERO: i32 = 0x02;

/// One rank of an NCCL communicator on one [`CudaPlatform`].
///
/// Not `Send` and not `Sync` (an NCCL communicator belongs to the thread that uses it): build it on its thread,
/// e.g. through [`factory`] on the collective actor's thread. Dropping it destroys the communicator
/// (`ncclCommDestroy`, which waits for its pending AllGathers, so their peers must issue them too), or aborts it
/// (`ncclCommAbort`) once poisoned or after [`NcclCollective::abort`].
pub struct NcclCollective {
    platform: Arc<CudaPlatform>,
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    state: RefCell<State>,
    /// With the copy-engine option: the heap whose buffers get windows, and the windows registered so far.
    symmetric: Option<(Arc<SymmetricHeap>, RefCell<Windows>)>,
}

impl fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.platform.ordinal())
            .finish()
    }
}

impl NcclCollective {
    /// Joins communicator `id` as `rank` of `world` on `platform`'s device: binds the platform's context to this
    /// thread and calls `ncclCommInitRank`, which blocks until every rank joined.
    pub fn new(platform: Arc<CudaPlatform>, id: &NcclUniqueId, rank: usize, world: usize) -> Result<Self, NcclError> {
        NcclCollective::with_options(platform, id, rank, world, NcclOptions::default())
    }

    /// [`NcclCollective::new`] with [`NcclOptions`]: with `copy_engine`, the communicator is created through
    /// `ncclCommInitRankConfig` with `NCCL_CTA_POLICY_ZERO`.
    pub fn with_options(
        platform: Arc<CudaPlatform>,
        id: &NcclUniqueId,
        rank: usize,
        world: usize,
        options: NcclOptions,
    ) -> Result<Self, NcclError> {
        let invalid = || NcclError::InvalidRank { rank, world };
        if world == 0 || rank >= world {
            return Err(invalid());
        }
        let nranks = i32::try_from(world).map_err(|_| invalid())?;
        let my_rank = i32::try_from(rank).map_err(|_| invalid())?;
        let version = nccl_version()?;
        platform.bind_to_thread()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        match &options.copy_engine {
            None => {
                // SAFETY: `comm` is a valid out-pointer for one communicator handle; the id is a plain 128-byte
                // value; the platform's context (the device's primary context, which NCCL's runtime calls use
                // too) is current.
                unsafe { nccl::comm_init_rank(&mut comm, nranks, id.to_sys(), my_rank) }
                    .map_err(|e| call_error("ncclCommInitRank", e, None))?;
            }
            Some(_) => {
                let mut config = zero_cta_config(version);
                // SAFETY: as above, plus `config` is a fully initialised `ncclConfig_t` (every field NCCL reads
                // is set, to "undefined" unless chosen) that outlives the call.
                unsafe { nccl::comm_init_rank_config(&mut comm, nranks, id.to_sys(), my_rank, &mut config) }
                    .map_err(|e| call_error("ncclCommInitRankConfig", e, None))?;
            }
        }
        if comm.is_null() {
            return Err(NcclError::Call {
                call: "ncclCommInitRank",
                code: "null communicator".to_string(),
                message: "NCCL returned success without a communicator".to_string(),
            });
        }
        tracing::debug!(target: "weightferry::nccl", rank, world, device = platform.ordinal(), "joined communicator");
        let symmetric = options.copy_engine.map(|heap| (heap, RefCell::new(Windows::default())));
        Ok(NcclCollective { platform, comm, rank, world, state: RefCell::new(State::default()), symmetric })
    }

    /// [`NcclCollective::new`] from the id's bytes as shipped by rank 0 (exactly [`NCCL_UNIQUE_ID_BYTES`]; any
    /// other length is [`NcclError::InvalidUniqueId`], before anything is initialised).
    pub fn from_id_bytes(platform: Arc<CudaPlatform>, id: &[u8], rank: usize, world: usize) -> Result<Self, NcclError> {
        NcclCollective::new(platform, &NcclUniqueId::from_bytes(id)?, rank, world)
    }

    /// The platform this rank runs on.
    pub fn platform(&self) -> &Arc<CudaPlatform> {
        &self.platform
    }

    /// The tags of every call, in call order (calls refused because the collective was already poisoned are not
    /// recorded; a call that failed and poisoned it is).
    pub fn issued_tags(&self) -> Vec<u64> {
        self.state.borrow().issued.clone()
    }

    /// How many `ncclAllGather`s were enqueued (zero-length gathers enqueue nothing and are not counted).
    pub fn enqueued(&self) -> u64 {
        self.state.borrow().enqueued
    }

    /// How many AllGathers went between two symmetric windows (with the copy-engine option; NCCL then chooses
    /// its copy-engine path).
    pub fn windowed(&self) -> u64 {
        self.state.borrow().windowed
    }

    /// How many symmetric windows this communicator registered.
    pub fn windows(&self) -> usize {
        self.symmetric.as_ref().map_or(0, |(_, w)| w.borrow().list.len())
    }

    /// Registers the buffer at `ptr` (a heap allocation of `len` bytes) as a symmetric window unless one maps it.
    /// A collective call: every rank registers its counterpart at the same point of the gather order.
    fn ensure_window(
        &self,
        heap: &SymmetricHeap,
        windows: &RefCell<Windows>,
        ptr: u64,
        len: u64,
    ) -> Result<(), NcclError> {
        if windows.borrow().contains(ptr) {
            return Ok(());
        }
        let bytes = usize::try_from(len).map_err(|_| NcclError::OutOfBounds {
            what: "symmetric window",
            offset: 0,
            len,
            size: len,
        })?;
        let mut win: sys::ncclWindow_t = std::ptr::null_mut();
        // SAFETY: the communicator is live; `ptr .. ptr + len` is one live `ncclMemAlloc` allocation of the heap
        // (it stays allocated while registered: the heap defers its release until `mark_deregistered`); `win` is a
        // valid out-pointer.
        let status = unsafe {
            sys::ncclCommWindowRegister(self.comm, ptr as *mut c_void, bytes, &mut win, NCCL_WIN_COLL_SYMMETRIC)
        };
        status.result().map_err(|e| {
            let (code, message) = describe(e.0, Some(self.comm));
            NcclError::WindowRegistration { code, message }
        })?;
        heap.mark_registered(ptr);
        windows.borrow_mut().list.push((ptr, win));
        Ok(())
    }

    /// The failure that poisoned the collective, if any.
    pub fn poison_reason(&self) -> Option<NcclError> {
        self.state.borrow().poison.clone()
    }

    /// Aborts the communicator now (`ncclCommAbort`), cancelling its pending AllGathers instead of waiting for
    /// them as dropping a healthy collective does. For a group whose peer is known to be gone (a healthy drop
    /// would wait for it forever). The buffers those AllGathers touched hold undefined bytes afterwards.
    pub fn abort(self) {
        self.state.borrow_mut().abort = true;
        drop(self);
    }

    /// Asks NCCL for an asynchronous error on the communicator (`ncclCommGetAsyncError`); an error poisons the
    /// collective. Returns the poisoning error if the collective is (now) poisoned.
    pub fn check_async_error(&self) -> Result<(), NcclError> {
        if let Some(p) = self.poison_reason() {
            return Err(p);
        }
        self.async_error().map_err(|e| self.poison(e))
    }

    fn async_error(&self) -> Result<(), NcclError> {
        let mut raw: u32 = 0;
        // SAFETY: the communicator is live (destroyed only in `drop`); NCCL writes one `ncclResult_t` (a 32-bit
        // enum) through the pointer, which we read as a plain `u32` so that an unknown code cannot be an invalid
        // Rust enum value.
        let status = unsafe { sys::ncclCommGetAsyncError(self.comm, (&mut raw as *mut u32).cast()) };
        status.result().map_err(|e| call_error("ncclCommGetAsyncError", e, Some(self.comm)))?;
        // 0 is ncclSuccess and 7 ncclInProgress (a non-blocking communicator still initialising): no error.
        if raw == 0 || raw == 7 {
            return Ok(());
        }
        let (code, message) = match result_from_raw(raw) {
            Some(code) => describe(code, Some(self.comm)),
            None => (format!("ncclResult_t {raw}"), String::new()),
        };
        Err(NcclError::Async { rank: self.rank, code, message })
    }

    /// Records `e` as the poisoning failure unless one is recorded; returns `e`.
    fn poison(&self, e: NcclError) -> NcclError {
        self.state.borrow_mut().poison.get_or_insert_with(|| e.clone());
        e
    }

    /// The typed form of [`Collective::all_gather`]: enqueues on `stream` an AllGather of
    /// `input = (buffer, offset, len)` of every rank into `output = (buffer, offset)`, which receives
    /// `len · world` bytes, rank 0's first. Every check happens before anything is enqueued; any failure poisons
    /// the collective (see the module documentation).
    ///
    /// The caller keeps both buffers and the stream alive until the gather has completed on the device (the
    /// platform contract: memory is freed only after its last use was observed).
    pub fn gather(
        &self,
        stream: StreamId,
        input: (DeviceBufferId, u64, u64),
        output: (DeviceBufferId, u64),
        tag: u64,
    ) -> Result<(), NcclError> {
        if let Some(cause) = self.poison_reason() {
            return Err(NcclError::Poisoned { cause: Box::new(cause) });
        }
        self.state.borrow_mut().issued.push(tag);
        match self.enqueue(stream, input, output, tag) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.poison(e)),
        }
    }

    fn enqueue(
        &self,
        stream: StreamId,
        (in_buf, in_off, len): (DeviceBufferId, u64, u64),
        (out_buf, out_off): (DeviceBufferId, u64),
        tag: u64,
    ) -> Result<(), NcclError> {
        self.async_error()?;
        let raw_stream = self
            .platform
            .raw_stream(stream)
            .ok_or(NcclError::InvalidHandle { what: "stream", id: u64::from(stream.0) })?;
        let (in_ptr, in_size) =
            self.platform.device_ptr(in_buf).ok_or(NcclError::InvalidHandle { what: "device buffer", id: in_buf.0 })?;
        let (out_ptr, out_size) = self
            .platform
            .device_ptr(out_buf)
            .ok_or(NcclError::InvalidHandle { what: "device buffer", id: out_buf.0 })?;
        check_range("AllGather input", in_off, len, in_size)?;
        let out_len = len.checked_mul(self.world as u64).ok_or(NcclError::OutOfBounds {
            what: "AllGather output",
            offset: out_off,
            len: u64::MAX,
            size: out_size,
        })?;
        check_range("AllGather output", out_off, out_len, out_size)?;
        if in_buf == out_buf {
            let overlaps = in_off < out_off + out_len && out_off < in_off + len;
            let in_place = in_off == out_off + self.rank as u64 * len;
            if overlaps && !in_place {
                return Err(NcclError::Overlap { in_offset: in_off, len, out_offset: out_off, out_len });
            }
        }
        if len == 0 {
            return Ok(());
        }
        let count = usize::try_from(len).map_err(|_| NcclError::OutOfBounds {
            what: "AllGather input",
            offset: in_off,
            len,
            size: in_size,
        })?;
        self.platform.bind_to_thread()?;
        if let Some((heap, windows)) = &self.symmetric {
            if let (Some(in_len), Some(out_len)) = (heap.allocation_len(in_ptr), heap.allocation_len(out_ptr)) {
                self.ensure_window(heap, windows, in_ptr, in_len)?;
                self.ensure_window(heap, windows, out_ptr, out_len)?;
                self.state.borrow_mut().windowed += 1;
            }
        }
        // A span on the comm lane while the device timeline is armed (the label is formatted only then).
        let span = if self.platform.timeline.armed() {
            let label = self.platform.gather_label(tag, out_len);
            self.platform.timeline_begin(stream, crate::platform::timeline::COMM_LANE, &label)
        } else {
            None
        };
        // SAFETY: both ranges were checked against the live buffers' sizes (`in_off + len <= in_size`,
        // `out_off + len · world <= out_size`), they do not overlap unless in place, which NCCL supports; the
        // stream belongs to the same platform (context) as the buffers and the communicator's device; the caller
        // keeps buffers and stream alive until the gather completed (platform contract). A driver `CUstream` and
        // a runtime `cudaStream_t` are the same object.
        let status = unsafe {
            nccl::all_gather(
                (in_ptr + in_off) as *const c_void,
                (out_ptr + out_off) as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                raw_stream as sys::cudaStream_t,
            )
        };
        self.platform.timeline_end(stream, span);
        status.map_err(|e| call_error("ncclAllGather", e, Some(self.comm)))?;
        self.state.borrow_mut().enqueued += 1;
        Ok(())
    }
}

/// The `ncclResult_t` of a raw code this module knows how to name.
fn result_from_raw(raw: u32) -> Option<sys::ncclResult_t> {
    use sys::ncclResult_t::*;
    Some(match raw {
        0 => ncclSuccess,
        1 => ncclUnhandledCudaError,
        2 => ncclSystemError,
        3 => ncclInternalError,
        4 => ncclInvalidArgument,
        5 => ncclInvalidUsage,
        6 => ncclRemoteError,
        7 => ncclInProgress,
        _ => return None,
    })
}

/// Checks `offset + len <= size` without overflow.
fn check_range(what: &'static str, offset: u64, len: u64, size: u64) -> Result<(), NcclError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(NcclError::OutOfBounds { what, offset, len, size }),
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(
        &self,
        stream: StreamId,
        input: (DeviceBufferId, u64, u64),
        output: (DeviceBufferId, u64),
        tag: u64,
    ) -> Result<(), PlatformError> {
        self.gather(stream, input, output, tag).map_err(Into::into)
    }

    fn windowed_gathers(&self) -> u64 {
        self.windowed()
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if let Err(e) = self.platform.bind_to_thread() {
            tracing::warn!(target: "weightferry::nccl", "dropping the NCCL communicator: {e}");
        }
        let failed = self.state.borrow().abort || self.poison_reason().is_some() || self.async_error().is_err();
        if let Some((heap, windows)) = &self.symmetric {
            tracing::info!(
                target: "weightferry::nccl",
                rank = self.rank,
                windows = windows.borrow().list.len(),
                windowed = self.state.borrow().windowed,
                enqueued = self.state.borrow().enqueued,
                "copy-engine option: AllGathers between symmetric windows"
            );
            for (ptr, win) in std::mem::take(&mut windows.borrow_mut().list) {
                if !failed {
                    // SAFETY: the communicator is live and `win` one of its windows, deregistered exactly once
                    // (the list was taken); every rank deregisters in the same (registration) order.
                    let status = unsafe { sys::ncclCommWindowDeregister(self.comm, win) };
                    if let Err(e) = status.result() {
                        tracing::warn!(target: "weightferry::nccl", "ncclCommWindowDeregister failed: {:?}", e.0);
                    }
                }
                // After an abort NCCL drops its windows with the communicator, below.
                heap.mark_deregistered(ptr);
            }
        }
        let (call, result) = if failed {
            // SAFETY: the communicator is live and is aborted exactly once, here (this is its owner's drop).
            ("ncclCommAbort", unsafe { nccl::comm_abort(self.comm) })
        } else {
            // SAFETY: the communicator is live and is destroyed exactly once, here (this is its owner's drop).
            ("ncclCommDestroy", unsafe { nccl::comm_destroy(self.comm) })
        };
        if let Err(e) = result {
            tracing::warn!(target: "weightferry::nccl", "{call} failed: {:?}", e.0);
        }
    }
}

/// A [`CollectiveFactory`] that joins communicator `id` as `rank` of `world` on `platform` — on the collective
/// actor's thread, which then owns the communicator. Pass the same platform (as a `PlatformRef`) to
/// `CollectiveHandle::spawn`, so the comm stream it creates belongs to this communicator's device.
pub fn factory(platform: Arc<CudaPlatform>, id: NcclUniqueId, rank: usize, world: usize) -> CollectiveFactory {
    factory_with_options(platform, id, rank, world, NcclOptions::default())
}

/// [`factory`] with [`NcclOptions`].
pub fn factory_with_options(
    platform: Arc<CudaPlatform>,
    id: NcclUniqueId,
    rank: usize,
    world: usize,
    options: NcclOptions,
) -> CollectiveFactory {
    Box::new(move || {
        let comm = NcclCollective::with_options(platform, &id, rank, world, options).map_err(PlatformError::from)?;
        Ok(Box::new(comm) as Box<dyn Collective>)
    })
}

/// An `ncclConfig_t` that asks for `NCCL_CTA_POLICY_ZERO` and leaves every other field to NCCL, tagged with the
/// running library's version (NCCL reads only the fields its version knows).
fn zero_cta_config(version: i32) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: NCCL_CONFIG_MAGIC,
        version: u32::try_from(version).unwrap_or(0),
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: NCCL_CTA_POLICY_ZERO,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_its_bytes() {
        let bytes: [u8; NCCL_UNIQUE_ID_BYTES] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5a);
        let id = NcclUniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes(), bytes);
        assert_eq!(id.as_bytes(), &bytes);
        assert_eq!(NcclUniqueId::from(bytes), id);
        let sys_id = id.to_sys();
        assert_eq!(sys_id.internal.map(|c| c as u8), bytes);
    }

    #[test]
    fn unique_id_of_the_wrong_length_is_refused() {
        for len in [0, 1, 127, 129, 256] {
            assert_eq!(NcclUniqueId::from_bytes(&vec![7u8; len]), Err(NcclError::InvalidUniqueId { len }));
        }
    }

    #[test]
    fn errors_map_to_platform_kinds() {
        let oob = NcclError::OutOfBounds { what: "AllGather input", offset: 3, len: 9, size: 10 };
        assert_eq!(
            PlatformError::from(oob),
            PlatformError::OutOfBounds { what: "AllGather input", offset: 3, len: 9, size: 10 }
        );
        assert_eq!(
            PlatformError::from(NcclError::InvalidHandle { what: "stream", id: 4 }),
            PlatformError::InvalidHandle { what: "stream", id: 4 }
        );
        let poisoned = NcclError::Poisoned { cause: Box::new(NcclError::InvalidRank { rank: 2, world: 2 }) };
        match PlatformError::from(poisoned) {
            PlatformError::Driver(msg) => assert!(msg.contains("poisoned") && msg.contains("invalid rank 2"), "{msg}"),
            other => panic!("expected a driver error, got {other:?}"),
        }
    }

    #[test]
    fn the_zero_cta_config_sets_the_policy_and_leaves_every_other_field_to_nccl() {
        let c = zero_cta_config(22803);
        assert_eq!((c.magic, c.version, c.size), (0xcafe_beef, 22803, std::mem::size_of::<sys::ncclConfig_t>()));
        assert_eq!(c.CTAPolicy, 2);
        for v in [c.blocking, c.cgaClusterSize, c.minCTAs, c.maxCTAs, c.splitShare, c.trafficClass, c.collnetEnable] {
            assert_eq!(v, i32::MIN);
        }
        for v in [c.shrinkShare, c.nvlsCTAs, c.nChannelsPerNetPeer, c.nvlinkCentricSched, c.graphUsageMode] {
            assert_eq!(v, i32::MIN);
        }
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn a_failed_window_registration_names_the_way_out() {
        let e = NcclError::WindowRegistration { code: "ncclSystemError".into(), message: "no fd passing".into() };
        assert_eq!(
            e.to_string(),
            "ncclCommWindowRegister failed: ncclSystemError (no fd passing); the copy-engine AllGather cannot run \
             here: build the communicator without NcclOptions::copy_engine (weightferry run --allgather-engine kernel)"
        );
        match PlatformError::from(e) {
            PlatformError::Driver(msg) => assert!(msg.contains("--allgather-engine kernel"), "{msg}"),
            other => panic!("expected a driver error, got {other:?}"),
        }
    }

    #[test]
    fn range_checks_reject_overflow() {
        assert!(check_range("x", 0, 10, 10).is_ok());
        assert!(check_range("x", 1, 10, 10).is_err());
        assert!(check_range("x", u64::MAX, 2, u64::MAX).is_err());
    }

    #[test]
    fn raw_result_codes_are_named_without_transmuting() {
        assert_eq!(result_from_raw(5), Some(sys::ncclResult_t::ncclInvalidUsage));
        assert_eq!(result_from_raw(42), None);
    }
}
