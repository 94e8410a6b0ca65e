//! The compute backend of the reference engine: a trait the engine enqueues module kernels through, and its
//! implementation on the simulated platform.
//!
//! A [`Compute`] owns nothing of the offload machinery: it is told which device ranges hold each weight storage
//! (from a [`WeightSource`](weightferry::offload::WeightSource)) and which device buffers hold the activations, and it
//! enqueues one kernel per module on the engine's compute stream. [`SimCompute`] runs the arithmetic of
//! [`super::math`] on a [`SimPlatform`] stream worker and declares every range it touches, so the sim hazard
//! detector checks that each kernel is ordered after the copies that filled its weights. A cuBLAS implementation can
//! implement the same trait later.

use super::math::{self, Phase, ACTIVATION_BYTES};
use super::EngineError;
use std::collections::HashMap;
use std::sync::Arc;
use weightferry::pipeline::{StorageId, TensorDesc};
use weightferry::scheduler::{Access, DeviceBufferId, PlatformRef, SimPlatform, StreamId};

/// Where one weight storage sits on the device for one kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightRange {
    /// The storage.
    pub storage: StorageId,
    /// Device buffer holding it.
    pub buffer: DeviceBufferId,
    /// Byte offset of the storage in the buffer.
    pub offset: u64,
    /// Byte length of the storage.
    pub len: u64,
}

/// The activation buffers of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activations {
    /// The latent matrix (DiT and VAE state; the output).
    pub latent: DeviceBufferId,
    /// The context matrix (encoder output, read by the DiT).
    pub context: DeviceBufferId,
}

/// One module's kernel.
#[derive(Debug, Clone)]
pub struct ModuleKernel {
    /// Label (the module path).
    pub label: String,
    /// Which activation it transforms.
    pub phase: Phase,
    /// Tensors applied, in order.
    pub tensors: Arc<Vec<TensorDesc>>,
    /// Device ranges of the storages the tensors view.
    pub weights: Vec<WeightRange>,
    /// The activations.
    pub activations: Activations,
}

/// A device that runs the reference engine's kernels.
pub trait Compute: Send + Sync + std::fmt::Debug {
    /// The platform the kernels run on (for streams, memory and offload backends).
    fn platform(&self) -> PlatformRef;
    /// Bytes of the activation matrix a phase transforms (the latent for DiT/VAE, the context for encoders).
    fn activation_bytes(&self, phase: Phase) -> u64 {
        let _ = phase;
        ACTIVATION_BYTES
    }
    /// Device bytes of scratch the compute allocated for itself (not weights, not activations).
    fn workspace_bytes(&self) -> u64 {
        0
    }
    /// Deterministic initial contents of a phase's activation matrix.
    fn initial_activation(&self, phase: Phase, seed: u64) -> Vec<u8> {
        math::initial_activation(seed, if phase == Phase::Encoder { 2 } else { 1 })
    }
    /// Enqueues a kernel that overwrites `buffer[0..data.len()]` with `data`.
    fn fill(&self, stream: StreamId, buffer: DeviceBufferId, data: Vec<u8>) -> Result<(), EngineError>;
    /// Enqueues one module's kernel on `stream`.
    fn launch_module(&self, stream: StreamId, kernel: ModuleKernel) -> Result<(), EngineError>;
    /// Waits for `stream`, then reads `len` bytes of `buffer` from offset 0.
    fn read_back(&self, stream: StreamId, buffer: DeviceBufferId, len: u64) -> Result<Vec<u8>, EngineError>;
}

/// [`Compute`] on the simulated platform: kernels run [`math::apply_module`] on the stream's worker thread.
#[derive(Debug, Clone)]
pub struct SimCompute {
    sim: Arc<SimPlatform>,
}

impl SimCompute {
    /// Compute on `sim`.
    pub fn new(sim: Arc<SimPlatform>) -> Self {
        SimCompute { sim }
    }
    /// The simulated platform.
    pub fn sim(&self) -> &Arc<SimPlatform> {
        &self.sim
    }
}

impl Compute for SimCompute {
    fn platform(&self) -> PlatformRef {
        self.sim.clone()
    }

    fn fill(&self, stream: StreamId, buffer: DeviceBufferId, data: Vec<u8>) -> Result<(), EngineError> {
        let access = vec![Access::write(buffer, 0, data.len() as u64)];
        self.sim.launch(
            stream,
            "init-activation",
            access,
            Box::new(move |k| k.write(buffer, 0, &data).map_err(String::from)),
        )?;
        Ok(())
    }

    fn launch_module(&self, stream: StreamId, kernel: ModuleKernel) -> Result<(), EngineError> {
        let acts = kernel.activations;
        let mut accesses: Vec<Access> =
            kernel.weights.iter().filter(|w| w.len > 0).map(|w| Access::read(w.buffer, w.offset, w.len)).collect();
        let (latent_write, context_write) = match kernel.phase {
            Phase::Encoder => (false, true),
            Phase::Dit | Phase::Vae => (true, false),
        };
        accesses.push(Access { buffer: acts.latent, offset: 0, len: ACTIVATION_BYTES, write: latent_write });
        accesses.push(Access { buffer: acts.context, offset: 0, len: ACTIVATION_BYTES, write: context_write });
        let label = kernel.label.clone();
        let body = move |k: &weightferry::scheduler::SimKernelCtx| -> Result<(), String> {
            let mut lat = vec![0u8; ACTIVATION_BYTES as usize];
            let mut ctx = vec![0u8; ACTIVATION_BYTES as usize];
            k.read(acts.latent, 0, &mut lat)?;
            k.read(acts.context, 0, &mut ctx)?;
            let mut storages = HashMap::with_capacity(kernel.weights.len());
            for w in &kernel.weights {
                let mut bytes = vec![0u8; w.len as usize];
                if w.len > 0 {
                    k.read(w.buffer, w.offset, &mut bytes)?;
                }
                storages.insert(w.storage, bytes);
            }
            let mut lat = math::f32s_from_bytes(&lat);
            let mut ctx = math::f32s_from_bytes(&ctx);
            math::apply_module(kernel.phase, &mut lat, &mut ctx, &kernel.tensors, &storages)
                .map_err(|e| format!("{}: {e}", kernel.label))?;
            match kernel.phase {
                Phase::Encoder => k.write(acts.context, 0, &math::f32s_to_bytes(&ctx))?,
                Phase::Dit | Phase::Vae => k.write(acts.latent, 0, &math::f32s_to_bytes(&lat))?,
            }
            Ok(())
        };
        self.sim.launch(stream, &label, accesses, Box::new(body))?;
        Ok(())
    }

    fn read_back(&self, stream: StreamId, buffer: DeviceBufferId, len: u64) -> Result<Vec<u8>, EngineError> {
        use weightferry::scheduler::Platform;
        self.sim.stream_synchronize(stream)?;
        let mut out = vec![0u8; len as usize];
        self.sim.read_device(buffer, 0, &mut out)?;
        Ok(out)
    }
}
