"""``Module.apply(fn)`` on an enabled pipeline: torch's walk over a module and its submodules, the way diffusers edits
weights in place (``fuse_lora`` and ``unfuse_lora`` merge each LoRA layer's delta into its base weight through
``apply``; ``apply(init_weights)`` initialises them). While offloaded a streamed weight is an empty placeholder
between forwards, so such a walk would meet placeholders (torch's shape errors) or device copies weightferry's copy
never sees. While enabled, every module of the pipeline carries an instance ``apply`` that runs the walk inside
``Handle.editing(module)``: the weights of that module are ordinary CPU tensors holding their true values during the
walk, and what it changed is written through after it, as an edit inside ``editing()`` is. A walk started inside an
``editing()`` block or during a forward runs as is (its nested walks, torch's ``apply`` calling each child's, too)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.nn as nn

    from ._describe import Modules

__all__ = ["WalkGuard"]


class WalkGuard:
    """The instance ``apply`` of every module of one enabled pipeline; :meth:`remove` gives each module its class's
    own ``apply`` back (or the instance attribute it had before). ``editing(module)`` opens ``Handle.editing`` on the
    module; ``as_is()`` says whether a walk runs unchanged now (inside an editing block or a forward)."""

    def __init__(
        self,
        modules: Modules,
        editing: Callable[[nn.Module], AbstractContextManager[None]],
        as_is: Callable[[], bool],
    ) -> None:
        self._modules = modules
        self._editing = editing
        self._as_is = as_is
        self._saved: dict[int, tuple[Any, bool]] = {}  # id(module) -> (its own instance apply, whether it had one)

    def install(self) -> None:
        """Puts the editing ``apply`` on every module."""
        for module in self._modules.values():
            if id(module) in self._saved:
                continue  # one module object reachable at two paths
            had = "apply" in module.__dict__
            own = module.__dict__.get("apply")
            self._saved[id(module)] = (own, had)
            module.__dict__["apply"] = self._walk(module, own if had else None)

    def remove(self) -> None:
        """Restores every module's ``apply`` (idempotent)."""
        for module in self._modules.values():
            saved = self._saved.pop(id(module), None)
            if saved is None:
                continue
            own, had = saved
            if had:
                module.__dict__["apply"] = own
            else:
                module.__dict__.pop("apply", None)

    def _walk(self, module: nn.Module, own: Callable[..., Any] | None) -> Callable[..., Any]:
        walk = own if own is not None else type(module).apply.__get__(module)

        def apply(fn: Callable[[nn.Module], None]) -> Any:
            if self._as_is():
                return walk(fn)
            with self._editing(module):
                return walk(fn)

        return apply
