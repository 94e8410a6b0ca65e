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
                "GBps_while_copying": h2d_bytes / h2d_busy / 1e3 if h2d_busy else None},
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
