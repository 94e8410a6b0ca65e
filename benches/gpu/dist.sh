#!/usr/bin/env bash
# Distributed layerwise vs single-GPU layerwise (issue 6), on a 2-GPU machine, from the repository root, with the
# binary built with `--features nccl` and carried in .devbin/ as docs/gpus.md ("A GPU machine without cargo")
# describes (needed: .devbin/weightferry).
#
# Usage: bash benches/gpu/dist.sh [presets]        (default "flux-dev wan-14b")
#        SKIP_SINGLE=1 bash benches/gpu/dist.sh      (the distributed runs only)
#        DIST_ARGS="--allgather-engine kernel" bash benches/gpu/dist.sh   (extra `run` arguments)
#
# Per preset: (1) the timed distributed run, 2 ranks (one process per GPU, NCCL), depth 2, one AllGather per block
# section (the default; 64 MiB chunks measured 5-10% slower on flux-dev, benches/RESULTS.md):
# `weightferry launch --nproc 2 -- run --platform cuda --time-steps LO,HI --time-rounds 3 --trace F` (the median of
# 3 rounds; each rank also traces
# one more LO-step execution: a timeline table per rank at the end; traces in /tmp/dist-trace); (2) single-GPU layerwise of
# the same preset on GPU 0: `weightferry bench --steps LO,HI --depths 1,2 --budgets none`. Steps: 1,3 for flux,
# 1,2 for wan-14b (2.9 s per step). Each command has its own timeout; the whole script stays under ~560 s.
# NCCL_NVLS_ENABLE=0 (NVLink multicast off) is exported; launch adds NCCL_MAX_NCHANNELS=4 unless set.
# Writes $OUT/dist-<preset>.json (rank 0's report), $OUT/bench-<preset>.json and one log, $OUT/dist.log (every
# command's stderr and every rank's other output, in order), when $OUT is set (else /tmp): 2 files per preset plus
# the log, inside the device tool's 8 returned files for up to 3 presets. Prints a table last (python3; without it,
# the raw reports).
set -u
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
out="${OUT:-/tmp}"
presets="${1:-flux-dev wan-14b}"
wf=.devbin/weightferry
[ -x "$wf" ] || { echo "$wf missing: build it with --features nccl and carry .devbin (docs/gpus.md)"; exit 2; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -3
nproc; free -g | head -2
log="$out/dist.log"
: > "$log"
config=/tmp/weightferry-dist-config.json
cat > "$config" <<'EOF'
{"data_parallel_size": 2, "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
 "layer_options": {"dit": {"weight_transfer": "allgather", "prefetch_depth": 2}}}}
EOF
status=0
start=$SECONDS
for p in $presets; do
  case "$p" in
    wan-14b) steps=1,2; tdist=280; tbench=150 ;;
    *) steps=1,3; tdist=130; tbench=90 ;;
  esac
  echo "== $p: distributed, 2 ranks, depth 2, whole sections, --time-steps $steps (timeout $tdist s)"
  t0=$SECONDS
  raw="$(mktemp /tmp/dist-raw.XXXXXX)"
  echo "== $p distributed" >> "$log"
  mkdir -p /tmp/dist-trace
  timeout "$tdist" "$wf" launch --nproc 2 -- run --platform cuda --preset "$p" --config "$config" \
    --time-steps "$steps" --time-rounds 3 --trace "/tmp/dist-trace/$p.json" ${DIST_ARGS:-} --json > "$raw" 2>> "$log"
  rc=$?
  # Rank 0's report; NCCL's own lines (its version banner) and the other ranks' output go to the log.
  sed -n 's/^\[rank 0\] //p' "$raw" | grep -v '^NCCL ' > "$out/dist-$p.json"
  grep -v '^\[rank 0\] [{} "]' "$raw" >> "$log"
  rm -f "$raw"
  echo "distributed $p exit $rc ($((SECONDS - t0)) s)"
  tail -4 "$log"
  [ "$rc" = 0 ] || status=1
  if [ -n "${SKIP_SINGLE:-}" ]; then
    continue
  fi
  echo "== $p: single GPU (GPU 0), bench --steps $steps --depths 1,2 --budgets none (timeout $tbench s)"
  t0=$SECONDS
  echo "== $p bench" >> "$log"
  CUDA_VISIBLE_DEVICES=0 timeout "$tbench" "$wf" bench --preset "$p" --steps "$steps" --depths 1,2 --budgets none \
    --json > "$out/bench-$p.json" 2>> "$log"
  rc=$?
  echo "bench $p exit $rc ($((SECONDS - t0)) s)"
  tail -3 "$log"
  [ "$rc" = 0 ] || status=1
done
echo "== total $((SECONDS - start)) s"
if command -v python3 > /dev/null; then
  python3 - "$out" $presets <<'EOF'
