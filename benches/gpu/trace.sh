#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with `.devbin/` built with `--features cuda` and carried as
# docs/gpus.md ("A GPU machine without cargo") describes (keep .devbin/weightferry, .devbin/tests/cuda_platform and
# .devbin/tests/gpu_bit_exact). Runs the GPU tests, then the traced benchmarks that explain the compute-bound (Wan-14B)
# figures: device timelines of every configuration, interleaved rounds, and the same run with the host's run-ahead
# bounded (hook latency without driver back-pressure). Writes tables, logs, an `nvidia-smi dmon` log (power, clocks) and
# the traces (one tarball) under $OUT; prints the tables last.
set -u
out="${OUT:-/tmp/wf-out}"; mkdir -p "$out"
tr=/tmp/wf-traces; mkdir -p "$tr"
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv,noheader
nvidia-smi dmon -s pc -d 1 > "$out/dmon.txt" 2>&1 &
dmon=$!
echo "== GPU platform tests"; timeout 120 .devbin/tests/cuda_platform --include-ignored --test-threads=1 2>&1 | tail -3
echo "== GPU bit-exact tests"; timeout 300 .devbin/tests/gpu_bit_exact --include-ignored --test-threads=1 2>&1 | tail -12
run() { # name, args...
  n=$1; shift
  echo "== bench $n: $*"
  timeout 400 .devbin/weightferry bench "$@" > "$out/$n.md" 2> "$out/$n.log"; echo "exit $?"
}
run wan-trace --preset wan-14b --steps 1,3 --depths 1,4 --budgets 0.75 --rounds 3 --trace "$tr/wan"
run wan-ahead2 --preset wan-14b --steps 1,2 --depths 4 --budgets 0.75 --max-blocks-ahead 2
run flux-trace --preset flux-dev --steps 1,3 --depths 1,4 --budgets 0.75 --rounds 2 --trace "$tr/flux"
kill $dmon 2>/dev/null
tar czf "$out/traces.tgz" -C /tmp wf-traces
for n in wan-trace wan-ahead2 flux-trace; do echo "### $n"; cat "$out/$n.md"; done
