#!/usr/bin/env bash
# One call on the GPU machine, from the repository root: weightferry's bench and the peer benchmark (diffusers group
# offloading, accelerate sequential offload, PyTorch resident) on the same machine, then one merged markdown table.
#
#   sh benches/peers/compare.sh ["flux-dev wan-14b"]
#
# Needs .devbin/weightferry (built with --features cuda, see benches/gpu/README.md) and .whl/diffusers-0.42.1-py3-none-any.whl
# (see benches/peers/README.md); carry both. Environment (defaults = the small matrix, ~9 min for flux-dev + wan-14b):
#   OURS_ARGS  extra `weightferry bench` args  (default: --steps 1,3 --depths 1 --budgets 0.25,0.5,0.75)
#   PEER_ARGS  extra peer_bench.py args        (default: --steps 2 --warmup 1)
#   BUDGET_S   seconds for the whole script     (default 560); later stages are skipped, never the table
#   PEER_MIN_S seconds of each preset's share kept for the peers (default 90); ours gets the rest
#   WF_BIN     weightferry binary (default .devbin/weightferry)
#   WEIGHTS    "preset:weight ..." share of the time per preset (default flux-dev:2 wan-14b:3 qwen-image:3)
# Writes to $OUT (or /tmp/peers-out): ours-<preset>.json, peers-<preset>.json, run.log, table.md.
set -u
cd "$(dirname "$0")/../.." || exit 1
presets="${1:-flux-dev wan-14b}"
out="${OUT:-/tmp/peers-out}"
mkdir -p "$out"
log="$out/run.log"
: > "$log"
start=$(date +%s)
deadline=$((start + ${BUDGET_S:-560}))
ours_args="${OURS_ARGS:---steps 1,3 --depths 1 --budgets 0.25,0.5,0.75}"
peer_args="${PEER_ARGS:---steps 2 --warmup 1}"
weights="${WEIGHTS:-flux-dev:2 wan-14b:3 qwen-image:3}"
bin="${WF_BIN:-.devbin/weightferry}"
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2
python3 -c 'import torch, diffusers, accelerate; print("torch", torch.__version__, "diffusers", diffusers.__version__, "accelerate", accelerate.__version__)' \
  || { echo "python packages missing"; exit 1; }
echo "== byte check: peer model vs weightferry plan"
python3 benches/peers/check_shapes.py --weightferry "$bin" $presets || { echo "byte check failed"; exit 1; }

weight_of() { for w in $weights; do [ "${w%%:*}" = "$1" ] && { echo "${w##*:}"; return; }; done; echo 2; }
total_w=0
for p in $presets; do total_w=$((total_w + $(weight_of "$p"))); done
ours_files=""; peer_files=""
for p in $presets; do
  now=$(date +%s)
  left=$((deadline - now))
  w=$(weight_of "$p")
  share=$((left * w / total_w))
  total_w=$((total_w - w))
  pdeadline=$((now + share))
  # ours first, bounded so that PEER_MIN_S (default 90 s) of the preset's share is left for the peers (time that a
  # preset leaves unused goes to the next one)
  ours_limit=$((share - ${PEER_MIN_S:-90}))
  [ "$ours_limit" -lt $((share / 2)) ] && ours_limit=$((share / 2))
  echo "== $p: ${share} s (ours at most ${ours_limit} s): $bin bench --preset $p $ours_args --json"
  if [ "$ours_limit" -gt 30 ]; then
    timeout "$ours_limit" "$bin" bench --preset "$p" $ours_args --json > "$out/ours-$p.json" 2>> "$log"
    rc=$?
    echo "ours exit $rc ($(( $(date +%s) - now )) s)"
    [ "$rc" -eq 0 ] || tail -3 "$log"
    [ "$rc" -eq 0 ] && ours_files="$ours_files --ours $out/ours-$p.json"
  else
    echo "ours skipped: too little time left"
  fi
  echo "== $p: peer_bench.py $peer_args (until $(( pdeadline - $(date +%s) )) s from now)"
  python3 benches/peers/peer_bench.py --preset "$p" $peer_args --weightferry "$bin" --deadline "$pdeadline" \
    --json "$out/peers-$p.json" 2>> "$log" | tail -n +2
  echo "peers exit ${PIPESTATUS[0]} ($(( $(date +%s) - now )) s for $p)"
  [ -s "$out/peers-$p.json" ] && peer_files="$peer_files --peers $out/peers-$p.json"
done
echo "== table ($(( $(date +%s) - start )) s)"
python3 benches/peers/table.py $ours_files $peer_files --out "$out/table.md"
