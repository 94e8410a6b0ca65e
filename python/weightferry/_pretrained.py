"""``from_pretrained()``: a model or a whole diffusers pipeline offloaded straight from its saved folder, never held
whole in host memory.

The model is built on ``meta`` from the folder's config (its parameters only: buffers stay real, computed as the
class builds them), each parameter given the dtype its tensor has in the folder's safetensors files (read from
their headers), and bound from those files by :func:`weightferry.enable` with ``checkpoint=``: the weights go from
the files to their masters (or are served by the files themselves, ``host_masters``) and no full copy of the model
exists in the process. Works for diffusers models (``ModelMixin``: ``config.json`` and
``diffusion_pytorch_model*.safetensors``) and transformers models (``PreTrainedModel``: ``config.json`` and
``model*.safetensors``), single files or sharded with their index. A pipeline folder (``model_index.json``) gives
each component the config offloads that treatment (one checkpoint per component); the others (a VAE left out,
tokenizers, the scheduler) load as their own ``from_pretrained`` loads them, in their files' dtype.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _core
from ._config import ConfigLike
from ._enable import enable
from ._handle import Handle
from ._plan import plan

if TYPE_CHECKING:
    import torch

__all__ = ["from_pretrained"]

# safetensors' dtype names as torch dtypes (the names its headers use).
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}


def from_pretrained(
    model_class: type[torch.nn.Module],
    folder: str | os.PathLike[str],
    config: ConfigLike,
    device: str | torch.device | None = None,
    *,
    subfolder: str | None = None,
    name: str = "transformer",
    variant: str | None = None,
) -> tuple[torch.nn.Module, Handle]:
    """Builds ``model_class`` from the saved model in ``folder`` (``subfolder`` inside it, as a pipeline folder's
    ``"transformer"``) on ``meta``, and offloads it under ``config`` on ``device`` with its weights bound from the
    folder's safetensors files; returns ``(model, handle)``. The model's component name in the config's vocabulary
    is ``name`` (its key in the one-component pipeline ``{name: model}``). ``variant`` picks the weight files of that
    variant (``"fp16"``: ``diffusion_pytorch_model.fp16.safetensors``), as diffusers' own ``variant=`` does; without
    it, the files with no variant in their name.

    Raises :class:`weightferry.CheckpointError` when the folder holds no config or no safetensors weights (or
    several candidate files), and whatever :func:`weightferry.enable` raises; on any failure nothing is left
    allocated.

    ``model_class`` may also be a diffusers pipeline class and ``folder`` its saved folder (``model_index.json``):
    then every component the config offloads is built on ``meta`` and bound from its subfolder's files, the others
    load as usual, and the result is ``(pipeline, handle)``."""
    path = Path(os.fspath(folder)) / (subfolder or "")
    if subfolder is None and (path / "model_index.json").is_file():
        return _pipeline(model_class, path, config, device, variant)
    checkpoint, files = _weights(path, variant)
    dtypes = _file_dtypes(files)
    model = _on_meta(model_class, path)
    _follow_file_dtypes(model, dtypes)
    handle = enable({name: model}, config, device, checkpoint=checkpoint)
    return model, handle


def _variant_of(name: str) -> str | None:
    """The variant a weight file's name carries, as diffusers and transformers name them: ``None`` for
    ``model.safetensors``, ``model-00001-of-00002.safetensors`` and ``model.safetensors.index.json``; ``"fp16"`` for
    ``model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors`` and ``model.safetensors.index.fp16.json``."""
    index = re.fullmatch(r".*\.safetensors\.index(?:\.(.+))?\.json", name)
    if index:
        return index.group(1)
    stem = re.sub(r"-\d+-of-\d+$", "", name.removesuffix(".safetensors"))
    return stem.rsplit(".", 1)[1] if "." in stem else None


def _weights(path: Path, variant: str | None) -> tuple[str, list[Path]]:
    """What ``enable(checkpoint=)`` reads for the folder's weights of ``variant`` (its index, else its one file), and
    the safetensors files that holds."""
    if not (path / "config.json").is_file():
        raise _core.CheckpointError(
            f"{str(path)!r} holds no config.json: from_pretrained reads a model saved with save_pretrained (pass the "
            "pipeline folder with subfolder='transformer', for instance)"
        )
    indexes = [p for p in sorted(path.glob("*.safetensors.index*.json")) if _variant_of(p.name) == variant]
    if len(indexes) == 1:
        weight_map = json.loads(indexes[0].read_text()).get("weight_map", {})
        return str(indexes[0]), sorted({path / f for f in weight_map.values()})
    files = [p for p in sorted(path.glob("*.safetensors")) if _variant_of(p.name) == variant]
    if len(indexes) > 1 or len(files) != 1:
        found = ", ".join(p.name for p in sorted(path.glob("*.safetensors*"))) or "none"
        which = f"variant {variant!r}" if variant else "no variant"
        raise _core.CheckpointError(
            f"{str(path)!r} must hold one .safetensors file or one *.safetensors.index.json of {which} (found: "
            f"{found}); pass variant= to pick one, or call weightferry.enable(model, config, checkpoint=FILE) with "
            "the file to read"
        )
    return str(files[0]), files


def _file_dtypes(files: list[Path]) -> dict[str, Any]:
    """Each tensor's torch dtype, read from the files' headers (no tensor data is read)."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                kind = st.get_slice(key).get_dtype()
                if kind in _DTYPES:
                    out[key] = getattr(torch, _DTYPES[kind])
    return out


