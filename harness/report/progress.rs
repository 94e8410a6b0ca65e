//! Progress of a run, for terminal progress bars: what the [`driver`](crate::drivers::run) reports
//! ([`RunObserver`]: host masters built at `enable`, DiT steps completed on the device), the [`StepWatch`] that
//! follows the device, and the `indicatif` bars of `weightferry run` ([`RunBars`]).
//!
//! Steps follow the device, not the host: the engine's host thread only enqueues kernels and copies and may run
//! many blocks ahead, so its progress calls would report steps early. At the start of each DiT step after the first,
//! and when the DiT phase ends, [`StepWatch`] records an event on the engine's compute stream; a watcher thread
//! polls those events in order and reports step `k` complete when its event completed, i.e. when every kernel
//! enqueued before it (and so every copy they waited on) has run.
//!
//! Bars are drawn only on a terminal stderr, never with `--json`, and only once the work is expected to take about
//! a second ([`draw_bar`]); until then they exist hidden.

use crate::drivers::compare::RunStage;
use crate::engine::math::Phase;
use crate::engine::Progress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weightferry::scheduler::{EventId, PlatformRef, StreamId};

/// What a progress display is told while a run goes on (from the driver's thread and the step watcher's).
pub trait RunObserver: Send + Sync + std::fmt::Debug {
    /// `enable` of the offloaded run has built `done` of `total` bytes of host masters.
    fn masters(&self, done: u64, total: u64);
    /// The device has completed `done` of the `total` DiT steps of `stage`'s execution (`done = 0`: it started).
    fn steps(&self, stage: RunStage, done: u32, total: u32);
    /// Time passes while the device works on a step (called every [`POLL`] while waiting).
    fn tick(&self) {}
}

/// How often the step watcher looks at the device while a step runs.
pub const POLL: Duration = Duration::from_millis(50);

/// A step boundary sent to the watcher: the event that completes it (`None`: already complete).
struct Mark {
    event: Option<EventId>,
    stage: RunStage,
    done: u32,
    total: u32,
}

/// Marks DiT step boundaries on the engine's compute stream and reports each step to the observer once the device
/// completed it. Without an observer it does nothing (records no event, starts no thread).
pub struct StepWatch {
    platform: PlatformRef,
    stream: StreamId,
    tx: Option<mpsc::Sender<Mark>>,
    worker: Option<JoinHandle<()>>,
    /// The stage being watched and the steps marked so far.
    at: Option<(RunStage, u32, u32)>,
}

impl std::fmt::Debug for StepWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepWatch").field("active", &self.tx.is_some()).field("at", &self.at).finish()
    }
}

/// The DiT steps an execution has finished on the host when it reports `p`: none during the encoders, `p.step`
/// at the start of DiT step `p.step`, all of them once the VAE starts.
pub fn steps_before(p: &Progress<'_>) -> u32 {
    match p.phase {
        Phase::Encoder => 0,
        Phase::Dit => p.step,
        Phase::Vae => p.steps,
    }
}

impl StepWatch {
    /// A watch over `stream` (the engine's compute stream) reporting to `observer`.
    pub fn new(platform: PlatformRef, stream: StreamId, observer: Option<Arc<dyn RunObserver>>) -> StepWatch {
        let mut w = StepWatch { platform: platform.clone(), stream, tx: None, worker: None, at: None };
        let Some(observer) = observer else { return w };
        let (tx, rx) = mpsc::channel::<Mark>();
        let spawned = std::thread::Builder::new().name("wf-progress".into()).spawn(move || {
            for m in rx {
                if let Some(e) = m.event {
                    let done = loop {
                        match platform.event_query(e) {
                            Ok(true) => break true,
                            Ok(false) => {
                                observer.tick();
                                std::thread::sleep(POLL);
                            }
                            Err(_) => break false,
                        }
                    };
                    let _ = platform.destroy_event(e);
                    if !done {
                        // The stream failed: the run fails too, and reports no further progress.
                        continue;
                    }
                }
                observer.steps(m.stage, m.done, m.total);
            }
        });
        // Without a watcher thread the run goes on without progress.
        if let Ok(worker) = spawned {
            w.tx = Some(tx);
            w.worker = Some(worker);
        }
        w
    }

