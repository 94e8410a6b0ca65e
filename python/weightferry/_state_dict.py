"""Torch ``state_dict`` of an enabled pipeline's modules. While offloaded, a module's own tensors hold placeholders
or recycled device slots, so a post-hook on every module that owns weights replaces its entries with the true
weights read from the session: bit-identical to what ``enable`` took, as ``Handle.state_dict`` gives them (CPU
tensors; views of one storage within a module share it). ``module.state_dict()``, ``save_pretrained``,
``torch.save(module.state_dict())`` and safetensors' ``save_model`` all go through ``state_dict``.

A module whose weights have attached parts (tensors of a subclass's Python state: bitsandbytes' ``quant_state``,
which its ``_save_to_state_dict`` writes as ``weight.absmax``, ``weight.quant_map``, ...) gets a pre-hook too: it
lends those tensors their true bytes (CPU tensors read from the session) while the module writes its entries, and
the post-hook gives them back what they held."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._storages import assign

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn
    from torch.utils.hooks import RemovableHandle

    from . import _core
    from ._describe import Bound
    from ._edits import Signatures
    from ._storages import StorageMap, View

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
        # id(module) -> ([(a lent attached part's view, what its tensor held before)], keep_vars) while it writes
        self._lent: dict[int, tuple[list[tuple[View, torch.Tensor]], bool]] = {}

    def install(self) -> None:
        """Registers a post-hook on every module that owns weights, and a pre-hook on those whose weights have
        attached parts."""
        for module, attrs in self._owned.values():
            attached = [part for path in attrs.values() for part in self._storages.attached.get(path, [])]
            if attached:
                pre = self._lend(attached)
                self._handles.append(module.register_state_dict_pre_hook(pre))  # type: ignore[no-untyped-call]
            hook = self._hook(attrs)
            self._handles.append(module.register_state_dict_post_hook(hook))  # type: ignore[no-untyped-call]

    def _lend(self, paths: list[str]) -> Callable[[nn.Module, str, bool], None]:
        """The pre-hook lending the attached parts at ``paths`` their true bytes (nothing inside ``editing()``,
        where they hold them already)."""
        locations, views = self._storages.locations, self._storages.views
        lent_views = [views[locations[p][0]][locations[p][1]] for p in paths]
        sids = {locations[p][0] for p in paths}

        def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            if self._sigs.editing is not None:
                return
            self._check(sids)
            true = self._storages.true_tensors(self._session, paths)
            self._lent[id(module)] = ([(v, v.tensor.data) for v in lent_views], keep_vars)
            for v, p in zip(lent_views, paths):
                assign(v.tensor, true[p])

        return pre

    def _give_back(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        """Gives the lent parts back what they held; an entry that is a lent tensor itself (``keep_vars``) becomes
        a copy of the true bytes."""
        lent, keep_vars = self._lent.pop(id(module), ([], False))
        if keep_vars:  # otherwise every entry is a detached tensor of its own
            by_id = {id(v.tensor): v for v, _ in lent}
            for key, value in state_dict.items():
                if id(value) in by_id:
                    state_dict[key] = value.detach().clone()
        for v, old in lent:
            assign(v.tensor, old)
        self._sigs.record([v for v, _ in lent])

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
            self._give_back(module, state_dict)
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
