"""What an offloaded pipeline refuses before anything changes. ``.to(...)``, ``.half()``, ``.cuda()``, ``.cpu()``
and every other conversion go through ``nn.Module._apply``, which would convert the placeholders and device views
the modules hold while offloaded, not weightferry's copy, and be undone at ``disable``: while enabled, every module of
the pipeline carries an instance ``_apply`` that raises :class:`weightferry.OffloadError` naming the fix. It is set on
every module (the root too), so the call fails at its first module, before any tensor is converted.

``load_state_dict`` would copy into those views too (lost at the next forward and at ``disable``): while enabled,
a load whose state dict holds a key of a weight weightferry manages raises :class:`weightferry.OffloadError` at
the first pipeline module torch visits, before it loads anything below; loads of other tensors (an adapter's new
weights, say) go through."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _core

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.utils.hooks import RemovableHandle

    from ._describe import Bound, Modules
    from ._storages import StorageMap

__all__ = ["ConversionGuard", "LoadGuard"]

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


_LOAD_MESSAGE = (
    "'{path}' is offloaded by weightferry: load_state_dict would write its weights ('{key}' among them) into the "
    "views it holds while offloaded, not into weightferry's copy, and lose them; call disable() on the handle, load, "
    "and enable again (nothing was loaded)"
)


class LoadGuard:
    """``load_state_dict`` pre-hooks on every module of one enabled pipeline that has managed weights below it."""

    def __init__(self, modules: Modules, storages: StorageMap, bound: Bound) -> None:
        # module path -> the state-dict keys, relative to the module, of the managed weights at or below it.
        below: dict[str, list[str]] = {}
        for path in bound:
            if path not in storages.state_paths:
                continue
            parts = path.split(".")
            for i in range(len(parts)):
                owner = ".".join(parts[:i])
                if owner in modules:
                    below.setdefault(owner, []).append(".".join(parts[i:]))
        self._below = below
        self._modules = modules
        self._handles: list[RemovableHandle] = []

    def install(self) -> None:
        """Registers the refusing pre-hook on every module with managed weights below it."""
        for path, keys in self._below.items():
            hook = _refuse_load(path or type(self._modules[path]).__name__, keys)
            self._handles.append(self._modules[path].register_load_state_dict_pre_hook(hook))  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        """Removes every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _refuse_load(path: str, keys: list[str]) -> Callable[..., None]:
    def hook(module: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for key in keys:
            if prefix + key in state_dict:
                raise _core.OffloadError(_LOAD_MESSAGE.format(path=path, key=prefix + key))

    return hook
