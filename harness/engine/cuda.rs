//! The GPU reference engine's compute: each module's kernel is a sequence of cuBLAS bf16 GEMMs of the module's real
//! weight shapes over a configurable number of tokens, on the engine's compute stream.
//!
//! Per module (block or non-block child), with `x` the phase's activation (`tokens × width`, bf16):
//! - every bf16 weight of rank ≥ 2, viewed as `[out, in]` (contiguous, or stored transposed), is one GEMM
//!   `y = alpha · input · wᵀ` where `input` is the previous product if it is at least `in` wide, else `x`, else the
//!   other activation, else a buffer of zeros (so an execution never reads what an earlier one left behind); a
//!   product exactly `width` wide is added back into `x` (a residual, `axpy`). `alpha = 1 / (√in · σ_w)` keeps magnitudes steady over any depth;
//! - a block of a DiT or an encoder (a module whose path ends in a block index) also runs a self-attention proxy of
//!   the right cost: `S = x·xᵀ` and `O = S·x` chunk by chunk (4·tokens²·width flops), added back into `x`;
//! - tensors of other dtypes or layouts (norm scales, f32 modulation tables, rope buffers) are not read: their cost
//!   is negligible and the large weights that share their copies already prove ordering.
//!
//! The same sequence of cuBLAS calls on the same handle and stream with the same shapes gives the same bits, which is
//! what the bit-exact offloaded-vs-resident check relies on. All scratch is allocated at construction and counted
//! as workspace, not weight memory.

use super::compute::{Compute, ModuleKernel};
use super::math::Phase;
use super::synthetic::splitmix64;
use super::EngineError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use weightferry::pipeline::{DType, PipelineDesc, StorageId, TensorDesc};
use weightferry::platform::cuda::blas::{BLayout, Blas, Gemm};
use weightferry::platform::cuda::CudaPlatform;
use weightferry::scheduler::{DeviceBufferId, HostMemoryKind, Platform, PlatformError, PlatformRef, StreamId};

/// Standard deviation of the synthetic weights (uniform in ±0.05).
const WEIGHT_STD: f32 = 0.028_867_5;
/// Residual scale of each added product.
const RESIDUAL: f32 = 0.05;
/// Rows of one attention-proxy chunk.
const ATTN_CHUNK: usize = 1024;
/// Weights with a dimension above this (vocabulary embeddings, which a real model gathers from rather than
/// multiplies by) are not multiplied: it would cost scratch memory proportional to the vocabulary.
const MAX_GEMM_DIM: usize = 32768;

/// Shapes of the GPU engine's activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuShape {
    /// Tokens of the latent (DiT and VAE) activation.
    pub tokens: usize,
    /// Tokens of the context (encoder) activation.
    pub context_tokens: usize,
}

/// Default token counts of a preset: (DiT tokens, encoder tokens).
pub fn default_tokens(preset: &str) -> (usize, usize) {
    match preset {
        // 1024² image: 64×64 latent patches + 512 text tokens.
        "flux-dev" | "qwen-image" => (4096 + 512, 512),
        // 480p × 81 frames: 30 × 52 patches × 21 latent frames.
        "wan-14b" => (30 * 52 * 21, 512),
        _ => (256, 64),
    }
}

struct Scratch {
    /// Two product buffers, `tokens × max_dim` each.
    prod: [DeviceBufferId; 2],
    /// Attention scores, `ATTN_CHUNK × tokens`.
    scores: DeviceBufferId,
    /// Attention output, `tokens × max_width`.
    attn_out: DeviceBufferId,
    /// Zeros, `tokens × max_dim`, never written after construction: the input of a product whose width matches
    /// no activation. (Reading a product buffer there instead made the output depend on what earlier executions
    /// left in it, so two runs of the same pipeline could differ.)
    zeros: DeviceBufferId,
}

/// [`Compute`] on a CUDA device.
pub struct CudaCompute {
    platform: Arc<CudaPlatform>,
    shape: GpuShape,
    latent_width: usize,
    context_width: usize,
    max_dim: usize,
    scratch: Scratch,
    workspace_bytes: u64,
    blas: Mutex<Option<(StreamId, Blas)>>,
}

impl std::fmt::Debug for CudaCompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCompute").field("shape", &self.shape).field("latent_width", &self.latent_width).finish()
    }
}

