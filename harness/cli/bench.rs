//! `weightferry bench`: the GPU benchmark matrix (see [`crate::bench`]`::gpu`, built with the `cuda` feature): per
//! preset, the resident step time, the pinned H2D bandwidth, and every offload configuration's step time as a ratio
//! to its bound, printed as markdown tables ([`crate::report`]`::bench`) or one JSON object. The arguments are
//! checked (exit 2) before the build's GPU support is.

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

/// Checks `bench`'s arguments: known presets, `--steps LO,HI` with HI > LO, `--budgets`
/// as [`parse_budgets`] reads them, at least one configuration besides the resident ones, and no copy-submission
/// mode named twice.
pub fn check_args(a: &BenchArgs) -> Result<CheckedBench, CliError> {
    let presets = if a.preset.is_empty() {
        vec!["flux-dev".to_string(), "wan-14b".to_string(), "qwen-image".to_string()]
    } else {
        a.preset.clone()
    };
    for p in &presets {
        if weightferry::pipeline::presets::preset(p).is_none() {
            return Err(CliError::invalid(format!("unknown preset '{p}'")));
        }
    }
    let steps = match a.steps.as_slice() {
        [lo, hi] if hi > lo => (*lo, *hi),
        _ => return Err(CliError::invalid("--steps takes two counts LO,HI with HI > LO, e.g. 2,6")),
    };
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
    emit(&crate::report::bench::markdown(&report));
    Ok(if report.rows.iter().all(|r| r.outputs_match) { 0 } else { 1 })
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
}
