"""Binders: how a device's bytes become what a torch tensor holds, one per device.

- ``"cuda"`` / ``"cuda:N"`` (:class:`CudaBinder`): torch views weightferry's device buffers in place
  (``__cuda_array_interface__``, one torch storage per buffer, made once). A streamed block's tensors are bound at
  each of its forwards, one ``.data`` assignment per tensor from views made the first time the block landed in that
  slot (:meth:`CudaBinder.rebinding`), and given a placeholder on the device after it (:func:`placeholder`):
  between its forwards a streamed tensor never shows a slot that may hold another block's bytes, and an edit of it
  cannot reach a slot.
- ``"sim"`` (:class:`SimBinder`, the simulated device: device buffers in host memory, compute on the CPU): a tensor
  "on the device" is a CPU tensor holding a copy of the simulated device memory, rebuilt at each streamed block's
  ``pre_forward`` and emptied after it: the sim is the test device, so the copy is acceptable there.

Every binding of a tensor goes through the binder's ``set_data`` (``_storages.set_data`` unless a test injects
another).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union

from . import _core
from ._capture import capturing
from ._storages import View, assign, set_data, tensors_over

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeAlias

__all__ = [
    "Binder",
    "CudaBinder",
    "Rebinding",
    "SentinelProbe",
    "SetData",
    "SimBinder",
    "is_placeholder",
    "placeholder",
    "repoison",
    "sentinel",
    "shaped",
    "span",
    "stray_writes",
]

SetData: TypeAlias = "Callable[[View, torch.Tensor], None]"
"""Makes a view's tensor object hold a tensor's data."""
Rebinding: TypeAlias = "list[tuple[torch.Tensor, torch.Tensor]]"
"""Pairs of (a pipeline tensor, a tensor viewing its bytes on the device)."""


_sentinels: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
_SENTINEL_ELEMENTS = 1 << 16  # the least a sentinel holds: any weight whose dimensions sum to less views one


def span(shape: tuple[int, ...]) -> int:
    """The elements a tensor of ``shape`` with stride 1 in every dimension reaches (none when it has none)."""
    return 0 if 0 in shape else 1 + sum(n - 1 for n in shape)


def sentinel(dtype: torch.dtype, device: str | torch.device = "cpu", elements: int = 1) -> torch.Tensor:
    """A buffer of at least ``elements`` elements of ``dtype`` on ``device`` that placeholders view: the first made
    that is long enough, else a new one (never freed: a few hundred KB at most). Its elements are a signalling NaN in
    a float dtype that has one (``_SIGNALLING``), else bytes ``0xff`` (NaN, -1 or the largest value; ``True`` for
    ``bool``). The same shape always gets the same buffer, so a placeholder's data pointer is the same every time it
    is given back (the edit check compares pointers, :mod:`._edits`)."""
    import torch

    made = _sentinels.setdefault((str(torch.device(device)), dtype), [])
    for one in made:
        if one.numel() >= elements:
            return one
    with torch.inference_mode(False):  # an ordinary tensor, though made in a forward under inference_mode
        one = torch.empty(max(elements, _SENTINEL_ELEMENTS), dtype=dtype, device=device)
    _poison(one)
    made.append(one)
    return one


# A signalling NaN per float dtype (sign set, exponent all ones, top mantissa bit clear, lowest bit set), as the
# signed integer of its width: arithmetic on one gives a quiet NaN, other bytes, so an in-place write through
# ``.data`` that bumps no version counter (``weight.data += delta``, ``weight.data.mul_(2)``) still changes them and
# :func:`stray_writes` finds it. Other dtypes get bytes ``0xff``.
_SIGNALLING = {"float64": 0xFFF0000000000001 - (1 << 64), "float32": 0xFF800001 - (1 << 32),
               "bfloat16": 0xFF81 - (1 << 16), "float16": 0xFC01 - (1 << 16)}


def _as_ints(one: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``one``'s bytes as integers of its element width and the value each of them holds while poisoned."""
    import torch

    if one.dtype == torch.bool:
        return one.view(torch.uint8), 1
    value = _SIGNALLING.get(str(one.dtype).removeprefix("torch."))
    if value is None:
        return one.view(torch.uint8), 0xFF
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[one.dtype.itemsize]
    return one.view(ints), value


_poisoned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(a sentinel) -> (its elements as integers, a copy)


def _poison(one: torch.Tensor) -> None:
    import torch

    ints, value = _as_ints(one)
    with torch.no_grad():
        ints.fill_(value)
    _poisoned.setdefault(id(one), (ints, ints.clone()))


def repoison() -> None:
    """Gives every sentinel its bytes again: an in-place write to a placeholder outside ``Handle.editing()`` (caught
    at the next check, :func:`._edits.check`) wrote into its dtype's sentinel."""
    for made in _sentinels.values():
        for one in made:
            _poison(one)


