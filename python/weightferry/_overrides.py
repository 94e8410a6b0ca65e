"""An instance attribute put on every module of an enabled pipeline, in front of its class's method, and taken away
again: how the guards of ``_guards`` (``_apply``), ``_walks`` (``apply``) and ``_pickling`` (``__getstate__``)
change what a module does while offloaded. Python finds an instance attribute before a non-data descriptor of the
class, so the module's own code and torch's call the override; a module that had its own instance attribute gets
it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.nn as nn

    from ._describe import Modules

__all__ = ["Overrides"]


class Overrides:
    """Instance attribute ``name`` of every module of ``modules``, made by ``make(path, module, own)`` (``own``: the
    module's instance attribute it replaces, or ``None``)."""

    def __init__(self, modules: Modules, name: str) -> None:
        self._modules = modules
        self._name = name
        self._saved: dict[int, tuple[Any, bool]] = {}  # id(module) -> (its own instance attribute, whether it had one)

    def install(
        self, make: Callable[[str, nn.Module, Any], Any], only: Callable[[nn.Module], bool] | None = None
    ) -> None:
        """Puts the override on every module (once per module object, which may be reachable at two paths), or on
        those for which ``only(module)`` holds."""
        for path, module in self._modules.items():
            if id(module) in self._saved or (only is not None and not only(module)):
                continue
            had = self._name in module.__dict__
            own = module.__dict__.get(self._name)
            self._saved[id(module)] = (own, had)
            module.__dict__[self._name] = make(path or type(module).__name__, module, own if had else None)

    def remove(self) -> None:
        """Gives every module what it had (idempotent)."""
        for module in self._modules.values():
            saved = self._saved.pop(id(module), None)
            if saved is None:
                continue
            own, had = saved
            if had:
                module.__dict__[self._name] = own
            else:
                module.__dict__.pop(self._name, None)
