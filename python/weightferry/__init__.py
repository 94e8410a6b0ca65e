"""weightferry for PyTorch: plan how a pipeline's weights are offloaded (the same resolver as the
``weightferry`` CLI).

Public API:

- :func:`plan` — the resolved offload plan of a pipeline under a config (the JSON of
  ``weightferry plan --json``), touching nothing.
- :func:`describe` — a torch pipeline as a pipeline description (the JSON format of the README).
- :func:`check_config` — validates a config and names the strategy it selects.
- :class:`Error` and its subclasses :class:`ConfigError`, :class:`PipelineError`, :class:`PlanError`;
  :class:`WeightferryWarning` for the resolver's warnings.

``enable()`` (offloading a pipeline) is not part of this version yet.
"""

from ._core import ConfigError, Error, PipelineError, PlanError, __version__
from ._describe import describe
from ._plan import WeightferryWarning, check_config, plan

__all__ = [
    "ConfigError",
    "Error",
    "PipelineError",
    "PlanError",
    "WeightferryWarning",
    "__version__",
    "check_config",
    "describe",
    "plan",
]
