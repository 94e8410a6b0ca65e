"""Torch ``state_dict`` of an enabled pipeline's modules. While offloaded, a module's own tensors hold placeholders
or recycled device slots, so a post-hook on every module that owns weights replaces its entries with the true
weights read from the session: bit-identical to what ``enable`` took, as ``Handle.state_dict`` gives them (CPU
tensors; views of one storage within a module share it). ``module.state_dict()``, ``save_pretrained``,
``torch.save(module.state_dict())`` and safetensors' ``save_model`` all go through ``state_dict``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn
    from torch.utils.hooks import RemovableHandle

    from . import _core
    from ._describe import Bound
    from ._edits import Signatures
    from ._storages import StorageMap

__all__ = ["StateDictHooks"]


class StateDictHooks:
    """The ``state_dict`` post-hooks of one enabled pipeline: installed once the session offloads, removed at
    ``disable`` (and by ``enable``'s undo)."""

    def __init__(
        self,
        session: _core.Session,
        storages: StorageMap,
        bound: Bound,
        sigs: Signatures,
        check: Callable[[set[int]], None],
    ) -> None:
        self._session = session
        self._storages = storages
        self._sigs = sigs  # inside Handle.editing() the edited tensors are the true weights themselves
        self._check = check  # refuses tensors changed outside weightferry before they are read
        # id(module) -> (the module, its own attribute -> the tensor's pipeline path), for parameters and persistent
        # buffers only (what torch's state_dict holds).
        self._owned: dict[int, tuple[nn.Module, dict[str, str]]] = {}
        for path, (module, attr) in bound.items():
            if path in storages.state_paths:
                self._owned.setdefault(id(module), (module, {}))[1][attr] = path
        for path, c in storages.composites.items():  # a tensor subclass: its entry is rebuilt over its parts
            if c.owner is not None:
                module, attr = c.owner
                self._owned.setdefault(id(module), (module, {}))[1][attr] = path
        self._handles: list[RemovableHandle] = []

    def install(self) -> None:
        """Registers a post-hook on every module that owns weights."""
        for module, attrs in self._owned.values():
            hook = self._hook(attrs)
            self._handles.append(module.register_state_dict_post_hook(hook))  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        """Removes every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, attrs: dict[str, str]) -> Callable[[nn.Module, dict[str, Any], str, Any], None]:
        paths = self._storages.locations
        composites = self._storages.composites
        parts = {p: [leaf for _, _, leaf in composites[p].leaves()] if p in composites else [p] for p in attrs.values()}
        sids = {paths[leaf][0] for leaves in parts.values() for leaf in leaves}

        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            self._check(sids)
            editing = self._sigs.editing or set()
            wanted = [
                p
                for a, p in attrs.items()
                if prefix + a in state_dict and not any(paths[leaf][0] in editing for leaf in parts[p])
            ]
            true: dict[str, torch.Tensor] = self._storages.true_tensors(self._session, wanted)
            for attr, path in attrs.items():
                if path in true:
                    state_dict[prefix + attr] = true[path]

        return hook
