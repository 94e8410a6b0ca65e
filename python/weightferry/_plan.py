"""``plan()`` and ``check_config()``: the config argument handed to the Rust resolver, and the resolver's warnings
surfaced as Python warnings."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from . import _core
from ._config import ConfigLike, config_arg
from ._describe import PipelineLike, _describe
from ._discover import Declared, left_resident
from ._vocab import in_python_words
from ._warnings import warn_report

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

__all__ = ["Strategy", "check_config", "plan"]

Strategy: TypeAlias = Literal["none", "model", "layer", "distributed_layer"]
"""The strategy a config selects."""


def check_config(config: ConfigLike) -> Strategy:
    """Validates ``config`` (a dict or a path to a ``.json`` / ``.toml`` file) and returns the strategy it selects:
    ``"none"``, ``"model"``, ``"layer"`` or ``"distributed_layer"``. Raises :class:`weightferry.ConfigError` with
    the CLI's message."""
    text, fmt = config_arg(config)
    return _core.check_config(text, fmt)


def plan(
    pipeline: PipelineLike,
    config: ConfigLike,
    *,
    name: str | None = None,
    dit: list[str] | None = None,
    encoders: list[str] | None = None,
    vaes: list[str] | None = None,
    blocks: Mapping[str, list[str]] | None = None,
    checkpoint: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None,
) -> dict[str, Any]:
    """The resolved offload plan of ``pipeline`` under ``config``, as a dict: the object
    ``weightferry plan --pipeline FILE --config FILE --json`` prints for ``describe(pipeline)`` written to FILE
    (``"strategy"``, ``"components"``, ``"device_weight_bytes"``, ``"total_weight_bytes"``, ...).

    ``pipeline`` is what :func:`describe` accepts; ``config`` a dict in the config file's vocabulary or a path to a
    ``.json`` / ``.toml`` file; ``name`` the report's ``"pipeline"`` (default: the pipeline's class name);
    ``dit``, ``encoders``, ``vaes`` and ``blocks`` what :func:`describe` takes. ``checkpoint`` (what
    :func:`enable` takes) predicts the host side as ``enable(..., checkpoint=)`` will hold it: the checkpoint's
    files are mapped, not read, so ``"host"`` says which blocks they serve (``mapped_bytes``) and which the disk tier
    reads on every pass beyond ``host_budget`` (``disk_bytes``, ``staging_bytes``); a ``host_budget = "auto"`` is
    resolved from this process's memory now, as enable would.
    A component whose discovered block lists leave large lists of blocks on the device (each a twentieth of the
    model or more: Latte's temporal blocks) has ``"left_resident"``: ``[{"path", "blocks", "bytes"}]``, paths in the
    component, as its one warning names them (``blocks=`` streams them).
    Touches nothing: no tensor is moved or copied, no hook installed, no attribute written. Each warning of the
    resolver is also issued as a :class:`WeightferryWarning`.

    Raises :class:`weightferry.ConfigError`, :class:`weightferry.PipelineError` or
    :class:`weightferry.PlanError` with the CLI's message.
    """
    desc, bound, modules, _ = _describe(pipeline, Declared.of(dit, encoders, vaes, blocks))
    text, fmt = config_arg(config)
    label = desc["class"] if name is None else str(name)
    with in_python_words():
        report: dict[str, Any] = json.loads(_core.plan(json.dumps(desc), text, fmt, label))
    if checkpoint is not None:
        from ._enable import checkpoint_host_plan  # enable's session opening, imported when asked for

        report["host"] = checkpoint_host_plan(desc, bound, modules, text, fmt, label, checkpoint)
        report["warnings"] = [w for w in report["warnings"] if not w.startswith("enable will refuse this plan")]
    for component in report.get("components", []):
        module = modules.get(component.get("path"))
        left = left_resident(module) if module is not None else []
        if left:
            component["left_resident"] = left
    warn_report(report, stacklevel=2)
    return report
