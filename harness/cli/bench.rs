//! `weightferry bench`: the GPU benchmark matrix (see `engine::gpu`, built with the `cuda` feature): per preset,
//! the resident step time, the pinned H2D bandwidth, and every offload configuration's step time as a ratio to its
//! bound, printed as a markdown table (or one JSON object). The arguments are checked (exit 2) before the build's GPU support is.

use super::{BenchArgs, CliError};

/// What `--budgets` asks for: fractions of the DiT's bytes in (0, 1], comma-separated, or `none` (only the depth
/// configurations, no budget rows).
pub fn parse_budgets(text: &str) -> Result<Vec<f64>, CliError> {
    let bad = || {
        CliError::invalid(format!(
            "--budgets {text:?}: expected fractions in (0, 1] separated by commas, e.g. 0.25,0.5,0.75, or none for \
             no budget rows"
        ))
    };
    let text_trim = text.trim();
    if text_trim.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    text_trim
        .split(',')
        .map(|f| match f.trim().parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 && v <= 1.0 => Ok(v),
            _ => Err(bad()),
        })
        .collect()
}

/// The checked arguments of `bench`.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedBench {
    /// Presets, in order.
    pub presets: Vec<String>,
    /// `(lo, hi)` steps.
    pub steps: (u32, u32),
    /// Budget fractions (empty: no budget rows).
    pub budgets: Vec<f64>,
    /// Copy-submission modes, each once, in the order given.
    pub copy_submission: Vec<weightferry::config::CopySubmission>,
}

/// Checks `bench`'s arguments: known presets, `--steps LO,HI` with HI > LO, `--rounds` at least 1, `--budgets`
/// as [`parse_budgets`] reads them, at least one configuration besides the resident ones, and no copy-submission
/// mode named twice.
pub fn check_args(a: &BenchArgs) -> Result<CheckedBench, CliError> {
    let presets = if a.preset.is_empty() {
        vec!["flux-dev".to_string(), "wan-14b".to_string(), "qwen-image".to_string()]
    } else {
        a.preset.clone()
    };
    for p in &presets {
        if weightferry::plan::presets::preset(p).is_none() {
            return Err(CliError::invalid(format!("unknown preset '{p}'")));
        }
    }
    let steps = match a.steps.as_slice() {
        [lo, hi] if hi > lo => (*lo, *hi),
        _ => return Err(CliError::invalid("--steps takes two counts LO,HI with HI > LO, e.g. 2,6")),
    };
    if a.rounds == 0 {
        return Err(CliError::invalid("--rounds must be at least 1"));
    }
    let budgets = parse_budgets(&a.budgets)?;
    if budgets.is_empty() && a.depths.is_empty() {
        return Err(CliError::invalid(
            "--budgets none leaves nothing to measure without --depths; give --depths (e.g. 1,2) or budgets",
        ));
    }
    let mut copy_submission: Vec<weightferry::config::CopySubmission> = Vec::new();
    for m in &a.copy_submission {
        let m = (*m).into();
        if copy_submission.contains(&m) {
            return Err(CliError::invalid(format!(
                "--copy-submission names `{}` twice; give each mode once, e.g. actor,hook",
                m.as_str()
            )));
        }
        copy_submission.push(m);
    }
    Ok(CheckedBench { presets, steps, budgets, copy_submission })
}

/// Runs `weightferry bench`; returns the exit code.
pub fn bench(a: &BenchArgs) -> Result<i32, CliError> {
    let checked = check_args(a)?;
    run_checked(a, checked)
}

#[cfg(not(feature = "cuda"))]
fn run_checked(_a: &BenchArgs, _c: CheckedBench) -> Result<i32, CliError> {
    Err(CliError::invalid("bench measures a GPU: rebuild with --features cuda and run it on a machine with a GPU"))
}

