#!/usr/bin/env python3
"""Peer benchmark: one DiT pass of a weightferry preset's exact DiT, in PyTorch, fully resident and under the
offloaders people use today (diffusers group offloading, accelerate sequential CPU offload), each as a ratio to the
bound `weightferry bench` uses: max(compute time, streamed bytes / pinned H2D bandwidth), all measured here.

Model. Built from benches/peers/pipelines/<preset>.json, the preset exported by our own library (see
benches/peers/README.md): the same modules, block lists, tensor shapes and dtypes (bf16 weights, f32 tables, buffers),
so the same per-block weight bytes (checked against `weightferry plan --json` before anything runs). Every module of the
description is an nn.Module holding its own tensors as parameters/buffers; block lists are nn.ModuleList, so diffusers'
block-level group offloading sees exactly our blocks and accelerate's hooks see every leaf. Weights are deterministic
(uniform, scaled by 1/sqrt(fan-in); not the same values as ours).

Work per pass: exactly what our GPU reference engine computes per DiT step (pipeline_spec.py's docstring): one GEMM
per bf16 weight of rank >= 2 over `tokens` rows, with the same [tokens, in] x [in, out] shapes and the same residual
adds, plus per block the same attention proxy as ours (S = x x^T, O = S x in 1024-row chunks, 4 * tokens^2 * width
flops, plain matmuls). `--attention sdpa` replaces the proxy with torch's scaled_dot_product_attention over
width/128 heads of 128 (same flop count, fused kernel: faster than the proxy, so not our engine's work).

Variants (each in its own subprocess, so peak host RSS and device memory are per variant):
  resident             all weights on the device: the compute time of the pass (the bound's compute term)
  group_stream         diffusers apply_group_offloading(block_level, num_blocks_per_group=1, use_stream=True)
  group_stream_record  ... use_stream=True, record_stream=True
  group_stream_lowmem  ... use_stream=True, low_cpu_mem_usage=True (pins on the fly instead of pre-pinning)
  group_nostream       ... use_stream=False (synchronous onload; not in the default set)
  sequential           accelerate.cpu_offload(model, cuda) = what diffusers' enable_sequential_cpu_offload applies
                       to each model (offload_buffers as diffusers sets it); `--sequential-blocks K` runs only the
                       first K blocks of each block list and extrapolates (labelled "extrapolated")

Timing: `--warmup` passes (the first one lets group offloading's lazy prefetch record the execution order), then
`--steps` timed passes with CUDA events on the current stream (wall time with a synchronize too), the activation
reset before each; step_s is their mean. Streamed bytes per pass = bytes of the model's parameters and buffers that
are not on the device between passes (every one of them is copied in during a pass). Pinned H2D bandwidth:
16 copies of a 256 MiB pinned buffer, as `weightferry bench` measures it, in each variant's process after its
passes. Peak device memory: torch.cuda.max_memory_allocated, reset per variant, minus what the activations and
workspace hold before any weight is placed ("peak weights"). Peak host memory: VmHWM of the variant's process
(read before the bandwidth probe), with its RSS before the model was built reported as `base_rss`.

Needs torch and, for the group variants, diffusers 0.42.1 (pure Python wheel diffusers-0.42.1-py3-none-any.whl,
installed with --no-deps: every dependency it imports is already on the GPU machine; see benches/peers/README.md);
accelerate for `sequential`. Runs on CPU for testing (`--device cpu`: streams are unavailable there, so the group
variants run with use_stream=False and record_stream off, labelled as such).

    python3 benches/peers/peer_bench.py --preset flux-dev --preset wan-14b --json peers.json
    python3 benches/peers/peer_bench.py --preset flux-tiny --device cpu --tokens 64 --steps 2
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_spec as ps

ALL_VARIANTS = ["resident", "group_stream", "group_stream_record", "group_stream_lowmem", "group_nostream",
                "sequential"]
DEFAULT_VARIANTS = "resident,group_stream,sequential,group_stream_record,group_stream_lowmem"
RESULT_TAG = "PEER_RESULT "
GB = 1e9


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def rss_bytes(field):
    """VmRSS / VmHWM of this process in bytes (falls back to ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------------------------
# The PyTorch model (torch imported lazily so the parent and the table need none of it).

def build_model(spec, tokens, device, build_device, seed, attention):
    import torch
    from torch import nn

    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
                   "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2, "i64": torch.int64, "i32": torch.int32,
                   "i8": torch.int8, "u8": torch.uint8}
    rows, width = tokens, spec.width

    class Workspace:
        """Activations and scratch of the pass, on the compute device (not weights). Deliberately has no `.to`:
        hooks pass it through untouched."""

        def __init__(self):
            kw = dict(device=device, dtype=torch.bfloat16)
            g = torch.Generator(device=device).manual_seed(seed ^ 0x1A7E47)
            self.x0 = (torch.rand(rows, width, generator=g, device=device) * 2 - 1).to(torch.bfloat16)
            self.x = self.x0.clone()
            self.prod = [torch.empty(rows * spec.max_out, **kw), torch.empty(rows * spec.max_out, **kw)]
            self.zeros = torch.zeros(rows, spec.max_in, **kw)
            self.scores = torch.empty(min(ps.ATTN_CHUNK, rows), rows, **kw)
            self.attn_out = torch.empty(rows, width, **kw)
            self.cur = None
            self.next = 0
            self.limit_blocks = 0  # > 0: run only the first K blocks of each block list
            self.segments = None  # list of (label, seconds) when segment timing is on
            self.gemms = 0  # weight GEMMs and attention proxies run (for the tests)
            self.attns = 0

        def gemm(self, x, w, out, inn):
            if self.cur is not None and self.cur.shape[1] >= inn:
                a = self.cur[:, :inn]
            elif width >= inn:
                a = x[:, :inn]
            else:
                a = self.zeros[:, :inn]
            c = self.prod[self.next][: rows * out].view(rows, out)
            torch.mm(a, w.t(), out=c)
            if out == width:
                x.add_(c, alpha=ps.RESIDUAL)
            self.cur = c
            self.next ^= 1
            self.gemms += 1

        def attention(self, x):
            self.attns += 1
            if attention == "sdpa":
                h = max(width // 128, 1)
                q = x.view(1, rows, h, width // h).transpose(1, 2)
                o = torch.nn.functional.scaled_dot_product_attention(q, q, q)
                x.add_(o.transpose(1, 2).reshape(rows, width), alpha=ps.RESIDUAL)
                return
            for r0 in range(0, rows, ps.ATTN_CHUNK):
                c = min(ps.ATTN_CHUNK, rows - r0)
                s = self.scores[:c]
                s.addmm_(x[r0:r0 + c], x.t(), beta=0.0, alpha=1.0 / width)
                self.attn_out[r0:r0 + c].addmm_(s, x, beta=0.0, alpha=1.0 / rows)
            x.add_(self.attn_out, alpha=ps.RESIDUAL)

    ws = Workspace()
    counter = [0]

    def make_tensor(t):
        shape = [t.shape[1], t.shape[0]] if t.transposed else t.shape
        dt = torch_dtype[t.dtype]
        v = torch.empty(shape, dtype=dt, device=build_device)
        if dt.is_floating_point and t.dtype != "f8e4m3":
            counter[0] += 1
            g = t.gemm_view()
            scale = (3.0 / g[1]) ** 0.5 if g else 0.05
            gen_dev = device  # generate where it is fast (the GPU), copy to the host when building there
            gen = torch.Generator(device=gen_dev).manual_seed(seed * 1000003 + counter[0])
            r = torch.rand(shape, generator=gen, device=gen_dev, dtype=torch.float32).mul_(2 * scale).sub_(scale)
            v.copy_(r)
            del r
        else:
            v.zero_()
        return v

    class Node(nn.Module):
        """One module of the description. `kernel_start`: a kernel of our program starts here (resets the product
        chain); `is_block`: a block of a block list (runs the attention proxy after its GEMMs)."""

        def __init__(self, m, kernel_start, is_block, inside_kernel):
            super().__init__()
            self._ws = ws
            self._kernel_start = kernel_start
            self._is_block = is_block
            self._gemms = []
            for t in m.tensors:
                if t.tied_to is not None:
                    continue  # a view of a block weight: computed inside that block only (program.rs)
                v = make_tensor(t)
                if t.kind == "parameter":
                    self.register_parameter(t.name, nn.Parameter(v, requires_grad=False))
                else:
                    self.register_buffer(t.name, v, persistent=t.kind == "persistent_buffer")
                g = t.gemm_view()
                if g:
                    self._gemms.append((t.name, g[0], g[1], t.transposed))
            self._order = []
            for name, c in m.children:
                if c.block_list and c.children:
                    self.add_module(name, nn.ModuleList([Node(b, True, True, True) for _, b in c.children]))
                    self._order.append((name, "blocks"))
                elif inside_kernel:
                    self.add_module(name, Node(c, False, False, True))
                    self._order.append((name, "module"))
                elif c.contains_block_list():
                    self.add_module(name, Node(c, True, False, False))  # entered: its own tensors are a kernel
                    self._order.append((name, "module"))
                else:
                    self.add_module(name, Node(c, True, False, True))  # one kernel over its subtree
                    self._order.append((name, "module"))

        def forward(self, x):
            w = self._ws
            if self._kernel_start:
                w.cur = None
            for name, out, inn, transposed in self._gemms:
                p = getattr(self, name)
                w.gemm(x, p.t() if transposed else p.view(out, inn), out, inn)
            for name, kind in self._order:
                child = getattr(self, name)
                seg = w.segments is not None and kind == "blocks"
                if seg:
                    _sync()
                    t0 = time.perf_counter()
                if kind == "blocks":
                    n = len(child) if w.limit_blocks <= 0 else min(w.limit_blocks, len(child))
                    for i in range(n):
                        x = child[i](x)
                else:
                    x = child(x)
                if seg:
                    _sync()
                    w.segments.append((name, n, len(child), time.perf_counter() - t0))
            if self._is_block:
                w.attention(x)
            return x

    def _sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    model = Node(spec.root, True, False, False).eval()
    return model, ws


def tensor_bytes(model, where):
    """Bytes of the model's parameters and buffers whose device type is (where='on') / is not ('off') the GPU."""
    tot = 0
    for t in list(model.parameters()) + list(model.buffers()):
        on = t.device.type == "cuda"
        if (where == "on") == on:
            tot += t.numel() * t.element_size()
    return tot


def h2d_bandwidth(torch, size=256 << 20, copies=16):
    """Pinned host -> device bandwidth, bytes/s: `copies` copies of one pinned buffer (as `weightferry bench`)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(copies):
        dev.copy_(host, non_blocking=True)
    e.record()
    torch.cuda.synchronize()
    return size * copies / (s.elapsed_time(e) / 1e3)


# ---------------------------------------------------------------------------------------------------------------
# One variant, in this process (the child).

def run_variant(a, preset, variant):
    import torch

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    spec = ps.DitSpec(ps.load_document(preset))
    tokens = a.tokens or ps.default_tokens(preset)
    torch.manual_seed(a.seed)
    if cuda:
        torch.zeros(1, device=device)  # the CUDA context belongs to the baseline, not to the model
        torch.cuda.synchronize()
    base_rss = rss_bytes("VmRSS")
    res = {"preset": preset, "variant": variant, "tokens": tokens, "attention": a.attention,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    build_device = device if variant == "resident" else torch.device("cpu")
    t0 = time.perf_counter()
    model, ws = build_model(spec, tokens, device, build_device, a.seed, a.attention)
    dev_base = 0
    if cuda:
        # Drop the weight generator's temporaries; the peak counts from here (weights already placed included).
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        dev_base = torch.cuda.memory_allocated() - tensor_bytes(model, "on")
    res["build_s"] = time.perf_counter() - t0
    res["model_bytes"] = tensor_bytes(model, "on") + tensor_bytes(model, "off")
    res["model_rss"] = rss_bytes("VmRSS")
    log(f"[{preset} {variant}] model built: {res['model_bytes'] / GB:.2f} GB in {res['build_s']:.1f} s, "
        f"RSS {res['model_rss'] / GB:.2f} GB")

    config = {}
    t0 = time.perf_counter()
    if variant.startswith("group_"):
        import diffusers
        from diffusers.hooks import apply_group_offloading
        res["diffusers"] = diffusers.__version__
        use_stream = variant.startswith("group_stream") and cuda
        config = dict(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                      num_blocks_per_group=1, use_stream=use_stream,
                      record_stream=use_stream and variant == "group_stream_record",
                      low_cpu_mem_usage=variant == "group_stream_lowmem")
        if variant.startswith("group_stream") and not cuda:
            res["note"] = "cpu test: use_stream unavailable, ran with use_stream=False"
        apply_group_offloading(model, **config)
        config = {k: (str(v) if isinstance(v, torch.device) else v) for k, v in config.items()}
    elif variant == "sequential":
        import accelerate
        from accelerate import cpu_offload
        res["accelerate"] = accelerate.__version__
        offload_buffers = len(model._parameters) > 0  # as diffusers' enable_sequential_cpu_offload sets it
        cpu_offload(model, execution_device=device, offload_buffers=offload_buffers)
        config = dict(fn="accelerate.cpu_offload", execution_device=str(device), offload_buffers=offload_buffers)
        if a.sequential_blocks > 0:
            ws.limit_blocks = a.sequential_blocks
    elif variant != "resident":
        raise SystemExit(f"unknown variant {variant}")
    res["config"] = config
    res["apply_s"] = time.perf_counter() - t0

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def one_pass():
        ws.x.copy_(ws.x0)
        ws.segments = [] if ws.limit_blocks > 0 else None
        sync()
        w0 = time.perf_counter()
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        with torch.no_grad():
            model(ws.x)
        if cuda:
            e.record()
        sync()
        wall = time.perf_counter() - w0
        ev = s.elapsed_time(e) / 1e3 if cuda else wall
        if ws.limit_blocks > 0:
            # Extrapolate: time outside the block lists + each list's time scaled from K blocks to all of them.
            listed = sum(seg[3] for seg in ws.segments)
            full = sum(seg[3] * seg[2] / max(seg[1], 1) for seg in ws.segments)
            return wall - listed + full, wall, ev
        return ev, wall, ev

    for i in range(a.warmup):
        t, _, _ = one_pass()
        log(f"[{preset} {variant}] warm-up pass {i + 1}: {t:.4f} s")
    times, walls = [], []
    for _ in range(a.steps):
        t, wall, _ = one_pass()
        times.append(t)
        walls.append(wall)
    res["step_s"] = sum(times) / len(times)
    res["step_min_s"], res["step_max_s"] = min(times), max(times)
    res["wall_s"] = sum(walls) / len(walls)
    res["passes"] = a.steps
    res["extrapolated"] = ws.limit_blocks > 0
    if res["extrapolated"]:
        res["extrapolated_from_blocks"] = ws.limit_blocks
    res["streamed_bytes"] = tensor_bytes(model, "off") if variant != "resident" else 0
    res["device_resident_weight_bytes"] = tensor_bytes(model, "on")
    res["checksum"] = float(ws.x.float().sum().item())
    res["peak_host_rss"] = rss_bytes("VmHWM")
    res["rss_after_passes"] = rss_bytes("VmRSS")
    res["base_rss"] = base_rss
    if cuda:
        res["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        res["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved()
        res["device_base_bytes"] = dev_base
        res["peak_device_weight_bytes"] = res["peak_device_bytes"] - dev_base
        res["h2d_bytes_per_s"] = h2d_bandwidth(torch)
    else:
        res["peak_device_bytes"] = res["peak_device_weight_bytes"] = 0
        res["h2d_bytes_per_s"] = None
    log(f"[{preset} {variant}] {res['step_s']:.4f} s/pass (min {res['step_min_s']:.4f}, max {res['step_max_s']:.4f}"
        f"{', extrapolated' if res['extrapolated'] else ''}), streamed {res['streamed_bytes'] / GB:.2f} GB, "
        f"peak device weights {res['peak_device_weight_bytes'] / GB:.2f} GB, "
        f"peak RSS {res['peak_host_rss'] / GB:.2f} GB")
    return res


# ---------------------------------------------------------------------------------------------------------------
# The parent: byte check, one subprocess per variant, bounds.

def plan_of(binary, preset):
    if not binary:
        return None
    try:
        out = subprocess.run([binary, "plan", "--preset", preset, "--json"], check=True, capture_output=True,
                             text=True, timeout=60).stdout
        return json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log(f"weightferry plan failed: {e}")
        return None


def child_args(a, preset, variant):
    args = [sys.executable, os.path.abspath(__file__), "--child", variant, "--preset", preset,
            "--device", a.device, "--steps", str(a.steps), "--warmup", str(a.warmup), "--seed", str(a.seed),
            "--attention", a.attention, "--sequential-blocks", str(a.sequential_blocks)]
    if a.tokens:
        args += ["--tokens", str(a.tokens)]
    return args


def bench_preset(a, preset):
    spec = ps.DitSpec(ps.load_document(preset))
    summary = spec.summary()
    tokens = a.tokens or ps.default_tokens(preset)
    out = {"preset": preset, "tokens": tokens, "spec": summary, "flops_per_pass": spec.gemm_flops(tokens),
           "rows": []}
    log(f"== {preset}: DiT {summary['dit_bytes'] / GB:.3f} GB, {summary['blocks']} blocks, width {spec.width}, "
        f"{tokens} tokens, {out['flops_per_pass'] / 1e12:.1f} TFLOP per pass")
    plan = plan_of(a.weightferry, preset)
    if plan is not None:
        cmp = ps.compare_with_plan(summary, plan)
        out["plan_check"] = [{"quantity": q, "weightferry": x, "peer": y, "equal": eq} for q, x, y, eq in cmp]
        for q, x, y, eq in cmp:
            log(f"   {q:26s} weightferry plan {x:>14}  peer model {y:>14}  {'ok' if eq else 'MISMATCH'}")
        if not all(r[3] for r in cmp):
            raise SystemExit(f"{preset}: the peer model's bytes differ from weightferry plan")
    else:
        log("   (no weightferry binary: byte check against `weightferry plan` skipped)")
    for variant in a.variants:
        t0 = time.perf_counter()
        timeout = a.child_timeout
        if a.deadline:
            timeout = min(timeout, a.deadline - time.time())
            if timeout < a.min_variant_s:
                out["rows"].append({"preset": preset, "variant": variant,
                                    "error": f"skipped: {timeout:.0f} s left before the deadline"})
                log(f"[{preset} {variant}] skipped: {timeout:.0f} s left before the deadline")
                continue
        try:
            p = subprocess.run(child_args(a, preset, variant), stdout=subprocess.PIPE, text=True,
                               timeout=timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_TAG)]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"exit status {p.returncode}")
            row = json.loads(lines[-1][len(RESULT_TAG):])
        except subprocess.TimeoutExpired:
            row = {"preset": preset, "variant": variant, "error": f"timed out after {timeout:.0f} s"}
            log(f"[{preset} {variant}] timed out")
        except (RuntimeError, ValueError) as e:
            row = {"preset": preset, "variant": variant, "error": str(e) or type(e).__name__}
            log(f"[{preset} {variant}] FAILED: {row['error']}")
        row["process_s"] = time.perf_counter() - t0
        out["rows"].append(row)
    # Bounds: compute = the resident pass measured in this run; bandwidth = the variant's own probe.
    res = next((r for r in out["rows"] if r["variant"] == "resident" and "step_s" in r), None)
    out["compute_s"] = res["step_s"] if res else None
    for r in out["rows"]:
        if "step_s" not in r:
            continue
        bw = r.get("h2d_bytes_per_s")
        transfer = r["streamed_bytes"] / bw if bw else 0.0
        r["transfer_s"] = transfer
        if out["compute_s"] is not None:
            r["bound_s"] = max(out["compute_s"], transfer)
            r["ratio"] = r["step_s"] / r["bound_s"] if r["bound_s"] > 0 else None
        r["host_over_weights"] = r["peak_host_rss"] / summary["dit_bytes"]
        if res is not None and not r.get("extrapolated"):
            r["output_matches_resident"] = r["checksum"] == res["checksum"]
    return out


def print_summary(report):
    print(f"peer bench: torch {report.get('torch')}, diffusers {report.get('diffusers')}, "
          f"accelerate {report.get('accelerate')}, device {report.get('device')}")
    print("| preset | variant | step s | bound s | ratio | GB streamed | H2D GB/s | peak device weights GB "
          "| peak host GB | host / DiT weights |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in report["presets"]:
        for r in p["rows"]:
            if "step_s" not in r:
                print(f"| {p['preset']} | {r['variant']} | failed: {r.get('error')} | | | | | | | |")
                continue
            f = lambda k, fmt, r=r: (fmt % r[k]) if r.get(k) is not None else "n/a"  # noqa: E731
            name = r["variant"] + (f" (extrapolated from {r['extrapolated_from_blocks']} blocks/list)"
                                   if r.get("extrapolated") else "")
            bw = r.get("h2d_bytes_per_s")
            print(f"| {p['preset']} | {name} | {r['step_s']:.4f} | {f('bound_s', '%.4f')} | {f('ratio', '%.3f')} "
                  f"| {r['streamed_bytes'] / GB:.2f} | {bw / GB if bw else float('nan'):.1f} "
                  f"| {r['peak_device_weight_bytes'] / GB:.2f} | {r['peak_host_rss'] / GB:.2f} "
                  f"| {r['host_over_weights']:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="flux-dev | wan-14b | qwen-image | *-tiny (repeatable)")
    ap.add_argument("--tokens", type=int, default=0, help="DiT tokens (default: as weightferry bench)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {','.join(ALL_VARIANTS)}")
    ap.add_argument("--steps", type=int, default=3, help="timed passes per variant (mean reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed passes first (>= 2 for lazy prefetch)")
    ap.add_argument("--sequential-blocks", type=int, default=0,
                    help="sequential: run only the first K blocks of each block list and extrapolate (0 = all)")
    ap.add_argument("--attention", choices=["proxy", "sdpa"], default="proxy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--weightferry", default=None,
                    help="binary for the byte check (default: .devbin/weightferry or target/release/weightferry)")
    ap.add_argument("--child-timeout", type=float, default=600, help="seconds per variant process")
    ap.add_argument("--deadline", type=float, default=0,
                    help="Unix time by which every variant must have finished (later ones are skipped, a running "
                         "one is stopped)")
    ap.add_argument("--min-variant-s", type=float, default=20,
                    help="with --deadline: do not start a variant with less time than this left")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.presets = a.preset or ["flux-dev"]
    if a.child:
        res = run_variant(a, a.presets[0], a.child)
        print(RESULT_TAG + json.dumps(res), flush=True)
        return
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in ALL_VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}")
    if a.weightferry is None:
        a.weightferry = next((b for b in [".devbin/weightferry", "target/release/weightferry"] if os.path.exists(b)),
                             None)
    report = {"system": "peers", "presets": [], "args": {k: v for k, v in vars(a).items() if k != "child"}}
    for p in a.presets:
        report["presets"].append(bench_preset(a, p))
    rows = [r for p in report["presets"] for r in p["rows"]]
    for k in ["torch", "diffusers", "accelerate", "device"]:
        report[k] = next((r[k] for r in rows if r.get(k)), None)
    print_summary(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        log(f"wrote {a.json}")
    sys.exit(0 if all("step_s" in r for r in rows) else 1)


if __name__ == "__main__":
    main()
