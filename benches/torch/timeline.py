"""A device timeline of one step, for ``diffusers_bench.py --profile``: where a step's time goes on the GPU.

One call of the step runs under ``torch.profiler`` (CUDA activity: kernels and copies, those a CUDA graph replays
included); its Chrome trace is written beside the results, and a summary is returned: the span from the first
device activity to the last, per stream the time busy (the union of its activities) and the largest idle gaps
inside the span, and for the host-to-device copies their count, bytes, summed time and the rate while copying. For
a copy-bound step the copy stream's gaps are the time the bound does not explain.
"""

import gzip
import json
import os


def _union(intervals):
    """Merged ``[(start, end)]`` of possibly overlapping intervals, sorted."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _stream_summary(intervals, t0, gaps_kept=6):
    """Busy time, idle time between its first and last activity and the largest gaps (ms from the span's start)."""
    merged = _union(intervals)
    busy = sum(e - s for s, e in merged)
    gaps = sorted(((merged[i + 1][0] - merged[i][1], merged[i][1] - t0) for i in range(len(merged) - 1)),
                  reverse=True)
    return {"first_ms": (merged[0][0] - t0) / 1e3, "last_ms": (merged[-1][1] - t0) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": sum(g for g, _ in gaps) / 1e3,
            "largest_gaps_ms": [[round(g / 1e3, 3), round(at / 1e3, 3)] for g, at in gaps[:gaps_kept]]}


def summarize(trace):
    """The summary of a Chrome trace (``torch.profiler``'s export) of one step; times in ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in
              ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return {"error": "no device activity recorded"}
    t0 = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    streams = {}
    for e in events:
        streams.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"]))
    h2d = [e for e in events if e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    h2d_bytes = sum(e.get("args", {}).get("bytes", 0) for e in h2d)
    h2d_busy = sum(e - s for s, e in _union((e["ts"], e["ts"] + e["dur"]) for e in h2d))
    return {
        "span_ms": (end - t0) / 1e3,
        "streams": {str(k): dict(_stream_summary(v, t0), activities=len(v)) for k, v in streams.items()},
        "h2d": {"copies": len(h2d), "bytes": h2d_bytes, "busy_ms": h2d_busy / 1e3,
                "GBps_while_copying": h2d_bytes / h2d_busy / 1e3 if h2d_busy else None,
                # each copy of at least 1 MiB in the order they started: its rate, GB/s
                "GBps_each": [round(e["args"]["bytes"] / e["dur"] / 1e3, 1) for e in sorted(h2d, key=lambda e: e["ts"])
                              if e.get("args", {}).get("bytes", 0) >= 1 << 20 and e["dur"] > 0]},
    }


def profile_step(torch, run_step, path):
    """Runs ``run_step()`` once under the profiler (synchronized before and after), writes its Chrome trace to
    ``path`` (gzip) and returns :func:`summarize` of it."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    raw = path + ".tmp.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    os.remove(raw)
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return summarize(trace)


def _page_nodes(address, nbytes, stride=2 << 20):
    """The NUMA node of one page every ``stride`` bytes of ``[address, address + nbytes)`` (``move_pages(2)``
    asked for none: it reports where each page is); ``-errno`` for a page it cannot place."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = list(range(address, address + nbytes, stride))
    arr = (ctypes.c_void_p * len(pages))(*pages)
    status = (ctypes.c_int * len(pages))()
    if libc.syscall(279, 0, len(pages), arr, None, status, 0) != 0:  # SYS_move_pages on x86_64
        return []
    return list(status)


def master_nodes(handle):
    """Per streamed block of ``handle``'s static stacks (execution order): ``[block, {node: share of its host
    master's pages}]``, and the node each GPU hangs off (``/sys/bus/pci/devices/*/numa_node``). What decides a
    host-to-device copy's rate when the machine has several memory nodes."""
    session = handle._session
    out = []
    for stack in session.static_stacks():
        for path in stack:
            nodes = []
            for hb, ho, _, n in session.capture_copies(path)[1]:
                nodes += _page_nodes(session.host_address(hb) + ho, n)
            share = {str(k): round(nodes.count(k) / len(nodes), 3) for k in sorted(set(nodes))} if nodes else {}
            out.append([path, share])
    return out


def numa_layout():
    """The machine's memory nodes and each NVIDIA device's node, as sysfs has them."""
    import glob

    nodes = sorted(os.path.basename(p) for p in glob.glob("/sys/devices/system/node/node*"))
    gpus = {}
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        try:
            with open(os.path.join(dev, "vendor")) as f, open(os.path.join(dev, "class")) as g:
                if f.read().strip() != "0x10de" or not g.read().startswith("0x03"):
                    continue
            with open(os.path.join(dev, "numa_node")) as f:
                gpus[os.path.basename(dev)] = int(f.read())
        except OSError:
            continue
    return {"nodes": nodes, "gpu_nodes": gpus}


def master_rates(torch, handle):
    """Per streamed block of ``handle``'s static stacks (execution order), the rate in GB/s of copying its host
    master into a scratch device buffer with torch, outside any graph, one block at a time: beside the same blocks'
    rates inside a step (``GBps_each``), it tells a slow source apart from a slow schedule."""
    import ctypes

    session = handle._session
    blocks = [(path, session.capture_copies(path)[1]) for stack in session.static_stacks() for path in stack]
    largest = max((sum(n for *_, n in copies) for _, copies in blocks), default=0)
    scratch = torch.empty(largest, dtype=torch.uint8, device="cuda")
    rates = []
    for _, copies in blocks:
        sources = []
        for hb, ho, _, n in copies:
            raw = (ctypes.c_uint8 * n).from_address(session.host_address(hb) + ho)
            sources.append(torch.frombuffer(raw, dtype=torch.uint8, count=n))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        at = 0
        for src in sources:
            scratch[at : at + src.numel()].copy_(src, non_blocking=True)
            at += src.numel()
        end.record()
        end.synchronize()
        rates.append(round(at / start.elapsed_time(end) / 1e6, 1))
    return rates