import json, sys
out, presets = sys.argv[1], sys.argv[2:]
def load(path):
    # The first JSON value of the file: NCCL may print its version line after rank 0's report.
    try:
        with open(path) as f:
            return json.JSONDecoder().raw_decode(f.read().lstrip())[0]
    except Exception as e:
        print(f"({path}: {e})")
        return None
gb = lambda b: f"{b / 1e9:.2f}"
num = lambda x, d=4: "n/a" if x is None else f"{x:.{d}f}"
print("| preset | run | step s | compute s | H2D GB/s | GB copied/step per GPU | bound s | ratio | "
      "single-GPU bound s | step / single-GPU bound | bit-exact |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for p in presets:
    d, b = load(f"{out}/dist-{p}.json"), load(f"{out}/bench-{p}.json")
    dist_step = None
    if d and d.get("timing"):
        t = d["timing"]
        dist_step = t["step_s"]
        bw = t["h2d_bytes_per_s"]
        chunk = f"{d['chunk_bytes'] / 2**20:g} MiB chunks" if d.get("chunk_bytes") else "one AllGather per section"
        chunk += f", {d.get('allgather_engine', '?')} AllGather"
        print(f"| {p} | 2 GPUs, depth {d['depth']}, {chunk} (group) | {num(t['step_s'])} | "
              f"{num(t['compute_s'])} | {num(bw and bw / 1e9, 1)} | {gb(t['shard_bytes_per_step'])} | "
              f"{num(t['bound_s'])} | {num(t['ratio'], 3)} | {num(t['single_gpu_bound_s'])} | "
              f"{num(t['ratio_to_single_gpu_bound'], 3)} | {'yes' if d['outputs_match'] and d['hazard_violations'] == 0 else 'NO'} |")
        for r in d["ranks"]:
            rt = r["timing"]
            rbw = rt["h2d_bytes_per_s"]
            print(f"| {p} | rank {r['rank']} | {num(rt['step_s'])} | {num(rt['resident_step_s'])} | "
                  f"{num(rbw and rbw / 1e9, 1)} | {gb(rt['shard_bytes_per_step'])} | {num(rt['bound_s'])} | "
                  f"{num(rt['ratio'], 3)} | {num(rt['single_gpu_bound_s'])} | – | {'yes' if r['bit_exact'] else 'NO'} |")
    single = {}
    if b:
        bw = dict((k, v) for k, v in b["h2d_bytes_per_s"]).get(p)
        compute = dict((k, v) for k, v in b["compute_s"]).get(p)
        for r in b["rows"]:
            if r["preset"] != p or r["config"] == "resident":
                continue
            single[r["config"]] = r["step_s"]
            print(f"| {p} | 1 GPU, {r['config']} | {num(r['step_s'])} | {num(compute)} | {num(bw and bw / 1e9, 1)} | "
                  f"{gb(r['streamed_bytes_per_step'])} | {num(r['bound_s'])} | {num(r['ratio'], 3)} | – | – | "
                  f"{'yes' if r['outputs_match'] else 'NO'} |")
    if dist_step and single.get("depth=2"):
        print(f"| {p} | 1 GPU depth=2 step / 2 GPUs step | {single['depth=2'] / dist_step:.3f} × | | | | | | | | |")
print()
print("| preset | rank | shard masters GB | DiT host GB while running | AllGathers | between symmetric windows | "
      "restore AllGathers | bit-exact |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for p in presets:
    d = load(f"{out}/dist-{p}.json")
    for r in (d or {}).get("ranks", []):
        print(f"| {p} | {r['rank']} | {gb(r['shard_host_bytes'])} | {gb(r.get('dit_host_bytes_while_running', 0))} | "
              f"{r['all_gathers']} | {r.get('windowed_all_gathers', 0)} | {r.get('restore_all_gathers', 0)} | "
              f"{'yes' if r['bit_exact'] else 'NO'} |")
print()
print("| preset | rank | traced steps | DiT window ms/step | compute busy ms | stalls/step | stall ms | longest stall ms | "
      "shard copies ms (beside compute) | AllGathers ms (beside compute) | dropped |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for p in presets:
    d = load(f"{out}/dist-{p}.json")
    for r in (d or {}).get("ranks", []):
        t = r.get("timeline")
        if not t:
            continue
        print(f"| {p} | {r['rank']} | {t['steps']} | {t['window_ms']:.2f} | {t['compute_busy_ms']:.2f} | "
              f"{t['stalls']:.1f} | {t['stall_ms']:.2f} | {t['longest_stall_ms']:.2f} | "
              f"{t['copy_busy_ms']:.2f} ({t['overlap_ms']:.2f}) | {t['comm_busy_ms']:.2f} ({t['comm_overlap_ms']:.2f}) | "
              f"{t['dropped']} |")
EOF
else
  for p in $presets; do cat "$out/dist-$p.json"; done
fi
exit $status
