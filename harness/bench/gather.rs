//! `weightferry bench-gather`: the block-rebuild rate of distributed layerwise offload on real GPUs (feature
//! `nccl`), and what the rebuild costs the compute running beside it.
//!
//! Each rank keeps its shard of a block (`block / world` bytes) in pinned host memory (the host master) and
//! rebuilds the full block on its GPU, chunk by chunk: the shard's slice of chunk `j` is copied host→device on a
//! copy stream, an event is recorded, and the comm stream waits on that event and AllGathers the chunk (chunk-major
//! layout: chunk `j` of the full block holds every rank's slice of chunk `j`, rank order). Two slots alternate
//! (double buffering): the copy into a slot waits for the gathers of the block that used it two blocks earlier.
//! Modes: `gather` (shard slots separate from the output slots, the production layout), `in-place` (the shard is
//! copied straight into its place in the output slot and gathered in place), `h2d-only` (the copies alone, no
//! collective). The rate is full-block bytes delivered per GPU per second over `blocks` blocks after warm-up, the
//! median of `repeats` runs; every rank starts each timed run at a barrier, and the slowest rank is reported. After
//! each run the last block is read back and compared byte for byte with the concatenation of the shards.
//!
//! Compute slowdown: a fixed loop of cuBLAS bf16 GEMMs on each GPU's compute stream is timed alone, beside the
//! copies alone (`h2d-only`), and beside copies + AllGather, each repeated and interleaved; the transfers are
//! enqueued first and sized to outlast the GEMM loop.
//!
//! Ranks are threads of this process, one per GPU, each with its own `CudaPlatform` and communicator. (Production
//! runs one process per GPU, with the unique id shipped over a TCP rendezvous; NCCL moves the same bytes either
//! way, but this microbenchmark keeps everything in one process to need no launcher.)
//!
//! Invariant: every rank runs the same sequence of configurations and enqueues the same AllGathers in the same
//! order; a rank that fails breaks the group barrier, so its peers stop at their next barrier instead of entering
//! a collective the failed rank will never issue.

use crate::engine::synthetic::splitmix64;
use crate::engine::timing::median;
use crate::engine::EngineError;
use serde::Serialize;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use weightferry::platform::cuda::blas::{BLayout, Blas, Gemm};
use weightferry::platform::cuda::nccl::{
    nccl_version, NcclCollective, NcclOptions, NcclUniqueId, NCCL_UNIQUE_ID_BYTES,
};
use weightferry::platform::cuda::symmetric::SymmetricHeap;
use weightferry::platform::cuda::CudaPlatform;
use weightferry::scheduler::{
    DeviceBufferId, EventId, HostBufferId, HostMemoryKind, Platform, PlatformError, StreamId,
};

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// Chunks (and blocks) are multiples of `world ·` this many bytes, like the chunked transport's alignment.
pub const CHUNK_ALIGN: u64 = 256;
/// Longest a rank waits at the group barrier for its peers.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

/// How a block is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GatherMode {
    /// Host→device copies of the shard only (no collective): what the copies alone achieve.
    H2dOnly,
    /// Shard copied into a shard slot, then AllGathered into the output slot (the production layout).
    Gather,
    /// Shard copied into its place in the output slot, then AllGathered in place.
    InPlace,
}

impl GatherMode {
    /// Short name (as on the command line).
    pub fn label(self) -> &'static str {
        match self {
            GatherMode::H2dOnly => "h2d-only",
            GatherMode::Gather => "gather",
            GatherMode::InPlace => "in-place",
        }
    }
}

