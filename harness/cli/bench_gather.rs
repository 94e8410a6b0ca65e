//! `weightferry bench-gather`: the block-rebuild rate of distributed layerwise offload (shard H2D + NCCL
//! AllGather, chunked and double-buffered) for one GPU and for every visible GPU, and the compute slowdown it
//! causes (see [`crate::bench`]`::gather`, built with the `nccl` feature), printed as markdown tables
//! ([`crate::report`]`::gather`) or JSON.

use super::{BenchGatherArgs, CliError};

/// Runs `weightferry bench-gather`; returns the exit code.
#[cfg(not(feature = "nccl"))]
pub fn bench_gather(_a: &BenchGatherArgs) -> Result<i32, CliError> {
    Err(CliError::invalid(
        "bench-gather measures GPUs through NCCL: rebuild with --features nccl and run it on a machine with GPUs",
    ))
}

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
        Some(GemmSpec {
            shape,
            iters: a.gemm_iters,
            chunk_bytes: mib(a.compute_chunk_mib)?,
            mode: mode(a.compute_mode),
        })
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
        emit(&crate::report::gather::markdown(&report));
    }
    Ok(if all_exact { 0 } else { 1 })
}