#[cfg(feature = "cuda")]
fn run_checked(a: &BenchArgs, c: CheckedBench) -> Result<i32, CliError> {
    use super::emit;
    use crate::bench::gpu::{bench as run_bench, BenchSpec};
    if let Some(dir) = &a.trace {
        std::fs::create_dir_all(dir)
            .map_err(|e| CliError::invalid(format!("--trace: cannot create directory `{}`: {e}", dir.display())))?;
    }
    let spec = BenchSpec {
        presets: c.presets,
        tokens: a.tokens,
        depths: a.depths.clone(),
        budgets: c.budgets,
        sweep: a.sweep,
        steps: c.steps,
        seed: 0,
        trace_dir: a.trace.clone(),
        rounds: a.rounds,
        max_blocks_ahead: a.max_blocks_ahead,
        copy_submission: c.copy_submission,
    };
    let report = run_bench(&spec, &mut |line| eprintln!("{line}"))
        .map_err(|e| CliError::failed(format!("bench failed: {e}")))?;
    if a.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::failed(e.to_string()))?;
        emit(&format!("{text}\n"));
        return Ok(0);
    }
    let gb = |b: f64| b / 1e9;
    let mut out = format!("device: {}\ncopy submission: {}\n\n", report.device, report.copy_submission);
    for (p, bw) in &report.h2d_bytes_per_s {
        let c = report.compute_s.iter().find(|(q, _)| q == p).map_or(0.0, |x| x.1);
        let t = report.tokens.iter().find(|(q, ..)| q == p).map_or(0, |x| x.1);
        out += &format!("{p}: pinned H2D {:.1} GB/s, resident step {:.4} s at {t} tokens\n", gb(*bw), c);
    }
    for (p, w, m, rss, rss_off) in &report.host_memory {
        out += &format!(
            "{p}: weights {:.2} GB, host masters {:.2} GB ({:.3}×), RSS while offloaded {:.2} GB, peak RSS {:.2} GB\n",
            gb(*w as f64),
            gb(*m as f64),
            *m as f64 / (*w).max(1) as f64,
            gb(*rss_off as f64),
            gb(*rss as f64)
        );
    }
    for (p, secs, rss) in &report.enable {
        out += &format!("{p}: enable {secs:.1} s, peak RSS during enable {:.2} GB\n", gb(*rss as f64));
    }
    out += "\n| preset | config | resident blocks | depth | step s | bound s | ratio | GB/step | peak weights GB | planned GB | hook p50 µs | bit-exact |\n";
    out += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
    for r in &report.rows {
        out += &format!(
            "| {} | {} | {} | {} | {:.4} | {:.4} | {:.3} | {:.2} | {:.2} | {:.2} | {:.1} | {} |\n",
            r.preset,
            r.config,
            r.resident_blocks,
            r.depth,
            r.step_s,
            r.bound_s,
            r.ratio,
            gb(r.streamed_bytes_per_step as f64),
            gb(r.peak_weight_bytes as f64),
            gb(r.planned_weight_bytes as f64),
            r.hook_p50_us,
            if r.outputs_match { "yes" } else { "NO" }
        );
    }
    if report.rows.iter().any(|r| r.timeline.is_some()) {
        out += "\nDevice timeline of one traced execution per configuration (DiT window, per step; busy Δ is the DiT \
                compute time against the resident run's; the device-time bound is max(the faster no-copy DiT \
                window, streamed bytes / H2D)):\n\n";
        out += "| preset | config | window ms | device-time ratio to bound | compute busy ms | busy Δ | stalls | stall ms | longest stall ms | copy busy ms | overlap ms |\n";
        out += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
        for r in &report.rows {
            let Some(t) = &r.timeline else { continue };
            let base = report
                .rows
                .iter()
                .find(|q| q.preset == r.preset && q.config == "resident")
                .and_then(|q| q.timeline.as_ref())
                .map_or(t.compute_busy_ms, |q| q.compute_busy_ms);
            let bw = report.h2d_bytes_per_s.iter().find(|(p, _)| *p == r.preset).map_or(0.0, |x| x.1);
            let ratio = device_time_ratio(&report.rows, r, bw);
            out += &format!(
                "| {} | {} | {:.2} | {} | {:.2} | {:+.2}% | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
                r.preset,
                r.config,
                t.window_ms,
                ratio.map_or("–".to_string(), |x| format!("{x:.4}")),
                t.compute_busy_ms,
                (t.compute_busy_ms / base.max(1e-9) - 1.0) * 100.0,
                t.stalls,
                t.stall_ms,
                t.longest_stall_ms,
                t.copy_busy_ms,
                t.overlap_ms
            );
        }
    }
    emit(&out);
    Ok(if report.rows.iter().all(|r| r.outputs_match) { 0 } else { 1 })
}

