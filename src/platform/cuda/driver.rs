//! Loading the CUDA driver without panicking, binding the context to the calling thread, and turning driver
//! status codes into readable text.
//!
//! cudarc loads `libcuda` lazily and panics when the library or one of its symbols is missing. Everything here
//! that can reach that lazy loader runs only after [`open_context`] has checked that the library and every symbol
//! this back end calls are present (and even that check runs inside `catch_unwind`), so the rest of the module
//! can call the driver freely.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::{sys, CudaContext};
use weightferry_actors::platform::{PlatformError, PlatformResult};

/// What a user without a GPU reads.
const NO_DRIVER: &str = "no CUDA driver found (libcuda.so could not be loaded); use --platform sim";

/// Every driver entry point this back end (and the cudarc context it wraps) calls. Checked once at start so
/// that cudarc's lazy symbol loader can never panic later.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuPointerGetAttribute",
];

/// Facts about the opened device.
pub(crate) struct OpenedDevice {
    /// The device's primary context (cudarc's owner object; event tracking disabled).
    pub(crate) ctx: Arc<CudaContext>,
    /// The device's marketing name.
    pub(crate) name: String,
    /// Total device memory in bytes.
    pub(crate) total_mem: u64,
}

/// Loads the driver, checks the device exists and retains its primary context.
///
/// Never panics: a missing library, a driver too old for the symbols we call, no device, or a panic anywhere in
/// the loader all come back as [`PlatformError::Unavailable`].
pub(crate) fn open_context(ordinal: usize) -> PlatformResult<OpenedDevice> {
    match panic::catch_unwind(AssertUnwindSafe(|| open_context_inner(ordinal))) {
        Ok(result) => result,
        Err(payload) => Err(PlatformError::Unavailable(format!(
            "CUDA driver initialisation panicked ({}); use --platform sim",
            panic_message(payload.as_ref())
        ))),
    }
}

/// Loads and initialises the driver and returns the number of CUDA devices (0 is not an error here).
///
/// Never panics, like [`open_context`].
pub(crate) fn device_count() -> PlatformResult<usize> {
    match panic::catch_unwind(AssertUnwindSafe(init_and_count)) {
        Ok(result) => result,
        Err(payload) => Err(PlatformError::Unavailable(format!(
            "CUDA driver initialisation panicked ({}); use --platform sim",
            panic_message(payload.as_ref())
        ))),
    }
}

/// Checks the library and its symbols, initialises the driver, and counts devices.
fn init_and_count() -> PlatformResult<usize> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names and drops what it opened; it
    // calls no driver function. Loading libcuda runs its initialisers, which is what any CUDA program does.
    if !unsafe { sys::is_culib_present() } {
        return Err(PlatformError::Unavailable(NO_DRIVER.to_string()));
    }
    // SAFETY: the library was just shown to load, so `culib` returns it instead of panicking (and a panic would
    // be caught by our caller anyway). `get` only resolves addresses; none of them is called here, and the
    // symbol type (a pointer-sized function pointer) is never used to call through.
    let lib = unsafe { sys::culib() };
    for name in REQUIRED_SYMBOLS {
        // SAFETY: see above; the resolved symbol is dropped immediately without being called.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
        if !found {
            return Err(PlatformError::Unavailable(format!(
                "the CUDA driver lacks {name} (a driver supporting CUDA 13.0 is required); use --platform sim"
            )));
        }
    }
    result::init().map_err(|e| {
        PlatformError::Unavailable(format!("CUDA driver failed to initialise ({}); use --platform sim", describe(e)))
    })?;
    let count = result::device::get_count().map_err(|e| {
        PlatformError::Unavailable(format!("cannot count CUDA devices ({}); use --platform sim", describe(e)))
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

fn open_context_inner(ordinal: usize) -> PlatformResult<OpenedDevice> {
    let count = init_and_count()?;
    if count == 0 {
        return Err(PlatformError::Unavailable("no CUDA device found; use --platform sim".to_string()));
    }
    if ordinal >= count {
        return Err(PlatformError::Unavailable(format!(
            "CUDA device {ordinal} does not exist ({count} device(s) present)"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| {
        PlatformError::Unavailable(format!("cannot create a CUDA context on device {ordinal} ({})", describe(e)))
    })?;
    // SAFETY: disabling event tracking only changes how cudarc `CudaSlice`s created afterwards synchronise. This
    // platform creates none: it orders all work with its own events, and users of `CudaPlatform::context` are
    // documented to synchronise through the platform's events.
    unsafe { ctx.disable_event_tracking() };
    let name = result::device::get_name(ctx.cu_device())
        .unwrap_or_else(|e| format!("CUDA device {ordinal} (name unavailable: {})", describe(e)));
    // SAFETY: `cu_device` comes from the context cudarc just created with `cuDeviceGet`.
    let total = unsafe { result::device::total_mem(ctx.cu_device()) }.map_err(|e| {
        PlatformError::Driver(format!("cannot read the memory size of device {ordinal}: {}", describe(e)))
    })?;
    Ok(OpenedDevice { ctx, name, total_mem: total as u64 })
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// `CUDA_ERROR_NAME: description` for a driver status.
pub(crate) fn describe(e: DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(name), Ok(text)) => format!("{}: {}", name.to_string_lossy(), text.to_string_lossy()),
        (Ok(name), Err(_)) => name.to_string_lossy().into_owned(),
        _ => format!("CUresult {}", e.0 as i64),
    }
}

/// Makes `ctx` current on the calling thread unless it already is.
///
/// Costs one `cuCtxGetCurrent` (a thread-local read inside the driver) when it already is current. Asking the
/// driver instead of caching a flag of our own stays correct when other code on the thread (cuBLAS set-up, another
/// device's platform, NCCL) switches contexts behind our back.
pub(crate) fn bind(ctx: sys::CUcontext) -> Result<(), DriverError> {
    let mut current: sys::CUcontext = ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer for one context handle; the call only writes it.
    unsafe { sys::cuCtxGetCurrent(&mut current) }.result()?;
    if current != ctx {
        // SAFETY: `ctx` is the primary context retained by a live `CudaContext` (every caller holds an
        // `Arc<CudaContext>` for the duration of the call), so it has not been released.
        unsafe { sys::cuCtxSetCurrent(ctx) }.result()?;
    }
    Ok(())
}

/// [`bind`] with the failure turned into a platform error.
pub(crate) fn bind_or_err(ctx: sys::CUcontext) -> PlatformResult<()> {
    bind(ctx).map_err(|e| PlatformError::Driver(format!("cannot make the CUDA context current: {}", describe(e))))
}

/// The context device memory at `ptr` was allocated in, or `None` when the driver does not know the address as
/// device memory of any context. The caller made a context current (the query needs an initialised driver).
pub(crate) fn pointer_context(ptr: sys::CUdeviceptr) -> Result<Option<sys::CUcontext>, DriverError> {
    let mut ctx: sys::CUcontext = ptr::null_mut();
    let attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT;
    // SAFETY: `ctx` is a valid out-pointer for one context handle, the size the CONTEXT attribute writes; the
    // driver only reads its own allocation tables for `ptr`, which may be any value.
    let status = unsafe { sys::cuPointerGetAttribute((&mut ctx as *mut sys::CUcontext).cast(), attribute, ptr) };
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok((!ctx.is_null()).then_some(ctx)),
        sys::CUresult::CUDA_ERROR_INVALID_VALUE => Ok(None),
        other => Err(DriverError(other)),
    }
}
