"""Edits of an enabled pipeline's weights made through its modules' own tensors.

While offloaded, a streamed tensor holds a placeholder or a device slot between its block's forwards, and a fixed
one a device copy: an in-place edit there (``weight.mul_(2)``, ``weight.data += delta``, ``weight.data = new``)
would reach neither weightferry's copy nor the other device copies, and on CUDA could overwrite another block's
bytes in a shared slot. So:

- :class:`Signatures` remembers each managed tensor's ``(version counter, data pointer)`` after weightferry bound
  it. torch bumps the version counter on every in-place change and ``.data = ...`` changes the pointer, so a
  difference is an edit made outside weightferry. It is checked before each component's forward, before a
  ``state_dict`` reads the weights, at ``retune``, ``editing`` and ``disable``: a changed tensor is put back and the
  device copies are rewritten from weightferry's copy (so no slot keeps a stray write), then
  :class:`weightferry.OffloadError` names it and the fix. An edit through ``.data`` moves neither: of a tensor kept
  on the device it is found by its bytes (at ``state_dict``, ``editing``, ``retune`` and ``disable``: a read of the
  device), of a streamed tensor between forwards by the bytes of the placeholders' shared elements, a signalling
  NaN (:func:`._binders.stray_writes`; before each forward on the CPU, around it on CUDA: ``SentinelProbe``).
- :func:`editing` (``Handle.editing()``) is the way to edit: inside it the selected modules' managed tensors are
  ordinary CPU tensors holding their true values (one host copy of them while it lasts), so any edit works as on
  the module not offloaded (peft's ``fuse_lora`` / ``unfuse_lora`` / ``merge_and_unload``, in-place edits,
  ``.data`` replacements); on leaving, every tensor whose signature changed is written through
  (:mod:`._writes`), even when the block raised (a half-done edit is kept as the resident module would keep it),
  and the tensors are bound to the device again. Tensors of those modules that weightferry does not manage and that
  are not on the CPU (adapters added after ``enable``) are on the CPU inside the block too, and go back after; the
  tensors the block gave those modules (an adapter loaded inside it: peft places it by the base weight, a CPU tensor
  there) go to the device the pipeline runs on, where the modules' other unmanaged tensors are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from . import _core
from ._binders import is_placeholder, repoison, span, stray_writes
from ._storages import set_data, tensors_over

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from ._storages import StorageMap, View
    from ._writes import Writer

__all__ = ["Drifted", "Signatures", "check", "drifted", "editing", "new_on_cpu", "place_new"]

Drifted = Callable[[set[int]], "list[tuple[int, View]]"]
"""Finds the tensors of some storages kept on the device whose bytes differ from weightferry's copy."""

_FIX = "make weight edits inside `with handle.editing():` (or disable, edit, and enable again)"


class Signatures:
    """``(version counter, data pointer)`` of every managed tensor as weightferry last bound it."""

    def __init__(self, storages: StorageMap) -> None:
        self.storages = storages
        self._sig: dict[int, tuple[int, int]] = {}
        self.editing: set[int] | None = None  # the storages an editing block holds as CPU tensors now

    def record(self, views: list[View]) -> None:
        """Remembers the views' tensors as bound now."""
        for v in views:
            t = v.tensor
            self._sig[id(t)] = (t._version, t.data_ptr())

    def placeholders(self, written: dict[tuple[str, torch.dtype], int]) -> list[str]:
        """The paths, sorted, of the tensors holding a placeholder now whose elements reach an element of a sentinel
        ``written`` names (``(device, dtype)`` and the first element written there)."""
        import torch

        out: list[str] = []
        if not written:
            return out
        for views in self.storages.views.values():
            for v in views:
                t = v.tensor
                first = written.get((str(torch.device(t.device)), t.dtype))
                if first is not None and is_placeholder(t) and span(tuple(t.shape)) > first:
                    out.append(v.path)
        return sorted(out)

    def changed(self, sids: Iterator[int] | list[int] | set[int]) -> list[tuple[int, View]]:
        """The views of ``sids`` whose tensor changed since it was recorded."""
        out = []
        for sid in sids:
            for v in self.storages.views[sid]:
                t = v.tensor
                if self._sig.get(id(t)) != (t._version, t.data_ptr()):
                    out.append((sid, v))
        return out


def check(
    sigs: Signatures, sids: Any, repair: Any, when: str, drifted: Drifted | None = None, devices: bool = False
) -> None:
    """Raises :class:`weightferry.OffloadError` naming the first managed tensor of ``sids`` changed outside
    weightferry (after ``repair`` put every changed one back), or the placeholders a write through ``.data`` may
    have reached; nothing when none changed or while editing. ``drifted`` (at ``state_dict``, ``editing``,
    ``retune``): the tensors of ``sids`` kept on the device whose bytes differ from weightferry's copy; ``devices``:
    the devices' sentinels are read too, not only the CPU's (a read that waits for the device's queued work)."""
    if sigs.editing is not None:
        return
    changed = sigs.changed(sids)
    if drifted is not None:
        seen = {id(v.tensor) for _, v in changed}
        changed += [(sid, v) for sid, v in drifted(set(sids)) if id(v.tensor) not in seen]
    written = stray_writes(devices)
    if written and not changed:  # a placeholder written in place: by a counted edit of another storage's tensor?
        changed = sigs.changed(list(sigs.storages.views))
    if changed:
        repair({sid for sid, _ in changed})
        repoison()  # the edit may have written into a placeholder's elements, which many placeholders view
        paths = sorted({v.path for _, v in changed})
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        raise _core.OffloadError(
            f"'{paths[0]}'{more} changed while offloaded, outside Handle.editing() (an in-place edit, or .data "
            f"replaced): weightferry's copy of the weights does not have the change, {when}; {_FIX}"
        )
    reached = sigs.placeholders(written)
    if reached:
        repoison()
        more = f" or one of {len(reached) - 1} more" if len(reached) > 1 else ""
        raise _core.OffloadError(
            f"'{reached[0]}'{more} was written between its block's forwards through .data, outside "
            "Handle.editing() (weight.data += delta, weight.data.mul_(...)): between forwards a streamed weight "
            f"holds a placeholder, so the write reached no weight and nothing changed; {_FIX}"
        )