/// `[out, in]` view of a weight, and its layout, when the GPU engine multiplies by it.
fn gemm_view(t: &TensorDesc) -> Option<(usize, usize, BLayout, usize)> {
    if t.dtype != DType::Bf16 || t.shape.len() < 2 {
        return None;
    }
    let out = t.shape[0] as usize;
    let inn = (t.numel() / t.shape[0].max(1)) as usize;
    if out > MAX_GEMM_DIM || inn > MAX_GEMM_DIM || out == 0 || inn == 0 {
        return None;
    }
    let contiguous = TensorDesc::contiguous_strides(&t.shape);
    if t.strides == contiguous {
        Some((out, inn, BLayout::WeightRowMajor, inn))
    } else if t.shape.len() == 2 && t.strides == [1, t.shape[0]] {
        Some((out, inn, BLayout::WeightColMajor, out))
    } else {
        None
    }
}

/// The most common `in` width among a set of weights (the hidden size of their component).
fn hidden_width<'a>(tensors: impl Iterator<Item = &'a TensorDesc>) -> usize {
    let mut counts: std::collections::BTreeMap<usize, usize> = std::collections::BTreeMap::new();
    for t in tensors {
        if let Some((_, inn, _, _)) = gemm_view(t) {
            *counts.entry(inn).or_default() += 1;
        }
    }
    counts.into_iter().max_by_key(|&(w, c)| (c, w)).map_or(64, |(w, _)| w)
}

fn is_block(label: &str) -> bool {
    label.rsplit('.').next().is_some_and(|last| !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()))
}

impl CudaCompute {
    /// Sizes the activations and scratch for `desc` at `shape` and allocates the scratch (zero-filled).
    pub fn new(platform: Arc<CudaPlatform>, desc: &PipelineDesc, shape: GpuShape) -> Result<CudaCompute, EngineError> {
        let decls = desc.components.clone().unwrap_or_default();
        let tensors_of = |paths: &[String]| -> Vec<TensorDesc> {
            paths
                .iter()
                .filter_map(|p| desc.module(p))
                .flat_map(|m| m.tensors_recursive().into_iter().map(|(_, t)| t.clone()))
                .collect()
        };
        let lat: Vec<TensorDesc> = tensors_of(&decls.dit).into_iter().chain(tensors_of(&decls.vaes)).collect();
        let ctx = tensors_of(&decls.encoders);
        let latent_width = hidden_width(tensors_of(&decls.dit).iter());
        let context_width = hidden_width(ctx.iter());
        let max_dim = lat
            .iter()
            .chain(&ctx)
            .filter_map(gemm_view)
            .map(|(o, i, _, _)| o.max(i))
            .chain([latent_width, context_width])
            .max()
            .unwrap_or(64);
        let rows = shape.tokens.max(shape.context_tokens).max(1);
        let p: &dyn Platform = platform.as_ref();
        let sizes = [
            (rows * max_dim * 2) as u64,
            (rows * max_dim * 2) as u64,
            (ATTN_CHUNK.min(rows) * rows * 2) as u64,
            (rows * latent_width.max(context_width) * 2) as u64,
            (rows * max_dim * 2) as u64,
        ];
        let mut bufs = Vec::new();
        for &s in &sizes {
            match p.alloc_device(s) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    for b in bufs {
                        let _ = p.free_device(b);
                    }
                    return Err(e.into());
                }
            }
        }
        // Zero the scratch once so every read of it is deterministic.
        let zero_stream = p.create_stream("gpu-engine-init")?;
        for &b in &bufs {
            platform.zero_device_async(b, zero_stream)?;
        }
        p.stream_synchronize(zero_stream)?;
        Ok(CudaCompute {
            platform,
            shape,
            latent_width,
            context_width,
            max_dim,
            scratch: Scratch { prod: [bufs[0], bufs[1]], scores: bufs[2], attn_out: bufs[3], zeros: bufs[4] },
            workspace_bytes: sizes.iter().sum(),
            blas: Mutex::new(None),
        })
    }

    /// The CUDA platform.
    pub fn cuda(&self) -> &Arc<CudaPlatform> {
        &self.platform
    }

    fn ptr(&self, b: DeviceBufferId) -> Result<u64, EngineError> {
        self.platform
            .device_ptr(b)
            .map(|(p, _)| p)
            .ok_or(EngineError::Platform(PlatformError::InvalidHandle { what: "device buffer", id: b.0 }))
    }

    fn with_blas<R>(
        &self,
        stream: StreamId,
        f: impl FnOnce(&Blas) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut g = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_none_or(|(s, _)| *s != stream) {
            *g = Some((stream, Blas::new(&self.platform, stream)?));
        }
        self.platform.bind_to_thread()?;
        match g.as_ref() {
            Some((_, b)) => f(b),
            None => Err(EngineError::Failed("cuBLAS handle missing".into())),
        }
    }
}

