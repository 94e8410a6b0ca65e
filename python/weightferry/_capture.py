"""Captured streaming: a component's forward recorded in a CUDA graph (``torch.cuda.graph``) with its static blocks
still streaming, the copies inside the graph on a copy stream forked from the capturing stream and joined to it by
events, so every replay copies the same host bytes into the same places in the same order.

While a capture is under way the hooks of the component's static blocks (eager, or the custom operators compiled
code calls) run a :class:`CaptureRun` instead of the session's scheduler: :mod:`._replay` decides each copy and wait
as the blocks open and close, and an emitter carries them out. :class:`CudaEmitter` issues them on torch's streams,
from the session's page-locked host memory into the places the blocks' tensors already view (:mod:`._static`).
Nothing of the session runs on the device meanwhile: its bookkeeping would not replay, and a query of one of its
events would end the capture. The graph leaves the places holding what the session left in them, so the session's
own schedule stays true after replays; a forward in which the session's scheduler runs after a capture waits for
replays on the host (:mod:`._hooks`).

On the simulated device, which has no graphs, :func:`simulated_capture` records the same schedule
(:class:`SimRecorder`) and :class:`SimGraph` replays it against the simulated device's memory around a forward of
the model (the model's kernels run again; the copies are the recorded ones, in the recorded order, from the host
buffers into the device places, and each block reads its place): what the tests check a capture's bytes and its
effect on the session with, without a GPU.

Only a component whose every hooked block is a static block with a host copy can be captured; anything else is an
:class:`OffloadError` while capturing, naming the block and the fix.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from . import _core
from ._replay import Copy, Fork, Join, Op, Ready, ReplayPlan, Use

if TYPE_CHECKING:
    import torch

    from ._static import StaticPlaces

__all__ = ["CaptureRun", "CudaEmitter", "SimGraph", "SimRecorder", "capturing", "not_static", "simulated_capture"]

Source = tuple[int, int, int, int, int]
"""One flat copy of a block: (device buffer, byte in it, host buffer, byte in it, bytes)."""


def not_static(path: str) -> _core.OffloadError:
    """The refusal of a capture that reaches block ``path``, which streams without a static schedule."""
    return _core.OffloadError(
        f"'{path}' streams without a static schedule and cannot be captured in a CUDA graph: set "
        "static_slots = true for its component's layers, or do not capture it"
    )


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph now."""
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


class Emitter(Protocol):
    """What carries a captured schedule out."""

    def prepare(self, path: str, sources: list[Source]) -> None: ...

    def mark(self, kind: str, path: str) -> None: ...

    def emit(self, stack: int, op: Op) -> None: ...


