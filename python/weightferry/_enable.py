"""``enable()``: offloads a torch pipeline's weights through weightferry and returns the :class:`~._handle.Handle`
that undoes it; and the opening of the native session on its device.

Either everything is offloaded or nothing is: each change ``enable`` makes to the pipeline pushes its undo on one
:class:`~._undo.UndoStack`, which a failure (and a plan that offloads nothing) runs, so every hook is removed and
every tensor gets its original data back. The parts, by role: ``_storages`` (which tensors view each storage, and the
hand-over of their bytes), ``_binders`` (device bytes as torch tensors, one binder per device), ``_hooks`` (the torch
forward hooks), ``_handle`` (the handle), ``_distributed`` (the rendezvous port of a distributed session).
:meth:`Handle.state_dict` reads the true weights from the session on either device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _core
from ._binders import Binder, CudaBinder, SetData, SimBinder, placeholder
from ._config import ConfigFormat, ConfigLike, config_arg
from ._describe import Bound, PipelineLike, _describe
from ._discover import Declared
from ._distributed import rendezvous_port
from ._handle import Handle
from ._offloaders import refuse_other_offloaders
from ._registry import is_offloaded
from ._single_file import Views, checkpoint_views
from ._storages import StorageMap, materialize_meta, set_data
from ._undo import UndoStack
from ._vocab import in_python_words
from ._warnings import WeightferryWarning, warn_report

if TYPE_CHECKING:
    import torch

    from ._hooks import StreamCheck

__all__ = ["Seams", "checkpoint_host_plan", "enable"]


def enable(
    pipeline: PipelineLike,
    config: ConfigLike,
    device: str | torch.device | None = None,
    *,
    name: str | None = None,
    checkpoint: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None,
    dit: list[str] | None = None,
    encoders: list[str] | None = None,
    vaes: list[str] | None = None,
    blocks: Mapping[str, list[str]] | None = None,
    _seams: Seams | None = None,
) -> Handle:
    """Offloads ``pipeline``'s weights under ``config`` and returns a :class:`Handle`.

    ``pipeline`` and ``config`` are what :func:`weightferry.plan` takes, and so are ``dit``, ``encoders``, ``vaes``
    and ``blocks`` (declarations a dict pipeline cannot carry; see :func:`weightferry.describe`). ``device`` is
    ``"cuda"`` (torch's current CUDA device; the default when torch sees one), ``"cuda:N"``, or ``"sim"`` (the
    simulated device: device buffers in host memory; without a CUDA device it must be named, or enable raises
    :class:`weightferry.DeviceError` saying so). The pipeline's tensors must be on the CPU. On CUDA the pipeline
    runs on torch's current stream at enable (a forward on another stream raises :class:`weightferry.OffloadError`);
    the caller moves the inputs to the device, and every tensor the plan keeps on the device (the fixed placement) is
    there after enable.

    ``checkpoint`` (a ``.safetensors`` file, or a folder with a ``*.safetensors.index.json``) fills a pipeline of one
    component (e.g. ``{"transformer": model}`` with the model built on the ``meta`` device) from the file: the
    component's tensor ``K`` is the file's tensor ``K``, every one checked by name, dtype and shape before a byte is
    read (:class:`weightferry.CheckpointError` naming the file and the tensor otherwise), and the weights never pass
    through torch. After :meth:`Handle.disable` the module holds them as ordinary CPU tensors. A mapping
    (``{"transformer": path, "text_encoder_2": path}``) fills each named component from its own file; the other
    components keep their own (CPU) tensors.

    The plan is resolved first, so a bad config or pipeline raises :class:`weightferry.ConfigError`,
    :class:`weightferry.PipelineError` or :class:`weightferry.PlanError` with the CLI's message before anything
    moves; a pipeline already enabled raises :class:`weightferry.OffloadError`. Then, storage by storage, the bytes go
    to weightferry (a streamed storage straight into the pinned host master it will live in) and the tensor's own host
    copy is released, so host memory holds about one copy of the weights throughout; the backend adopts those
    masters, builds the fixed placement and the block stacks, and torch forward hooks on the modules it hooks bind
    each streamed block's tensors to its device bytes for the block's forward. Any failure from here on removes every
    hook, gives every tensor its original data back, and re-raises.

    ``_seams`` is for weightferry's own tests (see :class:`Seams`).
    """
    seams = _seams if _seams is not None else Seams()
    device = _default_device(device)
    text, fmt = config_arg(config)
    desc, bound, modules, composites = _describe(pipeline, Declared.of(dit, encoders, vaes, blocks))
    refuse_other_offloaders(modules)
    if any(is_offloaded(getattr(m, n)) for m, n in bound.values()):
        raise _core.OffloadError(
            f"pipeline {desc['class']} is already enabled by weightferry (one of its tensors is offloaded); call "
            "disable() on its handle first"
        )
    ckpt, views = _checkpoint_views(desc, bound, modules, checkpoint) if checkpoint is not None else ([], {})
    with in_python_words():
        session, binder, stream = _open_session(
            json.dumps(desc), text, fmt, desc["class"] if name is None else str(name), device, ckpt, seams, views
        )
    _check_tensors(bound, [component for _, component in ckpt])
    if ckpt:
        _check_unfilled(bound, session)
    report = json.loads(session.plan_json())
    warn_report(report, stacklevel=2)

    undo = UndoStack()
    try:
        # With a checkpoint, meta tensors become empty CPU tensors first; their bytes come from the file.
        storages = StorageMap(session, bound, materialize_meta(bound, undo) if ckpt else {}, composites)
        binder.prepare([v for views in storages.views.values() for v in views])
        if ckpt:
            _check_held_match(session, storages, ckpt)
        handle = Handle(
            session, storages, modules, bound, binder, stream, json.loads(text) if fmt == "json" else None, pipeline
        )
        if ckpt:
            # The session has every other storage from the file: those tensors keep their (empty) data until enable
            # succeeded.
            undo.push(_data_setter([(t, t.data) for t in storages.tensors()]))
        # From its hand-over on, the session holds a storage's only copy: undoing rebuilds the tensors from it.
        handed: list[int] = []
        undo.push(lambda: storages.restore(session, handed))
        # The storages the session has no bytes of: every one, or from a checkpoint its non-persistent buffers.
        storages.hand_over(session, set(session.unwritten()), lambda v: binder.set_data(v, placeholder(v)), handed)
        undo.push(lambda: _disable_after_failure(session))
        if not session.enable():
            undo.pop()  # the session offloaded nothing: nothing to disable
            undo.unwind()
            warnings.warn(
                f"weightferry offloads nothing: {report.get('skip_reason') or 'the config disables offload'}",
                WeightferryWarning,
                stacklevel=2,
            )
            return handle
        undo.push(handle._unmark)
        undo.push(handle._hooks.remove)
        undo.push(handle._state_hooks.remove)
        undo.push(handle._guard.remove)
        undo.push(handle._walks.remove)
        undo.push(handle._lora.remove)
        undo.push(handle._copies.remove)
        undo.push(handle._load_hooks.remove)
        undo.push(handle._remove_watch)
        undo.push(handle._unwatch_added)
        buffered = json.loads(session.report()).get("buffered_files", [])
        handle._offload()
    except BaseException:
        undo.unwind()
        raise
    _warn_buffered(buffered)
    return handle


def _warn_buffered(paths: list[str]) -> None:
    """Warns of each checkpoint file the disk tier reads through the page cache (its filesystem refused
    ``O_DIRECT``): the reads work, but the file's pages then stay cached beyond ``host_budget``."""
    for path in paths:
        warnings.warn(
            f"{path}: the filesystem refuses O_DIRECT, so the disk tier reads this checkpoint through the page cache, "
            "whose pages the kernel keeps beyond host_budget; keep it on a local disk (ext4, xfs) to read around the "
            "cache",
            WeightferryWarning,
            stacklevel=3,
        )


