#!/usr/bin/env python3
"""Distributed layerwise offload of a full-size diffusers transformer from PyTorch (issue 16): every rank of a
torchrun job binds the transformer from one safetensors checkpoint with ``weight_transfer = "allgather"`` (each rank
reads and holds 1/N of every block; the blocks are rebuilt on each GPU by NCCL AllGathers), against the same
transformer resident on each GPU, with every term of the bound measured in the same job.

    torchrun --nproc-per-node N benches/torch/dist_bench.py [--model flux-dev] [--steps 5] [--warmup 2]

Per rank, in order: (1) rank 0 writes the checkpoint (``--out``/checkpoint-<model>.safetensors, unless it exists);
(2) resident: the module built on ``meta``, its state loaded from the file straight onto the GPU, stepped alone
(the compute term) and again with host-to-device copies and AllGathers of one step's volume queued on other streams
beside it (compute with the copies beside it); (3) pinned H2D and NCCL AllGather rates (``all_gather_into_tensor``
of a Flux-block-sized output, 16 times); (4) weightferry: ``enable(..., checkpoint=PATH)`` on a meta module, depth
``--depth``, stepped. Rank 0 prints one table: step time, the bound ``max(compute beside copies, H2D bytes per
rank / pinned H2D, gathered bytes / AllGather rate)``, the ratio, the block rebuild rate (blocks per second), host
RSS after enable, and whether each rank's output equals its resident output bit for bit.

``--tiny`` runs a tiny configuration on the CPU (gloo, ``device="sim"``) to check the script; it measures nothing.
Needs torch, diffusers, safetensors and weightferry (built with ``nccl`` for GPUs).
"""

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(__file__))
import diffusers_bench as bench


def timed(torch, cpu, fn, steps):
    """Seconds per call of ``fn`` over ``steps`` calls: between CUDA events on the current stream, or wall time."""
    if cpu:
        t0 = time.perf_counter()
        for _ in range(steps):
            out = fn()
        return (time.perf_counter() - t0) / steps, out
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        out = fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / steps, out


