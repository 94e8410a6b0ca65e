"""Views of an original model's single file: when a checkpoint names a model's tensors otherwise (a Flux GGUF in
Black Forest Labs' names, where one fused ``qkv`` tensor holds a diffusers model's ``to_q``, ``to_k`` and ``to_v``),
each model tensor is worked out as rows of the file's tensors by running the host library's own conversion (the
``checkpoint_mapping_fn`` diffusers' ``from_single_file`` runs for the model's class) over stand-ins that carry row
numbers instead of values, built from the file's header alone.

A converted tensor whose rows are each a whole row of a file tensor is a view: served from the file when its rows
are one run of one tensor, assembled when the model loads when they are several. One whose values the conversion
computed (no row's numbers) is the module's own (its bytes come from the module; a ``meta`` one is refused by
name). The conversion runs twice under two numberings, the second spaced and reversed, so numbers that were
computed rather than selected cannot pass for rows."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from . import _core

if TYPE_CHECKING:
    import torch

__all__ = ["checkpoint_views"]

# A view as the native session takes it: the rows of file tensors, concatenated, or None (the module's own).
Views = dict[str, "list[tuple[str, int, int]] | None"]


def checkpoint_views(module: Any, path: str, keys: list[str]) -> Views:
    """The views of those of ``keys`` (the module's tensor names the checkpoint fills) that the file at ``path`` does
    not hold by name; ``{}`` when it holds them all, when the module's class has no single-file conversion, or when
    the conversion cannot run on the file's names (the binder then names the first missing tensor)."""
    tensors = _core.checkpoint_tensors(path)
    held = {name for name, _, _ in tensors}
    lacking = [k for k in keys if k not in held]
    convert = _conversion(module) if lacking else None
    if convert is None:
        return {}
    table = _RowTable(tensors)
    try:
        first = _convert(convert, module, table.stand_ins(spaced=False))
        second = _convert(convert, module, table.stand_ins(spaced=True))
    except Exception:  # the conversion is another library's: any failure of it means no views
        return {}
    views: Views = {}
    for key in lacking:
        if key in first and key in second:
            views[key] = table.view(first[key], second[key])
    return views


def _conversion(module: Any) -> Callable[..., dict[str, Any]] | None:
    """diffusers' single-file conversion for ``module``'s class (or the nearest base class that has one)."""
    try:
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    except ImportError:
        return None
    for cls in type(module).__mro__:
        entry: Any = SINGLE_FILE_LOADABLE_CLASSES.get(cls.__name__)
        if isinstance(entry, dict) and callable(entry.get("checkpoint_mapping_fn")):
            fn: Callable[..., dict[str, Any]] = entry["checkpoint_mapping_fn"]
            return fn
    return None


def _convert(convert: Callable[..., dict[str, Any]], module: Any, stand_ins: dict[str, Any]) -> dict[str, Any]:
    """``convert`` run as ``from_single_file`` runs it, over ``stand_ins``, concatenations kept as row numbers."""
    with _row_cat_mode()():
        return convert(checkpoint=stand_ins, config=getattr(module, "config", None))


class _RowTable:
    """Every row of the file's tensors numbered in one sequence: tensor ``i``'s rows (its dim-0 entries; one for a
    tensor of no dimension) follow tensor ``i - 1``'s."""

    def __init__(self, tensors: list[tuple[str, str, list[int]]]) -> None:
        self.tensors = tensors
        self.rows = [shape[0] if shape else 1 for _, _, shape in tensors]
        self.starts: list[int] = []
        total = 0
        for n in self.rows:
            self.starts.append(total)
            total += n
        self.total = total
        self._owner: Any = None  # per row, the index of its tensor (made on first use)
        self._starts: Any = None  # ``starts`` as a tensor

    def numbers(self, rows: Any, spaced: bool) -> Any:
        """The numbers rows ``rows`` (an int64 tensor) carry in a numbering: themselves, or (spaced)
        ``3 * (total - 1 - row) + 1``."""
        return 3 * (self.total - 1 - rows) + 1 if spaced else rows

    def rows_of(self, numbers: Any, spaced: bool) -> Any:
        """The rows numbers name in a numbering (an int64 tensor), ``-1`` for a number no row carries."""
        import torch

        if spaced:
            rows = self.total - 1 - torch.div(numbers - 1, 3, rounding_mode="floor")
            rows = torch.where((numbers - 1) % 3 == 0, rows, -1)
        else:
            rows = numbers
        return torch.where((rows >= 0) & (rows < self.total), rows, -1)

    def stand_ins(self, spaced: bool) -> dict[str, Any]:
        """A tensor per file tensor, of its shape, whose entries are its rows' numbers (views of one number per
        row: no memory beyond that)."""
        import torch

        out: dict[str, Any] = {}
        for (name, _, shape), start, n in zip(self.tensors, self.starts, self.rows):
            numbers = self.numbers(torch.arange(start, start + n, dtype=torch.int64), spaced)
            if not shape:
                out[name] = numbers[0]
            else:
                out[name] = numbers.view(n, *([1] * (len(shape) - 1))).expand(*shape)
        return out

    def view(self, first: Any, second: Any) -> list[tuple[str, int, int]] | None:
        """The rows a converted tensor is made of, as runs of file tensors, if both numberings agree that each of
        its rows is a whole row of a file tensor of the same shape past dim 0; else ``None`` (the module's own)."""
        import torch

        a, b = _numbers(first), _numbers(second)
        if a is None or b is None or a.shape != b.shape:
            return None
        rows = self.rows_of(a, False)
        if bool((rows < 0).any()) or not torch.equal(rows, self.rows_of(b, True)):
            return None
        if self._owner is None:
            counts = torch.tensor(self.rows, dtype=torch.int64)
            self._owner = torch.repeat_interleave(torch.arange(len(self.rows)), counts)
            self._starts = torch.tensor(self.starts, dtype=torch.int64)
        which = self._owner[rows]
        for i in torch.unique(which).tolist():
            shape = self.tensors[i][2]
            if not shape or list(first.shape[1:]) != list(shape[1:]):
                return None
        local = rows - self._starts[which]
        # A run breaks where the source changes or the next row is not the one after.
        breaks = torch.ones(len(rows), dtype=torch.bool)
        breaks[1:] = (which[1:] != which[:-1]) | (local[1:] != local[:-1] + 1)
        starts = [*torch.nonzero(breaks).flatten().tolist(), len(rows)]
        return [
            (self.tensors[int(which[s])][0], int(local[s]), int(local[e - 1]) + 1) for s, e in zip(starts, starts[1:])
        ]


def _numbers(t: Any) -> Any:
    """The number each dim-0 entry of ``t`` carries (an int64 tensor), if all its entries past dim 0 carry that
    number; else ``None``."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == 0:
        return None
    column = t[(slice(None),) + (0,) * (t.dim() - 1)]
    if not _rows_only(t) and not bool((t.reshape(t.shape[0], -1) == column.unsqueeze(1)).all()):
        return None
    if column.is_floating_point():
        if not bool((column == column.round()).all()):
            return None
        return column.to(torch.int64)
    return column if column.dtype == torch.int64 else None


def _rows_only(t: torch.Tensor) -> bool:
    """Whether ``t`` is one number per dim-0 entry broadcast over the rest (stride 0 past dim 0)."""
    return t.dim() >= 1 and all(s == 0 for s, n in zip(t.stride()[1:], t.shape[1:]) if n > 1)


@functools.cache
def _row_cat_mode() -> type:
    """The torch function mode class (made once, on first use: torch is imported lazily)."""
    import torch
    from torch.overrides import TorchFunctionMode

    cats = {torch.cat, torch.concat, torch.concatenate}

    class RowCat(TorchFunctionMode):
        """Concatenates stand-ins along dim 0 as row numbers: the result broadcasts one number per row like its
        inputs, instead of materialising every entry (a conversion's ``torch.cat([q])`` of a full-size weight)."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in cats:
                tensors = list(args[0] if args else kwargs.get("tensors", ()))
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                if tensors and all(isinstance(x, torch.Tensor) for x in tensors):
                    first = tensors[0]
                    same = all(x.dim() == first.dim() and x.shape[1:] == first.shape[1:] for x in tensors)
                    if same and first.dim() >= 1 and dim in (0, -first.dim()) and all(map(_rows_only, tensors)):
                        column = func([x[(slice(None),) + (0,) * (x.dim() - 1)] for x in tensors], dim=0)
                        n = column.shape[0]
                        return column.view(n, *([1] * (first.dim() - 1))).expand(n, *first.shape[1:])
            return func(*args, **kwargs)

    return RowCat
