"""What an offloaded pipeline refuses before anything changes. ``.to(...)``, ``.half()``, ``.cuda()``, ``.cpu()``
and every other conversion go through ``nn.Module._apply``, which would convert the placeholders and device views
the modules hold while offloaded, not weightferry's copy, and be undone at ``disable``: while enabled, every module of
the pipeline carries an instance ``_apply`` that raises :class:`weightferry.OffloadError` naming the fix. It is set on
every module (the root too), so the call fails at its first module, before any tensor is converted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _core

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._describe import Modules

__all__ = ["ConversionGuard"]

_MESSAGE = (
    "'{path}' is offloaded by weightferry: converting it (.to(), .half(), .float(), .cuda(), .cpu(), ...) would "
    "change the device views it holds while offloaded, not its weights; call disable() on the handle, convert the "
    "module, and enable again"
)


class ConversionGuard:
    """The instance ``_apply`` of every module of one enabled pipeline; :meth:`remove` gives each module its class's
    own ``_apply`` back (or the instance attribute it had before)."""

    def __init__(self, modules: Modules) -> None:
        self._modules = modules
        self._saved: dict[int, tuple[Any, bool]] = {}  # id(module) -> (its own instance _apply, whether it had one)

    def install(self) -> None:
        """Puts the refusing ``_apply`` on every module."""
        for path, module in self._modules.items():
            if id(module) in self._saved:
                continue  # one module object reachable at two paths
            had = "_apply" in module.__dict__
            self._saved[id(module)] = (module.__dict__.get("_apply"), had)
            module.__dict__["_apply"] = _refuse(path or type(module).__name__)

    def remove(self) -> None:
        """Restores every module's ``_apply`` (idempotent)."""
        for module in self._modules.values():
            saved = self._saved.pop(id(module), None)
            if saved is None:
                continue
            own, had = saved
            if had:
                module.__dict__["_apply"] = own
            else:
                module.__dict__.pop("_apply", None)


def _refuse(path: str) -> Callable[..., Any]:
    def _apply(*args: Any, **kwargs: Any) -> Any:
        raise _core.OffloadError(_MESSAGE.format(path=path))

    return _apply

