//! libnccl as this crate loads it at run time (feature `nccl`): the check that the library and every symbol the
//! NCCL modules call are present ([`nccl_version`], so cudarc's lazy loader never panics), [`NcclError`] (the
//! errors of NCCL calls, and how NCCL describes a failed call), and the size of a unique id.

use std::ffi::CStr;
use std::panic::{self, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;
use weightferry_actors::platform::PlatformError;

/// Size of an NCCL unique id in bytes (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// Every NCCL entry point the collective calls, checked once before the first call so cudarc's lazy symbol loader
/// can never panic later.
const REQUIRED_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclAllGather",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclCommDestroy",
    "ncclGetErrorString",
    "ncclGetLastError",
];

/// Errors of the NCCL collective.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// libnccl (or one of the symbols this module calls) could not be loaded.
    #[error("NCCL unavailable: {0}")]
    Unavailable(String),
    /// An NCCL call returned an error.
    #[error("{call} failed: {code} ({message})")]
    Call {
        /// The NCCL function.
        call: &'static str,
        /// The `ncclResult_t` name.
        code: String,
        /// NCCL's description and last-error text.
        message: String,
    },
    /// Registering a symmetric window for the copy-engine AllGather failed (say, a container that does not let NCCL
    /// pass memory handles between processes).
    #[error(
        "ncclCommWindowRegister failed: {code} ({message}); the copy-engine AllGather cannot run here: build the \
         communicator without NcclOptions::copy_engine (weightferry run --allgather-engine kernel)"
    )]
    WindowRegistration {
        /// The `ncclResult_t` name.
        code: String,
        /// NCCL's description and last-error text.
        message: String,
    },
    /// NCCL reported an asynchronous error on the communicator (a failed or aborted collective).
    #[error("NCCL communicator error (rank {rank}): {code} ({message})")]
    Async {
        /// This rank.
        rank: usize,
        /// The `ncclResult_t` name.
        code: String,
        /// NCCL's description and last-error text.
        message: String,
    },
    /// A range outside its buffer (nothing was enqueued).
    #[error("{what} range {offset}+{len} exceeds its buffer of {size} bytes")]
    OutOfBounds {
        /// Input or output.
        what: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// Input and output ranges overlap other than as NCCL's in-place AllGather (input at `output + rank · len`).
    #[error("AllGather input {in_offset}+{len} overlaps output {out_offset}+{out_len} of the same buffer")]
    Overlap {
        /// Input offset.
        in_offset: u64,
        /// Input length.
        len: u64,
        /// Output offset.
        out_offset: u64,
        /// Output length (`len · world`).
        out_len: u64,
    },
    /// A stream or buffer handle the platform does not know.
    #[error("invalid {what} handle {id}")]
    InvalidHandle {
        /// Kind of handle.
        what: &'static str,
        /// Its numeric value.
        id: u64,
    },
    /// A unique id of the wrong length.
    #[error("an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len}")]
    InvalidUniqueId {
        /// The length given.
        len: usize,
    },
    /// A rank outside `0..world`, an empty group, or a group too large for NCCL.
    #[error("invalid rank {rank} in a group of {world}")]
    InvalidRank {
        /// The rank.
        rank: usize,
        /// The group size.
        world: usize,
    },
    /// An earlier failure poisoned the collective; this call enqueued nothing.
    #[error("NCCL collective poisoned by an earlier failure ({cause}); the group must be rebuilt")]
    Poisoned {
        /// The failure that poisoned it.
        cause: Box<NcclError>,
    },
    /// The CUDA platform failed (binding its context).
    #[error(transparent)]
    Platform(#[from] PlatformError),
}

impl From<NcclError> for PlatformError {
    /// Bounds, handle, availability and platform errors keep their platform kind; the rest become driver errors.
    fn from(e: NcclError) -> PlatformError {
        match e {
            NcclError::OutOfBounds { what, offset, len, size } => {
                PlatformError::OutOfBounds { what, offset, len, size }
            }
            NcclError::InvalidHandle { what, id } => PlatformError::InvalidHandle { what, id },
            NcclError::Unavailable(msg) => PlatformError::Unavailable(format!("NCCL: {msg}")),
            NcclError::Platform(p) => p,
            other => PlatformError::Driver(other.to_string()),
        }
    }
}

/// Checks once (per process) that libnccl and every symbol this module calls are present; returns NCCL's
/// version code (e.g. `22803` for 2.28.3).
///
/// Never panics: a missing library or symbol, or a panic in the loader, comes back as
/// [`NcclError::Unavailable`].
pub fn nccl_version() -> Result<i32, NcclError> {
    static LOADED: OnceLock<Result<i32, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| match panic::catch_unwind(AssertUnwindSafe(load_library)) {
            Ok(result) => result,
            Err(_) => Err("loading libnccl panicked".to_string()),
        })
        .clone()
        .map_err(NcclError::Unavailable)
}

fn load_library() -> Result<i32, String> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate names and drops what it opened.
    if !unsafe { sys::is_culib_present() } {
        return Err("libnccl.so could not be loaded (is NCCL on the loader path?)".to_string());
    }
    // SAFETY: the library was just shown to load, so `culib` returns it (a panic would be caught by our caller).
    let lib = unsafe { sys::culib() };
    for name in REQUIRED_SYMBOLS {
        // SAFETY: `get` only resolves the address; the symbol is dropped without being called.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
        if !found {
            return Err(format!("libnccl lacks {name}"));
        }
    }
    nccl::get_nccl_version().map_err(|e| format!("ncclGetVersion failed: {:?}", e.0))
}

/// `ncclResult_t` name and NCCL's description of it, plus the communicator's last-error text when known.
pub(super) fn describe(code: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> (String, String) {
    // SAFETY: only called after `nccl_version` succeeded, so the symbol exists; NCCL returns a static string.
    let text = unsafe { cstr(sys::ncclGetErrorString(code)) };
    // SAFETY: as above; `comm` is a live communicator (or null, which NCCL accepts: the process' last error).
    let last = unsafe { cstr(sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()))) };
    let message = if last.is_empty() { text } else { format!("{text}; {last}") };
    (format!("{code:?}"), message)
}

/// Copies a C string NCCL returned (null gives an empty string).
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string that stays valid for the call.
unsafe fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: the caller guarantees a valid NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

pub(super) fn call_error(call: &'static str, e: nccl::NcclError, comm: Option<sys::ncclComm_t>) -> NcclError {
    let (code, message) = describe(e.0, comm);
    NcclError::Call { call, code, message }
}
