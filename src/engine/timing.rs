//! Per-step figures of the benchmarks, derived from two executions of the same pipeline with `lo` and `hi` DiT
//! steps: the difference removes everything an execution does once (encoders, VAE, the first, cold step), so
//! `(t_hi − t_lo) / (hi − lo)` is the time of one step and the same difference of a byte counter is the bytes of
//! one step. The single-GPU bench (`engine::gpu`), the distributed timing mode (`offload::distributed_backend`) and
//! the gather bench all use these, so their figures are comparable.

use std::time::Duration;

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
