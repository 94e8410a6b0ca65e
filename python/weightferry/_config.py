"""The config argument of ``plan``, ``check_config``, ``enable`` and ``retune``: a dict in the config file's
vocabulary, or a path to a ``.json`` / ``.toml`` file, as the text and format the native module reads."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Literal, Union

from . import _core

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

__all__ = ["ConfigFormat", "ConfigLike", "config_arg"]

ConfigFormat: TypeAlias = Literal["json", "toml", "file"]
"""How the native module is given a config: JSON text, TOML text, or a path to a ``.json`` / ``.toml`` file."""

ConfigLike: TypeAlias = Union[dict[str, Any], str, "os.PathLike[str]"]
"""A config: a dict in the config file's vocabulary, or a path to a ``.json`` / ``.toml`` file."""


def config_arg(config: ConfigLike) -> tuple[str, ConfigFormat]:
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
