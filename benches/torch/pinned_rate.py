#!/usr/bin/env python3
"""The pinned host-to-device copy rate by the kind of host memory and by where a CUDA graph runs the copies: two
suspects for copies that run slower inside one captured forward than another (issue 29's ``reduce-overhead`` rows).

- ``--pages``: 1 GiB buffers from ``cudaHostAlloc`` (torch's pinned allocator), or ``mmap`` advised for transparent
  huge pages (``thp``) or against them (``nothp``) then ``cudaHostRegister``ed; four buffers, each the median rate of
  six timed copies, and how many of its bytes sit in huge pages.
- ``--graph``: ten 400 MiB copies on the capturing stream with small kernels forked beside them (the graph's root
  branch), or the kernels first and the copies forked (a side branch); eager and captured, and each replay after a
  small device-to-device ``copy_`` on the launching stream.

    python3 benches/torch/pinned_rate.py --pages hostalloc   # and thp, nothp: one process each
    python3 benches/torch/pinned_rate.py --graph
"""

import argparse
import ctypes
import functools
import mmap
import statistics

import torch

ALIGN = 2 << 20


def anon_huge_mb():
    """This process's anonymous memory in transparent huge pages, MB."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages"):
                return int(line.split()[1]) // 1024
    return -1


def registered(n, advice, keep):
    """``n`` bytes of ``mmap``ed memory, 2 MiB aligned, advised ``advice``, touched and registered with CUDA."""
    m = mmap.mmap(-1, n + ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = (-ctypes.addressof(ctypes.c_char.from_buffer(m))) % ALIGN
    m.madvise(advice, off, n)
    t = torch.frombuffer(m, dtype=torch.uint8)[off : off + n]
    t.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
    if int(err) != 0:
        raise SystemExit(f"cudaHostRegister failed: {err}")
    keep.append(m)
    return t


def pages(kind):
    n = 1 << 30
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    keep, rows = [], []
    for _ in range(4):
        before = anon_huge_mb()
        if kind == "hostalloc":
            src = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
        else:
            src = registered(n, mmap.MADV_HUGEPAGE if kind == "thp" else mmap.MADV_NOHUGEPAGE, keep)
        keep.append(src)
        gbps = timed(functools.partial(dst.copy_, src, non_blocking=True), n, runs=8)
        rows.append(f"{gbps:.1f}GB/s(huge {anon_huge_mb() - before}MB)")
    print(kind, " ".join(rows))


def graph():
    n, k = 400 << 20, 10
    srcs = [torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(i) for i in range(k)]
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def copies():
        for s in srcs:
            dst.copy_(s, non_blocking=True)

    def kernels(count):
        for _ in range(count):
            a.mul_(1.0)

    def root(count):
        side.wait_stream(torch.cuda.current_stream())
        copies()
        with torch.cuda.stream(side):
            kernels(count)
        torch.cuda.current_stream().wait_stream(side)

    def branch(count):
        kernels(1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copies()
        kernels(count)
        torch.cuda.current_stream().wait_stream(side)

    small, other = torch.zeros(1 << 20, device="cuda"), torch.ones(1 << 20, device="cuda")

    def after_copy(g):  # a small device-to-device copy_ on the launching stream before each replay
        small.copy_(other)
        g.replay()

    for count in (0, 50):
        for name, fn in (("root", root), ("branch", branch)):
            print(f"eager {name} kernels={count}: {timed(functools.partial(fn, count), k * n):.1f} GB/s")
            g = torch.cuda.CUDAGraph()
            fn(count)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn(count)
            print(f"graph {name} kernels={count}: {timed(g.replay, k * n):.1f} GB/s")
            gbps = timed(functools.partial(after_copy, g), k * n)
            print(f"graph {name} kernels={count} after a copy_: {gbps:.1f} GB/s")


def timed(fn, nbytes, runs=7):
    """Median GB/s of ``runs`` calls of ``fn`` that each move ``nbytes``, timed by events, the first two skipped."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(runs):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(out[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", choices=("hostalloc", "thp", "nothp"))
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()
    if args.pages is None and not args.graph:
        ap.error("give --pages KIND or --graph")
    if args.pages:
        pages(args.pages)
    if args.graph:
        graph()


if __name__ == "__main__":
    main()
