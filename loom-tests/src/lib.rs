//! Loom models of the scheduler's ordering invariants.
//!
//! The models live in `tests/` and only compile under `--cfg weightferry_loom`; this library holds the small
//! shared harness they use.
