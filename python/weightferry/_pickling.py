"""Copies of an enabled pipeline's modules: ``copy.deepcopy(module)``, ``pickle.dumps(module)``,
``torch.save(module)``. While offloaded a module holds placeholders and device views, and its hooks hold the native
session, so a copy could be neither right nor complete (Python would fail part-way with a pickling error about a
hook or the session). While enabled, every module of the pipeline carries an instance ``__getstate__`` — the copy
and pickle protocols look it up on the instance before the class — that raises :class:`weightferry.OffloadError`
naming the module and the fix, before anything is read; :meth:`CopyGuard.remove` gives each module its own back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _core
from ._overrides import Overrides

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._describe import Modules

__all__ = ["CopyGuard"]

_MESSAGE = (
    "'{path}' is offloaded by weightferry: copying or pickling it (copy.deepcopy, pickle, torch.save of the module) "
    "would copy placeholders and device views, not its weights; save its state_dict() (or save_pretrained), or call "
    "disable() on the handle first"
)


class CopyGuard:
    """The instance ``__getstate__`` of every module of one enabled pipeline."""

    def __init__(self, modules: Modules) -> None:
        self._overrides = Overrides(modules, "__getstate__")

    def install(self) -> None:
        """Puts the refusing ``__getstate__`` on every module."""
        self._overrides.install(lambda path, _module, _own: _refusal(path))

    def remove(self) -> None:
        """Restores every module's ``__getstate__`` (idempotent)."""
        self._overrides.remove()


def _refusal(path: str) -> Callable[[], Any]:
    def __getstate__() -> Any:
        raise _core.OffloadError(_MESSAGE.format(path=path))

    return __getstate__
