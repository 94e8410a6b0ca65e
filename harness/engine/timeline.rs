//! Device timelines of the GPU engine: spans (stream lane, label, start, end) as the CUDA platform's timing events
//! measured them, summarised into where a DiT pass spends its time, and written as a Chrome / Perfetto trace.
//!
//! The summary answers the questions a missed benchmark target raises: was the compute stream ever idle inside the
//! DiT window (a copy or, in a distributed run, an AllGather arrived late: a *stall*), and did the compute itself
//! take longer than in the resident run (copies and collectives contending with kernels for memory bandwidth and
//! SMs). Everything here is pure arithmetic on spans, so it is tested on the CPU; the spans come from
//! `platform::cuda::timeline` on a GPU, through a [`DeviceTracer`] (both in the library's `platform::timeline`).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
pub use weightferry::platform::timeline::{DeviceSpan, DeviceTracer, COMM_LANE, COMPUTE_LANE, COPY_LANE};
use weightferry::scheduler::{PlatformError, StreamId};

/// Gaps on the compute lane shorter than this are launch gaps, not stalls.
pub const STALL_THRESHOLD_US: f64 = 20.0;

/// Where the time of a window of compute spans went.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimelineSummary {
    /// From the first selected compute span's start to the last one's end, µs.
    pub window_us: f64,
    /// Time the compute lane was busy inside the window (union of its spans), µs.
    pub compute_busy_us: f64,
    /// Sum of the compute lane's gaps of at least [`STALL_THRESHOLD_US`] inside the window, µs.
    pub stall_us: f64,
    /// Number of such gaps.
    pub stalls: usize,
    /// Longest such gap, µs.
    pub longest_stall_us: f64,
    /// Time the copy lane was busy inside the window (union of its spans), µs.
    pub copy_busy_us: f64,
    /// Time both lanes were busy, µs.
    pub overlap_us: f64,
    /// Selected compute spans.
    pub kernels: usize,
    /// Copy spans inside the window.
    pub copies: usize,
    /// Time the comm lane was busy inside the window (union of its spans), µs; an AllGather span runs from its
    /// kernel's start, which may wait on the device for the peers, to its end.
    pub comm_busy_us: f64,
    /// Time the compute and comm lanes were both busy, µs.
    pub comm_overlap_us: f64,
    /// Collective spans inside the window.
    pub collectives: usize,
}

/// A traced execution's DiT window per step, as the reports print it (from a [`TimelineSummary`] of `steps` steps).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepTimeline {
    /// DiT window (first DiT kernel start to last DiT kernel end), ms per step.
    pub window_ms: f64,
    /// Compute stream busy inside it, ms per step.
    pub compute_busy_ms: f64,
    /// Compute-stream gaps of at least [`STALL_THRESHOLD_US`] per step (a copy or an AllGather arriving late).
    pub stalls: f64,
    /// Their total, ms per step.
    pub stall_ms: f64,
    /// The longest, ms.
    pub longest_stall_ms: f64,
    /// Copy stream busy inside the window, ms per step.
    pub copy_busy_ms: f64,
    /// Copies and compute both busy, ms per step.
    pub overlap_ms: f64,
    /// AllGathers busy inside the window, ms per step (0 without collectives).
    #[serde(default)]
    pub comm_busy_ms: f64,
    /// AllGathers and compute both busy, ms per step.
    #[serde(default)]
    pub comm_overlap_ms: f64,
    /// Spans dropped for want of timing events (0 unless the pool was too small).
    pub dropped: u64,
    /// The raw summary of the whole traced execution.
    pub summary: TimelineSummary,
}

impl StepTimeline {
    /// `summary` of an execution of `steps` steps (at least 1 is assumed), per step.
    pub fn per_step(summary: TimelineSummary, steps: u32, dropped: u64) -> Self {
        let n = f64::from(steps.max(1));
        StepTimeline {
            window_ms: summary.window_us / 1e3 / n,
            compute_busy_ms: summary.compute_busy_us / 1e3 / n,
            stalls: summary.stalls as f64 / n,
            stall_ms: summary.stall_us / 1e3 / n,
            longest_stall_ms: summary.longest_stall_us / 1e3,
            copy_busy_ms: summary.copy_busy_us / 1e3 / n,
            overlap_ms: summary.overlap_us / 1e3 / n,
            comm_busy_ms: summary.comm_busy_us / 1e3 / n,
            comm_overlap_ms: summary.comm_overlap_us / 1e3 / n,
            dropped,
            summary,
        }
    }
}