def _on_meta(model_class: type[torch.nn.Module], path: Path) -> torch.nn.Module:
    """``model_class`` built from the folder's config with its parameters on ``meta`` (buffers real), a
    transformers model's tied weights tied (its own ``tie_weights``)."""
    from accelerate import init_empty_weights  # type: ignore[import-untyped]

    model: torch.nn.Module
    with init_empty_weights():
        if hasattr(model_class, "load_config") and hasattr(model_class, "from_config"):  # diffusers' ModelMixin
            model = model_class.from_config(model_class.load_config(str(path)))
        elif hasattr(model_class, "config_class") and hasattr(model_class, "_from_config"):  # transformers
            model = model_class._from_config(model_class.config_class.from_pretrained(str(path)))
        else:
            raise _core.PipelineError(
                f"from_pretrained builds diffusers (ModelMixin) and transformers (PreTrainedModel) models; "
                f"{model_class.__name__} is neither: build it on meta yourself and call weightferry.enable(model, "
                "config, checkpoint=FILE)"
            )
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        # As transformers' from_pretrained ties them (after init_empty_weights, whose patched registration would
        # give each tie a new meta parameter): the files hold one name of each tie.
        tie()
    return model.eval()


def _follow_file_dtypes(model: torch.nn.Module, dtypes: dict[str, Any]) -> None:
    """Gives each meta parameter the dtype of its tensor in the files (a meta cast moves no byte); a parameter the
    files do not hold keeps its dtype (``enable`` names it)."""
    for key, t in model.state_dict(keep_vars=True).items():
        want = dtypes.get(key)
        if want is not None and t.is_meta and t.dtype != want:
            t.data = t.data.to(want)


def _pipeline(
    pipeline_class: Any, path: Path, config: ConfigLike, device: Any, variant: str | None
) -> tuple[Any, Handle]:
    """A diffusers pipeline from its saved folder: the offloaded components built on ``meta`` and bound from their
    files, the rest loaded by their own ``from_pretrained``."""
    index = json.loads((path / "model_index.json").read_text())
    components: dict[str, Any] = {}
    on_meta: dict[str, tuple[Path, str, dict[str, Any]]] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry:
            continue
        klass = getattr(importlib.import_module(entry[0]), entry[1])
        sub = path / name
        if (sub / "config.json").is_file() and any(sub.glob("*.safetensors")):
            checkpoint, files = _weights(sub, variant)
            dtypes = _file_dtypes(files)
            model = _on_meta(klass, sub)
            _follow_file_dtypes(model, dtypes)
            components[name], on_meta[name] = model, (sub, checkpoint, dtypes)
        else:
            components[name] = klass.from_pretrained(str(sub))
    accepted = inspect.signature(pipeline_class.__init__).parameters
    extra = {k: v for k, v in index.items() if k in accepted and k not in components and not isinstance(v, list)}
    pipe = pipeline_class(**components, **extra)
    selected = {c["path"] for c in plan(pipe, config)["components"] if c["selected"]}
    for name, (sub, _, dtypes) in list(on_meta.items()):
        if name not in selected:  # left resident by the config: loaded whole, as its own from_pretrained loads it
            klass = type(components[name])
            dtype = Counter(dtypes.values()).most_common(1)[0][0]
            loaded = klass.from_pretrained(str(sub), torch_dtype=dtype, variant=variant)
            pipe.register_modules(**{name: loaded.eval()})
            del on_meta[name]
    checkpoints = {name: checkpoint for name, (_, checkpoint, _) in on_meta.items()}
    handle = enable(pipe, config, device, checkpoint=checkpoints)
    return pipe, handle
