"""The schedule a captured CUDA graph replays: the copies and waits of one pass of a static stack, decided while the
graph is captured (:mod:`._capture` turns them into stream operations), and the order check that proves a schedule
safe over repeated replays.

While a forward is captured the session's scheduler cannot run: its host bookkeeping would not be replayed, and a
query of one of its events would end the capture. A static schedule makes that unnecessary: every block lands in
the same place on every pass, so one pass of copies, replayed, is the whole schedule. :class:`ReplayPlan` decides it
with the rules of the session's block stack, stated over places instead of slots:

- the graph starts with the places holding what the session left in them (``held``: the blocks of the previous
  pass's end, and the next pass's first blocks it prefetched), and ends with them holding the same, so the
  session's bookkeeping stays true after any number of replays (the last copies of the graph are that wrap);
- a block whose place does not hold it is copied there; the block's kernels wait for that copy (invariant 1);
- a copy into a place waits for the last use of the block it overwrites in this graph (invariant 2); a block from
  before the graph was read before it started, and the graph's copy stream forks from the capturing stream;
- after a block opens and after it closes, the following blocks whose places are free are prefetched, in order:
  a place is free unless its block is open, or will be read before the block to be copied into it.

:func:`hazards` runs a plan's operations over several replays on two streams with vector clocks and lists every
read that can see the wrong bytes and every copy that can overwrite a block still being read. ``fault`` builds the
broken variants the tests show it catches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = ["Copy", "Fork", "Join", "Op", "Ready", "ReplayPlan", "Use", "hazards"]


@dataclass(frozen=True)
class Fork:
    """The copy stream waits for the capturing stream (the graph's start)."""


@dataclass(frozen=True)
class Copy:
    """On the copy stream: wait for the events ``waits``, copy ``block`` into ``place``, record event ``event``."""

    block: str
    place: int
    event: int
    waits: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """The capturing stream waits for event ``event``, the copy of ``block`` (before the block's kernels)."""

    block: str
    event: int


@dataclass(frozen=True)
class Use:
    """After ``block``'s kernels: the capturing stream records event ``event``, its last use of ``place``."""

    block: str
    place: int
    event: int


@dataclass(frozen=True)
class Join:
    """The capturing stream waits for everything on the copy stream (the graph's end)."""


Op = Union[Fork, Copy, Ready, Use, Join]

FAULTS = ("skip_last_use_wait", "skip_ready_wait", "skip_wrap")


class ReplayPlan:
    """The operations of one captured pass of one static stack, decided as its blocks open and close.

    ``order``: the stack's blocks in execution order; ``place``: each block's place (blocks sharing a place share
    its device bytes); ``held``: place -> the block it holds when the graph starts. ``fault``: one of
    :data:`FAULTS`, a deliberately broken rule (tests only)."""

    def __init__(self, order: list[str], place: dict[str, int], held: dict[int, str], fault: str | None = None):
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        self._order = order
        self._pos = {b: i for i, b in enumerate(order)}
        self._place = place
        self.held = dict(held)
        self._fault = fault
        self._occupant: dict[int, str | None] = {p: held.get(p) for p in set(place.values())}
        self._last_use: dict[int, int | None] = dict.fromkeys(self._occupant)
        self._pending: dict[str, int] = {}  # block -> the event of its copy in this graph, not waited for yet
        self._open: set[str] = set()
        self._cursor = -1  # position of the block opened last
        self._events = 0

    def _event(self) -> int:
        self._events += 1
        return self._events

    def start(self) -> list[Op]:
        return [Fork()]

    def enter(self, block: str) -> list[Op]:
        """The block opens: its copy if its place does not hold it, the wait for its copy, then prefetches."""
        ops: list[Op] = []
        if self._occupant[self._place[block]] != block:
            ops.append(self._copy(block))
        event = self._pending.pop(block, None)
        if event is not None and self._fault != "skip_ready_wait":
            ops.append(Ready(block, event))
        self._open.add(block)
        self._cursor = self._pos[block]
        return ops + self._prefetch()

    def leave(self, block: str) -> list[Op]:
        """The block closes: the record of its last use, then prefetches."""
        place, event = self._place[block], self._event()
        self._open.discard(block)
        self._last_use[place] = event
        return [Use(block, place, event), *self._prefetch()]

    def finish(self) -> list[Op]:
        """The graph ends: each place given back the block it held at the start (the wrap), then the join."""
        ops: list[Op] = []
        if self._fault != "skip_wrap":
            for p, block in sorted(self.held.items()):
                if self._occupant[p] != block:
                    ops.append(self._copy(block))
        return [*ops, Join()]

    def _copy(self, block: str) -> Copy:
        place = self._place[block]
        last = self._last_use[place]
        waits = () if last is None or self._fault == "skip_last_use_wait" else (last,)
        event = self._event()
        self._occupant[place] = block
        self._last_use[place] = None  # earlier reads of the place are ordered before this copy already
        self._pending[block] = event
        return Copy(block, place, event, waits)

    def _free_for(self, block: str) -> bool:
        """Whether ``block`` may be copied into its place now (see the module doc)."""
        o = self._occupant[self._place[block]]
        if o is None:
            return True
        if o in self._open:
            return False
        return not self._cursor < self._pos[o] < self._pos[block]  # o is read before block: keep it

    def _prefetch(self) -> list[Op]:
        ops: list[Op] = []
        for block in self._order[self._cursor + 1 :]:
            if self._occupant[self._place[block]] == block:
                continue
            if not self._free_for(block):
                break
            ops.append(self._copy(block))
        return ops


def hazards(ops: list[Op], held: dict[int, str], replays: int = 3) -> list[str]:
    """Runs ``ops`` (one captured pass) ``replays`` times on two streams, the places holding ``held`` before the
    first, and lists every hazard: a block's kernels that can read bytes other than the block's (``read-before-ready``:
    its own copy may not have completed; ``read-wrong-block``: its place holds another block), a copy that can
    overwrite a block still being read (``overwrite-before-last-use``), and a replay that leaves a place holding
    another block than it started with (``replay-changed-places``). Streams ``C`` (capturing) and ``X`` (copies) carry
    vector clocks; an event carries the clock of its record; a wait joins it."""
    clock = {"C": [0, 0], "X": [0, 0]}
    own = {"C": 0, "X": 1}
    zero = (0, 0)
    writes: dict[int, list[tuple[str, tuple[int, int]]]] = {p: [(b, zero)] for p, b in held.items()}
    reads: dict[int, list[tuple[str, tuple[int, int]]]] = {}
    found: list[str] = []

    def tick(s: str) -> tuple[int, int]:
        clock[s][own[s]] += 1
        return (clock[s][0], clock[s][1])

    def join(s: str, vc: tuple[int, int]) -> None:
        clock[s] = [max(a, b) for a, b in zip(clock[s], vc)]

    for n in range(replays):
        events: dict[int, tuple[int, int]] = {}
        for op in ops:
            if isinstance(op, Fork):
                join("X", tick("C"))
            elif isinstance(op, Join):
                join("C", tuple(clock["X"]))  # type: ignore[arg-type]
            elif isinstance(op, Copy):
                for w in op.waits:
                    join("X", events[w])
                vc = events[op.event] = tick("X")
                for block, r in reads.get(op.place, []):
                    if not r[0] <= vc[0]:
                        found.append(f"replay {n}: overwrite-before-last-use: {op.block} over {block}")
                writes.setdefault(op.place, []).append((op.block, vc))
            elif isinstance(op, Ready):
                join("C", events[op.event])
            else:
                vc = events[op.event] = tick("C")
                found += [f"replay {n}: {h}" for h in _read_hazards(op, vc, writes.get(op.place, []))]
                reads.setdefault(op.place, []).append((op.block, vc))
        for p, block in held.items():
            if writes[p][-1][0] != block:
                found.append(f"replay {n}: replay-changed-places: place {p} holds {writes[p][-1][0]}, not {block}")
    return found


def _read_hazards(use: Use, vc: tuple[int, int], writes: list[tuple[str, tuple[int, int]]]) -> list[str]:
    """The hazards of the read of ``use.block`` at clock ``vc`` against the copies into its place so far."""
    before = [(b, w) for b, w in writes if w[1] <= vc[1]]  # copies ordered before the read
    racing = [(b, w) for b, w in writes if w[1] > vc[1]]  # copies the read may overlap (none is ordered after it)
    if racing:  # the latest copy the read may overlap: its own (not waited for) or one over it (not ordered after)
        b = racing[-1][0]
        kind = "read-before-ready" if b == use.block else "overwrite-before-last-use"
        return [f"{kind}: {use.block} against the copy of {b}"]
    if not before or before[-1][0] != use.block:
        return [f"read-wrong-block: {use.block} reads {before[-1][0] if before else 'nothing'}"]
    return []
