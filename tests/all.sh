#!/usr/bin/env sh
# Runs every test of the workspace: unit, integration and property tests, then the loom models.
# Usage (from the repository root): sh tests/all.sh
set -eu
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets
# The CUDA / NCCL modules' unit tests that need no GPU (config structs, the symmetric heap's bookkeeping).
cargo test -p weightferry --features nccl --lib platform::cuda::
# The peer benchmark's pure-Python parts (shape export, table merge); its torch tests skip without torch.
if command -v python3 > /dev/null; then
  python3 benches/peers/test_peers.py
fi
# Loom models run the production scheduler code under `--cfg weightferry_loom`, in their own target dir so the
# cfg change does not invalidate the ordinary build.
RUSTFLAGS="--cfg weightferry_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}" \
  cargo test -p weightferry-loom --release --target-dir target/loom -- --test-threads=2
