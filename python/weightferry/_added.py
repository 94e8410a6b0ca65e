"""Tensors an offloaded component gained after ``enable``: the adapter layers peft adds (``add_adapter``,
``load_lora_adapter``, a pipeline's ``load_lora_weights``) are ordinary tensors where the component runs, outside
weightferry's plan. :class:`AddedTensors` remembers every parameter and buffer of the components as ``enable`` left
them and counts the bytes of those that came since and sit on the components' device: ``Handle.stats()`` reports
them (``added_device_bytes``), ``Handle.retune()`` plans the weights within what a byte-count ``device_budget``
leaves beside them, and an ``editing()`` block that added some (a LoRA load) retunes so on leaving when the plan no
longer fits beside them. Added anywhere else (``add_adapter`` on the component), torch's global registration hooks
(a parameter, buffer or module registered on any module) mark them :attr:`AddedTensors.maybe_grew`, so the next
forward of a component counts them once and warns when the plan no longer fits beside them (a retune inside a
forward would drop the compiled code that may be running it)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["AddedTensors"]


class AddedTensors:
    """The tensors ``components`` hold beyond those they held when this was made (see the module doc)."""

    def __init__(self, components: list[torch.nn.Module], device: str | torch.device) -> None:
        import torch

        self._components = components
        self._device = torch.device(device)
        # By identity (a tensor's == compares elements), weakly: a tensor removed since is not kept alive.
        self._known = {id(t): weakref.ref(t) for t in self._tensors()}
        self.maybe_grew = False  # something was registered on some module since the last count
        self._hooks: list[Any] = []

    def watch(self) -> None:
        """Sets :attr:`maybe_grew` on every registration of a parameter, buffer or module anywhere (torch's global
        hooks: a flag per call, the count waits for the next forward)."""
        from torch.nn.modules import module as m

        def grew(*args: object) -> None:
            self.maybe_grew = True

        for register in (m.register_module_parameter_registration_hook, m.register_module_buffer_registration_hook,
                         m.register_module_module_registration_hook):
            self._hooks.append(register(grew))

    def unwatch(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def _tensors(self) -> Iterator[torch.Tensor]:
        for component in self._components:
            yield from component.parameters()
            yield from component.buffers()

    def device_bytes(self) -> int:
        """Bytes of the tensors added since, on the components' device (tensors sharing a storage counted once)."""
        total, seen = 0, set()
        for t in self._tensors():
            ref = self._known.get(id(t))
            if (ref is not None and ref() is t) or t.device != self._device:
                continue
            try:
                key = (t.untyped_storage().data_ptr(), t.storage_offset())
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: by object
                key = (id(t), 0)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total
