"""Writes into an enabled pipeline's weights: new values for the tensors weightferry manages become its
authoritative copy (the host master, or the fixed placement's host buffer) and every device copy of them is
refreshed (Rust: ``Session._write_weights_at``), so the next forward and ``disable`` see exactly the written values,
as the same write on the resident module would give. ``load_state_dict`` (:mod:`._loads`) and edits made inside
``Handle.editing()`` come through here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from . import _core
from ._storages import tensors_over

if TYPE_CHECKING:
    import torch

    from ._storages import StorageMap

__all__ = ["Writer", "check_shape"]


def check_shape(path: str, value: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Refuses a new value whose shape differs from the weight's (torch's ``load_state_dict`` calls it a size
    mismatch), naming the key as the caller wrote it (``what``)."""
    if tuple(value.shape) != shape:
        raise _core.OffloadError(
            f"{what}: size mismatch for '{path}': the new value has shape {list(value.shape)}, the weight "
            f"{list(shape)} (nothing was written)"
        )


class Writer:
    """Writes new values of managed weights through the session, then lets the hooks drop what they knew of the
    device copies (``refreshed``: the slots after a stack rebuild, the sim's copies of the fixed placement)."""

    def __init__(
        self, session: _core.Session, storages: StorageMap, refreshed: Callable[[set[int]], None]
    ) -> None:
        self._session = session
        self._storages = storages
        self._refreshed = refreshed

    def write(self, values: Mapping[str, torch.Tensor], what: str) -> None:
        """``values``: pipeline path of a parameter or persistent buffer -> its new value (converted to the weight's
        dtype as torch's ``copy_`` converts); see :meth:`write_views`."""
        self.write_views({self._storages.state_paths[path]: value for path, value in values.items()}, what)

    def write_views(self, values: Mapping[tuple[int, int], torch.Tensor], what: str) -> None:
        """``values``: (storage id, index of the tensor among its views) -> new value. Every value is checked (a
        tensor, the view's shape) before anything is written; each storage is rebuilt from its current bytes with its
        changed views overwritten and written whole, all in one call."""
        import torch

        by_storage: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (sid, index), value in values.items():
            view = self._storages.views[sid][index]
            if not isinstance(value, torch.Tensor):
                raise _core.OffloadError(
                    f"{what}: the new value of '{view.path}' is a {type(value).__name__}, not a torch.Tensor (nothing "
                    "was written)"
                )
            check_shape(view.path, value, view.shape, what)
            by_storage.setdefault(sid, []).append((index, value))
        self._write(by_storage)

    def rewrite(self, sids: set[int]) -> None:
        """Writes storages' own bytes again: every device copy of them is rebuilt from weightferry's copy."""
        self._write({sid: [] for sid in sids})

    def _write(self, by_storage: dict[int, list[tuple[int, torch.Tensor]]]) -> None:
        import torch

        if not by_storage:
            return
        keep: list[torch.Tensor] = []
        items = []
        with torch.no_grad():
            for sid, changes in by_storage.items():
                views = self._storages.views[sid]
                current = tensors_over(self._session.read_storage(sid), views)
                for index, value in changes:
                    current[index].copy_(value)
                flat = current[0].untyped_storage()
                keep.extend(current)
                items.append((sid, flat.data_ptr(), flat.nbytes()))
            try:
                self._session._write_weights_at(items)
            except _core.OffloadError as e:
                raise _core.OffloadError(self._named(str(e))) from None
        self._refreshed(set(by_storage))

    def _named(self, message: str) -> str:
        """The session's message with its leading ``storage N`` named by the storage's tensor path."""
        head, _, rest = message.partition(" ")
        sid, _, tail = rest.partition(" ")
        if head != "storage" or not sid.isdigit() or int(sid) not in self._storages.views:
            return message
        return f"'{self._storages.views[int(sid)][0].path}' {tail}"
