"""``HookClock``: the latency of the torch hooks, in memory that stays flat over any number of steps."""

from __future__ import annotations

from array import array
from typing import Any

__all__ = ["HookClock"]


class HookClock:
    """Latency of the torch hooks (pre and post, each as one sample, nanoseconds): the last :data:`SAMPLES` calls in a
    fixed ring, so memory stays flat over any number of steps, plus an exact call count and maximum."""

    SAMPLES = 4096

    def __init__(self) -> None:
        self.ring = array("q", bytes(8 * self.SAMPLES))
        self.calls = 0
        self.max_ns = 0
        self.total_ns = 0

    def record(self, ns: int) -> None:
        """Adds one sample."""
        self.ring[self.calls % self.SAMPLES] = ns
        self.calls += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def summary(self) -> dict[str, Any]:
        """``calls``, ``p50_us``, ``p99_us`` (over the ring), ``max_us``, ``total_ms``."""
        kept = sorted(self.ring[: min(self.calls, self.SAMPLES)])
        if not kept:
            return {"calls": 0, "p50_us": None, "p99_us": None, "max_us": None, "total_ms": 0.0}

        def pct(q: float) -> float:
            return kept[min(len(kept) - 1, int(q * len(kept)))] / 1e3

        return {"calls": self.calls, "p50_us": pct(0.5), "p99_us": pct(0.99), "max_us": self.max_ns / 1e3,
                "total_ms": self.total_ns / 1e6}