def checkpoint_host_plan(
    desc: dict[str, Any],
    bound: Bound,
    modules: Mapping[str, Any],
    text: str,
    fmt: ConfigFormat,
    name: str,
    checkpoint: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]],
) -> dict[str, Any]:
    """The host side of the plan (the report's ``"host"``) as :func:`enable` will find it with ``checkpoint``: the
    files mapped (no weight read) by a session on the simulated device, so what they serve and what the disk tier
    reads are known; the session is dropped after. Not for a distributed config (its session would meet its ranks)."""
    if _core.check_config(text, fmt).startswith("distributed"):
        raise _core.PlanError(
            "plan(checkpoint=...) predicts one process's host memory; a distributed config's ranks each bind their "
            "share at enable: call plan() without checkpoint="
        )
    ckpt, views = _checkpoint_views(desc, bound, modules, checkpoint)
    with in_python_words():
        session, _, _ = _open_session(json.dumps(desc), text, fmt, name, "sim", ckpt, Seams(), views)
    try:
        host: dict[str, Any] = json.loads(session.plan_json())["host"]
    finally:
        del session
    return host


def _default_device(device: str | torch.device | None) -> str | torch.device:
    """``device`` as given, or torch's current CUDA device when none is given; without one, an error naming the
    simulated device (a silent CPU simulation on a GPU machine, or a GPU run on a machine without one, would both
    surprise)."""
    if device is not None:
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    raise _core.DeviceError(
        "enable() got no device and torch sees no CUDA device; pass device=\"sim\" to run on weightferry's "
        "simulated device (device buffers in host memory), or device=\"cuda:N\" on a machine with a GPU"
    )


