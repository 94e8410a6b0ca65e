"""``enable()``: offloads a torch pipeline's weights through weightferry, and the :class:`Handle` that undoes it.

What it owns: the map from each storage (as the Rust side numbers them) to the torch tensors viewing it, the torch
forward hooks on the modules the backend hooks, and the rebinding of tensors — to the device bytes while offloaded,
to ordinary CPU tensors rebuilt from the host model after :meth:`Handle.disable`. Either everything is offloaded
or nothing is: a failure after the session exists removes every hook and gives every tensor its original data back.

Two devices, one binder each:

- ``"cuda"`` / ``"cuda:N"`` (:class:`_CudaBinder`): torch views weightferry's device buffers in place
  (``__cuda_array_interface__``, one torch storage per buffer, made once). A tensor is bound with ``set_`` to its
  bytes in a buffer; a streamed block is rebound only when its slot changed since its last forward (a steady
  pipeline whose streamed blocks divide among the slots does no tensor surgery per step), and then with one
  ``set_`` per tensor from views made the first time the block landed in that slot. The hooks never wait on the
  host: Rust orders torch's current stream behind the copies and records the block's reads on it. Between its forwards a streamed tensor still views its
  last slot, whose bytes may already belong to another block: read weights through the handle, not the modules.
- ``"sim"`` (:class:`_SimBinder`, the simulated device: device buffers in host memory, compute on the CPU): a tensor
  "on the device" is a CPU tensor holding a copy of the simulated device memory, rebuilt at each streamed block's
  ``pre_forward`` and emptied after it: the sim is the test device, so the copy is acceptable there.

:meth:`Handle.state_dict` reads the true weights from the session on either device.
"""

import ctypes
import json
import time
import warnings
import weakref
from array import array

from . import _core
from ._describe import _describe
from ._plan import WeightferryWarning, _config_arg

__all__ = ["Handle", "enable"]

# The session class; a seam for tests that inject failures after the session exists.
_Session = _core.Session

# Faults the simulated device injects (a dict such as {"oom_at_alloc": 3}, JSON-encoded for the session); a seam for
# tests of enable's undo at every allocation. None in normal use.
_SIM_FAULTS = None

# Every tensor object an enabled handle manages (id -> weak reference; not a WeakSet, whose lookup compares
# tensors with ``==``): a second enable over any of them is refused.
_OFFLOADED = {}


def _is_offloaded(t):
    ref = _OFFLOADED.get(id(t))
    return ref is not None and ref() is t


class _View:
    """One torch tensor object viewing a storage: where its elements are (offset, shape, strides, dtype)."""

    __slots__ = ("tensor", "path", "dtype", "shape", "strides", "offset")

    def __init__(self, tensor, path, like=None):
        """``like``: the tensor whose geometry this object takes (a meta tensor it replaced), else its own."""
        like = tensor if like is None else like
        self.tensor = tensor
        self.path = path
        self.dtype = like.dtype
        self.shape = tuple(like.shape)
        self.strides = tuple(like.stride())
        self.offset = like.storage_offset()


def _storage_bytes(tensor):
    """The bytes of the whole (CPU) storage ``tensor`` views: one copy, no numpy needed."""
    storage = tensor.untyped_storage()
    n = storage.nbytes()
    return ctypes.string_at(storage.data_ptr(), n) if n else b""


