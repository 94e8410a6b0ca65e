"""Tensor subclasses described by their parts: a wrapper subclass (no storage of its own, such as torchao's
``Int8Tensor`` and ``Float8Tensor``) that implements torch's ``__tensor_flatten__`` / ``__tensor_unflatten__``
protocol is the plain tensors it names (``qdata``, ``scale``, ...), each a storage weightferry masters and streams
like any other tensor. The subclass object itself stays the module's: its inner tensor objects are bound in place
(``.data``, like plain tensors), and when they change device the object is re-pointed at the device too
(:func:`settle`), so the model's own kernels run on the device views unchanged. Its state-dict entry is the
subclass rebuilt over the true parts (:func:`rebuild`).

A part's path is its subclass's path, ``#`` and the part's name (``blocks.0.attn.to_q.weight#qdata``): a name the
pipeline format accepts and no torch attribute has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

__all__ = ["SEP", "Composite", "is_composite", "rebuild", "settle"]

SEP = "#"
"""Joins a tensor subclass's path and the name of one of its parts."""


class Composite:
    """One tensor subclass described by its parts: the object, its flatten context, and per inner attribute the
    part's path (a plain tensor) or a nested :class:`Composite`. ``owner`` is ``(module, attribute)`` for the
    outermost one (where the module holds it), ``None`` for a nested one."""

    __slots__ = ("ctx", "owner", "parts", "path", "tensor")

    def __init__(self, tensor: torch.Tensor, path: str, owner: tuple[nn.Module, str] | None) -> None:
        names, ctx = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        self.tensor = tensor
        self.path = path
        self.ctx = ctx
        self.owner = owner
        self.parts: dict[str, str | Composite] = {}
        for name in names:
            inner = getattr(tensor, name)
            part = f"{path}{SEP}{name}"
            self.parts[name] = Composite(inner, part, None) if is_composite(inner) else part

    def leaves(self) -> list[tuple[torch.Tensor, str, str]]:
        """``(holder, attribute, part path)`` of every plain part, nested ones included."""
        out: list[tuple[Any, str, str]] = []
        for name, part in self.parts.items():
            if isinstance(part, Composite):
                out.extend(part.leaves())
            else:
                out.append((self.tensor, name, part))
        return out


def is_composite(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass without storage of its own that names its parts (``__tensor_flatten__``
    and ``__tensor_unflatten__``)."""
    import torch

    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    protocol = ("__tensor_flatten__", "__tensor_unflatten__")
    if not all(callable(getattr(cls, name, None)) for name in protocol):
        return False
    try:
        return t.numel() > 0 and t.untyped_storage().data_ptr() == 0 and not t.is_meta
    except RuntimeError:  # a wrapper subclass's storage is not its bytes
        return True


def rebuild(c: Composite, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The subclass of ``c`` rebuilt over ``parts`` (part path -> tensor), as its ``__tensor_unflatten__`` builds it."""
    inner = {name: rebuild(p, parts) if isinstance(p, Composite) else parts[p] for name, p in c.parts.items()}
    t = c.tensor
    return type(t).__tensor_unflatten__(inner, c.ctx, t.size(), t.stride())  # type: ignore[attr-defined,no-any-return]


def settle(c: Composite) -> None:
    """Re-points the subclass object at the device its parts are on now (``.data`` of a subclass rebuilt over its
    current inner tensors: the object, its attributes and the inner tensor objects stay), inner ones first. Nothing
    when it is there already."""
    for part in c.parts.values():
        if isinstance(part, Composite):
            settle(part)
    t = c.tensor
    first = getattr(t, next(iter(c.parts)))
    if t.device == first.device:
        return
    inner = {name: getattr(t, name) for name in c.parts}
    moved = type(t).__tensor_unflatten__(inner, c.ctx, t.size(), t.stride())  # type: ignore[attr-defined]
    t.data = moved
    for name, value in inner.items():  # the object keeps its own inner tensors
        setattr(t, name, value)