@dataclasses.dataclass(frozen=True)
class Seams:
    """What weightferry's tests inject into :func:`enable` (its ``_seams``); the defaults are production's.

    ``session``: makes the native session (called with the arguments of ``_core.Session``); ``sim_faults``: faults
    the simulated device injects (such as ``{"oom_at_alloc": 3}``); ``bind``: makes a tensor object hold a tensor's
    data (every binding of the binder goes through it)."""

    session: Callable[..., _core.Session] | None = None
    sim_faults: Mapping[str, int] | None = None
    bind: SetData = set_data


def _data_setter(originals: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """An undo step giving each tensor of ``originals`` its data back."""

    def step() -> None:
        for tensor, data in originals:
            tensor.data = data

    return step


def _disable_after_failure(session: _core.Session) -> None:
    """Disables the session after a failed enable; a failure to do so is a warning (the original one is raised)."""
    try:
        session.disable()
    except _core.Error as e:
        message = f"weightferry: disabling after a failed enable also failed: {e}"
        warnings.warn(message, WeightferryWarning, stacklevel=1)


def _check_tensors(bound: Bound, from_files: list[str]) -> None:
    """Refuses (``PipelineError``) a tensor that is not on the CPU: the host masters are made from CPU tensors (in a
    component a checkpoint fills, ``from_files``, ``meta`` tensors are fine too: their bytes come from the file)."""
    for path, (module, name) in bound.items():
        t = getattr(module, name)
        filled = any(path.startswith(f"{component}.") for component in from_files)
        if t.is_meta and from_files and not filled:
            raise _core.PipelineError(
                f"tensor '{path}' is on the meta device, but no checkpoint fills its component; give its component "
                "a file in checkpoint= ({component: path}), or build it with its weights"
            )
        if t.device.type not in (("cpu", "meta") if filled else ("cpu",)):
            raise _core.PipelineError(
                f"tensor '{path}' is on {t.device}; weightferry offloads a pipeline whose weights are on the CPU "
                "(move it there with .to('cpu') before enable; a module the config does not offload, such as a VAE "
                "left out of its components, is put on the device by enable with every tensor no block holds)"
            )


def _check_unfilled(bound: Bound, session: _core.Session) -> None:
    """Refuses (``PipelineError``) a ``meta`` tensor of a checkpoint's component that the file does not fill: the
    file holds it in another form (a GGUF file's quantized tensor that the module holds dequantized, as diffusers
    does for the layers a model keeps in float32), so only the module could give its values."""
    unwritten = set(session.unwritten())
    storage_of = dict(session.tensor_storages())
    for path, (module, name) in bound.items():
        if getattr(module, name).is_meta and storage_of.get(path) in unwritten:
            raise _core.PipelineError(
                f"tensor '{path}' is on the meta device, and the checkpoint holds it in another form (quantized "
                "where the module holds floats, or another shape), so its values cannot come from the file; build "
                "the module with its weights (diffusers' from_single_file with the quantization config) and enable "
                "it with checkpoint= again"
            )


def _checkpoint_views(
    desc: dict[str, Any],
    bound: Bound,
    modules: Mapping[str, Any],
    checkpoint: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]],
) -> tuple[list[tuple[str, str]], dict[str, Views]]:
    """What a session bound from ``checkpoint`` opens with: its ``(path, component)`` pairs and the components' tensors
    the files name otherwise (after checking the computed buffers the files do not hold)."""
    ckpt = _checkpoint_components(desc, checkpoint)
    if not ckpt:
        return ckpt, {}
    _check_computed_buffers(bound)
    return ckpt, _views(ckpt, bound, modules)