def stray_writes(devices: bool) -> dict[tuple[str, torch.dtype], int]:
    """The sentinels written since they were poisoned, as ``(device, dtype)`` and the first element written: each
    was reached by an in-place write to a placeholder. The CPU's sentinels always (a compare of a few hundred KB);
    the devices' when ``devices`` (a read that waits for the device's queued work; never while capturing)."""
    import torch

    out: dict[tuple[str, torch.dtype], int] = {}
    for (device, dtype), made in _sentinels.items():
        if device != "cpu" and (not devices or (device.startswith("cuda") and capturing())):
            continue
        for one in made:
            ints, poisoned = _poisoned[id(one)]
            if torch.equal(ints, poisoned):  # a compare of bytes; the first element written only when one was
                continue
            written = (ints != poisoned).nonzero()
            if written.numel():
                first = int(written[0, 0]) * ints.itemsize // one.dtype.itemsize
                out[(device, dtype)] = min(first, out.get((device, dtype), first))
    return out


class SentinelProbe:
    """Reads a CUDA device's sentinels without waiting for the device: :meth:`queue` (before a component's forward)
    compares them with their poisoned copies on the current stream and copies the answer to pinned host memory;
    :meth:`written` (after that forward) waits for that point of the stream only (long passed, as the host ran the
    forward's launches since) and says whether a placeholder was written before the forward began. So a write
    through ``.data`` between forwards, which no version counter shows, is refused at the end of the forward that
    ran without it, and that forward's output never reaches the caller."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._device = str(torch.device(device))
        self._answer = torch.zeros(1, dtype=torch.bool, pin_memory=True)
        self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._queued = False

    def queue(self) -> None:
        """Queues the compare on the current stream (not while it is being captured: nothing is queued then)."""
        import torch

        self._queued = False
        pairs = [_poisoned[id(one)] for (dev, _), made in _sentinels.items() if dev == self._device for one in made]
        if not pairs or capturing():
            return
        with torch.no_grad():
            unequal = [torch.ne(ints, poisoned).any() for ints, poisoned in pairs]
            self._answer.copy_(torch.stack(unequal).any(), non_blocking=True)
        self._done.record()
        self._queued = True

    def written(self) -> bool:
        """Whether the last :meth:`queue` found a sentinel written (``False`` when nothing was queued)."""
        if not self._queued:
            return False
        self._queued = False
        self._done.synchronize()
        return bool(self._answer.item())


def placeholder(view: View, device: str | torch.device = "cpu") -> torch.Tensor:
    """What a tensor holds before its bytes are bound and between its block's forwards: its true shape and dtype on
    ``device``, over a few elements of a :func:`sentinel` (stride 1 in every dimension: element ``(i, j)`` is element
    ``i + j``), so ``shape``, ``numel()`` and a module's parameter count are true, a read of its values gives NaN (a
    float dtype), never a plausible weight, and an in-place write runs (into the sentinel, which the next check of
    edits finds and repairs) instead of failing inside torch."""
    return shaped(view.dtype, tuple(view.shape), device)


def shaped(dtype: torch.dtype, shape: tuple[int, ...], device: str | torch.device = "cpu") -> torch.Tensor:
    """A placeholder of ``shape`` (see :func:`placeholder`)."""
    import torch

    t = torch.empty(0, dtype=dtype, device=device)
    one = sentinel(dtype, device, span(shape))
    return t.set_(one.untyped_storage(), 0, shape, (1,) * len(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a :func:`placeholder` (or holds no element)."""
    import torch

    if t.numel() == 0:
        return True
    ptr = t.untyped_storage().data_ptr()
    return any(one.data_ptr() == ptr for one in _sentinels.get((str(torch.device(t.device)), t.dtype), ()))


class SimBinder:
    """Binds tensors to copies of simulated device memory (see the module doc)."""

    device = "cpu"

    def __init__(self, session: _core.Session, bind: SetData = set_data) -> None:
        self._session = session
        self.set_data = bind

    def bind(self, views: list[View], nbytes: int, buffer: int, offset: int) -> None:
        """Binds the views of one storage to its ``nbytes`` at ``offset`` of device buffer ``buffer``."""
        data = self._session.read_device(buffer, offset, nbytes)
        for view, tensor in zip(views, tensors_over(data, views)):
            self.set_data(view, tensor)

    def unbind(self, views: list[View]) -> None:
        """Empties the views of a streamed storage after its block's forward."""
        for view in views:
            self.set_data(view, placeholder(view))

    def prepare(self, views: list[View]) -> None:
        """Makes the placeholders of ``views`` ahead (nothing to make here)."""

    def clear(self) -> None:
        """Forgets what the binder made of the device buffers (none here)."""


