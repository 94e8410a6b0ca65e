//! Timing figures of the drivers and benchmarks.
//!
//! Per-step figures come from two executions of the same pipeline with `lo` and `hi` DiT steps: the difference
//! removes everything an execution does once (encoders, VAE, the first, cold step), so `(t_hi − t_lo) / (hi − lo)`
//! is the time of one step and the same difference of a byte counter is the bytes of one step. The single-GPU bench
//! (`engine::gpu`), the distributed timing mode (`distributed_run`) and the gather bench all use these, so their
//! figures are comparable. Also here: hook-latency percentiles and milliseconds, as the reports print them.

use super::{Engine, EngineError, ExecOptions, ExecOutput, Progress};
use std::time::{Duration, Instant};
use weightferry::hooks::HookRegistry;
use weightferry::offload::{BackendReport, WeightSource};

/// Milliseconds of `d`.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile of sorted durations, in microseconds (0 for no samples).
pub fn percentile_us(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1e6
}

/// The median and 99th percentile ([`percentile_us`]) of hook latencies in any order, µs.
pub fn hook_percentiles_us(latencies: &[Duration]) -> (f64, f64) {
    let mut sorted = latencies.to_vec();
    sorted.sort();
    (percentile_us(&sorted, 50.0), percentile_us(&sorted, 99.0))
}

/// Host → device bytes the backend's block stacks copied: the counter per-step bytes are taken from.
pub fn stack_h2d_bytes(report: &BackendReport) -> u64 {
    report.stacks.iter().map(|s| s.h2d_bytes).sum()
}

/// Runs one execution and its wall time on the host, from the call until the output was read back.
pub fn timed_execution(
    engine: &Engine,
    source: &dyn WeightSource,
    hooks: &HookRegistry,
    opts: &ExecOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<(Duration, ExecOutput), EngineError> {
    let t = Instant::now();
    let out = engine.execute(source, hooks, opts, progress)?;
    Ok((t.elapsed(), out))
}

/// `(t_hi − t_lo) / (hi − lo)` in seconds (0 when `hi <= lo`).
pub fn step_seconds((lo, hi): (u32, u32), t_lo: Duration, t_hi: Duration) -> f64 {
    if hi <= lo {
        return 0.0;
    }
    (t_hi.as_secs_f64() - t_lo.as_secs_f64()) / f64::from(hi - lo)
}

/// Per-step bytes from counter readings before the `lo` execution (`b0`), between the executions (`b1`) and after
/// the `hi` execution (`b2`): `((b2 − b1) − (b1 − b0)) / (hi − lo)`.
pub fn bytes_per_step((lo, hi): (u32, u32), b0: u64, b1: u64, b2: u64) -> u64 {
    let d = u64::from(hi.saturating_sub(lo)).max(1);
    (b2.saturating_sub(b1)).saturating_sub(b1.saturating_sub(b0)) / d
}

/// What [`time_rounds`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Timed<T> {
    /// `(lo, hi)` steps.
    pub steps: (u32, u32),
    /// The rounds (the median round's wall times, the spread).
    pub rounds: TimedRounds,
    /// The last `hi` execution's result.
    pub out: T,
    /// Per-step bytes of the counter, from the first round ([`bytes_per_step`]).
    pub bytes_per_step: u64,
}

impl<T> Timed<T> {
    /// Seconds per step of the median round ([`step_seconds`]).
    pub fn step_s(&self) -> f64 {
        step_seconds(self.steps, self.rounds.lo, self.rounds.hi)
    }
}

/// Runs `rounds` rounds of `lo` then `hi` steps through `run` (one execution: its wall time and output), reading
/// `counter` (a byte counter) before, between and after the first round's two executions.
pub fn time_rounds<T, E>(
    steps: (u32, u32),
    rounds: u32,
    run: impl Fn(u32) -> Result<(Duration, T), E>,
    counter: impl Fn() -> u64,
) -> Result<Timed<T>, E> {
    let b0 = counter();
    let (t_lo, _) = run(steps.0)?;
    let b1 = counter();
    let (t_hi, mut out) = run(steps.1)?;
    let b2 = counter();
    let rounds = more_rounds(steps, (t_lo, t_hi), rounds, &run, &mut out)?;
    Ok(Timed { steps, rounds, out, bytes_per_step: bytes_per_step(steps, b0, b1, b2) })
}

/// Timed executions repeated in rounds: each round runs `lo` then `hi` steps, and gives one step time
/// ([`step_seconds`]) from its pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedRounds {
    /// Wall time of the `lo` execution of the median round (the round whose step time is the median).
    pub lo: Duration,
    /// Wall time of its `hi` execution.
    pub hi: Duration,
    /// Rounds run.
    pub rounds: u32,
    /// Shortest step time of a round, s.
    pub step_min_s: f64,
    /// Longest step time of a round, s.
    pub step_max_s: f64,
}

/// Runs rounds 2..=`rounds` of alternating `lo` / `hi` executions through `run` after the `first` round's wall
/// times (the caller ran it, to read its counters around it); keeps the last `hi` output in `output` and returns
/// the median round ([`median`]'s convention: the upper middle for an even count) and the spread.
pub fn more_rounds<T, E>(
    steps: (u32, u32),
    first: (Duration, Duration),
    rounds: u32,
    run: impl Fn(u32) -> Result<(Duration, T), E>,
    output: &mut T,
) -> Result<TimedRounds, E> {
    let mut pairs = vec![first];
    for _ in 1..rounds.max(1) {
        let (lo, _) = run(steps.0)?;
        let (hi, out) = run(steps.1)?;
        *output = out;
        pairs.push((lo, hi));
    }
    let step_s: Vec<f64> = pairs.iter().map(|&(lo, hi)| step_seconds(steps, lo, hi)).collect();
    let mid = median(step_s.clone());
    let (lo, hi) = pairs[step_s.iter().position(|&s| s == mid).unwrap_or(0)];
    Ok(TimedRounds {
        lo,
        hi,
        rounds: pairs.len() as u32,
        step_min_s: step_s.iter().copied().fold(f64::INFINITY, f64::min),
        step_max_s: step_s.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    })
}

