"""Hooks the compiler traces: the work around a statically bound block's forward (:mod:`._static`) as two custom
operators, ``weightferry::enter`` and ``weightferry::leave`` (``torch.library``), so ``torch.compile(fullgraph=True)``
traces a streamed transformer with no graph break at its blocks, and the compiled code still opens and closes each
block exactly where the eager hooks would.

While torch.compile traces (``torch.compiler.is_compiling()``) a static block's hooks call the operators; when the
compiled code runs, the operators run the eager hooks' work (the same checks, the session's ``pre_forward`` /
``post_forward``). Their order is declared, not hoped for:

- both mutate ``order`` (one small tensor per handle), so they keep program order among themselves;
- ``enter`` mutates the block's weights (one tensor of each of its storages: :mod:`._static`): every read of them
  takes the values ``enter`` gives back, so none moves before it. A mutation declared, never made: inductor hands
  ``enter`` the weights themselves and copies nothing. AOT autograd without inductor (``backend="aot_eager"``) hands
  it copies, which ``enter`` fills from the weights on the simulated device and refuses on CUDA, where the copies
  written back when the graph ends would land in slots the next copies are filling;
- ``leave`` takes the block's output tensors, so it runs after every operation they are computed from: every read
  of the block's weights that reaches its output. A block whose output holds no tensor is refused while tracing.

Why not ``leave`` declaring the weights mutated too (a form tried before): in a functional graph a read of the values
before a mutation may still run after it, and inductor moved some there (on the CPU its oneDNN passes made a
feed-forward's linear and GELU one kernel after ``leave``; on CUDA it handed the operators copies too), and gave
``leave`` copies to keep the old values for them: the compiled code read a block's slot after ``leave`` had released
it to the copy stream. The simulated device now poisons a
static block's place when the block closes (:meth:`._static.StaticPlaces.poison`), so such a read gives NaN in
the tests instead of passing by luck. The price of ``leave`` taking the outputs: they must be stored before the next
block reads them, so inductor no longer computes a block's last pointwise operations inside the next block's
kernels; in float32 the outputs equal the resident model compiled whole, bit for bit, and in bf16 they equal the
resident model compiled with the same edge at every block (one bf16 rounding step from it compiled whole, measured).
Declaring the block's *inputs* mutated instead (vLLM's prefetch offloader) orders nothing after the block's reads.

Each storage of a static block is a torch storage of its own (over the same device bytes), so no two blocks' weights
alias as graph inputs: aliased mutated inputs make AOT autograd merge them into one base that it clones and writes
back whole. The version counters the declared mutations move are recorded again when the component's forward ends.
The operators find their hooks through a registry of live handles (:func:`register`), by number.

Three pairs: ``enter`` / ``leave`` tagged ``cudagraph_unsafe`` (inductor's CUDA graphs leave them out and the
session's scheduler runs between the graphs), and ``enter_in_graph`` / ``leave_in_graph`` untagged, which a trace
without graph breaks of a whole component calls (:func:`whole_trace`): CUDA graph trees (``mode="reduce-overhead"``)
then record the whole forward with the captured schedule of :mod:`._capture` inside. A trace that may break calls the
tagged pair: a break between two blocks would split their copies over two graphs, and the first would end with its
copy stream unjoined. A trace of one block's own call (regional compilation, :func:`block_trace`), whose graph would
hold one block's share of a schedule made for the whole forward, calls ``enter_block`` / ``leave_block``, tagged too,
which take the block's number as a tensor and its weights by their names in it: nothing in the trace names the
block, so every block of a class runs the same compiled code.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["TraceState", "block_trace", "ops", "output_tensors", "register", "unregister", "whole_trace"]


class _Runs(Protocol):
    """What the operators call: the hooks of one handle."""

    def traced_enter(self, unit: int, weights: list[torch.Tensor]) -> None: ...

    def traced_leave(self, unit: int) -> None: ...


class TraceState:
    """What the traced hooks of one handle know while torch.compile traces: how many static blocks the trace has
    opened (the hooks of their submodules then know they run inside a block)."""

    def __init__(self) -> None:
        self.open = 0


_registry: dict[int, weakref.ref[_Runs]] = {}
_numbers = itertools.count(1)
_ops: tuple[Any, Any, Any, Any, Any, Any] | None = None
_hook_guards_before = True
_limit_before: int | None = None
_blocks: dict[int, int] = {}  # key -> the static blocks of those hooks
_components: dict[int, list[weakref.ref[Any]]] = {}  # key -> the components those hooks stream
_block_modules: dict[int, list[weakref.ref[Any]]] = {}  # key -> the modules of its static blocks


def _limit_name() -> str:
    """torch.compile's limit of compiled versions of one function (``recompile_limit``; before torch 2.7
    ``cache_size_limit``)."""
    import torch._dynamo

    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def register(hooks: _Runs, blocks: tuple[Any, ...] = (), components: tuple[Any, ...] = ()) -> int:
    """Registers ``hooks`` (of the static blocks ``blocks``, modules of ``components``) for the operators; returns the
    number they name it by. While any hooks are registered:

    - torch.compile guards on modules' hooks (``torch._dynamo.config.skip_nnmodule_hook_guards = False``): by default
      it does not, and code compiled for a copy of the model without the hooks would run for the offloaded one,
      reading its bound tensors without opening a block (a silently wrong output where the tensors view their places);
    - its limit of compiled versions of one function is raised by the most static blocks registered: a trace that
      reaches a block's hooks any other way than through its own call (a function compiled around one block, say)
      names the block by constants, one version per block, and ``fullgraph=True`` fails where the limit is reached.

    Both settings as they were before are restored when the last hooks are unregistered."""
    global _hook_guards_before, _limit_before
    import torch._dynamo

    config = torch._dynamo.config
    if not _registry:
        _hook_guards_before = config.skip_nnmodule_hook_guards
        config.skip_nnmodule_hook_guards = False
        _limit_before = getattr(config, _limit_name())
    key = next(_numbers)
    _registry[key] = weakref.ref(hooks)
    _blocks[key] = len(blocks)
    _components[key] = [weakref.ref(c) for c in components]
    _block_modules[key] = [weakref.ref(b) for b in blocks]
    if _limit_before is not None:
        setattr(config, _limit_name(), _limit_before + max(_blocks.values()))
    return key


def unregister(key: int) -> None:
    """Forgets the hooks registered as ``key`` (their handle was disabled)."""
    import torch._dynamo

    _blocks.pop(key, None)
    _components.pop(key, None)
    _block_modules.pop(key, None)
    if _registry.pop(key, None) is None:
        return
    if not _registry:
        torch._dynamo.config.skip_nnmodule_hook_guards = _hook_guards_before
    if _limit_before is not None:
        setattr(torch._dynamo.config, _limit_name(), _limit_before + max(_blocks.values(), default=0))


def _hooks_of(key: int) -> _Runs:
    from . import _core

    ref = _registry.get(key)
    hooks = ref() if ref is not None else None
    if hooks is None:
        raise _core.OffloadError(
            "this compiled code was traced while weightferry offloaded the module, which is disabled now; call "
            "torch.compiler.reset() (or compile again) after disable"
        )
    return hooks


def ops(in_graph: bool = False, block: bool = False) -> tuple[Any, Any]:
    """``(enter, leave)``: the operators, defined once per process. ``in_graph``: the pair inductor's CUDA graphs may
    record (not tagged ``cudagraph_unsafe``), for a trace without graph breaks (:func:`whole_trace`). ``block``: the
    pair a trace of one block's call uses (:func:`block_trace`), tagged ``cudagraph_unsafe`` too, which takes the
    block's number as a tensor: a constant would make torch.compile specialize the code on it, one version per block,
    while a tensor is an input, so every block of a class shares one compiled version."""
    global _ops
    if _ops is None:
        unsafe = (_unsafe_tag(),)
        _ops = _define("", unsafe) + _define("_in_graph", ()) + _define("_block", unsafe, unit="Tensor")
    return _ops[4:] if block else _ops[2:4] if in_graph else _ops[:2]


def _unsafe_tag() -> Any:
    import torch

    return torch.Tag.cudagraph_unsafe


def _define(suffix: str, tags: tuple[Any, ...], unit: str = "int") -> tuple[Any, Any]:
    """Defines ``weightferry::enter{suffix}`` and ``weightferry::leave{suffix}`` with ``tags``, the block's number
    an ``int`` or a (0-d, CPU) ``Tensor`` (``unit``).

    Tagged ``cudagraph_unsafe``: inductor keeps them out of the CUDA graphs it captures (mode="reduce-overhead"
    partitions there) and they run the session's scheduler between the graphs' replays. Untagged: inductor's CUDA
    graph trees record them inside one graph of the whole forward, where the hooks run a captured schedule
    (:mod:`._capture`) whose copies every replay repeats."""
    import torch

    # Schemas spelled out: this module's annotations are strings (``from __future__ import annotations``).
    enter_schema = f"(Tensor(a!) order, Tensor(b!)[] weights, int key, {unit} unit) -> ()"
    leave_schema = f"(Tensor(a!) order, Tensor[] outputs, int key, {unit} unit) -> ()"

    @torch.library.custom_op(
        f"weightferry::enter{suffix}", mutates_args=("order", "weights"), schema=enter_schema, tags=tags
    )
    def enter(order: torch.Tensor, weights: list[torch.Tensor], key: int, unit: Any) -> None:
        _hooks_of(key).traced_enter(int(unit), weights)

    @enter.register_fake
    def _(order: torch.Tensor, weights: list[torch.Tensor], key: int, unit: Any) -> None:
        return None

    @torch.library.custom_op(f"weightferry::leave{suffix}", mutates_args=("order",), schema=leave_schema, tags=tags)
    def leave(order: torch.Tensor, outputs: list[torch.Tensor], key: int, unit: Any) -> None:
        _hooks_of(key).traced_leave(int(unit))

    @leave.register_fake
    def _(order: torch.Tensor, outputs: list[torch.Tensor], key: int, unit: Any) -> None:
        return None

    return getattr(torch.ops.weightferry, f"enter{suffix}"), getattr(torch.ops.weightferry, f"leave{suffix}")


def _whole_trace() -> bool:
    """Whether torch.compile traces the current frame as one graph (``fullgraph=True``, or
    ``torch._dynamo.error_on_graph_break``) that spans a whole streamed component: then no graph break can fall
    between two blocks of the forward, and a CUDA graph inductor records holds all of them. The frame the trace
    started in must be a method of a streamed component or of a module holding one: a trace of one block's call
    (diffusers' ``compile_repeated_blocks``, regional compilation) holds that block only, and a CUDA graph of it
    would replay one block's copies of a schedule made for the whole forward. Asked while tracing (see
    :func:`whole_trace`)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        one_graph = bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # not under dynamo's tracer, or another torch: the operators that stay out of graphs
        return False
    return one_graph and _holds(_root_owner(), _components)


