#!/usr/bin/env sh
# Runs every test of the workspace: unit, integration and property tests, then the loom models.
# Usage (from the repository root): sh tests/all.sh
set -eu
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets
# The doc examples (`--all-targets` leaves them out): the session's, and README.md's Rust quick start, compiled and
# run as a doctest of the library (src/lib.rs).
cargo test --workspace --doc
# The CUDA / NCCL modules' unit tests that need no GPU (config structs, the symmetric heap's bookkeeping).
cargo test -p weightferry --features nccl --lib platform::cuda::
# The Python package (python/): install its test dependencies (torch, diffusers, transformers, pytest, maturin) into
# .venv-py/ (a few seconds once they are there), build weightferry._core with maturin and run its tests against the
# CLI. A dependency that cannot be installed is an error here, never a skip.
sh python/install-test-deps.sh
if ! .venv-py/bin/python -c "import torch, diffusers, transformers, pytest, maturin" 2> /dev/null; then
  echo "error: .venv-py/ lacks torch, diffusers, transformers, pytest or maturin after installing them;" \
    "see python/install-test-deps.sh" >&2
  exit 1
fi
# target/debug/weightferry is the CLI `cargo test --workspace --all-targets` built above.
VIRTUAL_ENV="$PWD/.venv-py" .venv-py/bin/maturin develop --quiet -m python/Cargo.toml
WEIGHTFERRY_BIN="$PWD/target/debug/weightferry" .venv-py/bin/python -m pytest -q python/tests
# The peer benchmark's pure-Python parts (shape export, table merge); its torch tests skip without torch.
if command -v python3 > /dev/null; then
  python3 benches/peers/test_peers.py
fi
# The deliberately broken orderings (`OrderingFault`, actors/src/block_stack/faults.rs) exist only in builds with
# `--cfg weightferry_broken`; elsewhere a stack asking for one is refused. The tests proving that the checks can fail
# run here, in their own target dir (the cfg change would otherwise rebuild the ordinary one), limited to the test
# targets that hold them.
RUSTFLAGS="--cfg weightferry_broken" \
  cargo test -p weightferry-actors --target-dir target/broken --test scheduler --test scheduler_props --test gather_stack \
    --test reader
RUSTFLAGS="--cfg weightferry_broken" \
  cargo test -p weightferry-harness --target-dir target/broken --test cli --test run_bit_exact -- checks_can_fail failed_checks
# Loom models run the production scheduler code under `--cfg weightferry_loom`, in their own target dir so the
# cfg change does not invalidate the ordinary build. `--cfg weightferry_broken` compiles in the broken variants
# (`broken_*`, which prove each model can fail) in the same build; the correct models run with
# `OrderingFault::None`, where every fault point takes its production branch.
RUSTFLAGS="--cfg weightferry_loom --cfg weightferry_broken" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}" \
  cargo test -p weightferry-loom --release --target-dir target/loom -- --test-threads=2
