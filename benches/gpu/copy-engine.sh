#!/usr/bin/env bash
# NCCL's copy-engine AllGather against the kernel AllGather, on a 2-GPU machine, from the repository root, with the
# binary built with `--features nccl` and carried in .devbin/ as docs/gpus.md ("A GPU machine without cargo")
# describes (needed: .devbin/weightferry).
#
# Usage: bash benches/gpu/copy-engine.sh [preset]        (default flux-dev)
#
# (1) `bench-gather --worlds 2 --modes gather --chunk-mib 0,64` (block rebuild rate, then GEMMs beside whole-block
# transfers) with the kernel AllGather and with `--nccl-copy-engine`; (2) the distributed run of the preset
# (`launch --nproc 2 -- run --platform cuda --time-steps 1,3 --time-rounds 3 --trace`, depth 2, one AllGather per
# section) with `--allgather-engine kernel` and `copy-engine`, each rank logging how many AllGathers went between
# symmetric windows. NCCL_NVLS_ENABLE=0 throughout.
# Writes to $OUT (else /tmp): ge-{kernel,ce}.json, dist-{kernel,ce}.json, traces of rank 0, and copy-engine.log.
set -u
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
out="${OUT:-/tmp}"
preset="${1:-flux-dev}"
wf=.devbin/weightferry
[ -x "$wf" ] || { echo "$wf missing: build it with --features nccl and carry .devbin (docs/gpus.md)"; exit 2; }
log="$out/copy-engine.log"
: > "$log"
status=0
for v in kernel ce; do
  flag=""; [ "$v" = ce ] && flag="--nccl-copy-engine"
  echo "== bench-gather $v" | tee -a "$log"
  timeout 150 "$wf" bench-gather --worlds 2 --modes gather --chunk-mib 0,64 --compute-chunk-mib 0 --repeats 1 \
    --gemm-iters 200 $flag --json > "$out/ge-$v.json" 2>> "$log"
  echo "bench-gather $v exit $?" | tee -a "$log"
done
config=/tmp/weightferry-ce-config.json
cat > "$config" <<'JSON'
{"data_parallel_size": 2, "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
 "layer_options": {"dit": {"weight_transfer": "allgather", "prefetch_depth": 2}}}}
JSON
for v in kernel ce; do
  flag="--allgather-engine kernel"; [ "$v" = ce ] && flag="--allgather-engine copy-engine"
  echo "== $preset distributed $v" | tee -a "$log"
  raw="$(mktemp /tmp/ce-raw.XXXXXX)"
  RUST_LOG=weightferry::nccl=info timeout 140 "$wf" launch --nproc 2 -- run --platform cuda --preset "$preset" \
    --config "$config" --time-steps 1,3 --time-rounds 3 --trace "/tmp/ce-$v.json" $flag --json > "$raw" 2>> "$log"
  rc=$?
  sed -n 's/^\[rank 0\] //p' "$raw" | grep -v '^NCCL ' > "$out/dist-$v.json"
  grep -v '^\[rank 0\] [{} "]' "$raw" >> "$log"
  rm -f "$raw"
  cp "/tmp/ce-$v.rank0.json" "$out/trace-$v.rank0.json" 2>/dev/null
  echo "distributed $v exit $rc" | tee -a "$log"
  [ "$rc" = 0 ] || status=1
done
grep -i "copy-engine option\|copy engine\|error\|warn" "$log" | head -20
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def load(p):
    try:
        with open(p) as f:
            text = f.read()
        # NCCL may print its version line before the report.
        return json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
    except Exception as e:
        print(f"({p}: {e})"); return None
for v in ("kernel", "ce"):
    g = load(f"{out}/ge-{v}.json")
    if g:
        for r in g.get("rows", []):
            print(f"{v}: world {r['world']} chunk {r['chunk_bytes'] / 2**20:.0f} MiB: "
                  f"{r['block_bytes_per_s'] / 1e9:.1f} GB/s of full blocks per GPU, exact {r['exact']}")
        for c in g.get("compute", []):
            print(f"{v}: GEMMs beside transfers (world {c['world']}): +{100 * c['slowdown_gather']:.1f}% "
                  f"(AllGather's extra over H2D alone +{100 * c['nccl_extra']:.1f}%)")
for v in ("kernel", "ce"):
    d = load(f"{out}/dist-{v}.json")
    if d and d.get("timing"):
        t = d["timing"]
        print(f"dist {v}: step {t['step_s']:.4f} s bound {t['bound_s']:.4f} ratio {t['ratio']:.3f} bit-exact {d['outputs_match']}")
        for r in d["ranks"]:
            tl = r.get("timeline") or {}
            print(f"  rank {r['rank']}: step {r['timing']['step_s']:.4f} window {tl.get('window_ms', 0):.1f} "
                  f"compute {tl.get('compute_busy_ms', 0):.1f} stall {tl.get('stall_ms', 0):.1f} "
                  f"copy {tl.get('copy_busy_ms', 0):.1f} comm {tl.get('comm_busy_ms', 0):.1f}")
PY
exit $status
