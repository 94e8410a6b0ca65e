//! The device a session offloads to: [`DeviceSpec`] says which (the simulated device with its [`SimConfig`], or a
//! CUDA device by ordinal running on the caller's compute stream), [`Device`] is the opened platform.

use super::error::{offload_err, SessionError};
use crate::dist::rank::RankDevice;
use std::sync::Arc;
use weightferry_actors::platform::{PlatformRef, StreamId};
use weightferry_actors::sim::{SimConfig, SimPlatform};

/// Which device a session opens.
#[derive(Debug, Clone)]
pub enum DeviceSpec {
    /// The simulated device (device buffers in host memory); `device_budget = "auto"` plans from its capacity.
    Sim(SimConfig),
    /// A CUDA device shared with a host engine (feature `cuda`; without it, opening fails with
    /// [`SessionError::Device`]).
    Cuda(CudaDevice),
}

/// A CUDA device a host engine already uses: the session runs on the engine's compute stream in the engine's
/// primary context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaDevice {
    ordinal: usize,
    stream: u64,
    probe_ptr: u64,
    free_bytes: u64,
}

impl CudaDevice {
    /// CUDA device `ordinal`, where the engine runs its kernels on `stream` (a `CUstream`; 0 is the legacy default
    /// stream) and owns the device address `probe_ptr` (checked to be in the device's primary context when the
    /// session opens). `free_bytes`: the device's free memory as the engine sees it, for `device_budget = "auto"`.
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream of device `ordinal`'s primary context that outlives the session (the
    /// session adopts it without owning it, and orders its copies against it).
    pub unsafe fn adopting(ordinal: usize, stream: u64, probe_ptr: u64, free_bytes: u64) -> CudaDevice {
        CudaDevice { ordinal, stream, probe_ptr, free_bytes }
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl DeviceSpec {
    /// The free device memory `device_budget = "auto"` plans from.
    pub fn free_bytes(&self) -> u64 {
        match self {
            DeviceSpec::Sim(config) => config.device_capacity,
            DeviceSpec::Cuda(cuda) => cuda.free_bytes,
        }
    }
}

/// An opened device.
#[derive(Debug)]
pub enum Device {
    /// The simulated device.
    Sim(Arc<SimPlatform>),
    /// A CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::platform::cuda::CudaPlatform>),
    /// A platform the host engine opened itself and keeps ([`Session::from_model`](super::Session::from_model)):
    /// the session neither reads it back nor shuts it down, and builds no collective on it.
    Engine(PlatformRef),
}

impl Device {
    /// Opens the device and names the compute stream: the simulated device's own, or the engine's stream adopted.
    pub fn open(spec: &DeviceSpec) -> Result<(Device, PlatformRef, StreamId), SessionError> {
        match spec {
            DeviceSpec::Sim(config) => {
                let sim = Arc::new(SimPlatform::new(config.clone()).map_err(offload_err)?);
                let platform: PlatformRef = sim.clone();
                let compute = platform.create_stream("compute").map_err(offload_err)?;
                Ok((Device::Sim(sim), platform, compute))
            }
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(cuda) => Self::open_cuda(cuda),
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => Err(SessionError::Device("this build of weightferry has no CUDA support".into())),
        }
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(spec: &CudaDevice) -> Result<(Device, PlatformRef, StreamId), SessionError> {
        use crate::platform::cuda::CudaPlatform;
        let ordinal = spec.ordinal;
        let unavailable = |e: weightferry_actors::platform::PlatformError| {
            SessionError::Device(super::error::one_line(&e.to_string().replace("--platform sim", "device=\"sim\"")))
        };
        let cuda = Arc::new(CudaPlatform::new(ordinal).map_err(unavailable)?);
        if !cuda.shares_context_with(spec.probe_ptr).map_err(unavailable)? {
            return Err(SessionError::Device(format!(
                "torch's memory on cuda:{ordinal} is not in the device's primary context; weightferry shares \
                 torch's primary CUDA context and cannot offload next to another context (one made with \
                 cuCtxCreate)"
            )));
        }
        // SAFETY: `CudaDevice::adopting`'s contract: `stream` is 0 or a live stream of this device's primary
        // context (just checked to be the engine's) that outlives the session.
        let compute = unsafe { cuda.adopt_stream(spec.stream as usize as _, "torch") }.map_err(offload_err)?;
        let platform: PlatformRef = cuda.clone();
        Ok((Device::Cuda(cuda), platform, compute))
    }

    /// The simulated device, if that is what this is.
    pub fn sim(&self) -> Option<&Arc<SimPlatform>> {
        match self {
            Device::Sim(sim) => Some(sim),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => None,
            Device::Engine(_) => None,
        }
    }

    /// Whether this is a CUDA device the session opened.
    pub fn is_cuda(&self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => true,
            _ => false,
        }
    }

    /// The device as a rank's collective sees it (`None` for the engine's own platform).
    pub(crate) fn rank_device(&self) -> Option<RankDevice<'_>> {
        match self {
            Device::Sim(sim) => Some(RankDevice::Sim(sim)),
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => Some(RankDevice::Cuda(cuda)),
            Device::Engine(_) => None,
        }
    }
}