class _CudaArray:
    """One of weightferry's CUDA buffers as torch can view it (``__cuda_array_interface__``, flat bytes). torch keeps
    this object alive as long as a view exists; it owns nothing, the session owns the memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class CudaBinder:
    """Binds tensors in place to weightferry's CUDA buffers (see the module doc)."""

    def __init__(self, session: _core.Session, device: torch.device, bind: SetData = set_data) -> None:
        self._session = session
        self.device = self._device = device
        self.set_data = bind
        self._storages: dict[int, torch.UntypedStorage] = {}  # buffer id -> torch UntypedStorage viewing it
        # (dtype, shape) -> the placeholder streamed tensors of that dtype and shape share (over one sentinel a dtype)
        self._empty: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        import torch

        self._no_grad = torch.no_grad

    def storage(self, buffer: int) -> torch.UntypedStorage:
        """The torch storage viewing device buffer ``buffer`` (made once, until :meth:`clear`)."""
        import torch

        st = self._storages.get(buffer)
        if st is None:
            ptr, n = self._session.device_ptr(buffer)
            if n:
                st = torch.as_tensor(_CudaArray(ptr, n), device=self._device).untyped_storage()
            else:
                st = torch.empty(0, dtype=torch.uint8, device=self._device).untyped_storage()
            self._storages[buffer] = st
        return st

    def storage_at(self, buffer: int, start: int, nbytes: int) -> torch.UntypedStorage:
        """A torch storage of its own over ``nbytes`` at byte ``start`` of device buffer ``buffer`` (the buffer's
        memory; a separate storage object, which torch does not see aliasing any other)."""
        import torch

        ptr, n = self._session.device_ptr(buffer)
        if start + nbytes > n:
            raise _core.OffloadError(
                f"internal error: bytes {start}..{start + nbytes} are outside device buffer {buffer} ({n} bytes)"
            )
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8, device=self._device).untyped_storage()
        return torch.as_tensor(_CudaArray(ptr + start, nbytes), device=self._device).untyped_storage()

    def rebinding(self, items: list[tuple[list[View], int, int]]) -> Rebinding:
        """What binding tensors to device bytes takes, built once and applied by :meth:`apply` as often as the bytes
        are there: ``items`` are ``(views, buffer, offset)`` (a storage's tensors and where its bytes are); the result
        pairs each tensor with a tensor viewing its bytes, so applying it is one ``set_`` per tensor with no
        geometry to convert (a streamed block lands in one of a few slots: the hooks keep one per slot)."""
        import torch

        pairs = []
        for views, buffer, offset in items:
            st = self.storage(buffer)
            for view in views:
                item = view.dtype.itemsize
                if offset % item:
                    raise _core.OffloadError(
                        f"internal error: tensor '{view.path}' would start at byte {offset} of device buffer {buffer}, "
                        f"not a multiple of its {item}-byte elements"
                    )
                t = view.tensor
                empty = self._placeholder(view)  # made now, not at the first unbind (which a capture may record)
                if t.device != self._device:
                    self.set_data(view, empty)
                src = torch.empty(0, dtype=view.dtype, device=self._device)
                src.set_(st, offset // item + view.offset, view.shape, view.strides)
                pairs.append((t, src))
        return pairs

    def apply(self, pairs: Rebinding) -> None:
        """Binds each tensor of a :meth:`rebinding` to its bytes (torch's own assignment, as ``set_data`` makes it:
        the rebinding's tensors are plain or a subclass's parts already on the device, so no subclass moves)."""
        for t, src in pairs:
            assign(t, src)

    def bind(self, views: list[View], nbytes: int, buffer: int, offset: int) -> None:
        """Binds the views of one storage to its bytes at ``offset`` of device buffer ``buffer``."""
        self.apply(self.rebinding([(views, buffer, offset)]))

    def unbind(self, views: list[View]) -> None:
        """Empties the views of a streamed storage after its block's forward (a placeholder on the device, so the
        module still reports the device)."""
        for view in views:
            self.set_data(view, self._placeholder(view))

    def prepare(self, views: list[View]) -> None:
        """Makes the placeholders of ``views`` on the device now, at ``enable``: made at a block's first unbind, the
        allocation and the filling of a sentinel could land inside a CUDA graph being captured."""
        for view in views:
            self._placeholder(view)

    def _placeholder(self, view: View) -> torch.Tensor:
        """The placeholder ``view``'s tensor holds between forwards, shared by every tensor of its dtype and shape."""
        key = (view.dtype, view.shape)
        empty = self._empty.get(key)
        if empty is None:
            empty = self._empty[key] = shaped(view.dtype, view.shape, self._device)
        return empty

    def clear(self) -> None:
        """Forgets the torch storages over the device buffers (new buffers after a retune, none after disable)."""
        self._storages.clear()


Binder: TypeAlias = Union[SimBinder, CudaBinder]
"""The binder of a session's device."""
