"""The resolver's errors in a Python caller's words: the resolver (shared with the CLI) names the fix as keys of the
pipeline-description file (``components.dit``, ``offload_plan.block_attrs``); a Python caller declares the same
things with ``enable``'s / ``plan``'s keywords (``dit=``, ``blocks=``) or class attributes, so those phrases are
rewritten before a :class:`weightferry.PlanError` reaches Python. The config's own keys
(``diffusion_offload_config.…``) are the same in a dict and a file and stay as they are."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from . import _core

__all__ = ["in_python_words", "python_words"]

_RULES: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"declare the DiT in `components\.dit` or remove"),
        'pass dit=["<name>"] to enable (or plan) naming it, or remove',
    ),
    (
        re.compile(r"Selected DiT '([^']+)' has no streamable layerwise-offload blocks; declare its block lists in "
                   r"offload_plan\.block_attrs"),
        r"Selected DiT '\1' has no streamable layerwise-offload blocks; pass blocks={" '"' r"\1" '"' r": [...]} to "
        r"enable (or plan) naming its block lists (nn.ModuleList), or declare _repeated_blocks on its class",
    ),
    (
        re.compile(r"Selected text encoder '([^']+)' requires a model-declared streamable "
                   r"\(offload_plan\.encoder_block_attrs\) or on-demand \(offload_plan\.on_demand_component_paths\) "
                   r"plan"),
        r"Selected text encoder '\1' has no block list to stream; pass blocks={" '"' r"\1" '"' r": [...]} to enable "
        r"(or plan) naming its block lists (nn.ModuleList)",
    ),
    (re.compile(r"offload_plan\.encoder_block_attrs"), "blocks= (or the pipeline's _offload_plan.encoder_block_attrs)"),
    (re.compile(r"offload_plan\.block_attrs"), "blocks= (or the pipeline's _offload_plan.block_attrs)"),
    (re.compile(r"\bclass_block_attrs\b"), "the class's _layerwise_offload_blocks_attrs"),
]


def python_words(message: str) -> str:
    """``message`` with the description-file phrases of a fix rewritten as the Python declarations that do it."""
    for pattern, words in _RULES:
        message = pattern.sub(words, message)
    return message


@contextmanager
def in_python_words() -> Iterator[None]:
    """Re-raises a :class:`weightferry.PlanError` from the block with its message in Python words."""
    try:
        yield
    except _core.PlanError as e:
        words = python_words(str(e))
        if words == str(e):
            raise
        raise _core.PlanError(words) from None
