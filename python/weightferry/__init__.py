"""weightferry for PyTorch: plan how a pipeline's weights are offloaded (the same resolver as the
``weightferry`` CLI).

Public API:

- :func:`plan` — the resolved offload plan of a pipeline under a config (the JSON of
  ``weightferry plan --json``), touching nothing.
- :func:`describe` — a torch pipeline as a pipeline description (the JSON format of docs/pipeline-format.md).
- :func:`enable` — offloads a pipeline on a CUDA GPU (``device="cuda"``) or the simulated device (``"sim"``),
  optionally reading its weights from a safetensors checkpoint, and returns a :class:`Handle` (``disable()``,
  ``stats()``, a context manager).
- :func:`from_pretrained` — a diffusers or transformers model built on ``meta`` from its saved folder and offloaded
  with its weights bound from the folder's safetensors files (never held whole in host memory).
- :func:`check_config` — validates a config and names the strategy it selects.
- :class:`Error` and its subclasses :class:`ConfigError`, :class:`PipelineError`, :class:`PlanError`,
  :class:`OffloadError`, :class:`DeviceError`, :class:`CheckpointError`; :class:`WeightferryWarning` for the
  resolver's warnings.
"""

from ._core import (
    CheckpointError,
    ConfigError,
    DeviceError,
    Error,
    OffloadError,
    PipelineError,
    PlanError,
    __version__,
)
from ._describe import describe
from ._enable import enable
from ._handle import Handle
from ._plan import check_config, plan
from ._pretrained import from_pretrained
from ._warnings import WeightferryWarning

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "Error",
    "Handle",
    "OffloadError",
    "PipelineError",
    "PlanError",
    "WeightferryWarning",
    "__version__",
    "check_config",
    "describe",
    "enable",
    "from_pretrained",
    "plan",
]
