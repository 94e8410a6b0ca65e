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

from ._overrides import Overrides

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
        self._editing = editing
        self._as_is = as_is
        self._overrides = Overrides(modules, "apply")

    def install(self) -> None:
        """Puts the editing ``apply`` on every module."""
        self._overrides.install(lambda _path, module, own: self._walk(module, own))

    def remove(self) -> None:
        """Restores every module's ``apply`` (idempotent)."""
        self._overrides.remove()

    def _walk(self, module: nn.Module, own: Callable[..., Any] | None) -> Callable[..., Any]:
        walk = own if own is not None else type(module).apply.__get__(module)

        def apply(fn: Callable[[nn.Module], None]) -> Any:
            if self._as_is():
                return walk(fn)
            with self._editing(module):
                return walk(fn)

        return apply
