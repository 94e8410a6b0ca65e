"""Type stubs of ``weightferry._core``, the native module (pyo3, ``python/src/bindings.rs``): strings in, strings
out. The package's Python modules are its only intended callers; users call :mod:`weightferry`."""

from typing import Literal, final

__version__: str
FALLBACK_COMPONENT_NAMES: dict[str, list[str]]
"""The deprecated scan's component names by kind (``"dit"``, ``"encoders"``, ``"vaes"``), shared with the resolver."""

class Error(Exception):
    """Base class of every error weightferry raises."""

class ConfigError(Error):
    """A config that could not be read, parsed or accepted."""

class PipelineError(Error):
    """A pipeline that cannot be described, or an invalid description."""

class PlanError(Error):
    """A valid config that cannot be applied to the pipeline."""

class OffloadError(Error):
    """Offloading failed, or was used out of order."""

class DeviceError(Error):
    """A device that cannot be used: unknown, absent, or not in torch's CUDA context."""

class CheckpointError(Error):
    """A checkpoint that cannot be read or does not match the pipeline."""

def plan(
    pipeline_json: str, config: str, config_format: Literal["json", "toml", "file"] = "json", name: str | None = None
) -> str:
    """The plan report of ``pipeline_json`` under ``config`` as JSON text (what ``weightferry plan --json`` prints);
    ``name`` is its ``pipeline`` (default ``"<python>"``). Raises ``ConfigError``, ``PipelineError`` or
    ``PlanError``."""

def check_config(
    config: str, config_format: Literal["json", "toml", "file"] = "json"
) -> Literal["none", "model", "layer", "distributed_layer"]:
    """Validates a config and returns the strategy it selects. Raises ``ConfigError``."""

def check_pipeline(pipeline_json: str, name: str | None = None) -> None:
    """Validates a pipeline description. Raises ``PipelineError`` naming the pipeline ``name``."""

def checkpoint_tensors(path: str) -> list[tuple[str, str, list[int]]]:
    """The tensors of a checkpoint (``.safetensors`` or ``.gguf`` file, index or folder of shards) as weightferry's
    reader checks them: ``(name, dtype, shape)`` in name order, dtypes in safetensors' names (a GGUF file's quantized
    tensor is ``U8`` of shape ``[..., row bytes]``). Reads headers only. Raises ``CheckpointError``."""

def trim_host_heap() -> bool:
    """Gives the C heap's free pages back to the system (glibc's ``malloc_trim``); ``False`` where it cannot."""

def _panic_for_test(message: str) -> None:
    """Panics inside the panic guard (raises ``Error``): for the tests."""

@final
class TorchCuda:
    """What a CUDA session needs of torch: its current ``stream`` on the device (``cuda_stream``), ``probe_ptr`` the
    ``data_ptr()`` of a live torch tensor there (the shared-context check), ``free_bytes`` the device's free memory
    (for ``device_budget = "auto"``), and ``default_cuda`` the ordinal ``"cuda"`` means."""

    def __new__(
        cls, *, stream: int = 0, probe_ptr: int = 0, free_bytes: int = 0, default_cuda: int = 0
    ) -> TorchCuda: ...

@final
class SessionOptions:
    """How a :class:`Session` opens: ``config_format`` as for :func:`plan`; ``name`` the report's pipeline (default
    ``"<python>"``); ``device`` ``"sim"``, ``"cuda"`` or ``"cuda:N"``; ``checkpoints``: ``(path, component)``
    pairs, a safetensors file or sharded folder and the component it fills; ``checkpoint_views``: per component,
    ``{name: [(source, start, end), ...] | None}``, its tensors the file names otherwise (rows of the file's tensors,
    concatenated, or ``None``: the module holds it in a form the file does not give); ``rendezvous_port`` for a
    distributed session when torch.distributed holds ``MASTER_PORT``; ``torch`` on CUDA; ``sim_faults`` (tests) a
    JSON fault plan for the simulated device."""

    def __new__(
        cls,
        *,
        config_format: Literal["json", "toml", "file"] = "json",
        name: str | None = None,
        device: str = "sim",
        checkpoints: list[tuple[str, str]] = ...,
        checkpoint_views: dict[str, dict[str, list[tuple[str, int, int]] | None]] = ...,
        rendezvous_port: int | None = None,
        torch: TorchCuda | None = None,
        sim_faults: str | None = None,
    ) -> SessionOptions: ...

