#!/usr/bin/env bash
# NCCL tests and the block-rebuild benchmark, on the GPU machine, from the repository root, with the binaries built
# with `--features nccl` and carried in .devbin/ as docs/gpus.md ("A GPU machine without cargo") describes (needed:
# .devbin/weightferry and .devbin/tests/nccl_collective; .devbin/tests/cuda_platform too if present).
#
# Usage: bash benches/gpu/nccl.sh [--skip-tests] [--skip-bench] [-- extra bench-gather arguments]
#
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is exported for everything below. The multi-GPU tests use
# every visible GPU (one thread per GPU in one process) and skip with a note below 2 GPUs. The bench runs world = 1
# and world = number of visible GPUs. Writes $OUT/nccl-tests.log, $OUT/bench-gather.md, $OUT/bench-gather.json and
# $OUT/bench-gather.log when $OUT is set (else /tmp), and prints a summary last.
set -u
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
out="${OUT:-/tmp}"
skip_tests=0
skip_bench=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) skip_tests=1 ;;
    --skip-bench) skip_bench=1 ;;
    --) shift; break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -6
ls -l "$(ldconfig -p | awk '/libnccl\.so /{print $NF; exit}')" 2>/dev/null || echo "libnccl.so: not in ldconfig cache"
status=0
if [ "$skip_tests" = 0 ]; then
  if [ -x .devbin/tests/cuda_platform ]; then
    echo "== CUDA platform tests"
    timeout 60 .devbin/tests/cuda_platform --include-ignored --test-threads=1 2>&1 | tail -2
  fi
  echo "== NCCL tests (--include-ignored, one test at a time)"
  timeout 180 .devbin/tests/nccl_collective --include-ignored --test-threads=1 --nocapture > "$out/nccl-tests.log" 2>&1
  rc=$?
  grep -E "^test |NOTE|panicked|^    [a-z_0-9]+$|test result" "$out/nccl-tests.log" | tail -30
  echo "nccl tests exit $rc"
  [ "$rc" = 0 ] || status=1
fi
if [ "$skip_bench" = 0 ]; then
  echo "== bench-gather $*"
  timeout 330 .devbin/weightferry bench-gather --json-out "$out/bench-gather.json" "$@" \
    > "$out/bench-gather.md" 2> "$out/bench-gather.log"
  rc=$?
  echo "bench-gather exit $rc"
  tail -25 "$out/bench-gather.log"
  cat "$out/bench-gather.md"
  [ "$rc" = 0 ] || status=1
fi
exit $status