def all_gather_rate(torch, dist, out_bytes, copies=16):
    """Bytes per second of gathered output (the whole tensor each rank ends with), NCCL, ``copies`` back to back."""
    world = dist.get_world_size()
    n = out_bytes // world // 2 * 2
    shard = torch.empty(n, dtype=torch.uint8, device="cuda")
    full = torch.empty(n * world, dtype=torch.uint8, device="cuda")
    dist.all_gather_into_tensor(full, shard)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(copies):
        dist.all_gather_into_tensor(full, shard)
    torch.cuda.synchronize()
    return n * world * copies / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="flux-dev", choices=sorted(bench.MODELS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny configuration on the CPU (gloo, device='sim')")
    ap.add_argument("--out", default="/tmp/wf-dist-bench")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    import weightferry as wf

    cpu = args.tiny and not torch.cuda.is_available()
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"checkpoint-{args.model}{'-tiny' if args.tiny else ''}.safetensors")
    if rank == 0 and not os.path.exists(path):
        model, _ = bench.build(torch, args.model, args.tiny)
        bench.write_checkpoint(torch, model, path)
        del model
    dist.barrier()
    spec = bench.MODELS[args.model]
    x = bench.inputs(torch, spec, dev, args.tiny)
    res = {"rank": rank, "world": world}

    def step(m):
        with torch.no_grad():
            return m(**x, return_dict=False)[0]

    # (2) resident, alone and with one step's copies and AllGathers queued beside it.
    model, _ = bench.build_on_meta(torch, args.model, args.tiny)
    model.load_state_dict(load_file(path, device=str(dev)), assign=True)
    blocks = [m for n, m in model.named_modules() if n.count(".") == 1 and n.split(".")[1].isdigit()]
    block_bytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    for _ in range(args.warmup):
        step(model)
    res["resident_s"], expected = timed(torch, cpu, lambda: step(model), args.steps)
    expected = expected.cpu()
    if cpu:
        res["beside_s"] = res["resident_s"]
    else:
        per_rank = block_bytes // world
        host = torch.empty(per_rank, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(per_rank, dtype=torch.uint8, device=dev)
        side = torch.cuda.Stream()
        n = block_bytes // world // len(blocks) // 2 * 2
        shard = torch.empty(n, dtype=torch.uint8, device=dev)
        full = torch.empty(n * world, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(args.steps):
                dst.copy_(host, non_blocking=True)
        works = [dist.all_gather_into_tensor(full, shard, async_op=True)
                 for _ in range(args.steps * len(blocks) if world > 1 else 0)]
        res["beside_s"], _ = timed(torch, cpu, lambda: step(model), args.steps)
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        del host, dst, shard, full
    del model
    if not cpu:
        torch.cuda.empty_cache()
    # (3) the copy rates.
    res["h2d_Bps"] = 1e9 if cpu else bench.h2d_bandwidth(torch)
    res["all_gather_Bps"] = 1e9 if cpu or world == 1 else all_gather_rate(torch, dist, block_bytes // len(blocks))
    # (4) weightferry from the checkpoint, each rank reading its shards.
    base = bench.rss()
    model, _ = bench.build_on_meta(torch, args.model, args.tiny)
    dit = {"prefetch_depth": args.depth}
    if world > 1:  # one rank: plain layerwise, the single-GPU row of the scaling table
        dit["weight_transfer"] = "allgather"
    cfg = {"data_parallel_size": world,
           "diffusion_offload_config": {"mode": "layer", "components": ["dit"], "layer_options": {"dit": dit}}}
    res["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    t0 = time.perf_counter()
    h = wf.enable({"transformer": model}, cfg, device="sim" if cpu else "cuda", checkpoint=path)
    res["enable_s"] = time.perf_counter() - t0
    res["rss_after_enable"] = bench.rss() - base
    for _ in range(args.warmup):
        out = step(model)
    before = h.stats()
    res["step_s"], out = timed(torch, cpu, lambda: step(model), args.steps)
    after = h.stats()
    res["bit_exact"] = bool(torch.equal(out.cpu(), expected))
    res["h2d_per_step"] = (after["bytes_streamed"] - before["bytes_streamed"]) / args.steps
    res["gathered_per_step"] = block_bytes
    group, was = after.get("group") or {}, before.get("group") or {}
    res["all_gathers_per_step"] = (group.get("all_gathers", 0) - was.get("all_gathers", 0)) / args.steps
    res["shard_host_bytes"] = group.get("shard_host_bytes", after["master_host_bytes"])
    res["blocks"] = len(blocks)
    h.disable()
    results = [None] * world
    dist.gather_object(res, results if rank == 0 else None, dst=0)
    if rank == 0:
        table(args.model, results)
        with open(os.path.join(args.out, f"dist-{args.model}-{world}.json"), "w") as f:
            json.dump(results, f, indent=1)
    # Every rank tears the group down together: a rank that leaves while rank 0 still writes can make gloo abort the
    # other one's teardown (SIGABRT, seen under load in the test suite).
    dist.barrier()
    dist.destroy_process_group()
    # Still seen once under load after the barrier: a SIGABRT at the end of a rank whose results were already
    # written. Leave without the interpreter's teardown (C++ destructors of the process group's threads); every
    # result is on disk and on stdout by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def table(model, results):
    print(f"\n{model}, {len(results)} rank(s); weights {results[0]['weight_bytes'] / 1e9:.2f} GB, "
          f"{results[0]['blocks']} blocks")
    print(f"{'rank':>4}{'step s':>9}{'resident':>9}{'beside':>9}{'H2D term':>9}{'AG term':>9}{'bound s':>9}"
          f"{'ratio':>7}{'blocks/s':>10}{'H2D GB/s':>9}{'AG GB/s':>9}{'RSS GB':>8}{'shard GB':>9}  bit-exact")
    for r in results:
        h2d = r["h2d_per_step"] / r["h2d_Bps"]
        ag = r["gathered_per_step"] / r["all_gather_Bps"] if r["world"] > 1 else 0.0
        bound = max(r["beside_s"], h2d, ag)
        print(f"{r['rank']:>4}{r['step_s']:>9.4f}{r['resident_s']:>9.4f}{r['beside_s']:>9.4f}{h2d:>9.4f}{ag:>9.4f}"
              f"{bound:>9.4f}{r['step_s'] / bound:>7.3f}{r['blocks'] / r['step_s']:>10.1f}"
              f"{r['h2d_Bps'] / 1e9:>9.1f}{r['all_gather_Bps'] / 1e9:>9.1f}{r['rss_after_enable'] / 1e9:>8.2f}"
              f"{r['shard_host_bytes'] / 1e9:>9.2f}  {r['bit_exact']}")


if __name__ == "__main__":
    main()
