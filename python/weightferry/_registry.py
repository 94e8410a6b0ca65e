"""The tensors enabled handles manage, process-wide: a second ``enable`` over any of them is refused."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["is_offloaded", "mark"]

# Every tensor object an enabled handle manages (id -> weak reference; not a WeakSet, whose lookup compares tensors
# with ``==``).
_OFFLOADED: dict[int, weakref.ref[torch.Tensor]] = {}


def is_offloaded(t: torch.Tensor) -> bool:
    """Whether an enabled handle manages ``t``."""
    ref = _OFFLOADED.get(id(t))
    return ref is not None and ref() is t


def mark(tensors: Iterable[torch.Tensor], on: bool) -> None:
    """Records ``tensors`` as managed (``on``) or no longer managed."""
    for t in tensors:
        if on:
            _OFFLOADED[id(t)] = weakref.ref(t)
        elif is_offloaded(t):
            del _OFFLOADED[id(t)]