def _write_storage(session, sid, tensor, nbytes):
    """Gives the session the bytes of the (CPU) storage ``tensor`` views, read in place by Rust. A storage whose size
    differs from the description's goes through a Python copy, so the size check names it."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes or storage.data_ptr() == 0:
        session.write_storage(sid, _storage_bytes(tensor))
    else:
        session._write_storage_at(sid, storage.data_ptr(), nbytes)


def _tensors_over(data, views):
    """One new CPU storage holding ``data`` (a ``bytearray``, shared, not copied) and a tensor per view over it, so
    views of one storage share it again."""
    import torch

    if len(data):
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    else:
        storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
    return [torch.empty(0, dtype=v.dtype).set_(storage, v.offset, v.shape, v.strides) for v in views]


def _bind(view, tensor):
    """Makes ``view``'s tensor object hold ``tensor``'s data (the object, its ``requires_grad`` and every reference
    to it stay). A seam for tests that inject a binding failure."""
    view.tensor.data = tensor


def _placeholder(view, device="cpu"):
    """What a tensor holds before its bytes are bound (and, on the sim, between its block's forwards): nothing (an
    empty tensor of its dtype on ``device``)."""
    import torch

    return torch.empty(0, dtype=view.dtype, device=device)


class _SimBinder:
    """Binds tensors to copies of simulated device memory (see the module doc)."""

    unbinds_after_forward = True
    device = "cpu"

    def __init__(self, session):
        self._session = session

    def bind(self, views, nbytes, buffer, offset):
        data = self._session.read_device(buffer, offset, nbytes)
        for view, tensor in zip(views, _tensors_over(data, views)):
            _bind(view, tensor)

    def unbind(self, views):
        for view in views:
            _bind(view, _placeholder(view))

    def clear(self):
        pass


class _CudaArray:
    """One of weightferry's CUDA buffers as torch can view it (``__cuda_array_interface__``, flat bytes). torch keeps
    this object alive as long as a view exists; it owns nothing, the session owns the memory."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class _CudaBinder:
    """Binds tensors in place to weightferry's CUDA buffers (see the module doc)."""

    unbinds_after_forward = False

    def __init__(self, session, device):
        self._session = session
        self.device = self._device = device
        self._storages = {}  # buffer id -> torch UntypedStorage viewing it
        import torch

        self._no_grad = torch.no_grad

    def _storage(self, buffer):
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

    def rebinding(self, items):
        """What binding tensors to device bytes takes, built once and applied by :meth:`apply` as often as the bytes
        are there: ``items`` are ``(views, buffer, offset)`` (a storage's tensors and where its bytes are); the result
        pairs each tensor with a tensor viewing its bytes, so applying it is one ``set_`` per tensor with no
        geometry to convert (a streamed block lands in one of a few slots: the hooks keep one per slot)."""
        import torch

        pairs = []
        for views, buffer, offset in items:
            st = self._storage(buffer)
            for view in views:
                item = view.dtype.itemsize
                if offset % item:
                    raise _core.OffloadError(
                        f"internal error: tensor '{view.path}' would start at byte {offset} of device buffer {buffer}, "
                        f"not a multiple of its {item}-byte elements"
                    )
                t = view.tensor
                if t.device != self._device:
                    _bind(view, _placeholder(view, self._device))
                src = torch.empty(0, dtype=view.dtype, device=self._device)
                src.set_(st, offset // item + view.offset, view.shape, view.strides)
                pairs.append((t, src))
        return pairs

    def apply(self, pairs):
        """Binds each tensor of a :meth:`rebinding` to its bytes."""
        with self._no_grad():
            for t, src in pairs:
                t.set_(src)

    def bind(self, views, nbytes, buffer, offset):
        self.apply(self.rebinding([(views, buffer, offset)]))

    def unbind(self, views):
        pass

    def clear(self):
        self._storages.clear()


def _compiler_disabled(fn):
    """``fn`` marked for torch.compile to run as is, never traced (``torch.compiler.disable``, torch >= 2.1)."""
    import torch

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _raw_stream_reader(index):
    """A cheap reader of torch's current raw stream on device ``index`` (0.15 us instead of 8 us)."""
    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return lambda: fast(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


class _HookClock:
    """Latency of the torch hooks (pre and post, each as one sample, nanoseconds): the last :data:`SAMPLES` calls in a
    fixed ring, so memory stays flat over any number of steps, plus an exact call count and maximum."""

    SAMPLES = 4096

    def __init__(self):
        self.ring = array("q", bytes(8 * self.SAMPLES))
        self.calls = 0
        self.max_ns = 0
        self.total_ns = 0

    def record(self, ns):
        self.ring[self.calls % self.SAMPLES] = ns
        self.calls += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def summary(self):
        kept = sorted(self.ring[: min(self.calls, self.SAMPLES)])
        if not kept:
            return {"calls": 0, "p50_us": None, "p99_us": None, "max_us": None, "total_ms": 0.0}

        def pct(q):
            return kept[min(len(kept) - 1, int(q * len(kept)))] / 1e3

        return {"calls": self.calls, "p50_us": pct(0.5), "p99_us": pct(0.99), "max_us": self.max_ns / 1e3,
                "total_ms": self.total_ns / 1e6}


class Handle:
    """An offloaded pipeline. :meth:`disable` gives every tensor ordinary CPU storage back (bit-identical);
    :meth:`stats` reports what the backend holds and did. A context manager: leaving the ``with`` block disables."""

    def __init__(self, session, views, nbytes, streamed_by, modules, binder, stream=None):
        self._session = session
        self._binder = binder
        # On CUDA: (torch's raw stream at enable, a reader of the current one); the hooks refuse another stream.
        self._stream = stream
        self._slot_of = {}  # unit module path -> (buffer, base) its tensors view now
        self._offsets = {}  # unit module path -> [(storage id, offset in its block)], asked once per enable/retune
        self._rebindings = {}  # (unit module path, buffer, base) -> the binder's rebinding of its tensors there
        self._clock = _HookClock()
        self._config = None  # the config dict given to enable (or the last retune), for retune's keyword edits
        self._broken = None  # why the hooks refuse to run (a retune that failed half-way), else None
        self._views = views  # storage id -> [_View]
        self._nbytes = nbytes  # storage id -> bytes
        self._streamed_by = streamed_by  # unit module path -> [storage id]
        self._modules = modules  # module path -> nn.Module
        self._torch_hooks = []
        self._entered = set()
        self._offloaded = False
        self._disabled = False

    # --- binding -------------------------------------------------------------------------------------------

    def _bind_from_device(self, sid, buffer, offset):
        self._binder.bind(self._views[sid], self._nbytes[sid], buffer, offset)

    def _check_stream(self):
        enabled_on, current = self._stream
        now = current()
        if now != enabled_on:
            raise _core.OffloadError(
                f"this forward runs on CUDA stream {now:#x}, but weightferry was enabled on stream {enabled_on:#x} "
                "(torch's current stream at enable): run the pipeline on that stream, or disable and enable again "
                "under the stream you use"
            )

    def _pre(self, path):
        clock = self._clock

        def hook(module, args):
            start = time.perf_counter_ns()
            try:
                if self._broken is not None:
                    raise _core.OffloadError(self._broken)
                if self._stream is not None:
                    self._check_stream()
                offsets = self._offsets.get(path)
                residency = self._session.pre_forward(path, offsets is None)
                self._entered.add(path)
                if residency is not None:
                    buffer, base, listed = residency
                    if offsets is None:
                        offsets = self._offsets[path] = listed
                    if self._binder.unbinds_after_forward:
                        for sid, off in offsets:
                            self._bind_from_device(sid, buffer, base + off)
                    elif self._slot_of.get(path) != (buffer, base):
                        # The block landed in another slot than at its last forward: its tensors move there.
                        key = (path, buffer, base)
                        pairs = self._rebindings.get(key)
                        if pairs is None:
                            views = self._views
                            pairs = self._rebindings[key] = self._binder.rebinding(
                                [(views[sid], buffer, base + off) for sid, off in offsets]
                            )
                        self._binder.apply(pairs)
                        self._slot_of[path] = (buffer, base)
                return None
            finally:
                clock.record(time.perf_counter_ns() - start)

        return hook

    def _post(self, path):
        clock = self._clock

        def hook(module, args, output):
            if path not in self._entered:
                return None  # its pre_forward failed: nothing to release
            start = time.perf_counter_ns()
            try:
                self._entered.discard(path)
                if self._binder.unbinds_after_forward:
                    for sid in self._streamed_by.get(path, ()):
                        self._binder.unbind(self._views[sid])
                self._session.post_forward(path)
                return None
            finally:
                clock.record(time.perf_counter_ns() - start)

        return hook

    def _install(self):
        """Binds the fixed placement once, releases the streamed tensors' host copies, installs the torch hooks."""
        streamed = {sid for sids in self._streamed_by.values() for sid in sids}
        for sid in self._views:
            if sid not in streamed:
                self._bind_from_device(sid, *self._session.locate(sid))
        for sid in streamed:
            for view in self._views[sid]:
                _bind(view, _placeholder(view, self._binder.device))
        for path in self._session.hooked_modules():
            module = self._modules.get(path)
            if module is None:
                raise _core.Error(f"internal error: the backend hooks module '{path}', which describe() did not name")
            # torch.compile must not trace into the hooks (they call into Rust and rebind tensors): each hook is one
            # graph break, and the compiled regions between them stay valid across rebinding.
            pre, post = _compiler_disabled(self._pre(path)), _compiler_disabled(self._post(path))
            self._torch_hooks.append(module.register_forward_pre_hook(pre))
            self._torch_hooks.append(module.register_forward_hook(post, always_call=True))

    def _remove_hooks(self):
        while self._torch_hooks:
            self._torch_hooks.pop().remove()
        self._entered.clear()
        self._forget_slots()

    def _forget_slots(self):
        """Drops what the hooks know of the slots (new slots after a retune, none after disable)."""
        self._slot_of.clear()
        self._offsets.clear()
        self._rebindings.clear()

    def _mark(self, on):
        for views in self._views.values():
            for view in views:
                if on:
                    _OFFLOADED[id(view.tensor)] = weakref.ref(view.tensor)
                elif _is_offloaded(view.tensor):
                    del _OFFLOADED[id(view.tensor)]

    # --- public --------------------------------------------------------------------------------------------

    @property
    def enabled(self):
        """Whether the pipeline is offloaded now (``False`` after :meth:`disable`, and when the plan streamed
        nothing)."""
        return self._offloaded and not self._disabled

    def disable(self):
        """Removes the hooks, disables the backend and rebinds every tensor to an ordinary CPU tensor rebuilt from
        the host model: bit-identical to before :func:`enable`, tensors that shared a storage sharing one again.
        Idempotent. If the backend cannot finish, raises :class:`weightferry.OffloadError` and can be called
        again."""
        if self._disabled:
            return
        self._remove_hooks()
        self._session.disable()
        self._binder.clear()
        if self._offloaded:
            for sid, views in self._views.items():
                data = self._session.read_storage(sid)
                for view, tensor in zip(views, _tensors_over(data, views)):
                    _bind(view, tensor)
            self._mark(False)
        self._disabled = True

    def _restore(self, sids):
        """Gives the tensors of ``sids`` ordinary CPU tensors rebuilt from the session's bytes (the undo of a failed
        or empty enable; plain assignments, so it cannot fail half-way on a binding). A storage the session cannot
        read back is reported after every other one was restored."""
        lost = []
        for sid in sids:
            views = self._views[sid]
            try:
                data = self._session.read_storage(sid)
            except _core.Error as e:
                lost.append(f"{views[0].path}: {e}")
                continue
            for view, tensor in zip(views, _tensors_over(data, views)):
                view.tensor.data = tensor
        if lost:
            raise _core.OffloadError(
                "weightferry could not give back the weights of "
                + "; ".join(lost)
                + " after a failed enable; keep the pipeline's handle and report this"
            )

    def stats(self):
        """The backend's report as a dict: ``strategy``, ``enabled``, ``stacks`` (per stack: ``loads``,
        ``h2d_bytes``, ``prefetch_hits``, ``reuse_hits``, ``sync_fetches`` (blocks not prefetched in time: the
        forward waited for their copy), ``record_waits`` (hook calls that waited on the host for the copy actor to
        enqueue their block's load), ``device_bytes``, ...), ``fixed_device_bytes``, ``master_host_bytes``,
        ``mapped_host_bytes`` (blocks served straight from a checkpoint file, no master), ``pinned``; and the totals
        ``bytes_streamed`` (host-to-device bytes of every stack), ``device_bytes`` (fixed placement and every
        stack's slots), ``host_bytes`` (the masters), ``stalls`` (the stacks'
        ``sync_fetches``), ``hooks`` (the torch hooks' own latency: ``calls``, ``p50_us``, ``p99_us`` over the last
        4096 calls, ``max_us``, ``total_ms``)."""
        report = json.loads(self._session.report())
        stacks = report.get("stacks", [])
        report["bytes_streamed"] = sum(s.get("h2d_bytes", 0) for s in stacks)
        report["device_bytes"] = report.get("fixed_device_bytes", 0) + sum(s.get("device_bytes", 0) for s in stacks)
        report["host_bytes"] = report.get("master_host_bytes", 0)
        report["stalls"] = sum(s.get("sync_fetches", 0) for s in stacks)
        report["hooks"] = self._clock.summary()
        return report

    def retune(self, config=None, *, prefetch_depth=None, resident_layers=None, device_budget=None):
        """Changes the DiT's prefetch depth, its resident layers and the device budget without rebuilding host
        masters or the fixed placement, and returns the new plan (the dict :func:`weightferry.plan` gives).

        ``config`` is a whole new config (dict or path, same vocabulary); without it the keywords edit the config
        dict given to :func:`enable` (``layer_options.dit.prefetch_depth``, ``layer_options.dit.resident_layers``,
        ``device_budget``; ``device_budget="auto"`` is planned from the device's free memory now). A config that
        would offload other components or blocks raises :class:`weightferry.OffloadError` and changes nothing
        (disable and enable instead); a bad config raises :class:`weightferry.ConfigError` /
        :class:`weightferry.PlanError`. Each streamed block is rebound to its new slot at its next forward."""
        if not self.enabled:
            raise _core.OffloadError("retune needs an enabled handle; this one is disabled or offloads nothing")
        edits = {"prefetch_depth": prefetch_depth, "resident_layers": resident_layers}
        if config is None:
            if self._config is None:
                raise _core.ConfigError(
                    "invalid config: <root>: retune(prefetch_depth=..., resident_layers=..., device_budget=...) "
                    "edits the config dict given to enable, but this handle was enabled from a file; pass the new "
                    "config to retune instead"
                )
            config = json.loads(json.dumps(self._config))
        if any(v is not None for v in edits.values()) or device_budget is not None:
            if not isinstance(config, dict):
                raise _core.ConfigError("invalid config: <root>: retune's keywords edit a config dict, not a path")
            config = json.loads(json.dumps(config))
            dcfg = config.setdefault("diffusion_offload_config", {})
            for key, value in edits.items():
                if value is not None:
                    dcfg.setdefault("layer_options", {}).setdefault("dit", {})[key] = value
            if device_budget is not None:
                dcfg["device_budget"] = device_budget
        text, fmt = _config_arg(config)
        free = 0
        if self._stream is not None:
            import torch

            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self._binder.device)[0]
        try:
            plan = self._session.retune(text, fmt, free)
        except _core.Error:
            if not self._session.hooked_modules():
                self._broken = (
                    "a retune failed after the old block stacks were taken down, so this pipeline has no offload "
                    "hooks; call disable() (which restores every weight) and enable again"
                )
            raise
        self._forget_slots()  # the slots are new: every streamed block is bound again at its next forward
        self._binder.clear()
        self._config = config if isinstance(config, dict) else None
        return json.loads(plan)

    def state_dict(self, component=None):
        """The pipeline's weights as ordinary CPU tensors read from weightferry's own copy (the host masters while
        offloaded): bit-identical to what :func:`enable` took, and the right values while enabled, when a streamed
        module's own tensors view recycled device slots. Parameters and persistent buffers, as torch's
        ``state_dict`` has them; names are ``describe()``'s (dotted from the pipeline), or relative to
        ``component`` (``handle.state_dict("transformer")`` has the keys of ``transformer.state_dict()``). Tensors
        that shared a storage share one here too."""
        prefix = None if component is None else f"{component}."
        wanted = {p: v for p, v in self._state_paths.items() if prefix is None or p.startswith(prefix)}
        if prefix is not None and not wanted:
            raise _core.PipelineError(f"the pipeline has no component '{component}' with weights")
        built, out = {}, {}
        for path, (sid, index) in wanted.items():
            if sid not in built:
                views = self._views[sid]
                built[sid] = _tensors_over(self._session.read_storage(sid), views)
            out[path if prefix is None else path[len(prefix):]] = built[sid][index]
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.disable()
        return False


def _check_tensors(bound, allowed=("cpu",)):
    """Refuses (``PipelineError``) a tensor that is not on the CPU: the host masters are made from CPU tensors (with a
    checkpoint, ``meta`` tensors are fine too: their bytes come from the file)."""
    for path, (module, name) in bound.items():
        t = getattr(module, name)
        if t.device.type not in allowed:
            raise _core.PipelineError(
                f"tensor '{path}' is on {t.device}; weightferry offloads a pipeline whose weights are on the CPU "
                "(move it there with .to('cpu') before enable)"
            )


def _cuda_index(device):
    """The CUDA ordinal of ``"cuda"`` (torch's current device) or ``"cuda:N"``; ``None`` for any other string (the
    Rust side names it unknown). Raises :class:`weightferry.DeviceError` when torch cannot reach that device."""
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        return None
    import torch

    if not torch.cuda.is_available():
        raise _core.DeviceError(
            f'device "{device}": torch sees no CUDA device (torch.cuda.is_available() is False); use device="sim" '
            "(the simulated device) on a machine without a GPU"
        )
    index = torch.cuda.current_device() if device == "cuda" else int(device[5:])
    count = torch.cuda.device_count()
    if index >= count:
        raise _core.DeviceError(f'device "{device}": CUDA device {index} does not exist ({count} device(s) present)')
    return index


# Distributed sessions opened by this process so far: each one's rendezvous port has its own key in torch's store
# (every rank enables in the same order, so the n-th enable of every rank reads the same key).
_RENDEZVOUS_COUNT = 0


def _rendezvous_port(text, fmt):
    """Where the ranks of a distributed session meet, when torch.distributed already runs a process group: its
    store holds ``MASTER_PORT``, so rank 0 picks a free port, publishes it in that store, and every rank reads it
    there. ``None`` (weightferry's rendezvous listens on ``MASTER_PORT``) without a process group, or when the config
    gathers nothing."""
    global _RENDEZVOUS_COUNT
    if not _core.check_config(text, fmt).startswith("distributed"):
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    import socket

    store = dist.distributed_c10d._get_default_store()
    _RENDEZVOUS_COUNT += 1
    key = f"weightferry/rendezvous/{_RENDEZVOUS_COUNT}"
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            store.set(key, str(s.getsockname()[1]))
    return int(store.get(key).decode())


def _open_session(desc_json, text, fmt, name, device, checkpoint=None):
    """The Rust session on ``device`` and its binder; on CUDA also (torch's raw stream, a reader of the current
    one). ``checkpoint`` is ``(path, component)`` or ``None``."""
    if not isinstance(device, str):
        device = str(device)  # a torch.device
    index = _cuda_index(device)
    path, component = tuple(checkpoint) if checkpoint is not None else (None, None)
    port = _rendezvous_port(text, fmt)
    if index is None:
        faults = json.dumps(_SIM_FAULTS) if _SIM_FAULTS is not None else None
        session = _Session(desc_json, text, _core.SessionOptions(
            config_format=fmt, name=name, device=device, checkpoint=path, component=component, sim_faults=faults,
            rendezvous_port=port))
        return session, _SimBinder(session), None
    import torch

    dev = torch.device("cuda", index)
    current = _raw_stream_reader(index)
    stream = current()
    probe = torch.empty(1, dtype=torch.uint8, device=dev)  # a torch allocation, for the shared-context check
    torch.cuda.empty_cache()  # device_budget = "auto" plans from the free memory, with torch's cache given back
    free, _total = torch.cuda.mem_get_info(index)
    torch_cuda = _core.TorchCuda(stream=stream, probe_ptr=probe.data_ptr(), free_bytes=free, default_cuda=index)
    session = _Session(desc_json, text, _core.SessionOptions(
        config_format=fmt, name=name, device=device, checkpoint=path, component=component, rendezvous_port=port,
        torch=torch_cuda))
    del probe
    return session, _CudaBinder(session, dev), (stream, current)


def _materialize_meta(bound):
    """Replaces every ``meta`` tensor of the pipeline by an empty CPU tensor of its dtype (a ``Parameter`` with its
    ``requires_grad`` for a parameter; one new object per old one, so tied attributes stay tied): a meta tensor
    cannot take CPU data (``.data`` refuses the type change). Returns the undo list ``[(module, attr, old)]``."""
    import torch
    import torch.nn as nn

    new_of, undo = {}, []
    for module, attr in bound.values():
        old = getattr(module, attr)
        if old.device.type != "meta":
            continue
        new = new_of.get(id(old))
        if new is None:
            empty = torch.empty(0, dtype=old.dtype)
            new = nn.Parameter(empty, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else empty
            new_of[id(old)] = new
        table = module._parameters if attr in module._parameters else module._buffers
        undo.append((table, attr, old))
        table[attr] = new
    return undo


def _check_computed_buffers(bound):
    """A module bound from a checkpoint keeps its non-persistent buffers (rotary tables and the like: computed when
    it is built, in no checkpoint), so they must hold real values, not ``meta``."""
    for path, (module, attr) in bound.items():
        if attr in module._non_persistent_buffers_set and getattr(module, attr).is_meta:
            raise _core.PipelineError(
                f"buffer '{path}' is on the meta device, but no checkpoint holds it (a non-persistent buffer, "
                "computed when the module is built); build the module with only its parameters on meta "
                "(accelerate.init_empty_weights(), which keeps buffers real) and enable it with checkpoint= again"
            )


def _checkpoint_component(desc, checkpoint):
    """``(path, component)`` for ``checkpoint=``: the one component the file fills."""
    import os

    try:
        path = os.fspath(checkpoint)
    except TypeError:
        raise _core.CheckpointError(
            f"checkpoint must be a path (str or os.PathLike) to a .safetensors file or a sharded folder, got "
            f"{type(checkpoint).__name__}"
        ) from None
    modules = list(desc.get("modules", {}))
    if len(modules) != 1 or desc.get("tensors"):
        raise _core.PipelineError(
            f"checkpoint= fills one component, but pipeline {desc['class']} has "
            f"{', '.join(modules) or 'no components'}{' and tensors of its own' if desc.get('tensors') else ''}; "
            "pass the module the file holds alone, e.g. {'transformer': model}"
        )
    return str(path), modules[0]


def enable(pipeline, config, device="sim", *, name=None, checkpoint=None):
    """Offloads ``pipeline``'s weights under ``config`` and returns a :class:`Handle`.

    ``pipeline`` and ``config`` are what :func:`weightferry.plan` takes. ``device`` is ``"cuda"`` (torch's current
    CUDA device), ``"cuda:N"``, or ``"sim"`` (the simulated device, the default: device buffers in host memory). The
    pipeline's tensors must be on the CPU. On CUDA the pipeline runs on torch's current stream at enable (a forward
    on another stream raises :class:`weightferry.OffloadError`); the caller moves the inputs to the device, and
    every tensor the plan keeps on the device (the fixed placement) is there after enable.

    ``checkpoint`` (a ``.safetensors`` file, or a folder with a ``*.safetensors.index.json``) fills a pipeline of one
    component (e.g. ``{"transformer": model}`` with the model built on the ``meta`` device) from the file: the
    component's tensor ``K`` is the file's tensor ``K``, every one checked by name, dtype and shape before a byte is
    read (:class:`weightferry.CheckpointError` naming the file and the tensor otherwise), and the weights never pass
    through torch. After :meth:`Handle.disable` the module holds them as ordinary CPU tensors.

    The plan is resolved first, so a bad config or pipeline raises :class:`weightferry.ConfigError`,
    :class:`weightferry.PipelineError` or :class:`weightferry.PlanError` with the CLI's message before anything
    moves; a pipeline already enabled raises :class:`weightferry.OffloadError`. Then every storage's bytes go to
    weightferry's host model, the backend builds host masters, the fixed placement and the block stacks, and torch
    forward hooks on the modules it hooks bind each streamed block's tensors to its device bytes for the block's
    forward. The tensors' own host copies are released. Any failure from here on removes every hook, gives every
    tensor its original data back, and re-raises.
    """
    text, fmt = _config_arg(config)
    desc, bound, modules = _describe(pipeline)
    objects = [getattr(m, n) for m, n in bound.values()]
    if any(_is_offloaded(t) for t in objects):
        raise _core.OffloadError(
            f"pipeline {desc['class']} is already enabled by weightferry (one of its tensors is offloaded); call "
            "disable() on its handle first"
        )
    ckpt = _checkpoint_component(desc, checkpoint) if checkpoint is not None else None
    if ckpt:
        _check_computed_buffers(bound)
    session, binder, stream = _open_session(
        json.dumps(desc), text, fmt, desc["class"] if name is None else str(name), device, ckpt
    )
    _check_tensors(bound, ("cpu", "meta") if ckpt else ("cpu",))
    report = json.loads(session.plan_json())
    for message in report.get("warnings", []):
        warnings.warn(message, WeightferryWarning, stacklevel=2)

    # With a checkpoint, meta tensors become empty CPU tensors first (undone on failure); their bytes come from the file.
    meta_undo = _materialize_meta(bound) if ckpt else []
    replaced = {id(table[attr]): old for table, attr, old in meta_undo}
    paths = dict(session.tensor_storages())
    if set(paths) != set(bound):
        raise _core.Error("internal error: the description's tensors and the pipeline's differ")
    views, seen = {}, set()
    for path, (module, attr) in bound.items():
        t = getattr(module, attr)
        key = (paths[path], id(t))
        if key not in seen:  # a tensor object registered twice (a tied attribute) is bound once
            seen.add(key)
            views.setdefault(paths[path], []).append(_View(t, path, replaced.get(id(t))))
    nbytes, streamed_by = {}, {}
    for sid, size, unit in session.storages():
        nbytes[sid] = size
        if unit is not None:
            streamed_by.setdefault(unit, []).append(sid)
    handle = Handle(session, views, nbytes, streamed_by, modules, binder, stream)
    handle._config = json.loads(text) if fmt == "json" else None
    # Every parameter and persistent buffer's path -> (storage, index of its tensor object among the storage's views).
    index_of = {id(v.tensor): (sid, i) for sid, vs in views.items() for i, v in enumerate(vs)}
    handle._state_paths = {
        path: index_of[id(getattr(module, attr))]
        for path, (module, attr) in bound.items()
        if attr in module._parameters or attr not in module._non_persistent_buffers_set
    }

    # Storage by storage, the bytes go to the session and torch's own host copy is given up at once, so host memory
    # holds about one copy of the weights throughout (plus the masters of one batch while the backend builds them).
    # From its write on, the session holds a storage's only copy: any failure rebuilds the tensors from it.
    released = []
    # With a checkpoint the session has every other storage from the file: those tensors keep their (empty) data
    # until enable succeeded, and a failure gives back the module's own meta tensors.
    originals = [(v.tensor, v.tensor.data) for vs in views.values() for v in vs] if ckpt else []
    # The storages the session has no bytes of: every one, or from a checkpoint its non-persistent buffers.
    from_module = set(session.unwritten())
    try:
        for sid, vs in views.items():
            if sid not in from_module:
                continue
            _write_storage(session, sid, vs[0].tensor, nbytes[sid])
            released.append(sid)
            for view in vs:
                _bind(view, _placeholder(view))
        if not session.enable():
            handle._restore(released)
            for tensor, data in originals:
                tensor.data = data
            for table, attr, old in meta_undo:
                table[attr] = old
            warnings.warn(
                f"weightferry offloads nothing: {report.get('skip_reason') or 'the config disables offload'}",
                WeightferryWarning,
                stacklevel=2,
            )
            return handle
        handle._offloaded = True
        handle._install()
        handle._mark(True)
    except BaseException:
        handle._remove_hooks()
        handle._mark(False)
        try:
            session.disable()
        except _core.Error as e:  # the original failure is the one to raise
            warnings.warn(f"weightferry: disabling after a failed enable also failed: {e}", WeightferryWarning)
        for tensor, data in originals:
            tensor.data = data
        for table, attr, old in meta_undo:
            table[attr] = old
        handle._restore(released)
        handle._disabled = True
        raise
    return handle
