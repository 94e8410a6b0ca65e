"""Forwards on another CUDA stream than the one weightferry was enabled on (a side stream of the caller's, or the
stream inductor's CUDA graph trees run their warm-up on): the session orders its copies against the enable stream
only (each block's kernels wait there for its copy; a slot is reused after an event recorded there), so the hooks
bridge the two streams around each block: after the block's copy is ordered, the forward's stream waits for the
enable stream; before the block is released, the enable stream waits for the forward's stream. Two events a block,
and only off the enable stream; on it nothing changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["StreamBridge"]


class StreamBridge:
    """Orders a forward on another stream with the enable stream (see the module doc)."""

    def __init__(self, enabled_on: int, current: Callable[[], int], device: Any) -> None:
        import torch

        self._enabled_on = enabled_on  # the raw enable stream
        self._current = current  # reads torch's current raw stream (cheap)
        self._device = device
        self._enable_stream = torch.cuda.current_stream(device)  # made at enable, on the enable stream

    def foreign(self) -> torch.cuda.Stream | None:
        """torch's current stream when it is not the enable stream, else None."""
        if self._current() == self._enabled_on:
            return None
        import torch

        return torch.cuda.current_stream(self._device)

    def loaded(self, stream: torch.cuda.Stream) -> None:
        """After the session ordered a block's copy on the enable stream: ``stream`` waits for it too."""
        stream.wait_stream(self._enable_stream)

    def releasing(self, stream: torch.cuda.Stream) -> None:
        """Before the session releases a block (its last use recorded on the enable stream): the enable stream waits
        for the block's kernels on ``stream``."""
        self._enable_stream.wait_stream(stream)