/// The median of repeated measurements: the middle value, the upper of the two middle values for an even count
/// (the slower of two runs: a benchmark claim should not rest on the luckier one); 0 for none.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_rounds_alternate_lo_and_hi_and_keep_the_median_round() {
        let ms = Duration::from_millis;
        // Round k's executions take (10 + k) ms and (10 + k + 2 · step_k) ms: steps 5, 1, 3, 4 ms for rounds 0..4.
        let step_ms = [5u64, 1, 3, 4];
        let calls = std::cell::RefCell::new(Vec::new());
        let run = |n: u32| -> Result<(Duration, u32), ()> {
            let mut c = calls.borrow_mut();
            c.push(n);
            let round = (c.len() - 1) / 2 + 1; // calls 0-1 are round 1, 2-3 round 2, … (round 0 is `first`)
            let base = 10 + round as u64;
            Ok(if n == 1 {
                (ms(base), 100 + round as u32)
            } else {
                (ms(base + 2 * step_ms[round]), 200 + round as u32)
            })
        };
        let mut out = 200;
        let r = more_rounds((1, 3), (ms(10), ms(20)), 4, run, &mut out).unwrap();
        assert_eq!(*calls.borrow(), vec![1, 3, 1, 3, 1, 3]);
        assert_eq!(out, 203, "the last hi output");
        assert_eq!((r.rounds, r.step_min_s, r.step_max_s), (4, 0.001, 0.005));
        // Steps sorted: 1, 3, 4, 5 ms: the upper middle is round 3 (4 ms).
        assert_eq!((r.lo, r.hi), (ms(13), ms(21)));
        let one = more_rounds((1, 3), (ms(10), ms(20)), 1, |_| Err::<(Duration, u32), ()>(()), &mut out).unwrap();
        assert_eq!((one.lo, one.hi, one.rounds, one.step_min_s), (ms(10), ms(20), 1, 0.005));
        assert_eq!(
            more_rounds((1, 3), (ms(10), ms(20)), 2, |_| Err::<(Duration, u32), _>("boom"), &mut out),
            Err("boom")
        );
    }

    #[test]
    fn percentiles_are_nearest_rank_over_the_sorted_latencies() {
        let us = Duration::from_micros;
        assert_eq!(percentile_us(&[], 50.0), 0.0);
        assert_eq!(percentile_us(&[us(1), us(2), us(3), us(4)], 50.0), 2.0);
        assert_eq!(percentile_us(&[us(1), us(2), us(3), us(4)], 99.0), 4.0);
        assert_eq!(percentile_us(&[us(7)], 0.0), 7.0);
        // Any order: sorted first.
        assert_eq!(hook_percentiles_us(&[us(30), us(10), us(20)]), (20.0, 30.0));
        assert_eq!(hook_percentiles_us(&[]), (0.0, 0.0));
        assert_eq!(ms(Duration::from_micros(1500)), 1.5);
    }

    #[test]
    fn time_rounds_reads_the_counter_around_the_first_round_and_keeps_the_last_hi_output() {
        let ms = Duration::from_millis;
        let calls = std::cell::RefCell::new(Vec::new());
        let counter = std::cell::Cell::new(0u64);
        // Each execution copies 10 bytes once plus 5 per step; `lo` takes 10 ms + 1 ms per step, `hi` 10 + 2.
        let run = |n: u32| -> Result<(Duration, usize), ()> {
            calls.borrow_mut().push(n);
            counter.set(counter.get() + 10 + 5 * u64::from(n));
            let per_step = if calls.borrow().len() <= 2 { 1 } else { 2 };
            Ok((ms(10 + per_step * u64::from(n)), calls.borrow().len()))
        };
        let reads = std::cell::RefCell::new(Vec::new());
        let read = || {
            reads.borrow_mut().push(counter.get());
            counter.get()
        };
        let t = time_rounds((1, 3), 2, run, read).unwrap();
        assert_eq!(*calls.borrow(), vec![1, 3, 1, 3]);
        assert_eq!(*reads.borrow(), vec![0, 15, 40], "before, between and after the first round only");
        assert_eq!(t.bytes_per_step, 5);
        assert_eq!(t.out, 4, "the last hi execution's");
        assert_eq!((t.steps, t.rounds.rounds), ((1, 3), 2));
        // Round steps: 1 ms and 2 ms; the upper middle of two is the second round (12 ms, 16 ms).
        assert_eq!((t.rounds.lo, t.rounds.hi), (ms(12), ms(16)));
        assert!((t.step_s() - 0.002).abs() < 1e-12, "{}", t.step_s());
        assert_eq!(time_rounds((1, 3), 1, |_| Err::<(Duration, ()), _>("boom"), || 0), Err("boom"));
    }

    #[test]
    fn median_of_an_odd_and_an_even_count() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 4.0);
        assert_eq!(median(vec![]), 0.0);
    }

    #[test]
    fn bytes_per_step_removes_what_both_executions_copy_once() {
        // lo = 1 step: 10 once + 5 per step; hi = 3 steps: 10 once + 15.
        assert_eq!(bytes_per_step((1, 3), 100, 115, 140), 5);
        assert_eq!(bytes_per_step((2, 2), 0, 10, 20), 0);
    }
}