    /// Called with every progress report of the engine: marks the steps finished on the host since the last call.
    pub fn observe(&mut self, stage: RunStage, p: Progress<'_>) {
        let Some(tx) = &self.tx else { return };
        let (marked, total) = match self.at {
            Some((s, marked, total)) if s == stage => (marked, total),
            previous => {
                // A new execution: the one before it returned after reading back its output, so it is complete.
                if let Some((s, marked, total)) = previous {
                    if marked < total {
                        let _ = tx.send(Mark { event: None, stage: s, done: total, total });
                    }
                }
                let _ = tx.send(Mark { event: None, stage, done: 0, total: p.steps });
                (0, p.steps)
            }
        };
        let done = steps_before(&p).min(total);
        self.at = Some((stage, marked.max(done), total));
        if done > marked {
            if let Some(event) = self.record() {
                let _ = tx.send(Mark { event: Some(event), stage, done, total });
            }
        }
    }

    /// A fresh event recorded on the stream (`None` if the platform refused: progress is best-effort).
    fn record(&self) -> Option<EventId> {
        let e = self.platform.create_event().ok()?;
        if self.platform.record_event(e, self.stream).is_err() {
            let _ = self.platform.destroy_event(e);
            return None;
        }
        Some(e)
    }

    /// The current execution returned successfully: reports it complete, then waits for the watcher to drain.
    pub fn finish(&mut self) {
        if let (Some(tx), Some((stage, marked, total))) = (&self.tx, self.at.take()) {
            if marked < total {
                let _ = tx.send(Mark { event: None, stage, done: total, total });
            }
        }
        self.stop();
    }