/// A traced row's DiT window against its device-time bound: `max(the faster DiT window of the no-copy rows
/// (resident placement, every block resident through the backend), streamed bytes per step / H2D bandwidth)`.
/// `None` when the row has no timeline or its preset no traced no-copy row.
#[cfg(feature = "cuda")]
fn device_time_ratio(rows: &[crate::bench::gpu::BenchRow], r: &crate::bench::gpu::BenchRow, bw: f64) -> Option<f64> {
    use crate::bench::gpu::RESIDENT_VIA_BACKEND;
    let t = r.timeline.as_ref()?;
    let compute_ms = rows
        .iter()
        .filter(|q| q.preset == r.preset && (q.config == "resident" || q.config == RESIDENT_VIA_BACKEND))
        .filter_map(|q| q.timeline.as_ref().map(|x| x.window_ms))
        .fold(None, |m: Option<f64>, w| Some(m.map_or(w, |m| m.min(w))))?;
    let copy_ms = if bw > 0.0 { r.streamed_bytes_per_step as f64 / bw * 1e3 } else { 0.0 };
    let bound = compute_ms.max(copy_ms);
    (bound > 0.0).then(|| t.window_ms / bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_fractions_or_none() {
        assert_eq!(parse_budgets("0.25,0.5, 0.75").unwrap(), vec![0.25, 0.5, 0.75]);
        assert_eq!(parse_budgets("1").unwrap(), vec![1.0]);
        assert!(parse_budgets("none").unwrap().is_empty());
        assert!(parse_budgets(" NONE ").unwrap().is_empty());
        for bad in ["", "0", "1.5", "0.5,", "nan", "0.5,none", "-0.25"] {
            let e = parse_budgets(bad).unwrap_err();
            assert_eq!(e.code, 2, "{bad:?}");
            assert_eq!(
                e.message,
                format!(
                    "--budgets {bad:?}: expected fractions in (0, 1] separated by commas, e.g. 0.25,0.5,0.75, or \
                     none for no budget rows"
                ),
                "{bad:?}"
            );
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_device_time_ratio_uses_the_faster_no_copy_window_or_the_copy_time() {
        use crate::bench::gpu::{BenchRow, RESIDENT_VIA_BACKEND};
        use crate::engine::timeline::StepTimeline;
        let row = |config: &str, window_ms: f64, bytes: u64| BenchRow {
            preset: "p".into(),
            config: config.into(),
            strategy: "layer".into(),
            resident_blocks: 0,
            depth: 1,
            budget_bytes: None,
            step_s: 0.0,
            step_samples: vec![],
            bound_s: 0.0,
            ratio: 0.0,
            streamed_bytes_per_step: bytes,
            peak_weight_bytes: 0,
            planned_weight_bytes: 0,
            hook_p50_us: 0.0,
            hook_p99_us: 0.0,
            outputs_match: true,
            timeline: Some(StepTimeline {
                window_ms,
                compute_busy_ms: window_ms,
                stalls: 0.0,
                stall_ms: 0.0,
                longest_stall_ms: 0.0,
                copy_busy_ms: 0.0,
                overlap_ms: 0.0,
                comm_busy_ms: 0.0,
                comm_overlap_ms: 0.0,
                dropped: 0,
                summary: Default::default(),
            }),
        };
        let rows = vec![
            row("resident", 200.0, 0),
            row(RESIDENT_VIA_BACKEND, 100.0, 0),
            row("depth=1", 110.0, 1_000_000), // 1 ms of copies at 1 GB/s: compute-bound
            row("depth=2", 450.0, 400_000_000), // 400 ms of copies: transfer-bound
        ];
        let r = |i: usize| device_time_ratio(&rows, &rows[i], 1e9).unwrap();
        assert!((r(2) - 1.1).abs() < 1e-12);
        assert!((r(3) - 1.125).abs() < 1e-12);
        assert!((r(1) - 1.0).abs() < 1e-12);
        let mut untraced = rows.clone();
        untraced[0].timeline = None;
        untraced[1].timeline = None;
        assert_eq!(device_time_ratio(&untraced, &untraced[2], 1e9), None);
    }
}
