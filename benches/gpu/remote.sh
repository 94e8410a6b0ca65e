#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the binaries built with `--features cuda` and carried in
# .devbin/ as docs/gpus.md ("A GPU machine without cargo") describes (see benches/gpu/README.md).
# Usage: sh benches/gpu/remote.sh "<bench presets>" [--skip-tests]
# Writes the bench table to $OUT/bench.md (when $OUT is set) and prints a short summary last.
set -u
presets="${1:-flux-dev wan-14b qwen-image}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
nproc; free -g | head -2
if [ "${2:-}" != "--skip-tests" ]; then
  echo "== GPU platform tests"; timeout 120 .devbin/tests/cuda_platform --include-ignored --test-threads=1 2>&1 | tail -2
  echo "== GPU bit-exact tests"; timeout 240 .devbin/tests/gpu_bit_exact --include-ignored --test-threads=1 2>&1 | tail -12
fi
args=""
for p in $presets; do args="$args --preset $p"; done
echo "== bench$args"
timeout 520 .devbin/weightferry bench $args --sweep > "$out/bench.md" 2> "$out/bench.log"
echo "bench exit $?"
tail -5 "$out/bench.log"
cat "$out/bench.md"
