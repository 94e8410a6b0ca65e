//! What `weightferry bench-gather` prints without `--json`: the block-rebuild rate of every configuration, its
//! scaling from one GPU to N against [`SCALING_TARGET`], and the compute slowdown of the transfers beside GEMMs
//! against [`NCCL_EXTRA_TARGET`].

use crate::bench::gather::{GatherBenchReport, GatherMode, MIB};

/// Target ratio of the block rate of N GPUs to that of one GPU (per GPU, N = 2).
pub const SCALING_TARGET: f64 = 1.95;
/// Target extra compute slowdown of the collective beyond what the copies alone cost.
pub const NCCL_EXTRA_TARGET: f64 = 0.02;

/// The report as markdown tables.
pub fn markdown(r: &GatherBenchReport) -> String {
    let gb = |b: f64| b / 1e9;
    let chunk = |requested: u64, used: u64| {
        if requested == 0 {
            format!("whole ({} MiB)", used / MIB)
        } else {
            format!("{} MiB", used as f64 / MIB as f64)
        }
    };
    let mut out = format!(
        "device: {} × {}, NCCL {} (NCCL_NVLS_ENABLE=0), block {} MiB of full block, {} timed blocks, median of {}\n\n",
        r.gpus,
        r.device,
        r.nccl_version,
        r.block_bytes / MIB,
        r.blocks,
        r.repeats
    );
    out += &format!("pinned H2D, GPU 0 alone: {:.1} GB/s\n\n", gb(r.h2d_single_gpu_bytes_per_s));
    out += "| world | mode | chunk | chunks/block | full-block GB/s per GPU (slowest rank) | per rank | H2D GB/s per GPU | exact |\n";
    out += "| --- | --- | --- | --- | --- | --- | --- | --- |\n";
    for row in &r.rows {
        let ranks: Vec<String> = row.per_rank_bytes_per_s.iter().map(|x| format!("{:.1}", gb(*x))).collect();
        out += &format!(
            "| {} | {} | {} | {} | {:.1} | {} | {:.1} | {} |\n",
            row.world,
            row.mode.label(),
            chunk(row.chunk_requested, row.chunk_bytes),
            row.chunks_per_block,
            gb(row.block_bytes_per_s),
            ranks.join(" / "),
            gb(row.h2d_bytes_per_s),
            if row.exact { "yes" } else { "NO" }
        );
    }
    if !r.scaling.is_empty() {
        out +=
            &format!("\n| world | mode | chunk | ÷ world 1 (target ≥ {SCALING_TARGET}) | ÷ H2D of one GPU | met |\n");
        out += "| --- | --- | --- | --- | --- | --- |\n";
        for s in &r.scaling {
            let used = r
                .rows
                .iter()
                .find(|x| x.world == s.world && x.mode == s.mode && x.chunk_requested == s.chunk_requested)
                .map_or(0, |x| x.chunk_bytes);
            out += &format!(
                "| {} | {} | {} | {:.3}× | {:.3}× | {} |\n",
                s.world,
                s.mode.label(),
                chunk(s.chunk_requested, used),
                s.ratio_to_world1,
                s.ratio_to_h2d,
                if s.mode == GatherMode::H2dOnly {
                    "n/a"
                } else if s.ratio_to_world1 >= SCALING_TARGET {
                    "yes"
                } else {
                    "no"
                }
            );
        }
    }
    if !r.compute.is_empty() {
        out += &format!(
            "\n| world | GEMM loop | transfers beside | alone ms | + H2D ms | + H2D + AllGather ms | H2D slowdown | H2D + AllGather slowdown | AllGather extra (target ≤ {:.0}%) | TFLOP/s alone |\n",
            NCCL_EXTRA_TARGET * 100.0
        );
        out += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
        let ms = |v: &[f64]| v.iter().map(|x| format!("{:.2}", x * 1e3)).collect::<Vec<_>>().join(" / ");
        for c in &r.compute {
            out += &format!(
                "| {} | {} | {} {} MiB chunks | {} | {} | {} | {:+.2}% | {:+.2}% | {:+.2}% {} | {:.0} |\n",
                c.world,
                c.gemm,
                c.mode.label(),
                c.chunk_bytes / MIB,
                ms(&c.alone_s),
                ms(&c.beside_h2d_s),
                ms(&c.beside_gather_s),
                c.slowdown_h2d * 100.0,
                c.slowdown_gather * 100.0,
                c.nccl_extra * 100.0,
                if c.nccl_extra <= NCCL_EXTRA_TARGET { "(met)" } else { "(not met)" },
                c.tflops_alone
            );
        }
    }
    out
}