def _block_trace() -> bool:
    """Whether the frame torch.compile's trace started in is a static block's own call (regional compilation):
    then every block of its class can share the compiled code if the hooks name the block by a tensor, not a
    constant. Asked while tracing (see :func:`block_trace`)."""
    import torch

    owner = _root_owner()
    if not isinstance(owner, torch.nn.Module):
        return False
    return any(ref() is owner for refs in _block_modules.values() for ref in refs)


def _root_owner() -> Any:
    """The first argument (``self`` of a method) of the frame the current trace started in, or ``None``."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        root = InstructionTranslator.current_tx().output.root_tx
        names = root.f_code.co_varnames
        return root.f_locals.get(names[0]) if root.f_code.co_argcount and names else None
    except Exception:  # not under dynamo's tracer, or another torch
        return None


def _holds(owner: Any, registered: dict[int, list[weakref.ref[Any]]]) -> bool:
    """Whether ``owner`` is one of the ``registered`` modules or a module holding one."""
    import torch

    if not isinstance(owner, torch.nn.Module):
        return False
    ids = {id(m) for refs in registered.values() for ref in refs if (m := ref()) is not None}
    return any(id(m) in ids for m in owner.modules())


_whole_trace_const: Any = None
_block_trace_const: Any = None


def block_trace() -> Any:
    """:func:`_block_trace` marked ``torch._dynamo.assume_constant_result`` (see :func:`whole_trace`)."""
    global _block_trace_const
    if _block_trace_const is None:
        import torch._dynamo

        _block_trace_const = torch._dynamo.assume_constant_result(_block_trace)  # type: ignore[no-untyped-call]
    return _block_trace_const


def whole_trace() -> Any:
    """:func:`_whole_trace` marked ``torch._dynamo.assume_constant_result``: called from traced code, dynamo runs it
    while tracing and keeps its answer as a constant of the trace."""
    global _whole_trace_const
    if _whole_trace_const is None:
        import torch._dynamo

        _whole_trace_const = torch._dynamo.assume_constant_result(_whole_trace)  # type: ignore[no-untyped-call]
    return _whole_trace_const


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a block's output (any nesting torch's pytree knows: tuples, lists, dicts, diffusers' output
    classes), for ``leave`` to wait on."""
    import torch
    from torch.utils import _pytree

    return [leaf for leaf in _pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
