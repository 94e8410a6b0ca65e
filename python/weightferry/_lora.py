"""diffusers' LoRA loading through an enabled pipeline. A diffusers pipeline that loads LoRAs names the components a
LoRA goes into in its class's ``_lora_loadable_modules`` (diffusers' LoRA loader mixins), and its methods that load,
fuse, unfuse and unload read or write the weights of those components directly: FLUX's ``load_lora_weights`` reads
each targeted layer's weight shape to widen a layer whose LoRA is wider (Control LoRAs), the pipeline's
``unfuse_lora`` unmerges every LoRA layer of a component in place (not through ``Module.apply``, see ``_walks``).
While offloaded a streamed weight is a placeholder between forwards (NaN values), so those calls would read NaN or
write nothing that lasts. While enabled, such a pipeline carries instance versions of the four methods that run the
pipeline's own inside ``Handle.editing()`` of the loadable components weightferry offloads: their weights are
ordinary tensors of their true shapes and values meanwhile, what the call changed in them is written through, and
the adapter layers it added are placed where the component runs (``_edits``). A call inside an ``editing()`` block
or during a forward runs as is; a pipeline without ``_lora_loadable_modules`` is left alone."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.nn as nn

    from ._describe import Modules

__all__ = ["LoraGuard"]

# The methods of diffusers' LoRA loader mixins that read or write the base weights of the loadable components.
_METHODS = ("load_lora_weights", "fuse_lora", "unfuse_lora", "unload_lora_weights")


class LoraGuard:
    """The instance LoRA methods (``_METHODS``) of one enabled diffusers pipeline;
    :meth:`remove` gives the pipeline what it had."""

    def __init__(
        self,
        pipeline: object,
        modules: Modules,
        editing: Callable[..., AbstractContextManager[None]],
        as_is: Callable[[], bool],
    ) -> None:
        self._pipeline = pipeline
        self._modules = modules
        self._editing = editing
        self._as_is = as_is
        self._saved: dict[str, tuple[Any, bool]] = {}  # method -> (the instance attribute it had, whether it had one)

    def install(self) -> None:
        """Puts the editing methods on the pipeline, when it is a diffusers pipeline that loads LoRAs."""
        names = getattr(type(self._pipeline), "_lora_loadable_modules", None)
        attrs = getattr(self._pipeline, "__dict__", None)
        if not isinstance(names, (list, tuple)) or not isinstance(attrs, dict):
            return
        for method in _METHODS:
            own = getattr(self._pipeline, method, None)
            if not callable(own) or method in self._saved:
                continue
            self._saved[method] = (attrs.get(method), method in attrs)
            attrs[method] = self._wrap(own, list(names))

    def remove(self) -> None:
        """Gives the pipeline the methods it had (idempotent)."""
        attrs = getattr(self._pipeline, "__dict__", {})
        for method, (own, had) in self._saved.items():
            if had:
                attrs[method] = own
            else:
                attrs.pop(method, None)
        self._saved.clear()

    def _components(self, names: list[str]) -> list[nn.Module]:
        """The loadable components that are components of this handle (by identity)."""
        ours = {id(m) for path, m in self._modules.items() if path and "." not in path}
        found = [getattr(self._pipeline, n, None) for n in names]
        return [m for m in found if m is not None and id(m) in ours]

    def _wrap(self, own: Callable[..., Any], names: list[str]) -> Callable[..., Any]:
        @functools.wraps(own)
        def call(*args: Any, **kwargs: Any) -> Any:
            components = [] if self._as_is() else self._components(names)
            if not components:
                return own(*args, **kwargs)
            with self._editing(*components):
                return own(*args, **kwargs)

        return call
