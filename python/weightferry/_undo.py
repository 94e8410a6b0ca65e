"""The undo stack of ``enable``: what puts a pipeline back as it was, one step per change, run last change first on
every exit that gives the pipeline back (a failure, or a plan that offloads nothing)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["UndoStack"]


class UndoStack:
    """Undo steps (callables without arguments), pushed as the changes they undo are made."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], object]] = []

    def push(self, step: Callable[[], object]) -> None:
        """Adds the undo of a change about to be made (so a change that fails half-way is undone too)."""
        self._steps.append(step)

    def pop(self) -> None:
        """Drops the last step: its change turned out not to happen."""
        self._steps.pop()

    def unwind(self) -> None:
        """Runs every step, last pushed first, and empties the stack. A step that raises does not stop the others:
        the first exception is raised after the last step ran."""
        first: BaseException | None = None
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except BaseException as e:
                if first is None:
                    first = e
        if first is not None:
            raise first
