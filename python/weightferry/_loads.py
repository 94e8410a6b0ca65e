"""``load_state_dict`` into an enabled pipeline. While offloaded, the modules' own tensors hold placeholders or
device slots, so torch's copy into them would be lost: a pre-hook on every module with managed weights below it
takes the state dict's entries for those weights out of torch's hands and writes them through weightferry's copy
(:mod:`._writes`) before torch loads anything else, and the module's post-hook strikes those keys from torch's
missing keys. Shapes are checked before anything is written (a mismatch raises :class:`weightferry.OffloadError`,
nothing loaded); dtypes convert as torch's ``copy_`` converts. Keys of other tensors (an adapter's weights added
after ``enable``, say) are loaded by torch as usual, strict and non-strict alike. ``assign=True`` of a managed
weight is refused: the module's tensor object stays weightferry's, so it cannot become the state dict's."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from . import _core

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.utils.hooks import RemovableHandle

    from ._describe import Bound, Modules
    from ._edits import Signatures
    from ._storages import StorageMap
    from ._writes import Writer

__all__ = ["LoadHooks"]


class LoadHooks:
    """The ``load_state_dict`` pre- and post-hooks of one enabled pipeline."""

    def __init__(
        self, modules: Modules, storages: StorageMap, bound: Bound, writer: Writer, sigs: Signatures
    ) -> None:
        # module path -> [(state-dict key relative to the module, pipeline path)] of the managed weights below it.
        below = _by_module([p for p in bound if p in storages.state_paths], modules)
        self._below = below
        self._modules = modules
        self._writer = writer
        self._sigs = sigs  # inside Handle.editing() torch loads into the edited CPU tensors itself
        self._sid = {path: sid for path, (sid, _) in storages.state_paths.items()}
        # module path -> [(state-dict key relative to the module, path)] of the tensor subclasses below it streamed
        # by their parts (described by them, or with attached parts): a load into them is refused before anything
        # is written.
        by_parts = [*storages.composites, *storages.attached]
        self._classes = {p: type(getattr(*bound[p])).__qualname__ for p in storages.attached}
        self._classes.update({p: type(c.tensor).__qualname__ for p, c in storages.composites.items()})
        self._composite_below = _by_module(by_parts, modules)
        for owner in self._composite_below:
            below.setdefault(owner, [])
        self._handles: list[RemovableHandle] = []
        # Per thread: [(module, the keys its pre-hook wrote)] of the loads under way, struck from the missing keys by
        # the module's post-hook.
        self._written = threading.local()

    def install(self) -> None:
        """Registers the hooks on every module with managed weights below it."""
        for path, keys in self._below.items():
            module = self._modules[path]
            name = path or type(module).__name__
            pre = self._pre(name, keys, self._composite_below.get(path, []))
            self._handles.append(module.register_load_state_dict_pre_hook(pre))  # type: ignore[no-untyped-call]
            self._handles.append(module.register_load_state_dict_post_hook(self._post))  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        """Removes every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pending(self) -> list[tuple[Any, set[str]]]:
        pending: list[tuple[Any, set[str]]] | None = getattr(self._written, "pending", None)
        if pending is None:
            pending = self._written.pending = []
        return pending

    def _pre(self, name: str, keys: list[tuple[str, str]], composites: list[tuple[str, str]]) -> Callable[..., None]:
        def hook(module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *args: Any) -> None:
            if prefix == "":
                self._pending().clear()  # a new load (a failed one may have left entries)
            for key, path in composites:
                if prefix + key in state_dict:
                    raise _core.OffloadError(
                        f"'{name}' is offloaded by weightferry: its weight '{prefix + key}' is a "
                        f"{self._classes[path]}, a tensor subclass weightferry streams by its parts, which "
                        "load_state_dict cannot write while offloaded; disable, load, and enable again (nothing was "
                        "loaded)"
                    )
            editing = self._sigs.editing or set()
            found = {
                prefix + key: path
                for key, path in keys
                if prefix + key in state_dict and self._sid[path] not in editing
            }
            if not found:
                return
            if isinstance(local_metadata, dict) and local_metadata.get("assign_to_params_buffers"):
                raise _core.OffloadError(
                    f"'{name}' is offloaded by weightferry: load_state_dict(assign=True) cannot make its weights "
                    f"('{next(iter(found))}' among them) the state dict's tensors; load without assign (the values "
                    "are written through), or disable first (nothing was loaded)"
                )
            self._writer.write({path: state_dict[key] for key, path in found.items()}, "load_state_dict")
            for key in found:
                del state_dict[key]
            self._pending().append((module, set(found)))

        return hook

    def _post(self, module: Any, incompatible: Any) -> None:
        pending = self._pending()
        for i in range(len(pending) - 1, -1, -1):
            if pending[i][0] is module:
                written = pending.pop(i)[1]
                incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in written]
                return


def _by_module(paths: list[str], modules: Modules) -> dict[str, list[tuple[str, str]]]:
    """Module path -> [(the state-dict key relative to the module, pipeline path)] of ``paths`` below it, for every
    module above each path."""
    out: dict[str, list[tuple[str, str]]] = {}
    for path in paths:
        parts = path.split(".")
        for i in range(len(parts)):
            owner = ".".join(parts[:i])
            if owner in modules:
                out.setdefault(owner, []).append((".".join(parts[i:]), path))
    return out
