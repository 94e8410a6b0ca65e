"""``WeightferryWarning``, the category of every warning weightferry issues, and the resolver's warnings of a plan
report issued as such."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["WeightferryWarning", "warn_report"]


class WeightferryWarning(UserWarning):
    """A warning of weightferry's resolver (e.g. the deprecated component scan of a pipeline without
    declarations)."""


def warn_report(report: Mapping[str, Any], stacklevel: int) -> None:
    """Issues each of the plan report's ``"warnings"`` as a :class:`WeightferryWarning`, attributed ``stacklevel``
    frames up from the caller (1: the caller itself)."""
    for message in report.get("warnings", []):
        warnings.warn(message, WeightferryWarning, stacklevel=stacklevel + 1)