/// The compute-slowdown measurement.
#[derive(Debug, Clone)]
pub struct GemmSpec {
    /// GEMM shape `m × n × k` (bf16, f32 accumulation).
    pub shape: (usize, usize, usize),
    /// GEMMs per timed loop.
    pub iters: u32,
    /// Chunk size (full-block bytes; 0 = whole block) of the transfers beside the GEMMs.
    pub chunk_bytes: u64,
    /// Mode of the transfers with AllGather (`Gather` or `InPlace`).
    pub mode: GatherMode,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct GatherBenchSpec {
    /// Full-block bytes (each rank holds `block_bytes / world`).
    pub block_bytes: u64,
    /// Chunk sizes in full-block bytes (0 = the whole block as one chunk).
    pub chunk_bytes: Vec<u64>,
    /// Timed blocks per run.
    pub blocks: u32,
    /// Untimed blocks before each configuration.
    pub warmup: u32,
    /// Timed runs per configuration (the median is reported).
    pub repeats: u32,
    /// Group sizes (ranks = GPUs 0..world).
    pub worlds: Vec<usize>,
    /// Modes to measure.
    pub modes: Vec<GatherMode>,
    /// The compute-slowdown measurement, if wanted.
    pub gemm: Option<GemmSpec>,
    /// NCCL's copy-engine AllGather: shard and output slots from NCCL's symmetric heap, registered as windows,
    /// on a communicator under `NCCL_CTA_POLICY_ZERO`.
    pub copy_engine: bool,
}

/// One measured configuration of one group size.
#[derive(Debug, Clone, Serialize)]
pub struct GatherRow {
    /// Ranks.
    pub world: usize,
    /// Mode.
    pub mode: GatherMode,
    /// Chunk size asked for (0 = whole block).
    pub chunk_requested: u64,
    /// Chunk size used (full-block bytes), after rounding down to a multiple of `world · 256`.
    pub chunk_bytes: u64,
    /// Chunks per block.
    pub chunks_per_block: usize,
    /// Full-block bytes delivered per second per GPU: the slowest rank's median.
    pub block_bytes_per_s: f64,
    /// Each rank's median rate.
    pub per_rank_bytes_per_s: Vec<f64>,
    /// Host→device bytes per second per GPU (`block_bytes_per_s / world`).
    pub h2d_bytes_per_s: f64,
    /// Whether the last block matched the expected bytes on every rank (for `h2d-only`: the shard slot).
    pub exact: bool,
}

/// A larger group's block rate relative to one GPU's.
#[derive(Debug, Clone, Serialize)]
pub struct ScalingRow {
    /// Mode.
    pub mode: GatherMode,
    /// Chunk size asked for.
    pub chunk_requested: u64,
    /// Ranks.
    pub world: usize,
    /// Block rate of `world` ranks divided by the block rate of one rank (same mode and chunk).
    pub ratio_to_world1: f64,
    /// Block rate of `world` ranks divided by the single-GPU pinned H2D bandwidth.
    pub ratio_to_h2d: f64,
}

/// The compute-slowdown measurement of one group size.
#[derive(Debug, Clone, Serialize)]
pub struct ComputeRow {
    /// Ranks.
    pub world: usize,
    /// Mode of the transfers with AllGather.
    pub mode: GatherMode,
    /// Chunk size used.
    pub chunk_bytes: u64,
    /// `m×n×k × iters`.
    pub gemm: String,
    /// Each rank's median GEMM-loop time alone, seconds.
    pub alone_s: Vec<f64>,
    /// Beside the copies alone.
    pub beside_h2d_s: Vec<f64>,
    /// Beside copies + AllGather.
    pub beside_gather_s: Vec<f64>,
    /// Worst rank's `beside_h2d / alone − 1`.
    pub slowdown_h2d: f64,
    /// Worst rank's `beside_gather / alone − 1`.
    pub slowdown_gather: f64,
    /// Worst rank's `beside_gather / beside_h2d − 1`: what the collective adds beyond the copies.
    pub nccl_extra: f64,
    /// Achieved GEMM TFLOP/s alone (slowest rank).
    pub tflops_alone: f64,
}

/// Everything `bench-gather` measured.
#[derive(Debug, Clone, Serialize)]
pub struct GatherBenchReport {
    /// Name of GPU 0.
    pub device: String,
    /// Visible GPUs.
    pub gpus: usize,
    /// NCCL version code (e.g. 22803).
    pub nccl_version: i32,
    /// Full-block bytes.
    pub block_bytes: u64,
    /// Timed blocks per run.
    pub blocks: u32,
    /// Runs per configuration.
    pub repeats: u32,
    /// Pinned H2D bandwidth of GPU 0 alone (256 MiB copies), bytes/s.
    pub h2d_single_gpu_bytes_per_s: f64,
    /// Measured configurations.
    pub rows: Vec<GatherRow>,
    /// Scaling of every group size above 1.
    pub scaling: Vec<ScalingRow>,
    /// Compute slowdown per group size.
    pub compute: Vec<ComputeRow>,
}

/// A reusable barrier that fails (instead of hanging) once a member failed or after a timeout.
struct GroupBarrier {
    size: usize,
    state: Mutex<BarrierState>,
    cond: Condvar,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: Option<String>,
    agreed: u32,
}

impl GroupBarrier {
    fn new(size: usize) -> Self {
        GroupBarrier {
            size,
            state: Mutex::new(BarrierState { arrived: 0, generation: 0, broken: None, agreed: 0 }),
            cond: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BarrierState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for every member; fails if the group is broken or the wait exceeds [`BARRIER_TIMEOUT`].
    fn wait(&self) -> Result<(), EngineError> {
        let mut st = self.lock();
        if let Some(why) = &st.broken {
            return Err(EngineError::Failed(format!("another rank failed: {why}")));
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.size {
            st.arrived = 0;
            st.generation += 1;
            self.cond.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + BARRIER_TIMEOUT;
        while st.generation == generation {
            if let Some(why) = &st.broken {
                return Err(EngineError::Failed(format!("another rank failed: {why}")));
            }
            let now = Instant::now();
            if now >= deadline {
                let why = "timed out waiting for the other ranks at the barrier".to_string();
                st.broken = Some(why.clone());
                self.cond.notify_all();
                return Err(EngineError::Failed(why));
            }
            st = self.cond.wait_timeout(st, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
        Ok(())
    }

    /// The largest `value` any member offered so far (a barrier: returns once every member offered one).
    fn agree_max(&self, value: u32) -> Result<u32, EngineError> {
        {
            let mut st = self.lock();
            st.agreed = st.agreed.max(value);
        }
        self.wait()?;
        Ok(self.lock().agreed)
    }

    fn break_with(&self, why: String) {
        self.lock().broken.get_or_insert(why);
        self.cond.notify_all();
    }
}

/// The chunks of a block: `(full-block offset, length)`, every length a multiple of `world · CHUNK_ALIGN`.
fn chunk_plan(block: u64, requested: u64, world: usize) -> Vec<(u64, u64)> {
    let unit = world as u64 * CHUNK_ALIGN;
    let chunk = if requested == 0 || requested >= block { block } else { (requested / unit).max(1) * unit };
    let mut out = Vec::new();
    let mut off = 0;
    while off < block {
        let len = chunk.min(block - off);
        out.push((off, len));
        off += len;
    }
    out
}

/// The deterministic content of rank `rank`'s host shard.
fn shard_content(rank: usize, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let mut state = 0xB10C_5EED ^ ((rank as u64) << 40);
    while (out.len() as u64) < len {
        let word = splitmix64(&mut state).to_le_bytes();
        let take = (len as usize - out.len()).min(8);
        out.extend_from_slice(&word[..take]);
    }
    out
}

/// bf16 bits of small values, so GEMMs see ordinary finite numbers.
fn gemm_fill(elems: usize, salt: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(elems * 2);
    for i in 0..elems as u64 {
        let v = (((i.wrapping_mul(7919) ^ salt) % 255) as f32 - 127.0) / 512.0;
        out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    out
}

/// Everything one rank owns.
struct Rank<'a> {
    p: Arc<CudaPlatform>,
    comm: NcclCollective,
    rank: usize,
    world: usize,
    block: u64,
    copy: StreamId,
    comm_stream: StreamId,
    host: HostBufferId,
    shard_slots: [DeviceBufferId; 2],
    out_slots: [DeviceBufferId; 2],
    chunk_events: [Vec<EventId>; 2],
    done: [EventId; 2],
    blocks_enqueued: u64,
    barrier: &'a GroupBarrier,
    /// Every rank's shard content, to check rebuilt blocks.
    shards: Vec<Vec<u8>>,
    readback: HostBufferId,
}

impl Rank<'_> {
    fn ensure_events(&mut self, chunks: usize) -> Result<(), PlatformError> {
        for slot in 0..2 {
            while self.chunk_events[slot].len() < chunks {
                let e = self.p.create_event()?;
                self.chunk_events[slot].push(e);
            }
        }
        Ok(())
    }

    /// Enqueues the rebuild of `n` blocks (no host wait).
    fn enqueue_blocks(&mut self, mode: GatherMode, chunks: &[(u64, u64)], n: u32) -> Result<(), EngineError> {
        self.ensure_events(chunks.len())?;
        let w = self.world as u64;
        for _ in 0..n {
            let b = self.blocks_enqueued;
            self.blocks_enqueued += 1;
            let s = (b % 2) as usize;
            if mode != GatherMode::H2dOnly {
                // The slot's previous block must be fully gathered before its shard (or output) is overwritten.
                self.p.stream_wait_event(self.copy, self.done[s])?;
            }
            for (j, &(fo, len)) in chunks.iter().enumerate() {
                let (ho, sl) = (fo / w, len / w);
                let tag = (b << 16) | j as u64;
                match mode {
                    GatherMode::H2dOnly => self.p.copy_h2d(self.copy, self.host, ho, self.shard_slots[s], ho, sl)?,
                    GatherMode::Gather => {
                        self.p.copy_h2d(self.copy, self.host, ho, self.shard_slots[s], ho, sl)?;
                        self.p.record_event(self.chunk_events[s][j], self.copy)?;
                        self.p.stream_wait_event(self.comm_stream, self.chunk_events[s][j])?;
                        self.comm
                            .gather(self.comm_stream, (self.shard_slots[s], ho, sl), (self.out_slots[s], fo), tag)
                            .map_err(PlatformError::from)?;
                    }
                    GatherMode::InPlace => {
                        let dst = fo + self.rank as u64 * sl;
                        self.p.copy_h2d(self.copy, self.host, ho, self.out_slots[s], dst, sl)?;
                        self.p.record_event(self.chunk_events[s][j], self.copy)?;
                        self.p.stream_wait_event(self.comm_stream, self.chunk_events[s][j])?;
                        self.comm
                            .gather(self.comm_stream, (self.out_slots[s], dst, sl), (self.out_slots[s], fo), tag)
                            .map_err(PlatformError::from)?;
                    }
                }
            }
            let last = if mode == GatherMode::H2dOnly { self.copy } else { self.comm_stream };
            self.p.record_event(self.done[s], last)?;
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), EngineError> {
        self.p.stream_synchronize(self.copy)?;
        self.p.stream_synchronize(self.comm_stream)?;
        Ok(())
    }

    /// Seconds to rebuild `n` blocks, started together with the other ranks.
    fn timed_blocks(&mut self, mode: GatherMode, chunks: &[(u64, u64)], n: u32) -> Result<f64, EngineError> {
        self.barrier.wait()?;
        let t0 = Instant::now();
        self.enqueue_blocks(mode, chunks, n)?;
        self.sync()?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Whether the most recently rebuilt block is exactly right.
    fn check_last(&mut self, mode: GatherMode, chunks: &[(u64, u64)]) -> Result<bool, EngineError> {
        let s = ((self.blocks_enqueued + 1) % 2) as usize;
        let w = self.world as u64;
        let (src, len) = match mode {
            GatherMode::H2dOnly => (self.shard_slots[s], self.block / w),
            _ => (self.out_slots[s], self.block),
        };
        self.p.copy_d2h(self.copy, src, 0, self.readback, 0, len)?;
        self.p.stream_synchronize(self.copy)?;
        let mut got = vec![0u8; len as usize];
        self.p.read_host(self.readback, 0, &mut got)?;
        if mode == GatherMode::H2dOnly {
            return Ok(got == self.shards[self.rank]);
        }
        for &(fo, clen) in chunks {
            let (ho, sl) = ((fo / w) as usize, (clen / w) as usize);
            for (r, shard) in self.shards.iter().enumerate() {
                let at = fo as usize + r * sl;
                if got[at..at + sl] != shard[ho..ho + sl] {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

/// One rank's measurement of one configuration.
struct RankRate {
    mode: GatherMode,
    requested: u64,
    chunk: u64,
    chunks: usize,
    bytes_per_s: f64,
    exact: bool,
}

/// One rank's GEMM-loop medians, seconds, and its FLOP rate alone.
#[derive(Debug, Clone, Copy)]
struct ComputeTimes {
    alone: f64,
    beside_h2d: f64,
    beside_gather: f64,
    flops_per_s: f64,
}

/// What one rank measured: rates per configuration (in spec order) and its compute timings.
struct RankResult {
    rates: Vec<RankRate>,
    compute: Option<ComputeTimes>,
}

fn rank_main(
    rank: usize,
    world: usize,
    id: [u8; NCCL_UNIQUE_ID_BYTES],
    spec: &GatherBenchSpec,
    barrier: &GroupBarrier,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<RankResult, EngineError> {
    let block = spec.block_bytes;
    let shard_len = block / world as u64;
    let p = Arc::new(CudaPlatform::new(rank)?);
    let host = p.alloc_host(shard_len, HostMemoryKind::Pinned)?;
    let shards: Vec<Vec<u8>> = (0..world).map(|r| shard_content(r, shard_len)).collect();
    p.write_host(host, 0, &shards[rank])?;
    let readback = p.alloc_host(block, HostMemoryKind::Pinned)?;
    let options = if spec.copy_engine {
        let heap = SymmetricHeap::new().map_err(PlatformError::from)?;
        p.set_shared_device_memory(heap.clone());
        NcclOptions { copy_engine: Some(heap) }
    } else {
        NcclOptions::default()
    };
    let shard_slots = [p.alloc_device_shared(shard_len)?, p.alloc_device_shared(shard_len)?];
    let out_slots = [p.alloc_device_shared(block)?, p.alloc_device_shared(block)?];
    let copy = p.create_stream("copy")?;
    let comm_stream = p.create_stream("comm")?;
    let done = [p.create_event()?, p.create_event()?];
    let uid = NcclUniqueId::from_bytes(&id).map_err(PlatformError::from)?;
    let comm = NcclCollective::with_options(p.clone(), &uid, rank, world, options).map_err(PlatformError::from)?;
    let mut r = Rank {
        p: p.clone(),
        comm,
        rank,
        world,
        block,
        copy,
        comm_stream,
        host,
        shard_slots,
        out_slots,
        chunk_events: [Vec::new(), Vec::new()],
        done,
        blocks_enqueued: 0,
        barrier,
        shards,
        readback,
    };
    // Warm the communicator (its first AllGather sets up connections, ≈2.5 s): one whole block, untimed.
    let whole = chunk_plan(block, 0, world);
    let t = Instant::now();
    r.enqueue_blocks(GatherMode::Gather, &whole, 1)?;
    r.sync()?;
    if rank == 0 {
        progress(&format!("world {world}: communicator warmed up ({:.2} s)", t.elapsed().as_secs_f64()));
    }
    let mut rates = Vec::new();
    for &mode in &spec.modes {
        for &requested in &spec.chunk_bytes {
            let chunks = chunk_plan(block, requested, world);
            r.barrier.wait()?;
            r.enqueue_blocks(mode, &chunks, spec.warmup)?;
            r.sync()?;
            let mut times = Vec::new();
            for _ in 0..spec.repeats {
                times.push(r.timed_blocks(mode, &chunks, spec.blocks)?);
            }
            let exact = r.check_last(mode, &chunks)?;
            let rate = block as f64 * f64::from(spec.blocks) / median(times);
            if rank == 0 {
                progress(&format!(
                    "world {world} {} chunk {} MiB ×{}: {:.1} GB/s of full blocks per GPU (rank 0), exact {exact}",
                    mode.label(),
                    chunks[0].1 / MIB,
                    chunks.len(),
                    rate / 1e9
                ));
            }
            rates.push(RankRate {
                mode,
                requested,
                chunk: chunks[0].1,
                chunks: chunks.len(),
                bytes_per_s: rate,
                exact,
            });
        }
    }
    let compute = match &spec.gemm {
        Some(g) => Some(compute_slowdown(&mut r, g, spec)?),
        None => None,
    };
    if rank == 0 && compute.is_some() {
        progress(&format!("world {world}: compute slowdown measured"));
    }
    r.sync()?;
    Ok(RankResult { rates, compute })
}

/// One rank's bf16 GEMM loop on a compute stream of its own: its operands (filled with small values), its cuBLAS
/// handle, and the chunking of the transfers it runs beside.
struct GemmLoop {
    p: Arc<CudaPlatform>,
    compute: StreamId,
    buffers: [DeviceBufferId; 3],
    gemm: Gemm,
    blas: Blas,
    /// GEMMs per timed loop.
    iters: u32,
    chunks: Vec<(u64, u64)>,
}

impl GemmLoop {
    /// Uploads the operands of `g`'s shape and creates the handle on a new compute stream.
    fn new(r: &Rank<'_>, g: &GemmSpec) -> Result<GemmLoop, EngineError> {
        let (m, n, k) = g.shape;
        let p = r.p.clone();
        let compute = p.create_stream("compute")?;
        let upload = |elems: usize, salt: u64| -> Result<DeviceBufferId, EngineError> {
            let bytes = gemm_fill(elems, salt);
            let len = bytes.len() as u64;
            let h = p.alloc_host(len, HostMemoryKind::Pinned)?;
            p.write_host(h, 0, &bytes)?;
            let d = p.alloc_device(len)?;
            p.copy_h2d(compute, h, 0, d, 0, len)?;
            p.stream_synchronize(compute)?;
            p.free_host(h)?;
            Ok(d)
        };
        let a = upload(m * k, 1)?;
        let b = upload(n * k, 2)?;
        let c = p.alloc_device((m * n * 2) as u64)?;
        let ptr = |buf: DeviceBufferId| {
            p.device_ptr(buf)
                .map(|(ptr, _)| ptr)
                .ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })
        };
        let gemm = Gemm {
            m,
            n,
            k,
            a: (ptr(a)?, k),
            b: (ptr(b)?, k),
            b_layout: BLayout::WeightRowMajor,
            c: (ptr(c)?, n),
            alpha: 1.0,
            beta: 0.0,
        };
        let blas = Blas::new(&p, compute)?;
        let chunks = chunk_plan(r.block, g.chunk_bytes, r.world);
        Ok(GemmLoop { p, compute, buffers: [a, b, c], gemm, blas, iters: g.iters, chunks })
    }

    /// The GEMM loop alone: `iters` GEMMs enqueued back to back, timed to the compute stream's completion.
    fn alone(&self, iters: u32) -> Result<f64, EngineError> {
        let t0 = Instant::now();
        for _ in 0..iters {
            self.blas.gemm(&self.gemm)?;
        }
        self.p.stream_synchronize(self.compute)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// The GEMM loop beside `n` blocks of transfers: the enqueues are interleaved (the GEMMs spread over the first
    /// two thirds of the blocks, which are sized to outlast them) so that a full launch queue on a transfer stream
    /// can never leave the compute stream without queued work; transfers start first. Timed to the compute
    /// stream's completion; the transfers are drained afterwards, untimed.
    fn beside(&self, r: &mut Rank<'_>, mode: GatherMode, n: u32) -> Result<f64, EngineError> {
        let spread = (u64::from(n) * 2 / 3).max(1);
        let mut issued = 0u32;
        let t0 = Instant::now();
        for blk in 0..u64::from(n) {
            r.enqueue_blocks(mode, &self.chunks, 1)?;
            let due = ((blk + 1) * u64::from(self.iters)).div_ceil(spread).min(u64::from(self.iters)) as u32;
            while issued < due {
                self.blas.gemm(&self.gemm)?;
                issued += 1;
            }
        }
        while issued < self.iters {
            self.blas.gemm(&self.gemm)?;
            issued += 1;
        }
        self.p.stream_synchronize(self.compute)?;
        let t = t0.elapsed().as_secs_f64();
        r.sync()?;
        Ok(t)
    }

    /// Drops the handle and frees the operands.
    fn free(self) -> Result<(), EngineError> {
        let GemmLoop { p, buffers, blas, .. } = self;
        drop(blas);
        for buf in buffers {
            p.free_device(buf)?;
        }
        Ok(())
    }
}

/// Median GEMM-loop seconds alone, beside the copies, beside copies + AllGather; the FLOP rate alone.
fn compute_slowdown(r: &mut Rank<'_>, g: &GemmSpec, spec: &GatherBenchSpec) -> Result<ComputeTimes, EngineError> {
    let (m, n, k) = g.shape;
    let gemms = GemmLoop::new(r, g)?;
    gemms.alone(10)?;
    // Size the transfers to outlast the GEMM loop (1.5× its time alone, at rates probed now).
    r.barrier.wait()?;
    let t_alone = gemms.alone(g.iters)?;
    let probe = 4;
    let t_h2d = r.timed_blocks(GatherMode::H2dOnly, &gemms.chunks, probe)?;
    let t_gather = r.timed_blocks(g.mode, &gemms.chunks, probe)?;
    let blocks_for = |t_probe: f64| ((1.5 * t_alone * f64::from(probe) / t_probe).ceil() as u32 + 2).clamp(4, 10_000);
    let n_h2d = blocks_for(t_h2d);
    // Every rank must issue the same AllGathers: the ranks agree on the largest count any of them wants.
    let n_gather = r.barrier.agree_max(blocks_for(t_gather))?;
    let mut alone = Vec::new();
    let mut beside_h2d = Vec::new();
    let mut beside_gather = Vec::new();
    for _ in 0..spec.repeats.max(1) {
        r.barrier.wait()?;
        alone.push(gemms.alone(g.iters)?);
        r.barrier.wait()?;
        beside_h2d.push(gemms.beside(r, GatherMode::H2dOnly, n_h2d)?);
        r.barrier.wait()?;
        beside_gather.push(gemms.beside(r, g.mode, n_gather)?);
    }
    gemms.free()?;
    let flops = 2.0 * m as f64 * n as f64 * k as f64 * f64::from(g.iters);
    let alone = median(alone);
    Ok(ComputeTimes {
        alone,
        beside_h2d: median(beside_h2d),
        beside_gather: median(beside_gather),
        flops_per_s: flops / alone,
    })
}

fn check_spec(spec: &GatherBenchSpec, gpus: usize) -> Result<(), EngineError> {
    let invalid = |m: String| Err(EngineError::Invalid(m));
    if spec.worlds.is_empty() {
        return invalid("no group size to measure".to_string());
    }
    for &w in &spec.worlds {
        if w == 0 || w > gpus {
            return invalid(format!("group size {w} needs 1..={gpus} GPUs ({gpus} visible)"));
        }
        if spec.block_bytes == 0 || spec.block_bytes % (w as u64 * CHUNK_ALIGN) != 0 {
            return invalid(format!(
                "block of {} bytes is not a positive multiple of {} (group size {w} × {CHUNK_ALIGN})",
                spec.block_bytes,
                w as u64 * CHUNK_ALIGN
            ));
        }
    }
    if spec.blocks == 0 || spec.repeats == 0 {
        return invalid("blocks and repeats must be at least 1".to_string());
    }
    if spec.modes.is_empty() || spec.chunk_bytes.is_empty() {
        return invalid("no mode or no chunk size to measure".to_string());
    }
    if let Some(g) = &spec.gemm {
        let (m, n, k) = g.shape;
        if m == 0 || n == 0 || k == 0 || g.iters == 0 {
            return invalid("the GEMM shape and iteration count must be positive".to_string());
        }
        let operand_bytes = |a: usize, b: usize| a.checked_mul(b).and_then(|x| x.checked_mul(2));
        let limit = 4usize << 30;
        if [operand_bytes(m, k), operand_bytes(n, k), operand_bytes(m, n)].iter().any(|x| x.is_none_or(|x| x > limit)) {
            return invalid(format!("GEMM {m}×{n}×{k}: every bf16 operand must fit in 4 GiB"));
        }
        if g.mode == GatherMode::H2dOnly {
            return invalid("the compute measurement needs a gathering mode (gather or in-place)".to_string());
        }
    }
    Ok(())
}

/// Runs one group of `world` ranks (threads, one per GPU) through every configuration.
fn run_group(
    spec: &GatherBenchSpec,
    world: usize,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<RankResult>, EngineError> {
    let id = NcclUniqueId::generate().map_err(PlatformError::from)?.to_bytes();
    let barrier = GroupBarrier::new(world);
    let results: Vec<Result<RankResult, EngineError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        rank_main(rank, world, id, spec, barrier, progress)
                    }));
                    let result = run.unwrap_or_else(|_| Err(EngineError::Failed("the rank panicked".to_string())));
                    if let Err(e) = &result {
                        barrier.break_with(format!("rank {rank}: {e}"));
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(EngineError::Failed("the rank panicked".to_string()))))
            .collect()
    });
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.map_err(|e| EngineError::Failed(format!("group of {world}, rank {rank}: {e}"))))
        .collect()
}

/// Runs the benchmark: the pinned H2D bandwidth of GPU 0 alone, then every group size of `spec` (default: 1 and
/// every visible GPU). `progress` gets a line per measured configuration (from rank 0).
pub fn bench_gather(
    spec: &GatherBenchSpec,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<GatherBenchReport, EngineError> {
    let version = nccl_version().map_err(PlatformError::from)?;
    let gpus = CudaPlatform::device_count()?;
    let mut spec = spec.clone();
    if spec.worlds.is_empty() {
        spec.worlds = if gpus > 1 { vec![1, gpus] } else { vec![1] };
    }
    check_spec(&spec, gpus)?;
    let (device, h2d) = {
        let p0 = CudaPlatform::new(0)?;
        (p0.device_name().to_string(), p0.measure_h2d_bandwidth(256 * MIB, 16)?)
    };
    progress(&format!("{gpus} × {device}, NCCL {version}: pinned H2D on GPU 0 alone {:.1} GB/s", h2d / 1e9));
    let mut rows: Vec<GatherRow> = Vec::new();
    let mut compute = Vec::new();
    for &world in &spec.worlds {
        let results = run_group(&spec, world, progress)?;
        let Some(first) = results.first() else { continue };
        for (i, f) in first.rates.iter().enumerate() {
            let per_rank: Vec<f64> = results.iter().filter_map(|r| r.rates.get(i).map(|x| x.bytes_per_s)).collect();
            let exact = results.iter().all(|r| r.rates.get(i).is_some_and(|x| x.exact));
            let rate = per_rank.iter().copied().fold(f64::INFINITY, f64::min);
            rows.push(GatherRow {
                world,
                mode: f.mode,
                chunk_requested: f.requested,
                chunk_bytes: f.chunk,
                chunks_per_block: f.chunks,
                block_bytes_per_s: rate,
                per_rank_bytes_per_s: per_rank,
                h2d_bytes_per_s: rate / world as f64,
                exact,
            });
        }
        if let Some(g) = &spec.gemm {
            let timings: Vec<ComputeTimes> = results.iter().filter_map(|r| r.compute).collect();
            if timings.len() == results.len() {
                let worst = |f: &dyn Fn(&ComputeTimes) -> f64| timings.iter().map(f).fold(f64::MIN, f64::max);
                let (m, n, k) = g.shape;
                compute.push(ComputeRow {
                    world,
                    mode: g.mode,
                    chunk_bytes: chunk_plan(spec.block_bytes, g.chunk_bytes, world)[0].1,
                    gemm: format!("{m}×{n}×{k} ×{}", g.iters),
                    alone_s: timings.iter().map(|t| t.alone).collect(),
                    beside_h2d_s: timings.iter().map(|t| t.beside_h2d).collect(),
                    beside_gather_s: timings.iter().map(|t| t.beside_gather).collect(),
                    slowdown_h2d: worst(&|t| t.beside_h2d / t.alone - 1.0),
                    slowdown_gather: worst(&|t| t.beside_gather / t.alone - 1.0),
                    nccl_extra: worst(&|t| t.beside_gather / t.beside_h2d - 1.0),
                    tflops_alone: timings.iter().map(|t| t.flops_per_s).fold(f64::INFINITY, f64::min) / 1e12,
                });
            }
        }
    }
    let scaling = rows
        .iter()
        .filter(|r| r.world > 1)
        .filter_map(|r| {
            let base =
                rows.iter().find(|b| b.world == 1 && b.mode == r.mode && b.chunk_requested == r.chunk_requested)?;
            Some(ScalingRow {
                mode: r.mode,
                chunk_requested: r.chunk_requested,
                world: r.world,
                ratio_to_world1: r.block_bytes_per_s / base.block_bytes_per_s,
                ratio_to_h2d: r.block_bytes_per_s / h2d,
            })
        })
        .collect();
    Ok(GatherBenchReport {
        device,
        gpus,
        nccl_version: version,
        block_bytes: spec.block_bytes,
        blocks: spec.blocks,
        repeats: spec.repeats,
        h2d_single_gpu_bytes_per_s: h2d,
        rows,
        scaling,
        compute,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_plans_cover_the_block_in_aligned_pieces() {
        let block = 512 * MIB;
        assert_eq!(chunk_plan(block, 0, 2), vec![(0, block)]);
        assert_eq!(chunk_plan(block, block * 2, 2), vec![(0, block)]);
        let plan = chunk_plan(block, 64 * MIB, 2);
        assert_eq!(plan.len(), 8);
        assert!(plan.iter().enumerate().all(|(j, &(o, l))| o == j as u64 * 64 * MIB && l == 64 * MIB));
        // 1000 bytes over 2 ranks rounds down to 512-byte chunks; the tail keeps the rest.
        assert_eq!(chunk_plan(2048 + 512, 1000, 2), vec![(0, 512), (512, 512), (1024, 512), (1536, 512), (2048, 512)]);
        let odd = chunk_plan(3 * 768, 1000, 3);
        assert_eq!(odd, vec![(0, 768), (768, 768), (1536, 768)]);
        assert_eq!(chunk_plan(1536, 1, 2), vec![(0, 512), (512, 512), (1024, 512)]);
    }

    #[test]
    fn shard_contents_differ_by_rank_and_are_deterministic() {
        assert_eq!(shard_content(0, 13), shard_content(0, 13));
        assert_ne!(shard_content(0, 64), shard_content(1, 64));
        assert_eq!(shard_content(1, 13), shard_content(1, 16)[..13].to_vec());
    }

    #[test]
    fn barrier_breaks_instead_of_hanging() {
        let b = GroupBarrier::new(2);
        b.break_with("rank 1: boom".to_string());
        match b.wait() {
            Err(EngineError::Failed(m)) => assert!(m.contains("boom"), "{m}"),
            other => panic!("expected a broken barrier, got {other:?}"),
        }
    }

    #[test]
    fn barrier_agrees_on_the_maximum() {
        let b = GroupBarrier::new(3);
        let got: Vec<u32> = std::thread::scope(|s| {
            let hs: Vec<_> = [5u32, 9, 2]
                .into_iter()
                .map(|v| {
                    let b = &b;
                    s.spawn(move || b.agree_max(v).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![9, 9, 9]);
    }

    #[test]
    fn specs_are_checked_before_any_gpu_work() {
        let spec = GatherBenchSpec {
            block_bytes: 512 * MIB,
            chunk_bytes: vec![0],
            blocks: 1,
            warmup: 0,
            repeats: 1,
            worlds: vec![1, 3],
            modes: vec![GatherMode::Gather],
            gemm: None,
            copy_engine: false,
        };
        assert!(check_spec(&spec, 4).is_err(), "512 MiB is not a multiple of 3 × 256");
        assert!(check_spec(&GatherBenchSpec { worlds: vec![1, 2], ..spec.clone() }, 4).is_ok());
        assert!(check_spec(&GatherBenchSpec { worlds: vec![8], ..spec.clone() }, 4).is_err());
        let gemm = GemmSpec { shape: (8, 8, 8), iters: 1, chunk_bytes: 0, mode: GatherMode::H2dOnly };
        assert!(check_spec(&GatherBenchSpec { worlds: vec![1], gemm: Some(gemm.clone()), ..spec.clone() }, 4).is_err());
        let ok = GemmSpec { mode: GatherMode::Gather, ..gemm.clone() };
        assert!(check_spec(&GatherBenchSpec { worlds: vec![1], gemm: Some(ok), ..spec.clone() }, 4).is_ok());
        let huge = GemmSpec { shape: (usize::MAX, 2, 2), mode: GatherMode::Gather, ..gemm };
        assert!(check_spec(&GatherBenchSpec { worlds: vec![1], gemm: Some(huge), ..spec }, 4).is_err());
    }
}