class CaptureRun:
    """The copies of one captured forward of a handle's static stacks (see the module doc)."""

    def __init__(self, session: _core.Session, static: StaticPlaces, emitter: Emitter) -> None:
        self.emitter = emitter
        self._plans: dict[str, ReplayPlan] = {}  # block path -> its stack's plan
        self._stacks: list[ReplayPlan] = []
        self._bytes: dict[str, int] = {}  # block path -> bytes of its copies
        for stack in session.static_stacks():
            plan = self._plan(session, static, stack)
            self._plans.update(dict.fromkeys(stack, plan))
            self._stacks.append(plan)
        self.copied_bytes = 0  # host-to-device bytes one replay copies
        self._ends = {stack[-1] for stack in session.static_stacks() if stack}  # last blocks not closed yet
        emitter.mark("start", "")
        for plan in self._stacks:
            self._issue(plan, plan.start())

    def _plan(self, session: _core.Session, static: StaticPlaces, stack: list[str]) -> ReplayPlan:
        """The replay plan of one static stack; the sources of each of its blocks' copies."""
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
            sources = [(spot.buffer, spot.base + off, hb, ho, n) for hb, ho, off, n in copies if n]
            self._bytes[path] = sum(s[4] for s in sources)
            self.emitter.prepare(path, sources)
        return ReplayPlan(stack, place, held)

    def enter(self, path: str) -> None:
        """Block ``path`` opens: its copy if needed, the wait for it, the prefetches."""
        plan = self._owner(path)
        self.emitter.mark("enter", path)
        self._issue(plan, plan.enter(path))

    def leave(self, path: str) -> None:
        """Block ``path`` closes: the record of its last use, the prefetches."""
        plan = self._owner(path)
        self.emitter.mark("leave", path)
        self._issue(plan, plan.leave(path))
        self._ends.discard(path)

    @property
    def complete(self) -> bool:
        """Whether the last block of every static stack closed: the forward's streaming is over, and the run can
        finish while the capture still records (CUDA graph trees end it when the compiled call returns)."""
        return not self._ends

    def finish(self) -> None:
        """The forward ends: the wrap copies, the join of the copy stream."""
        self.emitter.mark("finish", "")
        for plan in self._stacks:
            self._issue(plan, plan.finish())

    def _owner(self, path: str) -> ReplayPlan:
        plan = self._plans.get(path)
        if plan is None:
            raise not_static(path)
        return plan

    def _issue(self, plan: ReplayPlan, ops: list[Op]) -> None:
        stack = self._stacks.index(plan)
        for op in ops:
            if isinstance(op, Copy):
                self.copied_bytes += self._bytes[op.block]
            self.emitter.emit(stack, op)


class CudaEmitter:
    """Issues a captured schedule on torch's streams: the capturing stream (current when it is made) and
    ``copy_stream``; the copies from the session's page-locked host memory into the places' device bytes."""

    def __init__(self, session: _core.Session, static: StaticPlaces, copy_stream: torch.cuda.Stream) -> None:
        import torch

        self._session = session
        self._static = static
        self._stream = torch.cuda.current_stream()
        self._copy_stream = copy_stream
        self._pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # block -> (device, host) pairs
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}

    def prepare(self, path: str, sources: list[Source]) -> None:
        pairs = []
        for buffer, at, hb, ho, n in sources:
            flat = self._static.flat(buffer)
            pairs.append((flat[at : at + n], _host(self._session.host_address(hb) + ho, n)))
        self._pairs[path] = pairs

    def mark(self, kind: str, path: str) -> None:
        pass

    def _event(self, stack: int, number: int) -> torch.cuda.Event:
        import torch

        ev = self._events.get((stack, number))
        if ev is None:
            ev = self._events[(stack, number)] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return ev

    def emit(self, stack: int, op: Op) -> None:
        import torch

        if isinstance(op, Fork):
            self._copy_stream.wait_stream(self._stream)
        elif isinstance(op, Join):
            self._stream.wait_stream(self._copy_stream)
        elif isinstance(op, Copy):
            for w in op.waits:
                self._copy_stream.wait_event(self._event(stack, w))
            with torch.cuda.stream(self._copy_stream):
                for dst, src in self._pairs[op.block]:
                    dst.copy_(src, non_blocking=True)
            self._event(stack, op.event).record(self._copy_stream)
        elif isinstance(op, Ready):
            self._stream.wait_event(self._event(stack, op.event))
        elif isinstance(op, Use):
            self._event(stack, op.event).record(self._stream)


def _host(address: int, nbytes: int) -> torch.Tensor:
    """A CPU tensor over ``nbytes`` of the session's page-locked host memory at ``address`` (no copy)."""
    import torch

    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes)


Segment = tuple[str, str, list[Op]]
"""What the hooks did at one point of a captured forward (``"start"``, ``"enter"``, ``"leave"``, ``"finish"``; the
block), and the operations issued there."""


