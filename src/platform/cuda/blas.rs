//! cuBLAS on the platform's streams: the bf16 matrix products the GPU reference engine is made of.
//!
//! Matrices are row-major, as the pipeline description stores them. [`Blas::gemm`] computes
//! `C[m, n] = alpha · A[m, k] · op(B) + beta · C` where `B` is a weight `[n, k]` (contiguous or stored transposed) or a
//! plain `[k, n]` matrix; the row-major → column-major mapping is done here once. Every product accumulates in f32
//! (`CUBLAS_COMPUTE_32F`); the same handle on the same stream with the same shapes and alignments picks the same
//! algorithm, so repeated runs are bit-identical.

use super::CudaPlatform;
use cudarc::cublas::sys as blas;
use cudarc::driver::sys::CUdeviceptr;
use std::ffi::c_void;
use weightferry_actors::platform::{PlatformError, PlatformResult, StreamId};

/// How the `B` operand is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BLayout {
    /// `B` is a row-major weight `[n, k]` with row stride `ldb` (≥ k): the product uses `Bᵀ`.
    WeightRowMajor,
    /// `B` is a weight `[n, k]` stored transposed (column-major, strides `[1, ldb]`, ldb ≥ n): the product uses `Bᵀ`.
    WeightColMajor,
    /// `B` is a row-major `[k, n]` matrix with row stride `ldb` (≥ n): the product uses `B` as is.
    Plain,
}

/// One product `C = alpha · A · op(B) + beta · C` on bf16 operands.
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// `A` (row-major `[m, k]`), and its row stride.
    pub a: (CUdeviceptr, usize),
    /// `B` and its leading dimension (see [`BLayout`]).
    pub b: (CUdeviceptr, usize),
    /// Layout of `B`.
    pub b_layout: BLayout,
    /// `C` (row-major `[m, n]`), and its row stride.
    pub c: (CUdeviceptr, usize),
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the existing `C`.
    pub beta: f32,
}

/// A cuBLAS handle bound to one stream of a [`CudaPlatform`].
pub struct Blas {
    handle: blas::cublasHandle_t,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it are not concurrent; `Blas` is only
// used through `&mut`-free methods that the owner serialises (the GPU engine holds it behind a mutex).
unsafe impl Send for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Blas")
    }
}

fn blas_err(what: &str, status: blas::cublasStatus_t) -> PlatformError {
    PlatformError::Driver(format!("cuBLAS {what} failed: {status:?}"))
}

fn to_int(x: usize, what: &str) -> PlatformResult<i32> {
    i32::try_from(x).map_err(|_| PlatformError::Driver(format!("cuBLAS {what} = {x} does not fit a 32-bit int")))
}

impl Blas {
    /// Creates a handle whose work goes to `stream` of `platform`. Fails (never panics) when libcublas is missing.
    pub fn new(platform: &CudaPlatform, stream: StreamId) -> PlatformResult<Blas> {
        platform.bind_to_thread()?;
        let raw = platform
            .raw_stream(stream)
            .ok_or(PlatformError::InvalidHandle { what: "stream", id: u64::from(stream.0) })?;
        // SAFETY: `is_culib_present` only tries to load the library; loading has no other side effect.
        let present = std::panic::catch_unwind(|| unsafe { blas::is_culib_present() }).unwrap_or(false);
        if !present {
            return Err(PlatformError::Unavailable(
                "libcublas could not be loaded (is CUDA 13's libcublas.so.13 on the loader path?)".into(),
            ));
        }
        let mut handle: blas::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer and the context is current on this thread.
        let status = unsafe { blas::cublasCreate_v2(&mut handle) };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(blas_err("create", status));
        }
        let blas = Blas { handle };
        // SAFETY: both the handle and the stream are live; the stream outlives the handle (the platform destroys
        // streams only at drop, and the engine drops its Blas first).
        let status = unsafe { blas::cublasSetStream_v2(handle, raw as blas::cudaStream_t) };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(blas_err("set stream", status));
        }
        Ok(blas)
    }

    /// Enqueues one product (see [`Gemm`]).
    pub fn gemm(&self, g: &Gemm) -> PlatformResult<()> {
        if g.m == 0 || g.n == 0 || g.k == 0 {
            return Ok(());
        }
        use blas::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        // Row-major C[m,n] = A·op(B)  ⇔  column-major Cᵀ[n,m] = op'(B)·Aᵀ.
        let (transa, lda) = match g.b_layout {
            BLayout::WeightRowMajor => (CUBLAS_OP_T, g.b.1),
            BLayout::WeightColMajor => (CUBLAS_OP_N, g.b.1),
            BLayout::Plain => (CUBLAS_OP_N, g.b.1),
        };
        let (m, n, k) = (to_int(g.n, "n")?, to_int(g.m, "m")?, to_int(g.k, "k")?);
        let (lda, ldb, ldc) = (to_int(lda, "ldb")?, to_int(g.a.1, "lda")?, to_int(g.c.1, "ldc")?);
        let alpha = g.alpha;
        let beta = g.beta;
        // SAFETY: the pointers are live device allocations of the platform, sized by the caller for these shapes
        // and strides (the GPU engine derives both from the same tensor descriptions); alpha/beta point to f32s
        // that outlive the call (cuBLAS reads host scalars before returning).
        let status = unsafe {
            blas::cublasGemmEx(
                self.handle,
                transa,
                CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                g.b.0 as *const c_void,
                blas::cudaDataType::CUDA_R_16BF,
                lda,
                g.a.0 as *const c_void,
                blas::cudaDataType::CUDA_R_16BF,
                ldb,
                (&beta as *const f32).cast::<c_void>(),
                g.c.0 as *mut c_void,
                blas::cudaDataType::CUDA_R_16BF,
                ldc,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(blas_err("gemm", status));
        }
        Ok(())
    }

    /// Enqueues `y[0..n] += alpha · x[0..n]` on bf16 vectors (f32 arithmetic).
    pub fn axpy_bf16(&self, n: usize, alpha: f32, x: CUdeviceptr, y: CUdeviceptr) -> PlatformResult<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: `x` and `y` are live device allocations of at least `n` bf16 elements (caller's contract);
        // `alpha` outlives the call.
        let status = unsafe {
            blas::cublasAxpyEx_64(
                self.handle,
                n as i64,
                (&alpha as *const f32).cast::<c_void>(),
                blas::cudaDataType::CUDA_R_32F,
                x as *const c_void,
                blas::cudaDataType::CUDA_R_16BF,
                1,
                y as *mut c_void,
                blas::cudaDataType::CUDA_R_16BF,
                1,
                blas::cudaDataType::CUDA_R_32F,
            )
        };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(blas_err("axpy", status));
        }
        Ok(())
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `cublasCreate_v2` and is destroyed once, here.
        let _ = unsafe { blas::cublasDestroy_v2(self.handle) };
    }
}