    fn stop(&mut self) {
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for StepWatch {
    /// Stops the watcher (after it saw every recorded event complete) without reporting the execution complete.
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long work must be expected to take for its bar to be drawn.
pub const BAR_AFTER: Duration = Duration::from_secs(1);

/// Whether a progress bar is drawn: never with `--json` or when stderr is not a terminal; otherwise once the work
/// is expected to take at least [`BAR_AFTER`].
pub fn draw_bar(json: bool, stderr_is_terminal: bool, expected: Duration) -> bool {
    !json && stderr_is_terminal && expected >= BAR_AFTER
}

/// The expected duration of work that has done `done` of `total` units after `elapsed`: `elapsed · total / done`;
/// before any progress (or past the end) `elapsed` itself, a lower bound.
pub fn expected_duration(elapsed: Duration, done: u64, total: u64) -> Duration {
    if done == 0 || done >= total {
        return elapsed;
    }
    elapsed.mul_f64(total as f64 / done as f64)
}

/// One bar: hidden until [`draw_bar`] says otherwise.
#[derive(Debug)]
struct Bar {
    bar: ProgressBar,
    started: Instant,
    shown: bool,
}

/// The bars of `weightferry run`: one for the host masters `enable` builds (bytes), one for the DiT steps of the
/// current execution (resident, then offloaded). Made only when a bar could ever be drawn ([`RunBars::for_stderr`]).
#[derive(Debug)]
pub struct RunBars {
    json: bool,
    terminal: bool,
    target: fn() -> ProgressDrawTarget,
    masters: Mutex<Option<Bar>>,
    steps: Mutex<Option<(RunStage, Bar)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl RunBars {
    /// The bars for stderr, or `None` when no bar could be drawn (`--json`, or stderr is not a terminal).
    pub fn for_stderr(json: bool, stderr_is_terminal: bool) -> Option<Arc<RunBars>> {
        draw_bar(json, stderr_is_terminal, Duration::MAX)
            .then(|| Arc::new(RunBars::with_target(json, stderr_is_terminal, ProgressDrawTarget::stderr)))
    }

    /// Bars drawn to `target` once shown (tests pass a hidden target).
    pub fn with_target(json: bool, terminal: bool, target: fn() -> ProgressDrawTarget) -> RunBars {
        RunBars { json, terminal, target, masters: Mutex::new(None), steps: Mutex::new(None) }
    }

    /// Whether the masters bar and the steps bar are shown now.
    pub fn shown(&self) -> (bool, bool) {
        let m = lock(&self.masters).as_ref().is_some_and(|b| b.shown);
        let s = lock(&self.steps).as_ref().is_some_and(|(_, b)| b.shown);
        (m, s)
    }

    fn new_bar(template: &str, total: u64, prefix: String) -> Bar {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden()).with_prefix(prefix);
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        Bar { bar, started: Instant::now(), shown: false }
    }

    /// Shows `b` if its work is now expected to take long enough.
    fn reveal(&self, b: &mut Bar) {
        let expected = expected_duration(b.started.elapsed(), b.bar.position(), b.bar.length().unwrap_or(0));
        if !b.shown && draw_bar(self.json, self.terminal, expected) {
            b.bar.set_draw_target((self.target)());
            b.shown = true;
        }
    }

    /// Removes every bar from the terminal.
    pub fn clear(&self) {
        if let Some(b) = lock(&self.masters).take() {
            b.bar.finish_and_clear();
        }
        if let Some((_, b)) = lock(&self.steps).take() {
            b.bar.finish_and_clear();
        }
    }
}

impl RunObserver for RunBars {
    fn masters(&self, done: u64, total: u64) {
        let mut m = lock(&self.masters);
        let b = m.get_or_insert_with(|| {
            Self::new_bar(
                "{prefix} [{bar:30}] {binary_bytes}/{binary_total_bytes} ({eta})",
                total,
                "enable: building host masters".into(),
            )
        });
        b.bar.set_position(done);
        self.reveal(b);
        if done >= total {
            if let Some(b) = m.take() {
                b.bar.finish_and_clear();
            }
        }
    }

    fn steps(&self, stage: RunStage, done: u32, total: u32) {
        let mut s = lock(&self.steps);
        if s.as_ref().is_none_or(|(st, _)| *st != stage) {
            if let Some((_, old)) = s.take() {
                old.bar.finish_and_clear();
            }
            let b = Self::new_bar(
                "{prefix} [{bar:30}] {pos}/{len} steps ({elapsed})",
                u64::from(total),
                format!("{} run", stage.name()),
            );
            *s = Some((stage, b));
        }
        if let Some((_, b)) = s.as_mut() {
            b.bar.set_position(u64::from(done));
            self.reveal(b);
            if done >= total {
                b.bar.finish_and_clear();
            }
        }
    }

    fn tick(&self) {
        if let Some((_, b)) = lock(&self.steps).as_mut() {
            self.reveal(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_are_drawn_only_on_a_terminal_without_json_and_for_work_of_a_second_or_more() {
        let long = Duration::from_secs(1);
        let short = Duration::from_millis(999);
        assert!(draw_bar(false, true, long));
        assert!(!draw_bar(false, true, short));
        assert!(!draw_bar(true, true, long));
        assert!(!draw_bar(false, false, long));
        assert!(!draw_bar(true, false, Duration::MAX));
        assert!(RunBars::for_stderr(true, true).is_none());
        assert!(RunBars::for_stderr(false, false).is_none());
        assert!(RunBars::for_stderr(false, true).is_some());
    }

    #[test]
    fn expected_duration_scales_elapsed_by_the_work_left() {
        let s = Duration::from_millis(300);
        assert_eq!(expected_duration(s, 0, 8), s);
        assert_eq!(expected_duration(s, 1, 4), Duration::from_millis(1200));
        assert_eq!(expected_duration(s, 3, 4), Duration::from_millis(400));
        assert_eq!(expected_duration(s, 4, 4), s);
        assert_eq!(expected_duration(s, 0, 0), s);
    }

    #[test]
    fn steps_before_counts_finished_dit_steps() {
        let p = |phase, step| Progress { phase, component: "c", step, steps: 4 };
        assert_eq!(steps_before(&p(Phase::Encoder, 0)), 0);
        assert_eq!(steps_before(&p(Phase::Dit, 0)), 0);
        assert_eq!(steps_before(&p(Phase::Dit, 3)), 3);
        assert_eq!(steps_before(&p(Phase::Vae, 0)), 4);
    }

    #[derive(Debug, Default)]
    struct Seen(Mutex<Vec<(RunStage, u32, u32)>>);
    impl RunObserver for Seen {
        fn masters(&self, _: u64, _: u64) {}
        fn steps(&self, stage: RunStage, done: u32, total: u32) {
            lock(&self.0).push((stage, done, total));
        }
    }

    fn wait_for(seen: &Seen, n: usize) -> Vec<(RunStage, u32, u32)> {
        let t0 = Instant::now();
        while lock(&seen.0).len() < n && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        lock(&seen.0).clone()
    }

    #[test]
    fn steps_are_reported_when_the_device_completes_them_not_when_the_host_enqueues() {
        use weightferry::scheduler::{SimConfig, SimPlatform};
        let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
        let platform: PlatformRef = sim.clone();
        let stream = platform.create_stream("compute").unwrap();
        let seen = Arc::new(Seen::default());
        let mut watch = StepWatch::new(platform, stream, Some(seen.clone()));
        let p = |phase, step| Progress { phase, component: "c", step, steps: 2 };
        use RunStage::{Offloaded, Resident};
        watch.observe(Resident, p(Phase::Encoder, 0));
        let (gate, rx) = mpsc::channel::<()>();
        sim.launch(stream, "step 0", vec![], Box::new(move |_| rx.recv().map_err(|e| e.to_string()))).unwrap();
        watch.observe(Resident, p(Phase::Dit, 0));
        watch.observe(Resident, p(Phase::Dit, 1));
        std::thread::sleep(4 * POLL);
        // The host is in step 1; the device is still in step 0.
        assert_eq!(wait_for(&seen, 1), vec![(Resident, 0, 2)]);
        gate.send(()).unwrap();
        assert_eq!(wait_for(&seen, 2), vec![(Resident, 0, 2), (Resident, 1, 2)]);
        watch.observe(Resident, p(Phase::Vae, 0));
        // The offloaded execution starts after the resident one returned; it fails, so it is never reported done.
        watch.observe(Offloaded, p(Phase::Dit, 0));
        let want = vec![(Resident, 0, 2), (Resident, 1, 2), (Resident, 2, 2), (Offloaded, 0, 2)];
        assert_eq!(wait_for(&seen, 4), want);
        drop(watch); // joins the watcher: nothing more is reported
        assert_eq!(lock(&seen.0).clone(), want);
        // A finished execution is reported complete.
        let seen = Arc::new(Seen::default());
        let mut watch = StepWatch::new(sim.clone(), stream, Some(seen.clone()));
        watch.observe(Offloaded, p(Phase::Dit, 0));
        watch.finish();
        assert_eq!(lock(&seen.0).clone(), vec![(Offloaded, 0, 2), (Offloaded, 2, 2)]);
        // Without an observer nothing is recorded.
        let mut idle = StepWatch::new(sim.clone(), stream, None);
        idle.observe(Offloaded, p(Phase::Vae, 0));
        assert!(idle.tx.is_none() && idle.worker.is_none());
    }

    #[test]
    fn a_bar_is_shown_once_its_work_is_expected_to_last_a_second() {
        let bars = RunBars::with_target(false, true, ProgressDrawTarget::hidden);
        bars.steps(RunStage::Resident, 0, 100);
        assert_eq!(bars.shown(), (false, false));
        std::thread::sleep(Duration::from_millis(20));
        // 1 of 100 steps after 20 ms: about 2 s expected.
        bars.steps(RunStage::Resident, 1, 100);
        assert_eq!(bars.shown(), (false, true));
        bars.masters(0, 10);
        bars.masters(10, 10);
        assert_eq!(bars.shown(), (false, true));
        // A new execution starts a new, hidden bar.
        bars.steps(RunStage::Offloaded, 0, 100);
        assert_eq!(bars.shown(), (false, false));
        bars.clear();
        let never = RunBars::with_target(true, true, ProgressDrawTarget::hidden);
        never.steps(RunStage::Resident, 0, 100);
        std::thread::sleep(Duration::from_millis(20));
        never.steps(RunStage::Resident, 1, 100);
        assert_eq!(never.shown(), (false, false));
    }
}
