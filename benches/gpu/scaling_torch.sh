#!/usr/bin/env bash
# Distributed layerwise offload of a real diffusers transformer from PyTorch at 1, 2, 4 and 8 GPUs (issue 16's
# scaling table), from the repository root, with the wheels (the package's, diffusers) built and carried in .whl/
# as docs/gpus.md ("A GPU machine without cargo") describes (the package's wheel has NCCL: maturin enables `nccl`).
# One torchrun job per GPU count up to the GPUs present (benches/torch/dist_bench.py: each rank binds the model from one
# checkpoint written in the first job, holds 1/N of every block, and measures every term of its bound).
#
# Usage: bash benches/gpu/scaling_torch.sh [model] [counts]     (default flux-dev, "1 2 4 8")
# Writes $OUT/scaling-<model>.log (else /tmp) and prints each job's table.
set -u
model="${1:-flux-dev}"
counts="${2:-1 2 4 8}"
out="${OUT:-/tmp}"
log="$out/scaling-$model.log"
: > "$log"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$log" 2>&1 || { echo "installing .whl/ failed (see $log)"; exit 2; }
export PYTHONPATH=/tmp/site
gpus=$(nvidia-smi -L | wc -l)
steps=5; [ "$model" = wan-14b ] && steps=2
status=0
for n in $counts; do
  [ "$n" -le "$gpus" ] || continue
  echo "== $n GPU(s)" | tee -a "$log"
  timeout 400 torchrun --standalone --nproc-per-node "$n" benches/torch/dist_bench.py --model "$model" \
    --steps "$steps" --warmup 1 --out /tmp/wf-dist-bench >> "$log" 2>&1 || { echo "failed (see $log)"; status=1; }
done
grep -A10 "^$model, " "$log" | grep -v "^--$"
exit $status
