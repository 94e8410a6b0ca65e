"""Streamed tensors bound at fixed places: the device places of a static schedule
(``layer_options.<c>.static_slots``).

With a static schedule every block of a stack lands in the same device place (its slot, or its resident region) on
every pass, so its tensors can view that place for a whole forward of their component instead of being bound at
each block's forward and emptied after it: the ground for ``torch.compile(fullgraph=True)`` (the compiler sees the
same tensors, of their true shapes, at the same places on every call; :mod:`._traced`) and for captured graphs.

- :meth:`StaticPlaces.prime` learns each block's place by running its hooks once in execution order (one pass of
  copies, at enable and after anything that rebuilds the stacks: a retune, a write) and prepares the tensors that
  view it. The component's forward hooks bind every block there when its forward starts (:meth:`bind_all`) and
  empty them when it ends (:meth:`unbind_all`): between forwards a streamed tensor is a placeholder, as
  without a static schedule, never a view of a slot that may hold another block's bytes by then.
- On CUDA the tensors view the device buffers in place (the binder's storage of each buffer): the copy stream fills
  a slot, compiled code reads it where it is. A block called out of order while its slot was busy lands in another
  slot: eager hooks bind it there for that forward (compiled code, which calls blocks in order, never meets that).
- On the simulated device, whose memory torch cannot view, the tensors view CPU mirrors of the buffers
  (:attr:`StaticPlaces.mirrored`), and :meth:`StaticPlaces.landed` copies a block's bytes into them when it lands
  (from wherever it landed).
- A block's bytes in the mirror are poisoned when it closes (:meth:`StaticPlaces.poison`): the sim's counterpart of
  a slot the copy stream refills, so a read after the block closed (compiled code that moved one past
  ``weightferry::leave``) gives NaN in a test instead of the right bytes by luck.
- Each weightferry storage of a static block is bound over a torch storage of its own (the same bytes), so compiled
  code sees no two blocks' weights aliased: see :mod:`._traced`.
- Only blocks whose every tensor is a plain tensor holding a parameter (no tensor subclass, no buffer read outside
  a forward) are bound this way; the others keep the per-forward binding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from . import _core

if TYPE_CHECKING:
    import torch

    from ._binders import Binder
    from ._edits import Signatures
    from ._storages import StorageMap, View

__all__ = ["Place", "StaticPlaces"]


class Place(NamedTuple):
    """Where a block always lands: device buffer and byte offset."""

    buffer: int
    base: int


class StaticPlaces:
    """The places of the blocks of a handle's static stacks, and the tensors over them (see the module doc)."""

    def __init__(
        self, session: _core.Session, storages: StorageMap, binder: Binder, sigs: Signatures, eligible: set[str]
    ) -> None:
        """``eligible``: the unit paths whose tensors may be bound at their places (see the module doc)."""
        from ._binders import SimBinder

        self.mirrored = isinstance(binder, SimBinder)  # the sim: the tensors view CPU mirrors of the buffers
        self._session = session
        self._storages = storages
        self._binder = binder
        self._sigs = sigs
        self._eligible = eligible
        self.places: dict[str, Place] = {}  # unit path -> its place
        self.offsets: dict[str, list[tuple[int, int]]] = {}  # unit path -> [(storage, offset in its block)]
        self._pairs: dict[str, list[tuple[View, torch.Tensor]]] = {}  # unit path -> (view, its tensor at the place)
        self.bound: set[str] = set()  # the blocks whose tensors view their place now
        self.all_bound = False  # whether a component's forward bound them all (bind_all)
        self.tensors: dict[str, list[torch.Tensor]] = {}  # unit path -> the tensor of each of its storages
        self._mirrors: dict[int, torch.Tensor] = {}  # buffer -> its mirror (flat uint8; the sim)
        self._flats: dict[int, torch.Tensor] = {}  # buffer -> the buffer as flat uint8 (CUDA; captured copies)

    def prime(self) -> None:
        """Learns every static block's place (one pass of its hooks, in execution order) and prepares the binding
        of its tensors there (bound by :meth:`bind_all` for each forward of their component). Leaves every tensor
        a placeholder, its signature recorded. Run while no forward is under way."""
        self.unbind_all()
        self.places.clear()
        self.offsets.clear()
        self._pairs.clear()
        self.tensors.clear()
        self._mirrors.clear()
        self._flats.clear()
        for stack in self._session.static_stacks():
            for path in stack:
                residency = self._session.pre_forward(path, True)
                self._session.post_forward(path)
                if residency is None or path not in self._eligible:
                    continue
                buffer, base, offsets = residency
                self.places[path] = Place(buffer, base)
                self.offsets[path] = offsets
        if self.mirrored:
            self._make_mirrors()
        else:
            self._make_flats()
        # The mirrors are filled as each block lands (its forward); not here, where the places may still be
        # loading the next pass's first blocks.
        for path in self.places:
            self._prepare(path)
            for sid, _ in self.offsets[path]:
                self._binder.unbind(self._storages.views[sid])
                self._sigs.record(self._storages.views[sid])

    def _make_mirrors(self) -> None:
        """One zeroed CPU mirror per buffer, as long as the buffer's bytes the blocks use."""
        import torch

        ends: dict[int, int] = {}
        for path, place in self.places.items():
            for sid, off in self.offsets[path]:
                ends[place.buffer] = max(ends.get(place.buffer, 0), place.base + off + self._storages.nbytes[sid])
        self._mirrors = {buffer: torch.zeros(n, dtype=torch.uint8) for buffer, n in ends.items()}

    def _make_flats(self) -> None:
        """On CUDA: each place's buffer viewed as flat bytes, made here (outside any capture: viewing a buffer asks
        the driver about its address), for the copies of a captured forward (:mod:`._capture`)."""
        import torch

        from ._binders import CudaBinder

        assert isinstance(self._binder, CudaBinder)
        for buffer in {place.buffer for place in self.places.values()}:
            flat = torch.empty(0, dtype=torch.uint8, device=self._binder.device)
            storage = self._binder.storage(buffer)
            self._flats[buffer] = flat.set_(storage, 0, (storage.nbytes(),), (1,))

    def flat(self, buffer: int) -> torch.Tensor:
        """Device buffer ``buffer`` of a place as flat bytes (CUDA)."""
        return self._flats[buffer]

    def _storage(self, buffer: int, start: int, nbytes: int) -> torch.UntypedStorage:
        """A torch storage of its own over ``nbytes`` at byte ``start`` of device buffer ``buffer``: of its mirror on
        the sim, of the device buffer on CUDA (see :mod:`._traced` for why one per weightferry storage)."""
        import ctypes

        import torch

        if not nbytes:
            return torch.empty(0, dtype=torch.uint8, device=self._binder.device).untyped_storage()
        if self.mirrored:
            mirror = self._mirrors[buffer]
            raw = (ctypes.c_uint8 * nbytes).from_address(mirror.data_ptr() + start)
            return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes).untyped_storage()
        from ._binders import CudaBinder

        assert isinstance(self._binder, CudaBinder)
        return self._binder.storage_at(buffer, start, nbytes)

    def _prepare(self, path: str) -> None:
        """Makes the tensors that bind block ``path``'s tensors at its place, each storage over a torch storage of its
        own, and lists the tensor of each storage that ``weightferry::enter`` declares mutated."""
        import torch

        place = self.places[path]
        pairs = []
        device = self._binder.device
        for sid, off in self.offsets[path]:
            start, nbytes = place.base + off, self._storages.nbytes[sid]
            storage = self._storage(place.buffer, start, nbytes)
            for view in self._storages.views[sid]:
                item = view.dtype.itemsize
                if start % item:
                    raise _core.OffloadError(
                        f"internal error: tensor '{view.path}' would start at byte {start} of its place, not a "
                        f"multiple of its {item}-byte elements"
                    )
                t = torch.empty(0, dtype=view.dtype, device=device)
                t.set_(storage, view.offset, view.shape, view.strides)
                pairs.append((view, t))
        self._pairs[path] = pairs
        self.tensors[path] = [self._storages.views[sid][0].tensor for sid, _ in self.offsets[path]]

    def record(self) -> None:
        """Records the signatures of every static block's tensors (after a compiled forward moved their version
        counters: ``weightferry::enter`` declares them mutated)."""
        for path in self.places:
            for sid, _ in self.offsets[path]:
                self._sigs.record(self._storages.views[sid])

    def bind(self, path: str) -> None:
        """Binds block ``path``'s tensors at its place (``.data`` assignments: no version counter moves)."""
        for view, t in self._pairs[path]:
            self._binder.set_data(view, t)
        self.bound.add(path)

    def unbind(self, path: str) -> None:
        """Gives block ``path``'s tensors their placeholders again."""
        if path in self.bound:
            for sid, _ in self.offsets[path]:
                self._binder.unbind(self._storages.views[sid])
            self.bound.discard(path)

    def bind_all(self) -> None:
        """Binds every static block's tensors at its place: at the start of a component's forward, so the whole
        forward (compiled code included) sees them with their true shapes at the same places every time."""
        for path in self.places:
            if path not in self.bound:
                self.bind(path)
        self.all_bound = True

    def unbind_all(self) -> None:
        """Empties every static block's tensors: at the end of a component's forward (between forwards a streamed
        tensor is a placeholder, never a view of a slot that may hold another block's bytes)."""
        for path in list(self.bound):
            self.unbind(path)
        self.all_bound = False

    def landed(self, path: str, buffer: int, base: int) -> None:
        """On the sim, after block ``path`` landed at ``base`` of device buffer ``buffer`` (its place, or another slot
        when it was called out of order while its own was busy): copies its bytes into the mirror at its place,
        which its tensors view."""
        import torch

        place = self.places[path]
        mirror = self._mirrors[place.buffer]
        for sid, off in self.offsets[path]:
            n = self._storages.nbytes[sid]
            if n:
                data = torch.frombuffer(self._session.read_device(buffer, base + off, n), dtype=torch.uint8)
                mirror[place.base + off : place.base + off + n].copy_(data)

    def poison(self, path: str) -> None:
        """On the sim, when block ``path`` closes: fills its bytes in the mirror with ``0xff`` (NaN in every
        floating dtype), which :meth:`landed` overwrites when it lands again."""
        place = self.places[path]
        mirror = self._mirrors[place.buffer]
        for sid, off in self.offsets[path]:
            n = self._storages.nbytes[sid]
            mirror[place.base + off : place.base + off + n].fill_(0xFF)