/// Device pointers and shapes one module's GEMMs work on.
struct Operands {
    /// The phase's activation (`rows × width`, bf16), which the module updates.
    x: u64,
    rows: usize,
    width: usize,
    /// The other phase's activation (`other_rows × other_width`), read when its width fits a weight.
    other: u64,
    other_rows: usize,
    other_width: usize,
    /// The two product buffers, used in turn.
    prod: [u64; 2],
    /// The zeros: the input of a product whose width matches no activation.
    zeros: u64,
}

impl CudaCompute {
    /// The operands of `kernel`'s GEMMs: the phase's activation, the other one, the product buffers and the zeros.
    fn operands(&self, kernel: &ModuleKernel) -> Result<Operands, EngineError> {
        let (x_buf, x_rows, width, other_buf, other_rows, other_width) = match kernel.phase {
            Phase::Encoder => (
                kernel.activations.context,
                self.shape.context_tokens,
                self.context_width,
                kernel.activations.latent,
                self.shape.tokens,
                self.latent_width,
            ),
            Phase::Dit | Phase::Vae => (
                kernel.activations.latent,
                self.shape.tokens,
                self.latent_width,
                kernel.activations.context,
                self.shape.context_tokens,
                self.context_width,
            ),
        };
        let x = self.ptr(x_buf)?;
        let other = self.ptr(other_buf)?;
        let prod = [self.ptr(self.scratch.prod[0])?, self.ptr(self.scratch.prod[1])?];
        let zeros = self.ptr(self.scratch.zeros)?;
        Ok(Operands { x, rows: x_rows.max(1), width, other, other_rows, other_width, prod, zeros })
    }

    /// One GEMM per bf16 weight of rank ≥ 2 (in tensor order, skipping weights wider than `max_dim`): each reads the
    /// latest product when it is wide enough, else the activation, else the other activation, else zeros, and
    /// writes the other product buffer; a product as wide as the activation is added to it (× `RESIDUAL`).
    fn weight_gemms(
        &self,
        blas: &Blas,
        tensors: &[TensorDesc],
        wptr: &HashMap<StorageId, u64>,
        o: &Operands,
    ) -> Result<(), EngineError> {
        let (rows, width) = (o.rows, o.width);
        // (pointer, valid width, row stride) of the latest product; which product buffer it is in.
        let mut cur: Option<(u64, usize, usize, usize)> = None;
        let mut next = 0usize;
        for t in tensors {
            let Some((out, inn, layout, ld)) = gemm_view(t) else { continue };
            let Some(&base) = wptr.get(&t.storage) else { continue };
            if out > self.max_dim || inn > self.max_dim {
                continue;
            }
            let w = base + t.storage_offset * 2;
            let (a, lda) = match cur {
                Some((p, wdt, ld, _)) if wdt >= inn => (p, ld),
                _ if width >= inn => (o.x, width),
                _ if o.other_width >= inn && o.other_rows >= rows => (o.other, o.other_width),
                _ => (o.zeros, inn),
            };
            let c = o.prod[next];
            let alpha = 1.0 / ((inn as f32).sqrt() * WEIGHT_STD);
            blas.gemm(&Gemm {
                m: rows,
                n: out,
                k: inn,
                a: (a, lda),
                b: (w, ld),
                b_layout: layout,
                c: (c, out),
                alpha,
                beta: 0.0,
            })?;
            if out == width {
                blas.axpy_bf16(rows * width, RESIDUAL, c, o.x)?;
            }
            cur = Some((c, out, out, next));
            next ^= 1;
        }
        Ok(())
    }