@final
class Session:
    """One pipeline offloaded on a device (``weightferry.enable`` drives it). Every method raises a subclass of
    :class:`Error`."""

    def __new__(cls, pipeline_json: str, config: str, options: SessionOptions | None = None) -> Session:
        """Resolves the plan (``ConfigError``, ``PipelineError``, ``PlanError``), opens the device (``DeviceError``)
        and builds the host model, zero-filled or read from the checkpoint (``CheckpointError``)."""

    def plan_json(self) -> str:
        """The plan report as JSON text (what :func:`plan` returns)."""

    def tensor_storages(self) -> list[tuple[str, int]]:
        """``[(tensor path, storage id)]`` of every tensor, depth first."""

    def storages(self) -> list[tuple[int, int, str | None]]:
        """``[(storage id, bytes, unit module path or None for the fixed placement)]``, in id order."""

    def write_storage(self, storage: int, data: bytes | bytearray | memoryview) -> None:
        """Fills a storage's host bytes (exactly its size)."""

    def _write_storage_at(self, storage: int, address: int, len: int) -> None:
        """Fills a storage's host bytes from ``len`` bytes at host address ``address`` (the ``data_ptr()`` of a live
        CPU tensor storage the caller holds), read in place."""

    def _differing_at(self, items: list[tuple[int, int, int]]) -> list[int]:
        """The storages of ``[(storage id, host address, len)]`` (each the ``data_ptr()`` of a live CPU tensor storage
        the caller holds) whose bytes differ from the session's (before enable: the checkpoint file's), in the order
        given; read in place, nothing written."""
    def _write_weights_at(self, items: list[tuple[int, int, int]]) -> None:
        """Writes new bytes for storages from ``[(storage id, host address, len)]`` (each the ``data_ptr()`` of a live
        CPU tensor storage the caller holds), read in place: while enabled through to weightferry's host copy and
        every device copy. Every write is checked before any is applied."""

    def enable(self) -> bool:
        """Offloads (transactional); returns whether anything is offloaded."""

    def retune(
        self,
        config: str,
        config_format: Literal["json", "toml", "file"] = "json",
        free_bytes: int = 0,
        reserved_bytes: int = 0,
    ) -> str:
        """Retunes the enabled backend to a new config (``reserved_bytes``: device bytes outside the plan that a
        byte-count ``device_budget`` holds too); returns the new plan report as JSON text."""

    def is_enabled(self) -> bool:
        """Whether the backend is enabled."""

    def static_stacks(self) -> list[list[str]]:
        """The unit module paths of each stack with a static schedule (``static_slots``), in execution order; empty
        while not enabled."""

    def hooked_modules(self) -> list[str]:
        """The modules with offload hooks (dotted paths), sorted."""

    def pre_forward(
        self, module: str, with_offsets: bool = True
    ) -> tuple[int, int, list[tuple[int, int]]] | None:
        """Runs the module's pre-forward hooks and waits until its bytes are on the device: ``None``, or
        ``(buffer, base, [(storage id, offset in the block)])``, the list empty unless ``with_offsets``."""

    def unwritten(self) -> list[int]:
        """Storages not written yet, in id order."""

    def post_forward(self, module: str) -> None:
        """Runs the module's post-forward hooks."""

    def locate(self, storage: int) -> tuple[int, int]:
        """``(buffer, offset)`` of a storage on the device."""

    def read_device(self, buffer: int, offset: int, len: int) -> bytearray:
        """A copy of ``len`` bytes of simulated device memory."""

    def device_ptr(self, buffer: int) -> tuple[int, int]:
        """``(device address, bytes)`` of a CUDA device buffer."""

    def capture_copies(self, module: str) -> tuple[tuple[int, int] | None, list[tuple[int, int, int, int]]]:
        """What a captured CUDA graph copies for static unit ``module``: ``(buffer, offset)`` of its bytes now (in its
        slot or resident; ``None`` if nowhere), and ``(host buffer, offset in it, offset in the block, bytes)`` of
        each flat copy."""

    def host_address(self, buffer: int) -> int:
        """The address a CUDA device copy reads host buffer ``buffer`` at (page-locked memory only)."""

    def read_host(self, buffer: int, offset: int, len: int) -> bytearray:
        """A copy of ``len`` bytes of a simulated host buffer."""

    def write_device(self, buffer: int, offset: int, data: bytes) -> None:
        """Writes ``data`` into simulated device memory at ``offset`` of ``buffer``."""

    def fence(self) -> None:
        """Blocks until every load issued so far and every released slot's last use have completed."""

    def is_cuda(self) -> bool:
        """Whether the session drives a CUDA device."""

    def disable(self) -> None:
        """Disables offload: every storage gets its own host buffer back, bit-identical."""

    def read_storage(self, storage: int) -> bytearray:
        """A storage's host bytes."""

    def hazard_violations(self) -> list[str]:
        """The simulated device's recorded ordering violations; empty when every order held."""

    def report(self) -> str:
        """The backend's report as JSON text."""