def _views(ckpt: list[tuple[str, str]], bound: Bound, modules: Mapping[str, Any]) -> dict[str, Views]:
    """Per component a checkpoint fills, the tensors its file names otherwise (an original model's single file,
    worked out through the host library's own conversion: :mod:`._single_file`)."""
    views: dict[str, Views] = {}
    for path, component in ckpt:
        prefix = f"{component}."
        keys = [p[len(prefix):] for p, (m, attr) in bound.items()
                if p.startswith(prefix) and attr not in getattr(m, "_non_persistent_buffers_set", ())]
        found = checkpoint_views(modules.get(component), path, keys)
        if found:
            views[component] = found
    return views


def _check_held_match(session: _core.Session, storages: StorageMap, ckpt: list[tuple[str, str]]) -> None:
    """Refuses (``CheckpointError``) a module that holds weights other than its checkpoint's: ``checkpoint=`` serves
    the file's bytes, so a tensor the module changed since it was loaded (an edit, a fused LoRA) would be dropped
    without a word. Compares every storage the file fills whose tensor holds real bytes (a ``meta`` one has none),
    in place, before anything moves."""
    unwritten = set(session.unwritten())
    items, keep = [], []
    for sid, views in storages.views.items():
        t = views[0].tensor
        if sid in unwritten or t.device.type != "cpu" or storages.nbytes[sid] == 0:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:  # a meta tensor's empty stand-in
            continue
        keep.append(storage)
        items.append((sid, storage.data_ptr(), storage.nbytes()))
    differing = session._differing_at(items)
    if differing:
        path = storages.views[differing[0]][0].path
        file = next((p for p, c in ckpt if path.startswith(f"{c}.")), ckpt[0][0])
        more = f" (and {len(differing) - 1} more)" if len(differing) > 1 else ""
        raise _core.CheckpointError(
            f"tensor '{path}'{more} holds values other than checkpoint {file}: checkpoint= serves the file's "
            "bytes, so the module's (an edit, a fused LoRA) would be lost; enable without checkpoint= (the module's "
            "own tensors become the host masters), or save the module (save_pretrained) and name that file"
        )


def _check_computed_buffers(bound: Bound) -> None:
    """A module bound from a checkpoint keeps its non-persistent buffers (rotary tables and the like: computed when
    it is built, in no checkpoint), so they must hold real values, not ``meta``."""
    for path, (module, attr) in bound.items():
        if attr in getattr(module, "_non_persistent_buffers_set", ()) and getattr(module, attr).is_meta:
            raise _core.PipelineError(
                f"buffer '{path}' is on the meta device, but no checkpoint holds it (a non-persistent buffer, "
                "computed when the module is built); build the module with only its parameters on meta "
                "(accelerate.init_empty_weights(), which keeps buffers real) and enable it with checkpoint= again"
            )


def _checkpoint_components(
    desc: dict[str, Any], checkpoint: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]]
) -> list[tuple[str, str]]:
    """``[(path, component)]`` for ``checkpoint=``: a path fills the pipeline's one component; a mapping names the
    component each file fills (``{"transformer": path, "text_encoder_2": path}``), the others keep their tensors."""
    modules = list(desc.get("modules", {}))
    if isinstance(checkpoint, Mapping):
        pairs = [(_checkpoint_path(p, f"checkpoint[{c!r}]"), str(c)) for c, p in checkpoint.items()]
        unknown = [c for _, c in pairs if c not in modules]
        if unknown or not pairs:
            raise _core.PipelineError(
                f"checkpoint= names {', '.join(repr(c) for c in unknown) or 'no component'}, but pipeline "
                f"{desc['class']} has components {', '.join(modules) or 'none'}; key each file by the component it "
                "fills, e.g. {'transformer': 'transformer/diffusion_pytorch_model.safetensors'}"
            )
        return pairs
    path = _checkpoint_path(checkpoint, "checkpoint")
    if len(modules) != 1 or desc.get("tensors"):
        raise _core.PipelineError(
            f"checkpoint= fills one component, but pipeline {desc['class']} has "
            f"{', '.join(modules) or 'no components'}{' and tensors of its own' if desc.get('tensors') else ''}; "
            "pass the module the file holds alone, e.g. {'transformer': model}, or key each file by the component "
            "it fills: checkpoint={'transformer': path}"
        )
    return [(path, modules[0])]