    /// A block's attention proxy over the activation `x` (`rows × width`), in chunks of [`ATTN_CHUNK`] rows:
    /// scores = chunk · xᵀ / width, then out = scores · x / rows; the output is added to `x` (× `RESIDUAL`).
    fn attention(&self, blas: &Blas, x: u64, rows: usize, width: usize) -> Result<(), EngineError> {
        let scores = self.ptr(self.scratch.scores)?;
        let o = self.ptr(self.scratch.attn_out)?;
        let mut r0 = 0;
        while r0 < rows {
            let c = ATTN_CHUNK.min(rows - r0);
            let xr = x + (r0 * width * 2) as u64;
            blas.gemm(&Gemm {
                m: c,
                n: rows,
                k: width,
                a: (xr, width),
                b: (x, width),
                b_layout: BLayout::WeightRowMajor,
                c: (scores, rows),
                alpha: 1.0 / width as f32,
                beta: 0.0,
            })?;
            blas.gemm(&Gemm {
                m: c,
                n: width,
                k: rows,
                a: (scores, rows),
                b: (x, width),
                b_layout: BLayout::Plain,
                c: (o + (r0 * width * 2) as u64, width),
                alpha: 1.0 / rows as f32,
                beta: 0.0,
            })?;
            r0 += c;
        }
        blas.axpy_bf16(rows * width, RESIDUAL, o, x)?;
        Ok(())
    }
}

impl Drop for CudaCompute {
    fn drop(&mut self) {
        let p: &dyn Platform = self.platform.as_ref();
        if let Ok(mut g) = self.blas.lock() {
            g.take();
        }
        for b in
            [self.scratch.prod[0], self.scratch.prod[1], self.scratch.scores, self.scratch.attn_out, self.scratch.zeros]
        {
            let _ = p.free_device(b);
        }
    }
}

impl Compute for CudaCompute {
    fn platform(&self) -> PlatformRef {
        self.platform.clone()
    }

    fn activation_bytes(&self, phase: Phase) -> u64 {
        match phase {
            Phase::Encoder => (self.shape.context_tokens.max(1) * self.context_width * 2) as u64,
            Phase::Dit | Phase::Vae => (self.shape.tokens.max(1) * self.latent_width * 2) as u64,
        }
    }

    fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    fn initial_activation(&self, phase: Phase, seed: u64) -> Vec<u8> {
        let n = (self.activation_bytes(phase) / 2) as usize;
        let mut st = seed ^ if phase == Phase::Encoder { 0x00C0_47E7 } else { 0x001A_7E47 };
        let mut out = Vec::with_capacity(n * 2);
        for _ in 0..n {
            let v = ((splitmix64(&mut st) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        out
    }

    fn fill(&self, stream: StreamId, buffer: DeviceBufferId, data: Vec<u8>) -> Result<(), EngineError> {
        let p: &dyn Platform = self.platform.as_ref();
        let host = p.alloc_host(data.len() as u64, HostMemoryKind::Pageable)?;
        let r = p
            .write_host(host, 0, &data)
            .and_then(|()| p.copy_h2d(stream, host, 0, buffer, 0, data.len() as u64))
            .and_then(|()| p.stream_synchronize(stream));
        let _ = p.free_host(host);
        r.map_err(EngineError::from)
    }

    fn launch_module(&self, stream: StreamId, kernel: ModuleKernel) -> Result<(), EngineError> {
        let ops = self.operands(&kernel)?;
        // Weight pointer of each storage in this kernel.
        let mut wptr = HashMap::new();
        for w in &kernel.weights {
            if w.len > 0 {
                wptr.insert(w.storage, self.ptr(w.buffer)? + w.offset);
            }
        }
        let span = self.platform.timeline_begin(stream, super::timeline::COMPUTE_LANE, &kernel.label);
        let r = self.with_blas(stream, |blas| {
            self.weight_gemms(blas, &kernel.tensors, &wptr, &ops)?;
            if kernel.phase != Phase::Vae && is_block(&kernel.label) {
                self.attention(blas, ops.x, ops.rows, ops.width)?;
            }
            Ok(())
        });
        self.platform.timeline_end(stream, span);
        r
    }

    fn read_back(&self, stream: StreamId, buffer: DeviceBufferId, len: u64) -> Result<Vec<u8>, EngineError> {
        let p: &dyn Platform = self.platform.as_ref();
        p.stream_synchronize(stream)?;
        let host = p.alloc_host(len, HostMemoryKind::Pageable)?;
        let r = p.copy_d2h(stream, buffer, 0, host, 0, len).and_then(|()| p.stream_synchronize(stream));
        let mut out = vec![0u8; len as usize];
        let r = r.and_then(|()| p.read_host(host, 0, &mut out));
        let _ = p.free_host(host);
        r?;
        Ok(out)
    }
}
