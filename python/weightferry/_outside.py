"""Calls into a part of a streamed block from outside the block's forward.

Some models run a submodule of a block before the block itself: DiT's ``forward`` calls
``transformer_blocks[0].norm1.emb(...)`` to embed the timestep and class before any block runs. Between its forwards a
streamed block's tensors are placeholders, so such a call would meet them (NaN values). Every submodule of a hooked
block gets one pre and one post hook (always called): the outermost call made while its block is not open on this thread
opens the block with the block's own hooks (a fetch, like an out-of-order forward) and closes it after; calls inside
the block's forward do nothing.

torch.compile traces these hooks into the block's compiled forward, and guards on the hook ids and functions it finds
there. So every submodule of every block carries the same two hook functions under the same two hook ids, and under
compilation the hooks read only whether any hooked module is open (what is true when the block's own hook opened
it): the blocks of a stack share one compiled forward, with no graph break inside it, and a call from outside a block
breaks the graph where it opens and closes the block."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ._compiler import compiler_disabled

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle
    from typing_extensions import TypeAlias

__all__ = ["Unit", "hook_outside_calls"]

Unit: TypeAlias = "tuple[str, Callable[[torch.nn.Module, Any], None], Callable[[torch.nn.Module, Any, Any], Any]]"
"""A hooked block: its module path, and its own pre and post hooks (compiler-disabled)."""


class _Open(Protocol):
    """What the hooks of a handle say about the modules open now."""

    outside: list[torch.nn.Module]

    def busy(self) -> bool: ...

    def open_here(self, path: str) -> bool: ...

    def traced_open(self) -> bool: ...


def hook_outside_calls(blocks: dict[torch.nn.Module, Unit], hooks: _Open) -> list[RemovableHandle]:
    """Hooks every submodule of ``blocks`` (containers aside, which are never called) for calls from outside their
    block; returns the handles that remove the hooks."""
    import torch
    from torch.utils.hooks import RemovableHandle

    unit_of: dict[torch.nn.Module, Unit] = {}
    for block, unit in blocks.items():
        for sub in block.modules():
            if sub is not block and not isinstance(sub, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                unit_of[sub] = unit
    if not unit_of:
        return []
    compiling = torch.compiler.is_compiling

    @compiler_disabled
    def open_block(module: torch.nn.Module, args: Any) -> None:
        path, pre, _ = unit_of[module]
        if hooks.open_here(path):
            return  # inside its block's forward (the eager path of ``inner_pre`` already said so)
        pre(module, args)
        if hooks.open_here(path):
            hooks.outside.append(module)

    @compiler_disabled
    def close_block(module: torch.nn.Module, args: Any, output: Any) -> Any:
        path, _, post = unit_of[module]
        if not hooks.outside or hooks.outside[-1] is not module or not hooks.open_here(path):
            return None  # another thread's call, which the pre hook refused
        hooks.outside.pop()
        return post(module, args, output)

    def inner_pre(module: torch.nn.Module, args: Any) -> None:
        if compiling():
            if not hooks.busy() and not hooks.traced_open():
                open_block(module, args)
        elif not hooks.open_here(unit_of[module][0]):
            open_block(module, args)

    def inner_post(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if hooks.outside and hooks.outside[-1] is module:
            return close_block(module, args, output)
        return None

    first = next(iter(unit_of))
    pre_id = first.register_forward_pre_hook(inner_pre)
    post_id = first.register_forward_hook(inner_post, always_call=True)
    handles = [pre_id, post_id]
    for sub in unit_of:
        if sub is first:
            continue
        # The same ids as on the first submodule (see the module's doc): a handle of each dict, given those ids.
        pre = RemovableHandle(sub._forward_pre_hooks)
        pre.id = pre_id.id
        sub._forward_pre_hooks[pre.id] = inner_pre
        post = RemovableHandle(sub._forward_hooks, extra_dict=[sub._forward_hooks_always_called])
        post.id = post_id.id
        sub._forward_hooks[post.id] = inner_post
        sub._forward_hooks_always_called[post.id] = True
        handles += [pre, post]
    return handles
