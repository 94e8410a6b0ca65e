"""``plan()`` and ``check_config()``: the config argument (a dict in the config file's vocabulary, or a path to a
``.json`` / ``.toml`` file) handed to the Rust resolver, and the resolver's warnings surfaced as Python warnings."""

import json
import os
import warnings

from . import _core
from ._describe import describe

__all__ = ["WeightferryWarning", "check_config", "plan"]


class WeightferryWarning(UserWarning):
    """A warning of weightferry's resolver (e.g. the deprecated component scan of a pipeline without
    declarations)."""


def _config_arg(config):
    """Returns ``(text, format)`` for ``_core``: a dict as JSON text, a path as ``"file"`` (read by Rust exactly as
    the CLI's ``--config`` reads it)."""
    if isinstance(config, dict):
        try:
            return json.dumps(config, allow_nan=False), "json"
        except (TypeError, ValueError) as e:
            raise _core.ConfigError(
                f"invalid config: <root>: the config dict is not JSON data ({e}); use str, int, float, bool, "
                "None, lists and dicts with str keys"
            ) from None
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config), "file"
    raise _core.ConfigError(
        f"invalid config: <root>: expected a dict in the config file's vocabulary or a path to a .json or .toml "
        f"file, got {type(config).__name__}"
    )


def check_config(config):
    """Validates ``config`` (a dict or a path to a ``.json`` / ``.toml`` file) and returns the strategy it selects:
    ``"none"``, ``"model"``, ``"layer"`` or ``"distributed_layer"``. Raises :class:`weightferry.ConfigError` with
    the CLI's message."""
    text, fmt = _config_arg(config)
    return _core.check_config(text, fmt)


def plan(pipeline, config, *, name=None):
    """The resolved offload plan of ``pipeline`` under ``config``, as a dict: the object
    ``weightferry plan --pipeline FILE --config FILE --json`` prints for ``describe(pipeline)`` written to FILE
    (``"strategy"``, ``"components"``, ``"device_weight_bytes"``, ``"total_weight_bytes"``, ...).

    ``pipeline`` is what :func:`describe` accepts; ``config`` a dict in the config file's vocabulary or a path to a
    ``.json`` / ``.toml`` file; ``name`` the report's ``"pipeline"`` (default: the pipeline's class name).
    Touches nothing: no tensor is moved or copied, no hook installed, no attribute written. Each warning of the
    resolver is also issued as a :class:`WeightferryWarning`.

    Raises :class:`weightferry.ConfigError`, :class:`weightferry.PipelineError` or
    :class:`weightferry.PlanError` with the CLI's message.
    """
    desc = describe(pipeline)
    text, fmt = _config_arg(config)
    report = json.loads(_core.plan(json.dumps(desc), text, fmt, desc["class"] if name is None else str(name)))
    for message in report.get("warnings", []):
        warnings.warn(message, WeightferryWarning, stacklevel=2)
    return report
