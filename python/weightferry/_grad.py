"""Offloaded weights serve inference only. A backward through an offloaded block would need its weights after the
block's forward, when its tensors are placeholders again (torch would fail with a size mismatch deep in autograd):
when a hooked module's output requires grad, it passes through an identity whose backward raises
:class:`weightferry.OffloadError` naming the module and the fix, before any gradient of the block is computed. Under
``torch.no_grad()`` / ``torch.inference_mode()`` (how diffusers pipelines run) nothing is wrapped."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from . import _core

__all__ = ["inference_only"]

_Function: Any = None


def _function() -> Any:
    """The autograd identity, made once (torch is imported lazily)."""
    global _Function
    if _Function is None:
        import torch

        class RefuseBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, path: str) -> torch.Tensor:
                ctx.path = path
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                raise _core.OffloadError(
                    f"backward through '{ctx.path}', whose weights weightferry offloads: they are not on the device "
                    "after its forward, so offloaded modules serve inference only; run the pipeline under "
                    "torch.no_grad() or torch.inference_mode(), or disable offload to train"
                )

        _Function = RefuseBackward
    return _Function


def inference_only(output: Any, path: str) -> Any:
    """``output`` with every tensor that requires grad (in tuples, lists and dicts too) passed through the identity
    that refuses backward; ``output`` itself when none does."""
    import torch

    if isinstance(output, torch.Tensor):
        return _function().apply(output, path) if output.requires_grad else output
    if isinstance(output, tuple):
        items = [inference_only(o, path) for o in output]
        if all(a is b for a, b in zip(items, output)):
            return output
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if isinstance(output, list):
        return [inference_only(o, path) for o in output]
    if isinstance(output, MutableMapping):
        for k in list(output.keys()):
            output[k] = inference_only(output[k], path)
        return output
    return output
