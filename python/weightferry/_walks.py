"""``Module.apply(fn)`` on an enabled pipeline: torch's walk over a module and its submodules, the way diffusers edits
weights in place (``fuse_lora`` and ``unfuse_lora`` merge each LoRA layer's delta into its base weight through
``apply``; ``apply(init_weights)`` initialises them). While offloaded a streamed weight is a placeholder between
forwards, so such a walk would meet placeholders (NaN values, and writes that reach no weight) or device copies
weightferry's copy never sees. While enabled, every module of the pipeline carries an instance ``apply`` that runs the
walk inside ``Handle.editing(module)``: the weights of that module are ordinary CPU tensors holding their true values
during the walk, and what it changed is written through after it, as an edit inside ``editing()`` is. A walk started
inside an ``editing()`` block or during a forward runs as is (its nested walks, torch's ``apply`` calling each child's,
too).

The same holds for the other methods by which the libraries rewrite a module's own weights from their values
(:data:`WALKS`): diffusers' attention projection fusion (``fuse_projections`` / ``unfuse_projections`` of
``AttentionModuleMixin`` and of the older ``Attention``: what a model's or a pipeline's ``fuse_qkv_projections``
calls on each attention) and peft's tuner-layer ``merge`` / ``unmerge`` (what ``merge_and_unload`` calls on each
adapter layer). Each module whose class defines one of them carries an instance attribute of that name that runs
it inside ``Handle.editing(module)``, as ``apply``."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ._overrides import Overrides

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.nn as nn

    from ._describe import Modules

__all__ = ["WALKS", "WalkGuard"]

WALKS = ("apply", "fuse_projections", "unfuse_projections", "merge", "unmerge")
"""The methods run inside ``editing(module)`` while enabled: torch's walk (on every module), and where a module's
class defines them, diffusers' attention projection fusion and peft's tuner-layer merge."""


class WalkGuard:
    """The instance ``apply`` of every module of one enabled pipeline, and the instance attribute of each other name
    of :data:`WALKS` on the modules whose class defines it; :meth:`remove` gives each module its class's own method
    back (or the instance attribute it had before). ``editing(module)`` opens ``Handle.editing`` on the
    module; ``as_is()`` says whether a walk runs unchanged now (inside an editing block or a forward)."""

    def __init__(
        self,
        modules: Modules,
        editing: Callable[[nn.Module], AbstractContextManager[None]],
        as_is: Callable[[], bool],
    ) -> None:
        self._editing = editing
        self._as_is = as_is
        self._overrides = [Overrides(modules, name) for name in WALKS]

    def install(self) -> None:
        """Puts the editing methods on the modules."""
        for overrides, name in zip(self._overrides, WALKS):
            overrides.install(self._maker(name), only=functools.partial(_defines, name=name))

    def remove(self) -> None:
        """Restores every module's methods (idempotent)."""
        for overrides in self._overrides:
            overrides.remove()

    def _maker(self, name: str) -> Callable[[str, nn.Module, Any], Any]:
        return lambda _path, module, own: self._walk(module, name, own)

    def _walk(self, module: nn.Module, name: str, own: Callable[..., Any] | None) -> Callable[..., Any]:
        walk = own if own is not None else getattr(type(module), name).__get__(module)

        @functools.wraps(walk)  # its signature too: diffusers inspects a peft layer's merge for its arguments
        def edit(*args: Any, **kwargs: Any) -> Any:
            if self._as_is():
                return walk(*args, **kwargs)
            with self._editing(module):
                return walk(*args, **kwargs)

        return edit


def _defines(module: nn.Module, name: str) -> bool:
    """Whether the module's class has a method ``name``."""
    return callable(getattr(type(module), name, None))
