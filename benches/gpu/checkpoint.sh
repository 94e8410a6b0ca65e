#!/usr/bin/env bash
# Mapped against pinned checkpoint masters on one GPU (issue 15's benchmark), from the repository root, with the
# wheels (the package's, diffusers) built and carried in .whl/ as docs/gpus.md ("A GPU machine without cargo")
# describes (the run installs them into /tmp/site) and, for part (3), `.devbin/weightferry` built with
# `--features cuda` and staged the same way.
#
# Usage: bash benches/gpu/checkpoint.sh [model]        (default flux-dev)
#
# (1) the CUDA tests of the package (test_cuda.py, test_checkpoint.py; test_distributed.py's 2-GPU test runs where
# two GPUs are lent); (2) benches/torch/diffusers_bench.py with the variants resident and ck_<pinned|mapped>_<d2|b50>:
# the transformer's full-size safetensors file is written on this machine's disk in the same call, then loaded with
# `enable(..., checkpoint=PATH)` on a meta module; the table gives start to first step, the time to read the file
# once, anonymous and file-backed RSS, pinned and mapped bytes, and step time against the resident one; (3) the
# reference engine over the same file: `weightferry run --checkpoint PATH --platform cuda`.
# The checkpoint (24 GB for flux-dev) and the bench's files go to /tmp/wf-ck; the log, checkpoint.log, to $OUT (else
# to /tmp/wf-ck too), so a device call brings back only the log. Fits one 600 s call on flux-dev.
set -u
model="${1:-flux-dev}"
out=/tmp/wf-ck
mkdir -p "$out" "${OUT:-$out}"
log="${OUT:-$out}/checkpoint.log"
export PYTHONUNBUFFERED=1
: > "$log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$log" 2>&1 || { echo "installing .whl/ failed (see $log)"; exit 2; }
export PYTHONPATH=/tmp/site
status=0
echo "== tests" | tee -a "$log"
dist=""
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && dist=python/tests/test_distributed.py
WEIGHTFERRY_BIN=.devbin/weightferry timeout 100 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda.py \
  python/tests/test_checkpoint.py $dist 2>&1 | tail -30 | tee -a "$log" || status=1
echo "== bench ($model)" | tee -a "$log"
timeout 420 python3 benches/torch/diffusers_bench.py --model "$model" --steps 3 --warmup 1 --out "$out" \
  --variants resident,ck_pinned_d2,ck_mapped_d2,ck_pinned_b50,ck_mapped_b50 >> "$log" 2>&1 || status=1
if [ -x .devbin/weightferry ]; then
  echo "== reference engine over the file" | tee -a "$log"
  timeout 150 .devbin/weightferry run --checkpoint "$out/checkpoint.safetensors" --platform cuda --steps 2 \
    2>&1 | grep -E "host masters|outputs match|step|error" | tee -a "$log" || status=1
fi
# The tables last.
sed -n '/^variant /,$p' "$log"
exit $status
