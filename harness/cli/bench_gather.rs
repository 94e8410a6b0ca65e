//! `weightferry bench-gather`: the block-rebuild rate of distributed layerwise offload (shard H2D + NCCL
//! AllGather, chunked and double-buffered) for one GPU and for every visible GPU, and the compute slowdown it
//! causes (see `engine::gather_bench`, built with the `nccl` feature), printed as markdown tables (or JSON).

use super::{BenchGatherArgs, CliError};

/// Runs `weightferry bench-gather`; returns the exit code.
#[cfg(not(feature = "nccl"))]
pub fn bench_gather(_a: &BenchGatherArgs) -> Result<i32, CliError> {
    Err(CliError::invalid(
        "bench-gather measures GPUs through NCCL: rebuild with --features nccl and run it on a machine with GPUs",
    ))
}

/// Target ratio of the block rate of N GPUs to that of one GPU (per GPU, N = 2).
pub const SCALING_TARGET: f64 = 1.95;
/// Target extra compute slowdown of the collective beyond what the copies alone cost.
pub const NCCL_EXTRA_TARGET: f64 = 0.02;

/// Runs `weightferry bench-gather`; returns the exit code (1 when a rebuilt block was not exact).
#[cfg(feature = "nccl")]
pub fn bench_gather(a: &BenchGatherArgs) -> Result<i32, CliError> {
    use super::{emit, GatherModeArg};
    use crate::bench::gather::{bench_gather as run, GatherBenchReport, GatherBenchSpec, GatherMode, GemmSpec, MIB};

    let mode = |m: GatherModeArg| match m {
        GatherModeArg::H2dOnly => GatherMode::H2dOnly,
        GatherModeArg::Gather => GatherMode::Gather,
        GatherModeArg::InPlace => GatherMode::InPlace,
    };
    let mib = |x: u64| x.checked_mul(MIB).ok_or_else(|| CliError::invalid(format!("{x} MiB does not fit in 64 bits")));
    let gemm = if a.skip_compute {
        None
    } else {
        let shape = match a.gemm.as_slice() {
            [m, n, k] if *m > 0 && *n > 0 && *k > 0 => (*m, *n, *k),
            _ => return Err(CliError::invalid("--gemm takes three positive sizes M,N,K, e.g. 4096,12288,3072")),
        };
        let compute_mode = mode(a.compute_mode);
        if compute_mode == GatherMode::H2dOnly {
            return Err(CliError::invalid("--compute-mode must gather (gather or in-place)"));
        }
        Some(GemmSpec { shape, iters: a.gemm_iters, chunk_bytes: mib(a.compute_chunk_mib)?, mode: compute_mode })
    };
    let spec = GatherBenchSpec {
        block_bytes: mib(a.block_mib)?,
        chunk_bytes: a.chunk_mib.iter().map(|&c| mib(c)).collect::<Result<_, _>>()?,
        blocks: a.blocks,
        warmup: a.warmup,
        repeats: a.repeats,
        worlds: a.worlds.clone(),
        modes: a.modes.iter().map(|&m| mode(m)).collect(),
        gemm,
        copy_engine: a.nccl_copy_engine,
    };
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(v) if v == "0" => {}
        Ok(v) => {
            return Err(CliError::invalid(format!(
                "NCCL_NVLS_ENABLE={v}: NVLink multicast must stay off; set NCCL_NVLS_ENABLE=0 or unset it"
            )))
        }
        // Still single-threaded here: no NCCL, CUDA or worker thread exists yet.
        Err(_) => std::env::set_var("NCCL_NVLS_ENABLE", "0"),
    }
    let report: GatherBenchReport = run(&spec, &|line: &str| eprintln!("{line}")).map_err(|e| match e {
        crate::engine::EngineError::Invalid(m) => CliError::invalid(m),
        other => CliError::failed(format!("bench-gather failed: {other}")),
    })?;
    let json = serde_json::to_string_pretty(&report).map_err(|e| CliError::failed(e.to_string()))?;
    if let Some(path) = &a.json_out {
        std::fs::write(path, format!("{json}\n"))
            .map_err(|e| CliError::failed(format!("cannot write {}: {e}", path.display())))?;
    }
    let all_exact = report.rows.iter().all(|r| r.exact);
    if a.json {
        emit(&format!("{json}\n"));
    } else {
        emit(&markdown(&report));
    }
    Ok(if all_exact { 0 } else { 1 })
}

/// The report as markdown tables.
#[cfg(feature = "nccl")]
fn markdown(r: &crate::bench::gather::GatherBenchReport) -> String {
    use crate::bench::gather::MIB;
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
                if s.mode == crate::bench::gather::GatherMode::H2dOnly {
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