class SimRecorder:
    """Records a captured schedule on the simulated device (see the module doc): the segments and each block's
    sources, for a :class:`SimGraph` to replay."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.sources: dict[str, list[Source]] = {}

    def prepare(self, path: str, sources: list[Source]) -> None:
        self.sources[path] = sources

    def mark(self, kind: str, path: str) -> None:
        self.segments.append((kind, path, []))

    def emit(self, stack: int, op: Op) -> None:
        self.segments[-1][2].append(op)


class SimGraph:
    """A schedule recorded on the simulated device, replayed around a forward of the model: the forward's hooks
    hand it each point of the forward in turn (as :class:`CaptureRun`'s interface), it checks the point is the one
    recorded next and carries out the copies recorded there into the simulated device's memory (the waits are
    orders the simulated device's synchronous copies keep by themselves); each block then reads its place
    (:meth:`._static.StaticPlaces.landed`) and is poisoned when it closes, as in an eager forward."""

    def __init__(self, session: _core.Session, static: StaticPlaces, recorder: SimRecorder, copied_bytes: int):
        self._session = session
        self._static = static
        self._segments = recorder.segments
        self._sources = recorder.sources
        self.copied_bytes = copied_bytes
        self._next = 0

    def begin(self) -> None:
        self._next = 0
        self._step("start", "")

    def _step(self, kind: str, path: str) -> None:
        if self._next >= len(self._segments) or self._segments[self._next][:2] != (kind, path):
            want = self._segments[self._next][:2] if self._next < len(self._segments) else ("end", "")
            self._next = len(self._segments) + 1  # diverged: its finish does nothing more
            raise _core.OffloadError(
                f"this replay reached {kind} '{path}' where the captured forward reached {want[0]} '{want[1]}': a "
                "graph replays the forward it captured"
            )
        for op in self._segments[self._next][2]:
            if isinstance(op, Copy):
                for buffer, at, hb, ho, n in self._sources[op.block]:
                    self._session.write_device(buffer, at, bytes(self._session.read_host(hb, ho, n)))
        self._next += 1

    def enter(self, path: str) -> None:
        self._step("enter", path)
        place = self._static.places[path]
        self._static.landed(path, place.buffer, place.base)

    def leave(self, path: str) -> None:
        self._step("leave", path)
        self._static.poison(path)

    @property
    def complete(self) -> bool:
        """Whether the recorded forward's finish is next (as :attr:`CaptureRun.complete`)."""
        return self._next < len(self._segments) and self._segments[self._next][0] == "finish"

    def finish(self) -> None:
        if self._next <= len(self._segments):  # not after a divergence already refused
            self._step("finish", "")


class _Simulated:
    """What :func:`simulated_capture` gives: the recorded graph, once the captured forward ended."""

    def __init__(self, inside: bool = False) -> None:
        self.graph: SimGraph | None = None
        self.inside = inside  # the capture starts at the first static block, not with the component's forward

    def replay(self, hooks: Any, forward: Callable[[], Any]) -> Any:
        """Runs ``forward`` (a forward of the captured component) as a replay of the graph; returns its output."""
        if self.graph is None:
            raise _core.OffloadError("nothing was captured: run one forward of the component inside the block")
        hooks.simulate = self.graph
        try:
            return forward()
        finally:
            hooks.simulate = None


@contextmanager
def simulated_capture(hooks: Any, inside: bool = False) -> Iterator[_Simulated]:
    """On the simulated device: the component forward run inside the ``with`` block is captured (its schedule
    recorded, nothing of the session run); the result's ``replay(hooks, forward)`` replays it (see the module doc).
    ``inside``: the capture starts at the forward's first static block, as inductor's CUDA graph trees capture
    inside the compiled call, after the component's hooks ran. A test aid: the simulated device has no CUDA graphs."""
    if not getattr(hooks.static, "mirrored", False):
        raise _core.OffloadError("simulated_capture needs a static schedule on the simulated device")
    hooks.session_fence()  # as torch.cuda.graph synchronises the device before it captures
    result = _Simulated(inside)
    hooks.simulate = result
    try:
        yield result
    finally:
        hooks.simulate = None
