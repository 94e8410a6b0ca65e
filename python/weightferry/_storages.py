"""The storage map of an enabled pipeline: which torch tensor objects view each storage (as the Rust side numbers
them) and where, and the hand-over of their bytes: to the session at enable (torch's host copy released storage by
storage), back to ordinary CPU tensors rebuilt from the session's bytes at disable or after a failed enable."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import _core
from ._composites import SEP, Composite, rebuild, settle

# Bytes of torch tensors released between two trims of the C heap during the hand-over (see StorageMap.hand_over).
_TRIM_BYTES = 1 << 30

if TYPE_CHECKING:
    import torch

    from ._describe import Bound, Composites
    from ._undo import UndoStack

__all__ = ["StorageMap", "View", "assign", "materialize_meta", "set_data", "tensors_over"]


class View:
    """One torch tensor object viewing a storage: where its elements are (offset, shape, strides, dtype), and the
    tensor subclass it is a part of, if any (``owner``: re-pointed at the device its parts are on after a binding)."""

    __slots__ = ("dtype", "offset", "owner", "path", "shape", "strides", "tensor")

    def __init__(
        self, tensor: torch.Tensor, path: str, like: torch.Tensor | None = None, owner: Composite | None = None
    ) -> None:
        """``like``: the tensor whose geometry this object takes (a meta tensor it replaced), else its own."""
        like = tensor if like is None else like
        self.tensor = tensor
        self.owner = owner
        self.path = path
        self.dtype: torch.dtype = like.dtype
        self.shape = tuple(like.shape)
        self.strides = tuple(like.stride())
        self.offset = like.storage_offset()


def set_data(view: View, tensor: torch.Tensor) -> None:
    """Makes ``view``'s tensor object hold ``tensor``'s data (the object, its ``requires_grad`` and every reference
    to it stay), and the tensor subclass it is a part of follow it when it changes device: how a binder binds a
    tensor unless told otherwise (see ``Seams.bind``). The assignment is torch's own (:func:`assign`): a subclass's
    ``__torch_function__`` does not see it."""
    owner = view.owner if view.owner is not None and view.tensor.device != tensor.device else None
    assign(view.tensor, tensor)
    if owner is not None:
        settle(owner)


def assign(t: torch.Tensor, data: torch.Tensor) -> None:
    """``t.data = data`` as torch's tensor does it, whatever ``t``'s class: a tensor subclass's ``__torch_function__``
    (diffusers' ``GGUFParameter``) would run in Python on every binding, several times the cost of the assignment
    itself, and the binding swaps bytes under the object, which is nothing the class computes. A plain tensor or
    ``Parameter`` is assigned directly (switching torch functions off costs more than it saves there:
    ``benches/torch/bind_cost.py``)."""
    cls = type(t)
    if cls in _PLAIN:
        t.data = data
        return
    import torch

    if cls is torch.Tensor or cls is torch.nn.Parameter:
        _PLAIN.add(cls)
        t.data = data
        return
    with torch._C.DisableTorchFunctionSubclass():
        t.data = data


_PLAIN: set[type] = set()
"""torch's own tensor classes, once seen: their ``.data`` assignment runs no Python code."""


def tensors_over(data: bytearray, views: list[View]) -> list[torch.Tensor]:
    """One new CPU storage holding ``data`` (a ``bytearray``, shared, not copied) and a tensor per view over it, so
    views of one storage share it again."""
    import torch

    if len(data):
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    else:
        storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
    return [torch.empty(0, dtype=v.dtype).set_(storage, v.offset, v.shape, v.strides) for v in views]


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of the whole (CPU) storage ``tensor`` views: one copy, no numpy needed."""
    storage = tensor.untyped_storage()
    n = storage.nbytes()
    return ctypes.string_at(storage.data_ptr(), n) if n else b""


def _write_storage(session: _core.Session, sid: int, tensor: torch.Tensor, nbytes: int) -> None:
    """Gives the session the bytes of the (CPU) storage ``tensor`` views, read in place by Rust. A storage whose size
    differs from the description's goes through a Python copy, so the size check names it."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes or storage.data_ptr() == 0:
        session.write_storage(sid, _storage_bytes(tensor))
    else:
        session._write_storage_at(sid, storage.data_ptr(), nbytes)


def materialize_meta(bound: Bound, undo: UndoStack) -> dict[int, torch.Tensor]:
    """Replaces every ``meta`` tensor of the pipeline by an empty CPU tensor of its dtype (a ``Parameter`` with its
    ``requires_grad`` for a parameter; one new object per old one, so tied attributes stay tied): a meta tensor
    cannot take CPU data (``.data`` refuses the type change). Each replacement is undone by ``undo``. Returns
    ``{id(new tensor): the meta tensor it replaced}``."""
    import torch.nn as nn

    new_of: dict[int, torch.Tensor] = {}
    replaced: dict[int, torch.Tensor] = {}
    for module, attr in bound.values():
        old = getattr(module, attr)
        if old.device.type != "meta" or not isinstance(module, nn.Module):
            continue
        new = new_of.get(id(old))
        if new is None:
            new = _empty_like_kind(old)
            new_of[id(old)] = new
            replaced[id(new)] = old
        table: dict[str, Any] = module._parameters if attr in module._parameters else module._buffers
        undo.push(_put_back(table, attr, old))
        table[attr] = new
    return replaced


def _empty_like_kind(old: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor of ``old``'s dtype and kind: a ``Parameter`` (with its ``requires_grad``) for a parameter,
    of ``old``'s own class with its attributes for a ``Parameter`` subclass that is not a wrapper (diffusers'
    ``GGUFParameter`` and its ``quant_type``), so the module's own code sees the parameter it was built with."""
    import torch
    import torch.nn as nn

    empty = torch.empty(0, dtype=old.dtype)
    if not isinstance(old, nn.Parameter):
        return empty
    if type(old) is nn.Parameter or hasattr(old, "__tensor_flatten__"):
        return nn.Parameter(empty, requires_grad=old.requires_grad)
    # What Parameter.__new__ does for plain data, for old's class, whose own __new__ may ask for more arguments.
    new = torch.Tensor._make_subclass(type(old), empty, old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


def _put_back(table: dict[str, Any], attr: str, old: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        table[attr] = old

    return step


class StorageMap:
    """Storage id -> the tensor objects viewing it (:class:`View`), its size, and which unit streams it."""

    def __init__(
        self,
        session: _core.Session,
        bound: Bound,
        replaced: dict[int, torch.Tensor],
        composites: Composites | None = None,
    ) -> None:
        """Maps the pipeline's tensors (``bound``, from ``describe``) to the session's storages; ``replaced`` names
        the meta tensor an empty CPU tensor stands for (its geometry is the view's); ``composites`` are the tensor
        subclasses described by their parts (whose parts ``bound`` holds)."""
        import torch.nn as nn

        paths = dict(session.tensor_storages())
        if set(paths) != set(bound):
            raise _core.Error("internal error: the description's tensors and the pipeline's differ")
        self.composites: Composites = dict(composites or {})
        # a subclass over its own bytes -> the paths of its attached parts (the tensors of its Python state)
        self.attached: dict[str, list[str]] = {}
        for path in bound:
            base = path.split(SEP, 1)[0]
            if base != path and base not in self.composites:
                self.attached.setdefault(base, []).append(path)
        owner_of = {path: c for c in self.composites.values() for _, _, path in c.leaves()}
        self.views: dict[int, list[View]] = {}
        seen = set()
        for path, (module, attr) in bound.items():
            t = getattr(module, attr)
            key = (paths[path], id(t))
            if key not in seen:  # a tensor object registered twice (a tied attribute) is bound once
                seen.add(key)
                view = View(t, path, replaced.get(id(t)), owner_of.get(path))
                self.views.setdefault(paths[path], []).append(view)
        self.nbytes: dict[int, int] = {}
        self.streamed_by: dict[str, list[int]] = {}  # unit module path -> its storages
        for sid, size, unit in session.storages():
            self.nbytes[sid] = size
            if unit is not None:
                self.streamed_by.setdefault(unit, []).append(sid)
        # Every parameter and persistent buffer's path -> (storage, index of its tensor object among the views);
        # `locations` has the parts of tensor subclasses too.
        index_of = {id(v.tensor): (sid, i) for sid, vs in self.views.items() for i, v in enumerate(vs)}
        self.locations = {path: index_of[id(getattr(holder, attr))] for path, (holder, attr) in bound.items()}
        self.state_paths: dict[str, tuple[int, int]] = {
            path: self.locations[path]
            for path, (module, attr) in bound.items()
            if isinstance(module, nn.Module)
            and (attr in module._parameters or attr not in module._non_persistent_buffers_set)
        }

    def attached_storages(self) -> set[int]:
        """The storages of the attached parts (tensors of a subclass's Python state, bitsandbytes' ``quant_state``)."""
        return {self.locations[p][0] for parts in self.attached.values() for p in parts}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor object of the map."""
        for views in self.views.values():
            for view in views:
                yield view.tensor

    def streamed(self) -> set[int]:
        """The storages some unit streams (the rest is the fixed placement)."""
        return {sid for sids in self.streamed_by.values() for sid in sids}

    def hand_over(
        self, session: _core.Session, sids: set[int], release: Callable[[View], None], handed: list[int]
    ) -> None:
        """Storage by storage, gives the session the bytes of ``sids`` and releases torch's host copy at once (each
        tensor passes to ``release``), so host memory holds about one copy of the weights throughout: a streamed
        storage is written straight into the host master it will live in, and after every ``_TRIM_BYTES`` released
        the C heap gives the pages torch freed back to the system (the allocator keeps tensors freed in the middle
        of its heap otherwise). Appends each storage to ``handed`` once the session holds its only copy."""
        released = 0
        for sid, views in self.views.items():
            if sid not in sids:
                continue
            _write_storage(session, sid, views[0].tensor, self.nbytes[sid])
            handed.append(sid)
            for view in views:
                release(view)
            released += self.nbytes[sid]
            if released >= _TRIM_BYTES:
                _core.trim_host_heap()
                released = 0
        _core.trim_host_heap()

    def restore(self, session: _core.Session, sids: list[int]) -> None:
        """Gives the tensors of ``sids`` ordinary CPU tensors rebuilt from the session's bytes (the undo of a failed
        or empty enable; plain assignments, so it cannot fail half-way on a binding). A storage the session cannot
        read back is reported after every other one was restored."""
        lost = []
        for sid in sids:
            views = self.views[sid]
            try:
                data = session.read_storage(sid)
            except _core.Error as e:
                lost.append(f"{views[0].path}: {e}")
                continue
            for view, tensor in zip(views, tensors_over(data, views)):
                set_data(view, tensor)
        if lost:
            raise _core.OffloadError(
                "weightferry could not give back the weights of "
                + "; ".join(lost)
                + " after a failed enable; keep the pipeline's handle and report this"
            )

    def rebuild(self, session: _core.Session, bind: Callable[[View, torch.Tensor], None]) -> None:
        """Binds every tensor to an ordinary CPU tensor rebuilt from the session's host bytes (after disable)."""
        for sid, views in self.views.items():
            data = session.read_storage(sid)
            for view, tensor in zip(views, tensors_over(data, views)):
                bind(view, tensor)

    def state_dict(self, session: _core.Session, component: str | None) -> dict[str, torch.Tensor]:
        """The weights read from the session (see ``Handle.state_dict``)."""
        prefix = None if component is None else f"{component}."
        every = [*self.state_paths, *(p for p, c in self.composites.items() if _in_state_dict(c))]
        wanted = [p for p in every if prefix is None or p.startswith(prefix)]
        if prefix is not None and not wanted:
            raise _core.PipelineError(f"the pipeline has no component '{component}' with weights")
        true = self.true_tensors(session, wanted)
        return {path if prefix is None else path[len(prefix) :]: t for path, t in true.items()}

    def true_tensors(self, session: _core.Session, paths: list[str]) -> dict[str, torch.Tensor]:
        """Path -> the weight at ``paths`` (parameters and persistent buffers; a tensor subclass described by its
        parts is rebuilt over them) as a CPU tensor read from the session, each storage read once (its tensors
        share it)."""
        built: dict[int, list[torch.Tensor]] = {}

        def true(path: str) -> torch.Tensor:
            sid, index = self.locations[path]
            if sid not in built:
                views = self.views[sid]
                plain = tensors_over(session.read_storage(sid), views)
                built[sid] = [_as_class_of(v.tensor, t) for v, t in zip(views, plain)]
            return built[sid][index]

        out = {}
        for path in paths:
            c = self.composites.get(path)
            out[path] = true(path) if c is None else rebuild(c, {p: true(p) for _, _, p in c.leaves()})
        return out


def _in_state_dict(c: Composite) -> bool:
    """Whether the tensor subclass is a parameter or persistent buffer of its module (a state-dict entry)."""
    module, attr = c.owner if c.owner is not None else (None, "")
    return module is not None and (attr in module._parameters or attr not in module._non_persistent_buffers_set)


def _as_class_of(original: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``plain`` as ``original.detach()`` would give it: an object of ``original``'s class over ``plain`` with its
    Python attributes (its ``__dict__``, not what a ``__getstate__`` makes of them: bitsandbytes' ``Params4bit`` puts
    its live data there), detached by the class's own protocol. A ``Parameter`` gives a plain tensor, diffusers'
    ``GGUFParameter`` keeps its class and ``quant_type``, bitsandbytes' ``Params4bit`` gives a plain tensor, as each
    does resident."""
    import torch

    cls = type(original)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return plain
    out = torch.Tensor._make_subclass(cls, plain, False)
    out.__dict__.update(vars(original))
    return out.detach()