/// Runs `run` with `tracer` armed (`capacity` spans, origin on `stream`) and returns its result with the recorded
/// spans and the number dropped. The timeline is collected — and so disarmed — whether `run` succeeded or not; `run`'s
/// error comes first.
pub fn trace_execution<T, E: From<PlatformError>>(
    tracer: &dyn DeviceTracer,
    stream: StreamId,
    capacity: usize,
    run: impl FnOnce() -> Result<T, E>,
) -> Result<(T, Vec<DeviceSpan>, u64), E> {
    tracer.arm(stream, capacity)?;
    let out = run();
    let collected = tracer.collect();
    let out = out?;
    let (spans, dropped) = collected?;
    Ok((out, spans, dropped))
}

/// Whether a kernel label (a module path) is one of `roots` or inside one of them (`dit` holds `dit.blocks.0`,
/// not `dit2.x`): the selection of a component's window for [`summarize`].
pub fn in_modules(label: &str, roots: &[String]) -> bool {
    roots.iter().any(|r| label.strip_prefix(r.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('.')))
}

/// Union of intervals, sorted and merged.
fn merged(mut v: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    v.retain(|(a, b)| b > a);
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn clipped(v: &[(f64, f64)], lo: f64, hi: f64) -> Vec<(f64, f64)> {
    v.iter().map(|&(a, b)| (a.max(lo), b.min(hi))).filter(|(a, b)| b > a).collect()
}

fn length(v: &[(f64, f64)]) -> f64 {
    v.iter().map(|(a, b)| b - a).sum()
}

/// Total length of the intersection of two merged interval lists.
fn intersection(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

/// Summarises the compute spans for which `select(label)` holds (e.g. the DiT's modules) and the copies inside
/// their window. An empty selection gives the default (all zero) summary.
pub fn summarize(spans: &[DeviceSpan], select: impl Fn(&str) -> bool) -> TimelineSummary {
    let compute: Vec<(f64, f64)> =
        spans.iter().filter(|s| s.lane == COMPUTE_LANE && select(&s.label)).map(|s| (s.start_us, s.end_us)).collect();
    let kernels = compute.len();
    let compute = merged(compute);
    let (Some(first), Some(last)) = (compute.first(), compute.last()) else { return TimelineSummary::default() };
    let (lo, hi) = (first.0, last.1);
    let lane_in = |lane: &str| -> Vec<(f64, f64)> {
        let raw: Vec<(f64, f64)> = spans.iter().filter(|s| s.lane == lane).map(|s| (s.start_us, s.end_us)).collect();
        clipped(&raw, lo, hi)
    };
    let copies_in = lane_in(COPY_LANE);
    let copies = copies_in.len();
    let copy = merged(copies_in);
    let comm_in = lane_in(COMM_LANE);
    let collectives = comm_in.len();
    let comm = merged(comm_in);
    let (mut stall_us, mut stalls, mut longest) = (0.0, 0, 0.0f64);
    for w in compute.windows(2) {
        let gap = w[1].0 - w[0].1;
        if gap >= STALL_THRESHOLD_US {
            stall_us += gap;
            stalls += 1;
            longest = longest.max(gap);
        }
    }
    TimelineSummary {
        window_us: hi - lo,
        compute_busy_us: length(&compute),
        stall_us,
        stalls,
        longest_stall_us: longest,
        copy_busy_us: length(&copy),
        overlap_us: intersection(&compute, &copy),
        kernels,
        copies,
        comm_busy_us: length(&comm),
        comm_overlap_us: intersection(&compute, &comm),
        collectives,
    }
}

/// The spans as a Chrome / Perfetto trace: one thread per lane (compute first), complete (`"X"`) events.
pub fn to_chrome_json(spans: &[DeviceSpan], process: &str) -> Value {
    let mut lanes: Vec<&str> = vec![COMPUTE_LANE];
    for s in spans {
        if !lanes.contains(&s.lane.as_str()) {
            lanes.push(&s.lane);
        }
    }
    let mut events: Vec<Value> = vec![json!({"ph": "M", "pid": 1, "name": "process_name", "args": {"name": process}})];
    for (tid, lane) in lanes.iter().enumerate() {
        events.push(json!({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": lane}}));
    }
    for s in spans {
        let tid = lanes.iter().position(|l| *l == s.lane).unwrap_or(0);
        events.push(json!({
            "ph": "X", "pid": 1, "tid": tid, "name": s.label, "cat": s.lane,
            "ts": s.start_us, "dur": (s.end_us - s.start_us).max(0.0),
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(lane: &str, label: &str, a: f64, b: f64) -> DeviceSpan {
        DeviceSpan { lane: lane.into(), label: label.into(), start_us: a, end_us: b }
    }

    #[test]
    fn stalls_busy_time_and_overlap_are_measured_inside_the_selected_window() {
        let spans = vec![
            span(COMPUTE_LANE, "encoder.0", 0.0, 50.0),
            span(COMPUTE_LANE, "dit.blocks.0", 100.0, 200.0),
            span(COMPUTE_LANE, "dit.blocks.1", 205.0, 300.0), // 5 µs launch gap: not a stall
            span(COMPUTE_LANE, "dit.blocks.2", 400.0, 450.0), // 100 µs stall
            span(COMPUTE_LANE, "vae", 500.0, 900.0),
            span(COPY_LANE, "h2d 1", 20.0, 150.0),  // clipped to 100..150
            span(COPY_LANE, "h2d 2", 250.0, 420.0), // 250..420
            span(COPY_LANE, "h2d 3", 600.0, 700.0), // outside the window
        ];
        let s = summarize(&spans, |l| l.starts_with("dit."));
        assert_eq!(s.window_us, 350.0);
        assert_eq!(s.compute_busy_us, 245.0);
        assert_eq!(s.stalls, 1);
        assert_eq!(s.stall_us, 100.0);
        assert_eq!(s.longest_stall_us, 100.0);
        assert_eq!(s.copy_busy_us, 50.0 + 170.0);
        // Overlap: 100..150 (50) + 250..300 (50) + 400..420 (20).
        assert_eq!(s.overlap_us, 120.0);
        assert_eq!((s.kernels, s.copies), (3, 2));
    }

    #[test]
    fn collectives_are_measured_on_their_own_lane_inside_the_window() {
        let spans = vec![
            span(COMPUTE_LANE, "dit.blocks.0", 100.0, 200.0),
            span(COMPUTE_LANE, "dit.blocks.1", 300.0, 400.0), // 100 µs stall: the AllGather below ends at 300
            span(COMM_LANE, "allgather 1", 50.0, 120.0),      // clipped to 100..120
            span(COMM_LANE, "allgather 2", 150.0, 300.0),
            span(COMM_LANE, "allgather 3", 250.0, 260.0), // inside the previous one: counted once
            span(COMM_LANE, "allgather 4", 450.0, 500.0), // outside the window
            span(COPY_LANE, "h2d 1", 110.0, 160.0),
        ];
        let s = summarize(&spans, |l| l.starts_with("dit."));
        assert_eq!((s.window_us, s.compute_busy_us, s.stalls, s.stall_us), (300.0, 200.0, 1, 100.0));
        assert_eq!(s.comm_busy_us, 20.0 + 150.0);
        // Compute and comm both busy: 100..120 and 150..200.
        assert_eq!(s.comm_overlap_us, 20.0 + 50.0);
        assert_eq!(s.collectives, 3);
        assert_eq!((s.copy_busy_us, s.overlap_us, s.copies), (50.0, 50.0, 1));
    }

    #[test]
    fn labels_select_whole_module_paths_and_summaries_convert_per_step() {
        let roots = vec!["dit".to_string(), "transformer_2".to_string()];
        assert!(
            in_modules("dit", &roots) && in_modules("dit.blocks.0", &roots) && in_modules("transformer_2.x", &roots)
        );
        assert!(!in_modules("dit2.blocks.0", &roots) && !in_modules("encoder.dit", &roots) && !in_modules("", &roots));
        let s = TimelineSummary {
            window_us: 4000.0,
            compute_busy_us: 3000.0,
            stall_us: 800.0,
            stalls: 6,
            longest_stall_us: 500.0,
            copy_busy_us: 3600.0,
            overlap_us: 2400.0,
            kernels: 10,
            copies: 20,
            comm_busy_us: 1000.0,
            comm_overlap_us: 600.0,
            collectives: 8,
        };
        let t = StepTimeline::per_step(s.clone(), 2, 1);
        assert_eq!(
            (t.window_ms, t.compute_busy_ms, t.stalls, t.stall_ms, t.longest_stall_ms),
            (2.0, 1.5, 3.0, 0.4, 0.5)
        );
        assert_eq!(
            (t.copy_busy_ms, t.overlap_ms, t.comm_busy_ms, t.comm_overlap_ms, t.dropped),
            (1.8, 1.2, 0.5, 0.3, 1)
        );
        assert_eq!(t.summary, s);
        assert_eq!(StepTimeline::per_step(TimelineSummary::default(), 0, 0).window_ms, 0.0);
    }

    /// Records the calls; `arm` fails when asked to.
    #[derive(Default)]
    struct Recorder {
        calls: std::sync::Mutex<Vec<&'static str>>,
        fail_arm: bool,
    }

    impl DeviceTracer for Recorder {
        fn arm(&self, _stream: StreamId, _capacity: usize) -> Result<(), PlatformError> {
            self.calls.lock().unwrap().push("arm");
            if self.fail_arm {
                return Err(PlatformError::Driver("no events".into()));
            }
            Ok(())
        }
        fn collect(&self) -> Result<(Vec<DeviceSpan>, u64), PlatformError> {
            self.calls.lock().unwrap().push("collect");
            Ok((vec![span(COMPUTE_LANE, "dit.a", 0.0, 1.0)], 2))
        }
    }

    #[test]
    fn a_traced_execution_is_collected_whether_it_succeeds_or_not() {
        let r = Recorder::default();
        let (out, spans, dropped) =
            trace_execution(&r, StreamId(0), 8, || Ok::<_, PlatformError>(7)).expect("traced run");
        assert_eq!((out, spans.len(), dropped), (7, 1, 2));
        let e = trace_execution(&r, StreamId(0), 8, || Err::<(), _>(PlatformError::Driver("run failed".into())));
        assert_eq!(e.unwrap_err().to_string(), PlatformError::Driver("run failed".into()).to_string());
        assert_eq!(*r.calls.lock().unwrap(), ["arm", "collect", "arm", "collect"]);
        // A tracer that cannot arm runs nothing and collects nothing.
        let f = Recorder { fail_arm: true, ..Default::default() };
        let ran = std::cell::Cell::new(false);
        let e = trace_execution(&f, StreamId(0), 8, || {
            ran.set(true);
            Ok::<_, PlatformError>(())
        });
        assert!(e.is_err() && !ran.get());
        assert_eq!(*f.calls.lock().unwrap(), ["arm"]);
    }

    #[test]
    fn overlapping_spans_on_one_lane_count_once() {
        let spans = vec![
            span(COMPUTE_LANE, "dit.a", 0.0, 10.0),
            span(COMPUTE_LANE, "dit.b", 5.0, 30.0),
            span(COPY_LANE, "h2d", 0.0, 20.0),
            span(COPY_LANE, "h2d", 10.0, 25.0),
        ];
        let s = summarize(&spans, |_| true);
        assert_eq!((s.window_us, s.compute_busy_us, s.copy_busy_us, s.overlap_us), (30.0, 30.0, 25.0, 25.0));
        assert_eq!(s.stalls, 0);
    }

    #[test]
    fn an_empty_selection_summarises_to_zero() {
        let spans = vec![span(COPY_LANE, "h2d", 0.0, 20.0)];
        assert_eq!(summarize(&spans, |_| true), TimelineSummary::default());
    }

    #[test]
    fn the_chrome_trace_has_one_thread_per_lane_and_one_event_per_span() {
        let spans = vec![span(COPY_LANE, "h2d 8", 1.0, 3.0), span(COMPUTE_LANE, "dit.blocks.0", 2.0, 5.0)];
        let v = to_chrome_json(&spans, "flux-dev depth=1");
        let ev = v["traceEvents"].as_array().unwrap();
        let x: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 2);
        assert_eq!(x[0]["tid"], 1);
        assert_eq!(x[0]["dur"], 2.0);
        assert_eq!(x[1]["tid"], 0);
        assert_eq!(x[1]["name"], "dit.blocks.0");
        let names: Vec<&str> =
            ev.iter().filter(|e| e["name"] == "thread_name").map(|e| e["args"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["compute", "copy"]);
    }
}
