"""Captured streaming: a component's forward recorded in a CUDA graph (``torch.cuda.graph``) with its static blocks
still streaming, the copies inside the graph on a copy stream forked from the capturing stream and joined to it by
events, so every replay copies the same host bytes into the same places in the same order.

While a capture is under way the hooks of the component's static blocks (eager, or the custom operators compiled
code calls) run a :class:`CaptureRun` instead of the session's scheduler: :mod:`._replay` decides each copy and wait
as the blocks open and close, this module issues them on torch's streams, from the session's page-locked host
memory (``Session.capture_copies``) into the places the blocks' tensors already view (:mod:`._static`). Nothing
of the session runs on the device meanwhile: its bookkeeping would not replay, and a query of one of its events
would end the capture. The graph leaves the places holding what the session left in them, so the session's own
schedule stays true after replays; mixing eager forwards and replays is ordered by host waits at the eager
forward's edges (:meth:`._hooks.Hooks.bind_static`).

Only a component whose every hooked block is a static block with a host copy can be captured; anything else is an
:class:`OffloadError` while capturing, naming the block and the fix.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from . import _core
from ._replay import Copy, Fork, Join, Op, Ready, ReplayPlan, Use

if TYPE_CHECKING:
    import torch

    from ._static import StaticPlaces

__all__ = ["CaptureRun", "capturing"]


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph now."""
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


class CaptureRun:
    """The copies of one captured forward of a handle's static stacks (see the module doc)."""

    def __init__(self, session: _core.Session, static: StaticPlaces, copy_stream: torch.cuda.Stream) -> None:
        import torch

        self._stream = torch.cuda.current_stream()
        self._copy_stream = copy_stream
        self._plans: dict[str, ReplayPlan] = {}  # block path -> its stack's plan
        self._sources: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # block path -> (device, host) pairs
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._stacks: list[ReplayPlan] = []
        for stack in session.static_stacks():
            plan = self._plan(session, static, stack)
            self._plans.update(dict.fromkeys(stack, plan))
            self._stacks.append(plan)
        self.ops: list[Op] = []  # what was issued, in order
        self.copied_bytes = 0  # host-to-device bytes one replay copies
        for plan in self._stacks:
            self._issue(plan, plan.start())

    def _plan(self, session: _core.Session, static: StaticPlaces, stack: list[str]) -> ReplayPlan:
        """The replay plan of one static stack; the host and device bytes of each of its copies."""
        place: dict[str, int] = {}
        held: dict[int, str] = {}
        for path in stack:
            spot = static.places.get(path)
            if spot is None:
                raise _core.OffloadError(
                    f"'{path}' cannot be captured in a CUDA graph: its tensors are not bound at a fixed place (a "
                    "tensor subclass or a buffer read outside a forward); do not capture this component"
                )
            location, copies = session.capture_copies(path)
            place[path] = spot.buffer
            if location is not None:
                if tuple(location) != (spot.buffer, spot.base):
                    raise _core.OffloadError(
                        f"'{path}' is not at its place of the static schedule (it was called out of order): run "
                        "one forward of the component outside the capture first"
                    )
                held[spot.buffer] = path
            flat = static.flat(spot.buffer)
            self._sources[path] = [
                (flat[spot.base + off : spot.base + off + n], _host(addr, n)) for addr, off, n in copies if n
            ]
        return ReplayPlan(stack, place, held)

    def enter(self, path: str) -> None:
        """Block ``path`` opens: its copy if needed, the wait for it, the prefetches."""
        plan = self._owner(path)
        self._issue(plan, plan.enter(path))

    def leave(self, path: str) -> None:
        """Block ``path`` closes: the record of its last use, the prefetches."""
        plan = self._owner(path)
        self._issue(plan, plan.leave(path))

    def finish(self) -> None:
        """The forward ends: the wrap copies, the join of the copy stream."""
        for plan in self._stacks:
            self._issue(plan, plan.finish())

    def _owner(self, path: str) -> ReplayPlan:
        plan = self._plans.get(path)
        if plan is None:
            raise _core.OffloadError(
                f"'{path}' streams without a static schedule and cannot be captured in a CUDA graph: set "
                "static_slots = true for its component's layers, or do not capture it"
            )
        return plan

    def _event(self, plan: ReplayPlan, number: int) -> torch.cuda.Event:
        import torch

        key = (self._stacks.index(plan), number)
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return ev

    def _issue(self, plan: ReplayPlan, ops: list[Op]) -> None:
        """Issues ``ops`` on the capturing stream and the copy stream."""
        import torch

        for op in ops:
            if isinstance(op, Fork):
                self._copy_stream.wait_stream(self._stream)
            elif isinstance(op, Join):
                self._stream.wait_stream(self._copy_stream)
            elif isinstance(op, Copy):
                for w in op.waits:
                    self._copy_stream.wait_event(self._event(plan, w))
                with torch.cuda.stream(self._copy_stream):
                    for dst, src in self._sources[op.block]:
                        dst.copy_(src, non_blocking=True)
                        self.copied_bytes += src.numel()
                self._event(plan, op.event).record(self._copy_stream)
            elif isinstance(op, Ready):
                self._stream.wait_event(self._event(plan, op.event))
            elif isinstance(op, Use):
                self._event(plan, op.event).record(self._stream)
            self.ops.append(op)


def _host(address: int, nbytes: int) -> torch.Tensor:
    """A CPU tensor over ``nbytes`` of the session's page-locked host memory at ``address`` (no copy)."""
    import torch

    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes)