def drifted(session: _core.Session, storages: StorageMap, sids: set[int]) -> list[tuple[int, View]]:
    """Tensors of ``sids`` kept on the device (not streamed) whose bytes differ from weightferry's copy: an edit
    through ``.data`` (``weight.data += delta`` bumps no version counter and keeps the pointer) made outside
    ``editing()``, which the signatures cannot see. A tensor that cannot be compared is skipped."""
    import torch

    out = []
    streamed = storages.streamed()
    for sid in sorted(sids - streamed):
        views = storages.views[sid]
        true = tensors_over(session.read_storage(sid), views)
        for view, t in zip(views, true):
            try:
                now = view.tensor.detach()
                if now.shape != t.shape or now.dtype != t.dtype:
                    continue
                a = now.cpu().contiguous().reshape(-1).view(torch.uint8)
                b = t.contiguous().reshape(-1).view(torch.uint8)
            except (RuntimeError, TypeError):
                continue
            if not torch.equal(a, b):
                out.append((sid, view))
    return out


@contextmanager
def editing(
    sigs: Signatures,
    storages: StorageMap,
    session: _core.Session,
    writer: Writer,
    sids: set[int],
    modules: list[nn.Module],
    rebind: Any,
    device: torch.device | str = "cpu",
) -> Iterator[None]:
    """See the module doc; ``rebind(sids)`` binds the storages' tensors as they are between forwards again;
    ``device``: where the pipeline runs (``"cpu"`` on the simulated device)."""
    import torch

    if sigs.editing is not None:
        raise _core.OffloadError("Handle.editing() is already open for this pipeline; edit inside that block")
    before = {id(t) for t in _tensors(modules)}
    moved = _to_cpu(storages, modules)
    held: dict[int, bytearray] = {}  # storage -> the bytes its views hold inside the block
    for sid in sids:
        views = storages.views[sid]
        held[sid] = session.read_storage(sid)
        for view, t in zip(views, tensors_over(held[sid], views)):
            set_data(view, t)
        sigs.record(views)
    sigs.editing = sids
    try:
        yield
    finally:
        sigs.editing = None
        # An edit through ``.data`` (``weight.data += delta``: peft's merge) bumps no version counter of the
        # tensor, so the held bytes are compared too; a tensor given other data is caught by its signature.
        changed = {(sid, storages.views[sid].index(v)): v.tensor for sid, v in sigs.changed(sids)}
        for sid, data in held.items():
            if data != session.read_storage(sid):
                changed.update({(sid, i): v.tensor for i, v in enumerate(storages.views[sid])})
        held.clear()
        try:
            writer.write_views(changed, "editing")
        finally:
            with torch.no_grad():
                rebind(sids)
                _back(moved)
                place_new(modules, {id(t) for t in storages.tensors()} | before, device)


def _to_cpu(storages: StorageMap, modules: list[nn.Module]) -> list[tuple[torch.Tensor, torch.device]]:
    """Moves the tensors of ``modules`` that weightferry does not manage and that are not on the CPU there."""
    managed = {id(t) for t in storages.tensors()}
    moved = []
    seen: set[int] = set()
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) in managed or id(t) in seen or t.device.type == "cpu":
                continue
            seen.add(id(t))
            moved.append((t, t.device))
            t.data = t.data.to("cpu")
    return moved


def _back(moved: list[tuple[torch.Tensor, torch.device]]) -> None:
    for t, device in moved:
        if t.device.type == "cpu":
            t.data = t.data.to(device)


def _tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [t for module in modules for t in [*module.parameters(), *module.buffers()]]


def new_on_cpu(modules: list[nn.Module], known: set[int]) -> list[torch.Tensor]:
    """The CPU tensors of ``modules`` whose id is not in ``known`` (made during an editing block), each once."""
    out: dict[int, torch.Tensor] = {}
    for t in _tensors(modules):
        if id(t) not in known and t.device.type == "cpu":
            out.setdefault(id(t), t)
    return list(out.values())


def place_new(modules: list[nn.Module], known: set[int], device: torch.device | str) -> None:
    """Moves :func:`new_on_cpu`'s tensors to ``device``; nothing when ``device`` is the CPU."""
    import torch

    if torch.device(device).type == "cpu":
        return
    with torch.no_grad():
        for t in new_on_cpu(modules, known):
            t.data = t.data.to(device)
