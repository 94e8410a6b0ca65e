//! What `weightferry bench` prints without `--json`: the host-side figures of each preset, one markdown row per
//! measured configuration, and, for traced runs, where the DiT time went.

use crate::bench::gpu::{BenchReport, BenchRow, RESIDENT_VIA_BACKEND};

/// The whole report as markdown: the device, each preset's H2D bandwidth, resident step, host memory and enable
/// time, the table of configurations, and the timeline table when any configuration was traced.
pub fn markdown(report: &BenchReport) -> String {
    let mut out = presets(report);
    out += &rows_table(report);
    if report.rows.iter().any(|r| r.timeline.is_some()) {
        out += &timeline_table(report);
    }
    out
}

/// The device and the per-preset figures.
fn presets(report: &BenchReport) -> String {
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
    out
}

/// One row per configuration: step time, bound, ratio, bytes and whether it was bit-exact.
fn rows_table(report: &BenchReport) -> String {
    let gb = |b: f64| b / 1e9;
    let mut out = String::new();
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
    out
}

/// Where the DiT time went in each traced configuration.
fn timeline_table(report: &BenchReport) -> String {
    let mut out = String::new();
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
    out
}

/// A traced row's DiT window against its device-time bound: `max(the faster DiT window of the no-copy rows
/// (resident placement, every block resident through the backend), streamed bytes per step / H2D bandwidth)`.
/// `None` when the row has no timeline or its preset no traced no-copy row.
fn device_time_ratio(rows: &[BenchRow], r: &BenchRow, bw: f64) -> Option<f64> {
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
    fn the_device_time_ratio_uses_the_faster_no_copy_window_or_the_copy_time() {
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