def _checkpoint_path(checkpoint: Any, what: str) -> str:
    """``checkpoint`` as a path string, or the error naming ``what``."""
    try:
        path = os.fspath(checkpoint)
    except TypeError:
        raise _core.CheckpointError(
            f"{what} must be a path (str or os.PathLike) to a .safetensors or .gguf file or a sharded folder, got "
            f"{type(checkpoint).__name__}"
        ) from None
    return str(path)


def _cuda_index(device: str) -> int | None:
    """The CUDA ordinal of ``"cuda"`` (torch's current device) or ``"cuda:N"``; ``None`` for any other string (the
    Rust side names it unknown). Raises :class:`weightferry.DeviceError` when torch cannot reach that device."""
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        return None
    import torch

    if not torch.cuda.is_available():
        raise _core.DeviceError(
            f'device "{device}": torch sees no CUDA device (torch.cuda.is_available() is False); use device="sim" '
            "(the simulated device) on a machine without a GPU"
        )
    index = torch.cuda.current_device() if device == "cuda" else int(device[5:])
    count = torch.cuda.device_count()
    if index >= count:
        raise _core.DeviceError(f'device "{device}": CUDA device {index} does not exist ({count} device(s) present)')
    return index


def _raw_stream_reader(index: int) -> Callable[[], int]:
    """A cheap reader of torch's current raw stream on device ``index`` (0.15 us instead of 8 us)."""
    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return lambda: fast(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


class _TorchCuda(NamedTuple):
    """What a CUDA session needs of torch (see ``_core.TorchCuda``)."""

    stream: int = 0
    probe_ptr: int = 0
    free_bytes: int = 0
    default_cuda: int = 0


def _open_session(
    desc_json: str,
    text: str,
    fmt: ConfigFormat,
    name: str,
    device: str | torch.device,
    checkpoints: list[tuple[str, str]],
    seams: Seams,
    views: Mapping[str, Views] | None = None,
) -> tuple[_core.Session, Binder, StreamCheck | None]:
    """The native session on ``device`` and its binder; on CUDA also (torch's raw stream, a reader of the current
    one). ``checkpoints`` are ``(path, component)`` pairs, ``views`` per component its tensors the file names
    otherwise."""
    if not isinstance(device, str):
        device = str(device)  # a torch.device
    index = _cuda_index(device)
    port = rendezvous_port(text, fmt)
    new = seams.session if seams.session is not None else _core.Session
    if index is None:
        faults = json.dumps(seams.sim_faults) if seams.sim_faults is not None else None
        session = _new_session(new, desc_json, text, fmt, name, device, checkpoints, port, None, faults, views)
        return session, SimBinder(session, seams.bind), None
    import torch

    dev = torch.device("cuda", index)
    current = _raw_stream_reader(index)
    stream = current()
    probe = torch.empty(1, dtype=torch.uint8, device=dev)  # a torch allocation, for the shared-context check
    torch.cuda.empty_cache()  # device_budget = "auto" plans from the free memory, with torch's cache given back
    free, _total = torch.cuda.mem_get_info(index)
    cuda = _TorchCuda(stream=stream, probe_ptr=probe.data_ptr(), free_bytes=free, default_cuda=index)
    session = _new_session(new, desc_json, text, fmt, name, device, checkpoints, port, cuda, None, views)
    del probe
    return session, CudaBinder(session, dev, seams.bind), (stream, current)


def _new_session(
    new: Callable[..., _core.Session],
    pipeline_json: str,
    config: str,
    config_format: ConfigFormat,
    name: str,
    device: str,
    checkpoints: list[tuple[str, str]],
    rendezvous_port: int | None,
    torch: _TorchCuda | None,
    sim_faults: str | None,
    views: Mapping[str, Views] | None = None,
) -> _core.Session:
    """The native session (``new`` is ``_core.Session`` or a test's stand-in): the one place it is constructed."""
    native_torch = None
    if torch is not None:
        native_torch = _core.TorchCuda(stream=torch.stream, probe_ptr=torch.probe_ptr, free_bytes=torch.free_bytes,
                                       default_cuda=torch.default_cuda)
    options = _core.SessionOptions(config_format=config_format, name=name, device=device,
                                   checkpoints=checkpoints, checkpoint_views=dict(views or {}),
                                   rendezvous_port=rendezvous_port, torch=native_torch, sim_faults=sim_faults)
    return new(pipeline_json, config, options)
