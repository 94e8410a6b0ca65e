"""What an offloaded pipeline refuses before anything changes, and the one conversion it takes. ``.to(...)``,
``.half()``, ``.cuda()``, ``.cpu()`` and every other conversion go through ``nn.Module._apply``, which would convert
the placeholders and device views the modules hold while offloaded, not weightferry's copy, and be undone at
``disable``: while enabled, every module of the pipeline carries an instance ``_apply`` that raises
:class:`weightferry.OffloadError` naming the fix. It is set on every module (the root too), so the call fails at its
first module, before any tensor is converted.

A ``.to(...)`` that changes nothing (every tensor already on that device and of that dtype, no memory format:
diffusers' LoRA loader calls ``text_encoder.to(device=text_encoder.device, dtype=text_encoder.dtype)``) returns the
module as the module's own ``to`` would, without converting: every module also carries an instance ``to`` that
reads the arguments with torch's own parser and checks them against the tensors the module holds.

The other exception is a change of dtype on the device during a component's forward: what diffusers' layerwise casting
does (``enable_layerwise_casting``: weights stored in fp8, each layer cast to the compute dtype for its own forward
and back after it). Inside a forward, a conversion that keeps every tensor on its device converts the tensors the
modules hold now (the bound device views, never weightferry's copy) and remembers what each held; converting back
to a tensor's own dtype gives it exactly that again (the same view), and whatever is still converted when the
component's forward ends is given back then. So weightferry streams the stored (fp8) bytes and the layer computes
as it does resident."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _core
from ._compiler import compiler_disabled
from ._overrides import Overrides

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn

    from ._describe import Modules

__all__ = ["ConversionGuard"]

_MESSAGE = (
    "'{path}' is offloaded by weightferry: converting it (.to(), .half(), .float(), .cuda(), .cpu(), ...) would "
    "change the device views it holds while offloaded, not its weights; call disable() on the handle, convert the "
    "module, and enable again"
)
_MOVE = (
    "'{path}' is offloaded by weightferry: inside a forward only a change of dtype on the device is allowed "
    "(diffusers' layerwise casting); moving it to another device would move the device views it holds, not its "
    "weights"
)


class ConversionGuard:
    """The instance ``_apply`` of every module of one enabled pipeline; :meth:`remove` gives each module its class's
    own ``_apply`` back (or the instance attribute it had before). ``in_forward`` says whether a component's
    forward is under way (when a dtype cast on the device is taken, see the module doc)."""

    def __init__(self, modules: Modules, in_forward: Callable[[], bool]) -> None:
        self._in_forward = in_forward
        self._overrides = Overrides(modules, "_apply")
        self._to = Overrides(modules, "to")
        # id(tensor) -> (the tensor, what it held before its first cast in this forward)
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def install(self) -> None:
        """Puts the guarding ``_apply`` on every module."""
        self._overrides.install(lambda path, module, _own: self._guard(module, path))
        self._to.install(lambda _path, module, own: _unchanged_to(module, own))

    def remove(self) -> None:
        """Restores every module's ``_apply`` and ``to`` (idempotent)."""
        self.forward_ended()
        self._overrides.remove()
        self._to.remove()

    def forward_ended(self) -> None:
        """Gives every tensor still cast what it held before its first cast (a forward cast it and did not cast it
        back); one that was bound anew since (its block released it) keeps its new data."""
        held, self._held = self._held, {}
        for t, before in held.values():
            if t.dtype != before.dtype:
                t.data = before

    def _guard(self, module: nn.Module, path: str) -> Callable[..., Any]:
        def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            if not self._in_forward():
                raise _core.OffloadError(_MESSAGE.format(path=path))
            self._cast(list(module.modules()) if recurse else [module], fn, path)
            return module

        # Run as is under torch.compile: traced, it would be a graph per module path (and a recompile limit).
        return compiler_disabled(_apply)

    def _cast(self, modules: list[nn.Module], fn: Callable[[torch.Tensor], torch.Tensor], path: str) -> None:
        """Converts every tensor of ``modules`` with ``fn`` in place (``.data``), after checking that none would
        leave its device."""
        import torch

        tensors = {id(t): t for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None}
        with torch.no_grad():
            for dtype, device in {(t.dtype, t.device) for t in tensors.values()}:
                if fn(torch.empty(0, dtype=dtype, device=device)).device != device:
                    raise _core.OffloadError(_MOVE.format(path=path))
            for key, t in tensors.items():
                new = fn(t)
                if new.dtype == t.dtype:
                    continue
                held = self._held.get(key)
                if held is None:
                    self._held[key] = (t, t.data)
                    t.data = new
                elif new.dtype == held[1].dtype:
                    del self._held[key]
                    t.data = held[1]  # the very view it held: no copy stays behind
                else:
                    t.data = new


def _unchanged_to(module: nn.Module, own: Callable[..., Any] | None) -> Callable[..., Any]:
    """The module's ``to`` (its instance attribute ``own``, else its class's), returning the module at once when the
    call would change no tensor of it."""
    to = own if own is not None else type(module).to.__get__(module)

    def _to(*args: Any, **kwargs: Any) -> Any:
        return module if changes_nothing(module, args, kwargs) else to(*args, **kwargs)

    return compiler_disabled(_to)


def changes_nothing(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``module.to(*args, **kwargs)`` would leave every tensor of ``module`` as it is: arguments torch's
    parser takes, no memory format, a floating or complex dtype if any, and every tensor on that device and (if
    floating or complex) of that dtype. Arguments torch refuses are not "nothing": its own ``to`` raises."""
    import torch

    try:
        parsed: Any = torch._C._nn._parse_to(*args, **kwargs)  # (device, dtype, non_blocking, memory format or None)
    except (TypeError, RuntimeError, ValueError):
        return False
    device, dtype, _non_blocking, memory_format = parsed
    if memory_format is not None or (dtype is not None and not (dtype.is_floating_point or dtype.is_complex)):
        return False
    if device is not None and device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    for t in [*module.parameters(), *module.buffers()]:
        if device is not None and (t.device.type != device.type or (device.index is not None and
                                                                     t.device.index != device.index)):
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return False
    return True
