"""Hooks the compiler traces: the work around a statically bound block's forward (:mod:`._static`) as two custom
operators, ``weightferry::enter`` and ``weightferry::leave`` (``torch.library``), so ``torch.compile(fullgraph=True)``
traces a streamed transformer with no graph break at its blocks, and the compiled code still opens and closes each
block exactly where the eager hooks would.

While torch.compile traces (``torch.compiler.is_compiling()``) a static block's hooks call the operators; when the
compiled code runs, the operators run the eager hooks' work (the same checks, the session's ``pre_forward`` /
``post_forward``). Their order is declared, not hoped for:

- both mutate ``order`` (one small tensor per handle), so they keep program order among themselves;
- ``enter`` mutates the block's weights (one tensor of each of its storages: :mod:`._static`): no read of them moves
  before it. On the simulated device ``leave`` mutates them too (no read moves after it); on CUDA it takes the
  block's output tensors instead, so it runs after every operation they are computed from (see below why). A
  mutation declared, never made: inductor hands the operators the weights themselves and copies nothing. AOT
  autograd without inductor (``backend="aot_eager"``) hands them copies, which ``enter`` fills from the weights on
  the simulated device and refuses on CUDA, where the copies written back when the graph ends would land in slots
  the next copies are filling.

Each storage of a static block is a torch storage of its own (over the same device bytes), so no two blocks' weights
alias as graph inputs: aliased mutated inputs make AOT autograd merge them into one base that it clones and writes
back whole. Measured, against the resident model compiled alike (inductor): declaring the block's inputs mutated
instead (as vLLM's prefetch offloader does) put a tiny Wan in float32 3.6e-7 apart (CPU); ``leave`` taking the
block's outputs puts a bf16 Flux 0.0078 apart (CPU), since the outputs must then be stored before the next block
reads them and inductor no longer computes a block's last pointwise operations inside the next block's kernels;
with the weights declared both ways the outputs are bit-identical on the CPU. On CUDA (torch 2.11, an H200) that
last form made inductor hand ``enter`` copies of the first block's weights (refused), which the outputs form does
not: so CUDA keeps the outputs form, and its compiled output is not bit-identical to the resident model compiled
whole. The version counters the declared mutations move are recorded again when the component's forward ends.
The operators find their hooks through a registry of live handles (:func:`register`), by number.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["TraceState", "ops", "output_tensors", "register", "unregister"]


class _Runs(Protocol):
    """What the operators call: the hooks of one handle."""

    def traced_enter(self, unit: int, weights: list[torch.Tensor]) -> None: ...

    def traced_leave(self, unit: int, weights: list[torch.Tensor]) -> None: ...


class TraceState:
    """What the traced hooks of one handle know while torch.compile traces: how many static blocks the trace has
    opened (the hooks of their submodules then know they run inside a block)."""

    def __init__(self) -> None:
        self.open = 0


_registry: dict[int, weakref.ref[_Runs]] = {}
_numbers = itertools.count(1)
_ops: tuple[Any, Any] | None = None
_hook_guards_before = True


def register(hooks: _Runs) -> int:
    """Registers ``hooks`` for the operators; returns the number they name it by. While any hooks are registered,
    torch.compile guards on modules' hooks (``torch._dynamo.config.skip_nnmodule_hook_guards = False``; the setting
    before is restored when the last ones are unregistered): by default it does not, and code compiled for a copy of
    the model without the hooks would run for the offloaded one, reading its bound tensors without opening a block
    (a silently wrong output where the tensors view their places)."""
    global _hook_guards_before
    import torch._dynamo

    if not _registry:
        _hook_guards_before = torch._dynamo.config.skip_nnmodule_hook_guards
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    key = next(_numbers)
    _registry[key] = weakref.ref(hooks)
    return key


def unregister(key: int) -> None:
    """Forgets the hooks registered as ``key`` (their handle was disabled)."""
    import torch._dynamo

    if _registry.pop(key, None) is not None and not _registry:
        torch._dynamo.config.skip_nnmodule_hook_guards = _hook_guards_before


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


def ops() -> tuple[Any, Any]:
    """``(enter, leave)``: the operators, defined once per process."""
    global _ops
    if _ops is not None:
        return _ops
    import torch

    # Schemas spelled out: this module's annotations are strings (``from __future__ import annotations``).
    enter_schema = "(Tensor(a!) order, Tensor(b!)[] weights, int key, int unit) -> ()"
    leave_schema = "(Tensor(a!) order, Tensor(b!)[] weights, Tensor[] outputs, int key, int unit) -> ()"

    # cudagraph_unsafe: their work happens on the host (the session's scheduling and copies), which a replayed CUDA
    # graph would skip; inductor keeps them out of any graph it captures (mode="reduce-overhead" partitions there).
    unsafe = (torch.Tag.cudagraph_unsafe,)

    @torch.library.custom_op(
        "weightferry::enter", mutates_args=("order", "weights"), schema=enter_schema, tags=unsafe
    )
    def enter(order: torch.Tensor, weights: list[torch.Tensor], key: int, unit: int) -> None:
        _hooks_of(key).traced_enter(unit, weights)

    @enter.register_fake
    def _(order: torch.Tensor, weights: list[torch.Tensor], key: int, unit: int) -> None:
        return None

    @torch.library.custom_op(
        "weightferry::leave", mutates_args=("order", "weights"), schema=leave_schema, tags=unsafe
    )
    def leave(
        order: torch.Tensor, weights: list[torch.Tensor], outputs: list[torch.Tensor], key: int, unit: int
    ) -> None:
        _hooks_of(key).traced_leave(unit, weights)

    @leave.register_fake
    def _(order: torch.Tensor, weights: list[torch.Tensor], outputs: list[torch.Tensor], key: int, unit: int) -> None:
        return None

    _ops = (torch.ops.weightferry.enter, torch.ops.weightferry.leave)
    return _ops


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a block's output (a tensor, or a tuple or list holding some), for ``leave`` to wait on."""
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [o for o in output if isinstance(o, torch.Tensor)]
    return []
