"""What weightferry asks of torch.compile: functions it must run as they are (never traced), and dropping compiled
graphs when the hooks a graph was traced with change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["compiler_disabled", "reset_compiled"]

_F = TypeVar("_F", bound=Callable[..., Any])


def compiler_disabled(fn: _F, reason: str | None = None) -> _F:
    """``fn`` marked for torch.compile to run as is, never traced (``torch.compiler.disable``, torch >= 2.1);
    ``reason`` is what torch.compile says when a trace that may not break (``fullgraph=True``) reaches ``fn`` (torch
    >= 2.8 takes it; older versions say only that the function was disabled)."""
    import torch

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return fn
    if reason is not None:
        try:
            return disable(fn, reason=reason)  # type: ignore[no-any-return]
        except TypeError:  # a torch without the keyword
            pass
    return disable(fn)  # type: ignore[no-any-return]


def reset_compiled() -> None:
    """Drops every compiled graph of torch.compile (``torch.compiler.reset()``): code compiled before the hooks were
    installed ran the modules without them, and keeps running without them (reading the placeholders) unless it is
    traced again; so does code compiled with them after they are removed. Every compiled model recompiles at its next
    call."""
    import torch

    reset = getattr(getattr(torch, "compiler", None), "reset", None)
    if reset is not None:
        reset()
