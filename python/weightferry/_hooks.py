"""The torch forward hooks of an enabled pipeline, on the modules the backend hooks: each runs the session's
``pre_forward`` / ``post_forward`` and binds the module's streamed block to its device bytes for its forward.

On CUDA the hooks never wait on the host: Rust orders torch's current stream behind the copies and records the
block's reads on it. A streamed block's tensors are bound for each of its forwards (one ``.data`` assignment per
tensor, from views made once per block and slot) and emptied after it, on every device: between forwards a streamed
tensor is a placeholder (on the device), never a slot that may hold another block's bytes; the true weights
are read through ``state_dict()``. A whole component offloaded as one unit (model-level) is hooked at every entry
point (:func:`_entries`), so ``vae.decode`` finds it resident."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from . import _core
from ._binders import Binder, CudaBinder, Rebinding
from ._capture import CaptureRun, CudaEmitter, SimGraph, SimRecorder, capturing, not_static
from ._clock import HookClock
from ._compiler import compiler_disabled, reset_compiled
from ._grad import inference_only
from ._outside import Unit, hook_outside_calls
from ._static import StaticPlaces
from ._storages import tensors_over
from ._streams import StreamBridge
from ._traced import TraceState, block_trace, ops, output_tensors, register, unregister, whole_trace

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle
    from typing_extensions import TypeAlias

    from ._describe import Modules
    from ._edits import Signatures
    from ._storages import StorageMap

__all__ = ["Hooks", "StreamCheck"]

StreamCheck: TypeAlias = "tuple[int, Callable[[], int]]"
"""On CUDA: (torch's raw stream at enable, a reader of the current one); a forward on another stream is bridged to
the enable stream by events (:mod:`._streams`)."""

_UNTRACED = (
    "weightferry streams block '{path}' and rebinds its tensors in this hook, which torch.compile runs as it is (one "
    "graph break per streamed block): compile without fullgraph=True, or give the component a static schedule "
    "(\"static_slots\": True in its layer_options) so that torch.compile traces its blocks without a break"
)
"""What torch.compile says when a trace that may not break reaches a streamed block's hook (``compiler_disabled``)."""


def _entries(component: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules through which a whole component offloaded as one unit can run: the component itself (its
    ``forward``) and its submodules down to the first one that is not a container (``ModuleList`` / ``ModuleDict``,
    which are never called themselves), since other entry points (a VAE's ``decode`` and ``encode``, their tiled and
    sliced variants) call those and not the component's ``forward``. The unit is loaded at the first entry and
    released when it closes."""
    import torch.nn as nn

    out = [component]
    todo = list(component.children())
    while todo:
        child = todo.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            todo.extend(child.children())
        else:
            out.append(child)
    return out


class Hooks:
    """The hooks of one handle, and what they know of the slots the streamed blocks landed in."""

    def __init__(
        self,
        session: _core.Session,
        storages: StorageMap,
        binder: Binder,
        modules: Modules,
        stream: StreamCheck | None,
        sigs: Signatures,
    ) -> None:
        self._session = session
        self._sigs = sigs  # what each managed tensor held when the hooks bound it (edits outside are found by it)
        self._storages = storages
        self._binder = binder
        self._modules = modules  # module path -> nn.Module
        self._bridge = StreamBridge(stream[0], stream[1], binder.device) if stream is not None else None
        self._foreign: dict[str, torch.cuda.Stream] = {}  # unit path -> the other stream its forward runs on
        self.clock = HookClock()
        self.broken: str | None = None  # why the hooks refuse to run (a retune that failed half-way), else None
        # unit module path -> [(storage id, offset in its block)], asked once per enable/retune
        self._offsets: dict[str, list[tuple[int, int]]] = {}
        # (unit module path, buffer, base) -> the binder's rebinding of its tensors there
        self._rebindings: dict[tuple[str, int, int], Rebinding] = {}
        self._torch_hooks: list[RemovableHandle] = []
        self._entered: set[str] = set()
        self._depth: dict[str, int] = {}  # unit path -> its entry modules open now (nested calls of one unit)
        self.outside: list[torch.nn.Module] = []  # submodules whose call outside their block opened it, innermost last
        # One forward at a time: the thread whose hooked modules are open now, how many, and the first one's path.
        self._lock = threading.Lock()
        self._thread: int | None = None
        self._open = 0
        self._inside = ""
        # storage id -> CPU tensors of its true bytes, for streamed storages of buffers only (see _idle)
        self._idle_buffers: dict[int, list[torch.Tensor]] = {}
        # storages holding no parameter (nor a part or an attached part of one), found once at install
        self._buffer_only: frozenset[int] = frozenset()
        # A static schedule's blocks at fixed places (see _static), and how the compiler traces their hooks (_traced).
        self.static: StaticPlaces | None = None
        self._trace = TraceState()
        self._key = 0  # this handle's number for the custom operators (0: none registered)
        self._order: torch.Tensor | None = None  # the tensor both operators mutate, which keeps them in order
        self._units: list[str] = []  # the operators' unit numbers -> unit paths
        # static block path -> [the names of its weights in it, or None], read by its traced hooks (see _traced)
        self._names: dict[str, list[tuple[str, ...] | None]] = {}
        # A CUDA graph capture of a forward under way (_capture), whether one was captured since enable (eager
        # forwards then wait for replays at their edges), and the stream captured copies run on.
        self.capture: CaptureRun | SimGraph | None = None
        self.simulate: Any = None  # the sim: a capture to record (_capture.simulated_capture), or a graph to replay
        self.captured = False
        self.captured_bytes = 0  # host-to-device bytes a replay of the last captured forward copies
        self._scheduled = False  # whether the session's scheduler ran in this forward (after a capture: see _sync)
        self._copy_stream: torch.cuda.Stream | None = None

    def _idle(self, sid: int) -> None:
        """Binds a streamed storage's tensors as they are between forwards: a placeholder, except a storage
        of buffers only (a VAE's ``latents_mean``, a scheduler table), which pipelines read outside any forward:
        those hold their true bytes on the CPU (a copy read once from the session; buffers are small). The attached
        parts of a weight (bitsandbytes' ``quant_state`` tensors) are no buffers: their class reads them outside a
        forward only to write its state dict, which lends them their true bytes then (``_state_dict``)."""
        views = self._storages.views[sid]
        if sid not in self._buffer_only:
            self._binder.unbind(views)
            return
        cached = self._idle_buffers.get(sid)
        if cached is None:
            cached = self._idle_buffers[sid] = tensors_over(self._session.read_storage(sid), views)
        for view, tensor in zip(views, cached):
            self._binder.set_data(view, tensor)

    def _bind_from_device(self, sid: int, buffer: int, offset: int) -> None:
        self._binder.bind(self._storages.views[sid], self._storages.nbytes[sid], buffer, offset)

    def _enter(self, path: str) -> None:
        """Counts ``path`` open on this thread; refuses a thread while another one has a hooked module open (the
        backend's slots and the modules' tensors serve one forward at a time)."""
        me = threading.get_ident()
        with self._lock:
            if self._open and self._thread != me:
                raise _core.OffloadError(
                    f"weightferry runs one forward of an offloaded pipeline at a time: another thread is inside "
                    f"'{self._inside}' while this one enters '{path}'; run the pipeline from one thread at a time "
                    "(a lock around its calls), or give each thread its own pipeline"
                )
            if not self._open:
                self._thread, self._inside = me, path
            self._open += 1

    def open_here(self, path: str) -> bool:
        """Whether the unit ``path`` is open now, entered by this thread."""
        return path in self._entered and self._thread == threading.get_ident()

    def busy(self) -> bool:
        """Whether a hooked module is open now (a forward is under way: its block's tensors are bound)."""
        return self._open > 0

    def _leave(self) -> None:
        with self._lock:
            self._open -= 1
            if not self._open:
                self._thread = None

    def _pre(self, path: str) -> Callable[[torch.nn.Module, Any], None]:
        clock = self.clock

        def hook(module: torch.nn.Module, args: Any) -> None:
            if path in self._entered and self._thread == threading.get_ident():
                self._depth[path] += 1  # a submodule entry of a unit already open (a whole component's child)
                return
            start = time.perf_counter_ns()
            try:
                self._open_unit(path, traced=False)
            finally:
                clock.record(time.perf_counter_ns() - start)

        return hook

    def _open_unit(self, path: str, traced: bool) -> None:
        """Opens unit ``path`` for its forward: the checks, the session's ``pre_forward``, the binding of its tensors
        (``traced``: from the compiled code, where a static block must land at its place)."""
        if self.broken is not None:
            raise _core.OffloadError(self.broken)
        if self._sigs.editing is not None:
            raise _core.OffloadError(
                f"'{path}' runs inside Handle.editing(), where the weights are ordinary CPU tensors being "
                "edited: leave the editing block, then run the pipeline"
            )
        if self.capture is None and self.static is not None and self._may_capture and path in self.static.places:
            self._start_capture(inside=True)
        if self.capture is not None:
            self._open_captured(path)
            return
        if path in self._storages.streamed_by and isinstance(self._binder, CudaBinder) and capturing():
            # A graph being captured reached a unit the session streams: refused before any of its device work (its
            # copies, its waits on other streams), which the graph would not replay, ends the capture in a CUDA error.
            raise not_static(path)
        if self.captured and not self._scheduled:
            self._sync_with_replays()
        self._enter(path)
        residency = None
        try:
            offsets = self._offsets.get(path)
            residency = self._session.pre_forward(path, offsets is None)
            if residency is not None:
                buffer, base, listed = residency
                if offsets is None:
                    offsets = self._offsets[path] = listed
                self._place(path, offsets, buffer, base, traced)
                bridge = self._bridge
                foreign = bridge.foreign() if bridge is not None else None
                if bridge is not None and foreign is not None:
                    bridge.loaded(foreign)
                    self._foreign[path] = foreign
        except BaseException:
            if residency is not None:
                self._session.post_forward(path)
            self._leave()
            raise
        self._entered.add(path)
        self._depth[path] = 1

    def _open_captured(self, path: str) -> None:
        """Opens unit ``path`` in a forward being captured: the copies and waits of the captured schedule instead of
        the session's (its tensors are bound at its place since the forward started)."""
        assert self.capture is not None
        self._enter(path)
        try:
            self.capture.enter(path)
        except BaseException:
            self._leave()
            raise
        self._entered.add(path)
        self._depth[path] = 1

    def _place(self, path: str, offsets: list[tuple[int, int]], buffer: int, base: int, traced: bool) -> None:
        """Binds the tensors of unit ``path``, landed at ``base`` of device buffer ``buffer``, for its forward."""
        static = self.static
        if static is not None and path in static.places:
            if traced and path not in static.bound:
                raise _core.OffloadError(
                    f"compiled code reached block '{path}' outside a forward of its component, whose hooks bind a "
                    "static schedule's tensors: call the component itself (model(...)), not its forward(), or "
                    "compile without static_slots"
                )
            if path not in static.bound:
                static.bind(path)  # a block called without its component's forward (bound for this forward)
            if static.mirrored:
                # The mirrors at its place take its bytes from wherever it landed (a block called out of order while
                # its slot was busy lands in another one; the tensors still view the place).
                static.landed(path, buffer, base)
                return
            if static.places[path] == (buffer, base):
                return
            if traced:
                raise _core.OffloadError(
                    f"internal error: static block '{path}' landed at byte {base} of device buffer {buffer}, not at "
                    f"its place {tuple(static.places[path])}, in compiled code that reads it there"
                )
            # Called out of order while its slot was busy (eager): bound where it landed for this forward only.
            static.bound.discard(path)
        if isinstance(self._binder, CudaBinder):
            self._move(path, offsets, buffer, base)
        else:
            for sid, off in offsets:
                self._bind_from_device(sid, buffer, base + off)

    def _move(self, path: str, offsets: list[tuple[int, int]], buffer: int, base: int) -> None:
        """Binds the block's tensors to its slot (CUDA), from views made once per slot."""
        binder = cast(CudaBinder, self._binder)
        key = (path, buffer, base)
        pairs = self._rebindings.get(key)
        if pairs is None:
            views = self._storages.views
            pairs = self._rebindings[key] = binder.rebinding([(views[sid], buffer, base + off) for sid, off in offsets])
        binder.apply(pairs)

    def _post(self, path: str) -> Callable[[torch.nn.Module, Any, Any], Any]:
        import torch

        clock = self.clock
        grad_enabled = torch.is_grad_enabled

        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if path not in self._entered or self._thread != threading.get_ident():
                return None  # its pre_forward failed, or refused this thread (another one is inside): nothing to do
            if self._depth[path] > 1:
                self._depth[path] -= 1
                return None
            start = time.perf_counter_ns()
            try:
                self._close_unit(path)
            finally:
                clock.record(time.perf_counter_ns() - start)
            return inference_only(output, path) if grad_enabled() else None

        return hook

    def _close_unit(self, path: str) -> None:
        """Closes unit ``path`` after its forward: its streamed tensors as they are between forwards (a static
        block's stay at its place until its component's forward ends), and the session's ``post_forward``."""
        self._entered.discard(path)
        self._leave()
        if self.capture is not None:
            self.capture.leave(path)
            if self.capture.complete:
                self._finish_capture()  # inside the capture still: CUDA graph trees end it with the compiled call
            return
        # Binding and emptying assign ``.data``, which bumps no version counter, and a placeholder's data pointer is
        # the same every time (its dtype's sentinel): a streamed tensor's signature between forwards stays what
        # rebind_idle recorded.
        static = self.static
        if static is None or path not in static.bound or not static.all_bound:
            if static is not None:
                static.bound.discard(path)
            for sid in self._storages.streamed_by.get(path, ()):
                self._idle(sid)
        if static is not None and static.mirrored and path in static.places:
            static.poison(path)  # the sim: a read of the block after it closed gives NaN, not its bytes by luck
        foreign, bridge = self._foreign.pop(path, None), self._bridge
        if foreign is not None and bridge is not None:
            bridge.releasing(foreign)
        self._session.post_forward(path)

    def _sync_with_replays(self) -> None:
        """Once a graph was captured, before the session's scheduler first runs in a forward: waits on the host for
        the work on torch's stream (a graph replayed before may still read the places the session's copies are about
        to fill). The forward's end then waits for the session's copies (:meth:`idle_static`). A forward that only
        replays, or runs compiled code that cudagraphs replays, never gets here."""
        if isinstance(self._binder, CudaBinder):  # the sim's replays are synchronous
            import torch

            torch.cuda.current_stream(self._binder.device).synchronize()
        self._scheduled = True

    def session_fence(self) -> None:
        """Waits until every copy and read of the session's slots completed."""
        self._session.fence()

    def bind_static(self) -> None:
        """At the start of a component's forward: every static block's tensors at its place (see :mod:`._static`).
        A forward being captured in a CUDA graph starts its captured schedule (:mod:`._capture`)."""
        self._scheduled = False
        if self.static is None:
            return
        self._start_capture(inside=False)
        self.static.bind_all()

    @property
    def _may_capture(self) -> bool:
        """Whether a capture can begin in a forward of this handle (CUDA with a static schedule, or the sim told to
        record or replay one)."""
        return self._copy_stream is not None or self.simulate is not None

    def _start_capture(self, inside: bool) -> None:
        """Starts the captured schedule (:mod:`._capture`) if a capture is under way: ``torch.cuda.graph`` around
        the component's forward is found when the forward starts; inductor's CUDA graph trees, which capture inside
        the compiled call, at its first static block (``inside``)."""
        static = self.static
        assert static is not None
        if self._copy_stream is not None and capturing():
            emitter = CudaEmitter(self._session, static, self._copy_stream)
            self.capture = CaptureRun(self._session, static, emitter)
        elif isinstance(self.simulate, SimGraph):
            if not inside:
                self.capture = self.simulate
                self.simulate.begin()
        elif self.simulate is not None and getattr(self.simulate, "inside", False) == inside:
            self.capture = CaptureRun(self._session, static, SimRecorder())

    def _finish_capture(self) -> None:
        """Ends the captured schedule: the wrap copies and the join, while the capture still records them."""
        run, self.capture = self.capture, None
        assert run is not None and self.static is not None
        run.finish()  # the places hold again what they held when the capture started
        self.captured, self.captured_bytes = True, run.copied_bytes
        if isinstance(run, CaptureRun) and isinstance(run.emitter, SimRecorder) and self.simulate is not None:
            self.simulate.graph = SimGraph(self._session, self.static, run.emitter, run.copied_bytes)

    def idle_static(self) -> None:
        """At the end of a component's forward (also one that raised): a static block that compiled code opened and
        never closed (it raised between ``enter`` and ``leave``) is closed, and every static block's tensors are
        placeholders again."""
        if self.static is None:
            return
        if self._thread == threading.get_ident():
            for path in [p for p in self._entered if p in self.static.places]:
                self._close_unit(path)
        if self.capture is not None:
            if self._copy_stream is not None and not capturing():
                # Started inside a compiled call whose capture ended before every stack's last block closed (a
                # block raised or was skipped): torch refused that capture, and nothing of it ran.
                self.capture = None
            else:
                self._finish_capture()  # a forward captured whole that skipped a stack's last block
        elif self._scheduled:
            self._session.fence()  # the session's copies complete before a graph replayed next reads the places
            self._scheduled = False
        self.static.unbind_all()
        # The compiled forward's operators moved the version counters of the weights they declare mutated.
        self.static.record()

    def traced_enter(self, unit: int, weights: list[torch.Tensor]) -> None:
        """``weightferry::enter`` run by compiled code: opens static block ``unit`` (see :mod:`._traced`). Handed
        copies of its weights (AOT autograd without inductor), it fills them on the sim and refuses them on CUDA."""
        path = self._units[unit]
        start = time.perf_counter_ns()
        try:
            self._open_unit(path, traced=True)
            try:
                for given, own in self._copies(path, weights):
                    given.copy_(own)
            except BaseException:
                self._close_unit(path)
                raise
        finally:
            self.clock.record(time.perf_counter_ns() - start)

    def traced_leave(self, unit: int) -> None:
        """``weightferry::leave`` run by compiled code: closes static block ``unit``."""
        path = self._units[unit]
        if path not in self._entered or self._thread != threading.get_ident():
            return
        start = time.perf_counter_ns()
        try:
            self._close_unit(path)
        finally:
            self.clock.record(time.perf_counter_ns() - start)

    def _copies(self, path: str, weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The pairs (a tensor compiled code handed an operator, the block's own tensor) where the first is a copy;
        on CUDA a copy is refused (see :mod:`._traced`)."""
        assert self.static is not None
        own = self.static.tensors[path]
        pairs = [(g, o) for g, o in zip(weights, own) if o.numel() and g.data_ptr() != o.data_ptr()]
        if pairs and not self.static.mirrored:
            raise _core.OffloadError(
                f"this compiled forward hands block '{path}' copies of its weights, which it would write back into "
                "the device slots when it ends, over the next blocks' copies: compile with inductor (torch.compile's "
                "default backend), not a backend without it such as \"aot_eager\", or without static_slots"
            )
        return pairs

    def _traced(
        self,
        path: str,
        module: torch.nn.Module,
        pre: Callable[[torch.nn.Module, Any], None],
        post: Callable[[torch.nn.Module, Any, Any], Any],
    ) -> tuple[Callable[[torch.nn.Module, Any], None], Callable[[torch.nn.Module, Any, Any], Any]]:
        """The hooks of static block ``path`` (``module``): under torch.compile's tracing they call the custom
        operators (no graph break; in a trace without graph breaks the pair CUDA graph trees may record, in a trace
        of the block's own call the pair that names it by a tensor, see :mod:`._traced`), else the eager hooks
        ``pre`` / ``post``."""
        import torch

        compiling = torch.compiler.is_compiling
        enter_out, leave_out = ops()
        enter_in, leave_in = ops(in_graph=True)
        enter_block, leave_block = ops(block=True)
        whole, alone = whole_trace(), block_trace()
        unit, order, trace = len(self._units), self._order, self._trace
        self._units.append(path)
        static = self.static
        assert static is not None and order is not None
        key = self._key
        # For a trace of the block's own call: its number as a tensor and its weights by their names in it (the
        # same for every block of its class; renamed when the places are made again: restatic), so no constant of
        # the trace names the block.
        number = torch.tensor(unit)
        named = self._names[path] = [_names_in(module, static.tensors[path])]

        def traced_pre(module: torch.nn.Module, args: Any) -> None:
            if compiling():
                trace.open += 1
                if whole():
                    enter_in(order, static.tensors[path], key, unit)
                elif named[0] is not None and alone():
                    enter_block(order, [_attribute(module, n) for n in named[0]], key, number)
                else:
                    enter_out(order, static.tensors[path], key, unit)
                return
            pre(module, args)

        def traced_post(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if compiling():
                outputs = output_tensors(output)
                if not outputs:
                    raise _core.OffloadError(
                        f"static block '{path}' returned no tensor, so its compiled code cannot be ordered before "
                        "the block's slot is released: compile without static_slots for this component"
                    )
                if whole():
                    leave_in(order, outputs, key, unit)
                elif named[0] is not None and alone():
                    leave_block(order, outputs, key, number)
                else:
                    leave_out(order, outputs, key, unit)
                trace.open -= 1
                return None
            return post(module, args, output)

        return traced_pre, traced_post

    def traced_open(self) -> bool:
        """Whether torch.compile is tracing inside a static block now (its submodules' hooks have nothing to open)."""
        return self._trace.open > 0

    def install(self) -> None:
        """Binds the fixed placement once, releases the streamed tensors' host copies, installs the torch hooks."""
        import torch

        # Asked here once, not in every post-forward hook: which storages hold buffers only (see _idle).
        attached = self._storages.attached_storages()
        self._buffer_only = frozenset(
            sid
            for sid, views in self._storages.views.items()
            if sid not in attached
            and not any(isinstance(v.owner.tensor if v.owner else v.tensor, torch.nn.Parameter) for v in views)
        )
        self.rebind_idle(set(self._storages.views))
        self._install_static()
        blocks: dict[torch.nn.Module, Unit] = {}
        for path in self._session.hooked_modules():
            module = self._modules.get(path)
            if module is None:
                raise _core.Error(f"internal error: the backend hooks module '{path}', which describe() did not name")
            # torch.compile must not trace into the hooks (they call into Rust and rebind tensors): each hook is one
            # graph break, and the compiled regions between them stay valid across rebinding. A block at a fixed
            # place (a static schedule) is traced instead, as the custom operators of _traced.
            why = _UNTRACED.format(path=path)
            pre, post = compiler_disabled(self._pre(path), why), compiler_disabled(self._post(path), why)
            if self.static is not None and path in self.static.places:
                pre, post = self._traced(path, module, pre, post)
            for entry in _entries(module) if "." not in path else [module]:
                self._torch_hooks.append(entry.register_forward_pre_hook(pre))
                self._torch_hooks.append(entry.register_forward_hook(post, always_call=True))
            if "." in path:
                blocks[module] = (path, pre, post)
        self._torch_hooks += hook_outside_calls(blocks, self)
        reset_compiled()

    def _install_static(self) -> None:
        """Binds the blocks of the static stacks once (see :mod:`._static`): those whose every storage holds plain
        tensors of parameters; registers the handle for the custom operators."""
        import torch

        stacks = self._session.static_stacks()
        if not stacks:
            return
        attached = self._storages.attached_storages()

        def plain(sid: int) -> bool:
            views = self._storages.views[sid]
            return (
                sid not in self._buffer_only
                and sid not in attached
                and all(v.owner is None and type(v.tensor) in (torch.Tensor, torch.nn.Parameter) for v in views)
            )

        eligible = {
            path
            for stack in stacks
            for path in stack
            if all(plain(sid) for sid in self._storages.streamed_by.get(path, ()))
        }
        self.static = StaticPlaces(self._session, self._storages, self._binder, self._sigs, eligible)
        self.static.prime()
        components = tuple(m for path, m in self._modules.items() if "." not in path)
        blocks = tuple(self._modules[p] for p in self.static.places if p in self._modules)
        self._key = register(self, blocks, components)
        if isinstance(self._binder, CudaBinder):
            self._copy_stream = torch.cuda.Stream(self._binder.device)  # type: ignore[no-untyped-call]  # never while capturing
        self._order = torch.zeros(1, device=self._binder.device)
        # A static input for inductor's CUDA graph trees: both operators mutate it, and a mutated input that is not
        # static (a parameter, or an address marked so) makes them skip the graph.
        torch._dynamo.mark_static_address(self._order)

    def restatic(self) -> None:
        """Binds the static blocks at their places again, after the stacks were rebuilt (a retune, a write), and
        drops torch.compile's graphs: they were traced over the old places (AOT autograd's handling of tensors that
        share a storage is fixed when it traces, and nothing it guards on tells the new places apart)."""
        if self.static is not None:
            self._forget_captures("a write or a retune moved the blocks' places")
            self.static.prime()
            for path, named in self._names.items():
                module, tensors = self._modules.get(path), self.static.tensors.get(path)
                named[0] = _names_in(module, tensors) if module is not None and tensors is not None else None
            reset_compiled()

    def _forget_captures(self, why: str) -> None:
        """Warns, once a forward was captured in a CUDA graph, that graphs captured before hold device addresses
        that no longer hold the blocks (``why``), and forgets the capture."""
        if self.captured:
            import warnings

            from ._warnings import WeightferryWarning

            warnings.warn(
                f"{why}: CUDA graphs captured before copy into device memory that no longer holds the blocks; do not "
                "replay them, capture the forward again",
                WeightferryWarning,
                stacklevel=4,
            )
            self.captured, self.captured_bytes = False, 0

    def remove(self) -> None:
        """Removes every torch hook and forgets the slots."""
        self._forget_captures("weightferry was disabled")
        if self._torch_hooks:
            reset_compiled()
        while self._torch_hooks:
            self._torch_hooks.pop().remove()
        self._entered.clear()
        self._depth.clear()
        self.outside.clear()
        self._idle_buffers.clear()
        with self._lock:
            self._thread, self._open = None, 0
        self.forget_slots()
        if self._key:
            unregister(self._key)
            self._key = 0
        self.static = None
        self._units.clear()
        self._names.clear()
        self._trace.open = 0
        self.capture, self.captured, self._copy_stream, self.captured_bytes = None, False, None, 0

    def refreshed(self, sids: set[int]) -> None:
        """After a write through the session: its block stacks may be new (every streamed block is bound again at
        its next forward), and the fixed placement's written storages are bound again (on the sim a bound tensor is a
        copy of the device bytes)."""
        self.forget_slots()
        self._binder.clear()
        streamed = self._storages.streamed()
        for sid in sorted(sids & streamed):
            if self._idle_buffers.pop(sid, None) is not None:  # a written buffer: its true bytes again, now
                self._idle(sid)
                self._sigs.record(self._storages.views[sid])
        for sid in sorted(sids - streamed):
            self._bind_from_device(sid, *self._session.locate(sid))
            self._sigs.record(self._storages.views[sid])
        if sids & streamed:
            self.restatic()

    def rebind_idle(self, sids: set[int]) -> None:
        """Binds the tensors of ``sids`` as they are between forwards: the fixed placement to its device bytes, a
        streamed tensor to a placeholder until its block's next forward."""
        streamed = self._storages.streamed()
        if sids & streamed:
            self.forget_slots()
        for sid in sorted(sids):
            views = self._storages.views[sid]
            if sid in streamed:
                self._idle(sid)
            else:
                self._bind_from_device(sid, *self._session.locate(sid))
            self._sigs.record(views)
        if sids & streamed:
            self.restatic()

    def forget_slots(self) -> None:
        """Drops what the hooks know of the slots (new slots after a retune, none after disable)."""
        self._offsets.clear()
        self._rebindings.clear()


def _names_in(module: torch.nn.Module, tensors: list[torch.Tensor]) -> tuple[str, ...] | None:
    """The name of each of ``tensors`` among ``module``'s parameters and buffers, or ``None`` when one is not there."""
    own = {id(t): n for n, t in module.named_parameters(remove_duplicate=False)}
    own.update({id(t): n for n, t in module.named_buffers(remove_duplicate=False)})
    names = tuple(own.get(id(t), "") for t in tensors)
    return None if "" in names else names


def _attribute(module: torch.nn.Module, name: str) -> Any:
    """``module``'s parameter or buffer ``name`` (a dotted path), by attribute: torch.compile traces it as an input
    of the module it reads it from."""
    for part in name.split("."):
        module = getattr(module, part)
    return module
