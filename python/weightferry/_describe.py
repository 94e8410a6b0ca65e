"""``describe()``: a torch pipeline as a pipeline description (the ``weightferry-pipeline/1`` JSON format of
docs/pipeline-format.md), reading metadata only.

What it reads: the module tree in registration order (the execution order), every parameter and buffer's dtype,
shape, strides, storage offset and kind, storage identity (``untyped_storage().data_ptr()``, so tied and shared
weights become one storage), and the pipeline's declarations (``_dit_modules``, ``_encoder_modules``,
``_vae_modules``, ``_resident_modules``, ``_auxiliary_modules``, ``_offload_plan``;
``_layerwise_offload_blocks_attrs`` and the deprecated ``_layerwise_offload_blocks_attr`` on module classes). What the
declarations leave open, ``_discover`` finds from the host libraries' metadata (component classes,
``_repeated_blocks``, ``_no_split_modules``) and writes into the description as declarations.
"""

from __future__ import annotations

import copyreg
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

from . import _core
from ._binders import is_placeholder
from ._composites import SEP, Composite, is_composite
from ._discover import Declared, discover

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from typing_extensions import TypeAlias

__all__ = ["Bound", "Composites", "Description", "Modules", "PipelineLike", "describe"]

PipelineLike: TypeAlias = Union["Mapping[str, nn.Module]", "nn.Module", object]
"""What :func:`describe` accepts: a diffusers pipeline, an object whose public attributes are the components, a dict
of name -> ``torch.nn.Module``, or one ``torch.nn.Module``."""
Description: TypeAlias = "dict[str, Any]"
"""A pipeline description: JSON data in the ``weightferry-pipeline/1`` format."""
Bound: TypeAlias = "dict[str, tuple[Any, str]]"
"""Tensor path -> (the object holding it, its attribute name there): a module; for a part of a tensor subclass
described by its parts (``_composites``) the subclass object; for an attached part of a subclass over its own bytes
(a tensor of its Python state) the subclass or the object of its state holding it."""
Composites: TypeAlias = "dict[str, Composite]"
"""Tensor path -> the tensor subclass there, described by its parts (whose paths are in ``Bound``)."""
Modules: TypeAlias = "dict[str, nn.Module]"
"""Module path -> module (the root module, if any, at ``""``)."""
# One tensor viewing a storage, as the walk records it: (its description entry, its path, dtype name, element size,
# elements its view needs from the storage's start, the storage's bytes).
_StorageView: TypeAlias = "tuple[dict[str, Any], str, str, int, int, int]"

FORMAT = "weightferry-pipeline/1"

# Pipeline attribute -> key of the format's `components`.
_COMPONENT_DECLS = (
    ("_dit_modules", "dit"),
    ("_encoder_modules", "encoders"),
    ("_vae_modules", "vaes"),
    ("_resident_modules", "resident"),
    ("_auxiliary_modules", "auxiliary"),
)

_SUPPORTED = "float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int64, int32, int8, uint8"


def _dtype_names() -> dict[torch.dtype, str]:
    import torch

    return {
        torch.float32: "f32",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.float8_e4m3fn: "f8e4m3",
        torch.float8_e5m2: "f8e5m2",
        torch.int8: "i8",
        torch.int64: "i64",
        torch.int32: "i32",
        torch.uint8: "u8",
    }


def _error(message: str) -> _core.PipelineError:
    return _core.PipelineError(message)


def _path_list(value: object, where: str) -> list[str]:
    """A declaration that must be a list (or tuple) of dotted-path strings."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _error(f"{where} must be a list of dotted module paths (str), got {value!r}")


def _plain(value: object, where: str) -> Any:
    """A declaration value as JSON data: mappings to dicts, tuples / lists / sets to lists, strings as they are."""
    if isinstance(value, str) or value is None or isinstance(value, bool):
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _error(f"{where} has a key {k!r} that is not a str; use dotted module paths as keys")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v, f"{where}[...]") for v in value)
    raise _error(f"{where} holds {value!r} ({type(value).__name__}); use str, lists and dicts")


def _offload_plan(decl: object, where: str) -> dict[str, Any]:
    """The pipeline's ``_offload_plan`` (a dataclass such as vLLM-Omni's ``OffloadPlan``, a mapping, or an object
    with attributes) as the format's ``offload_plan`` object. Unknown fields pass through, so the Rust loader
    rejects them with its message."""
    if dataclasses.is_dataclass(decl) and not isinstance(decl, type):
        fields = {f.name: getattr(decl, f.name) for f in dataclasses.fields(decl)}
    elif isinstance(decl, Mapping):
        fields = dict(decl)
    elif hasattr(decl, "__dict__"):
        fields = {k: v for k, v in vars(decl).items() if not k.startswith("_")}
    else:
        raise _error(f"{where} must be an OffloadPlan dataclass, a dict or an object with attributes, got {decl!r}")
    # Empty fields carry nothing: leave them out so the description stays short.
    return {k: _plain(v, f"{where}.{k}") for k, v in fields.items() if v not in (None, (), [], {})}


def _adapter_layers(m: nn.Module, path: str) -> list[str]:
    """The paths of ``m``'s adapter layers, when its class names them in ``adapter_layer_names`` (peft's tuner layer
    protocol: ``lora_A``, ``lora_B``, ``lora_embedding_A``, …): small weights added and removed apart from the
    block's own, so they stay on the device instead of streaming with the block."""
    names = getattr(type(m), "adapter_layer_names", None)
    if not isinstance(names, (tuple, list)):
        return []
    return [f"{path}.{n}" for n in names if isinstance(n, str) and m._modules.get(n) is not None]


def _compiled_original(m: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles, found through its ``_orig_mod`` (nested
    wrappers too); any other module as it is. The component is described, hooked and bound as the original module;
    calls through the wrapper run its compiled code over it."""
    import torch.nn as nn

    while type(m).__name__ == "OptimizedModule":
        inner = getattr(m, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        m = inner
    return m


def _root_modules(pipeline: PipelineLike) -> tuple[str, nn.Module | None, list[tuple[str, nn.Module]]]:
    """``(class name, root nn.Module or None, [(name, nn.Module)])``: the components of ``pipeline``, in order."""
    import torch.nn as nn

    cls = type(pipeline).__name__
    if isinstance(pipeline, nn.Module):
        return cls, pipeline, [(k, v) for k, v in pipeline._modules.items() if v is not None]
    if isinstance(pipeline, Mapping):
        items = list(pipeline.items())
        for name, m in items:
            if not isinstance(name, str):
                raise _error(f"pipeline dict key {name!r} is not a str; name each component with a str")
            if not isinstance(m, nn.Module):
                raise _error(
                    f"pipeline dict entry '{name}' ({type(m).__name__}) is not a torch.nn.Module; pass only modules"
                )
        return cls, None, items
    # A diffusers pipeline lists its registered components in `components` (schedulers, tokenizers and None
    # entries included); any other object contributes its public module attributes.
    comps = getattr(pipeline, "components", None)
    if isinstance(comps, Mapping):
        items = list(comps.items())
    elif hasattr(pipeline, "__dict__"):
        items = [(k, v) for k, v in vars(pipeline).items() if not k.startswith("_")]
    else:
        raise _error(
            f"cannot find the components of a {cls}: pass a diffusers pipeline, an object whose attributes are the "
            "components, or a dict of name -> torch.nn.Module"
        )
    return cls, None, [(k, v) for k, v in items if isinstance(k, str) and isinstance(v, nn.Module)]


class _Describer:
    """One walk over the module tree: tensor entries, storage identity, class block attributes."""

    def __init__(self) -> None:
        self.dtypes = _dtype_names()
        # storage key -> [(entry, path, dtype name, element size, elements the view needs, storage bytes)]
        self.storages: dict[tuple[str, int], list[_StorageView]] = {}
        self.class_attrs: dict[str, list[str]] = {}
        self.class_attr: dict[str, str] = {}
        self.class_owner: dict[tuple[str, str], type] = {}
        # tensor path -> (module, attribute name); module path -> module (for enable's binding and hooks)
        self.bound: Bound = {}
        self.modules: Modules = {}
        self.pinned: list[str] = []  # module paths whose tensors stay on the device (adapter layers)
        self.composites: Composites = {}  # tensor path -> a tensor subclass described by its parts

    def tensor(self, t: torch.Tensor, path: str, kind: str) -> dict[str, Any]:
        import torch

        if t.layout != torch.strided:
            raise _error(
                f"tensor '{path}' has layout {t.layout}; weightferry offloads dense (strided) tensors only: make it "
                "dense (.to_dense()) or leave its module out of the offloaded components"
            )
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            _check_subclass(t, path)
        dtype = self.dtypes.get(t.dtype)
        if dtype is None:
            raise _error(
                f"tensor '{path}' has dtype {t.dtype}, which weightferry does not support; use one of {_SUPPORTED} "
                "(e.g. cast the module with .to(torch.bfloat16))"
            )
        shape = list(t.shape)
        strides = list(t.stride())
        offset = int(t.storage_offset())
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
        if is_placeholder(t) and t.numel():
            # An offloaded tensor between forwards (a pipeline described while enabled): described as the dense
            # tensor of its own it stands for, not as a view of the placeholders' shared elements.
            strides = list(torch.empty(shape, device="meta").stride())
            offset, ptr, nbytes = 0, 0, t.numel() * t.element_size()
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        entry = {"dtype": dtype, "shape": shape, "strides": strides, "kind": kind, "storage_offset": offset}
        # Storages without memory (empty, meta) have no address: each owns its own, except that one meta tensor
        # object reached at several paths (tied weights) is one storage, as it is once materialized.
        if ptr != 0 and nbytes > 0:
            key: tuple[str, int] = (str(t.device), ptr)
        else:
            key = ("meta", id(t)) if t.is_meta and t.numel() > 0 else ("unique", id(entry))
        self.storages.setdefault(key, []).append((entry, path, dtype, t.element_size(), offset + span, nbytes))
        return entry

    def module(self, m: nn.Module, path: str, active: set[int]) -> dict[str, Any]:
        if id(m) in active:
            raise _error(f"module '{path}' contains itself; weightferry needs a module tree without cycles")
        active.add(id(m))
        self.modules[path] = m
        self._class_decls(m, path)
        self.pinned.extend(_adapter_layers(m, path))
        node: dict[str, Any] = {"class": type(m).__name__}
        if callable(getattr(m, "load_to_device", None)) and callable(getattr(m, "offload_to_cpu", None)):
            node["has_lifecycle"] = True
        tensors = self.tensors(m, path)
        if tensors:
            node["tensors"] = tensors
            _check_aliases(m, path)
        children: dict[str, Any] = {}
        for name, child in m._modules.items():
            if child is not None:
                children[name] = self.module(child, f"{path}.{name}", active)
        if children:
            node["children"] = children
        active.discard(id(m))
        return node

    def tensors(self, m: nn.Module, path: str) -> dict[str, Any]:
        prefix = f"{path}." if path else ""
        out: dict[str, Any] = {}
        for name, p in m._parameters.items():
            if p is not None:
                self._entry(m, name, p, prefix, "parameter", out)
        for name, b in m._buffers.items():
            if b is not None:
                persistent = name not in m._non_persistent_buffers_set
                kind = "persistent_buffer" if persistent else "non_persistent_buffer"
                self._entry(m, name, b, prefix, kind, out)
        return out

    def _entry(self, m: nn.Module, name: str, t: torch.Tensor, prefix: str, kind: str, out: dict[str, Any]) -> None:
        """Describes ``m``'s tensor ``name`` into ``out``: one entry, then one per attached part of a subclass over
        its own bytes (the tensors of its Python state, ``<name>#<attribute>``), or one per part of a tensor subclass
        described by its parts (``_composites``)."""
        import torch

        if not is_composite(t):
            out[name] = self.tensor(t, prefix + name, kind)
            self.bound[prefix + name] = (m, name)
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                for part, holder, attr, value in _state_tensors(t, prefix + name):
                    path = f"{prefix}{name}{SEP}{part}"
                    out[path[len(prefix) :]] = self.tensor(value, path, kind)
                    self.bound[path] = (holder, attr)
            return
        c = Composite(t, prefix + name, (m, name))
        self.composites[prefix + name] = c
        for holder, attr, path in c.leaves():
            out[path[len(prefix) :]] = self.tensor(getattr(holder, attr), path, kind)
            self.bound[path] = (holder, attr)

    def _class_decls(self, m: nn.Module, path: str) -> None:
        """Records the block-list declarations of ``m``'s class (keyed by class name, as the format keys them)."""
        cls = type(m)
        plural = getattr(cls, "_layerwise_offload_blocks_attrs", None)
        if plural is not None:
            where = f"{cls.__qualname__}._layerwise_offload_blocks_attrs"
            self._record(self.class_attrs, cls, path, "_layerwise_offload_blocks_attrs", _path_list(plural, where))
        singular = getattr(cls, "_layerwise_offload_blocks_attr", None)
        if singular is not None:
            if not isinstance(singular, str):
                raise _error(
                    f"{cls.__qualname__}._layerwise_offload_blocks_attr must be a str (a block-list attribute), "
                    f"got {singular!r}"
                )
            self._record(self.class_attr, cls, path, "_layerwise_offload_blocks_attr", singular)

    def _record(self, table: dict[str, Any], cls: type, path: str, attr: str, value: object) -> None:
        owner = self.class_owner.setdefault((cls.__name__, attr), cls)
        if owner is not cls and getattr(owner, attr) != getattr(cls, attr):
            raise _error(
                f"two module classes named {cls.__name__} ({owner.__module__} and {cls.__module__}, the second at "
                f"'{path}') declare different {attr}; the description keys block attributes by class name, so "
                "rename one class"
            )
        table[cls.__name__] = value

    def storage_table(self) -> dict[str, Any]:
        """Names the storages several tensors share (or that are larger than their one view) and points their
        tensors at them; every other tensor owns a storage of exactly its view's size."""
        table: dict[str, Any] = {}
        for views in self.storages.values():
            _, path, dtype, size, needed, nbytes = views[0]
            if len(views) == 1 and needed * size == nbytes:
                continue
            for _, other_path, other_dtype, _, _, _ in views[1:]:
                if other_dtype != dtype:
                    raise _error(
                        f"tensors '{path}' ({dtype}) and '{other_path}' ({other_dtype}) share one storage with "
                        "different dtypes; weightferry needs every view of a storage to have the storage's dtype"
                    )
            if nbytes % size:
                raise _error(f"the storage of tensor '{path}' holds {nbytes} bytes, not a whole number of {dtype}")
            name = f"s{len(table)}"
            table[name] = {"dtype": dtype, "numel": nbytes // size}
            for view in views:
                view[0]["storage"] = name
        return table


def _check_subclass(t: torch.Tensor, path: str) -> None:
    """Accepts a ``torch.Tensor`` subclass whose bytes are its own storage (``torch.Tensor._make_subclass``, as
    diffusers' ``GGUFParameter`` and bitsandbytes' ``Params4bit`` are made): it streams as the plain tensor it wraps,
    and binding its data keeps the object, its class and its Python attributes (tensors there are its attached
    parts: :func:`_state_tensors`). Refuses (``PipelineError``, naming the tensor, its class and the fix) one without
    storage of its own that does not name its parts (a wrapper subclass without ``__tensor_flatten__``)."""

    name = f"{type(t).__module__}.{type(t).__qualname__}"
    try:
        has_storage = t.numel() == 0 or t.untyped_storage().data_ptr() != 0 or t.is_meta
    except RuntimeError:  # a wrapper subclass: its storage is not its bytes
        has_storage = False
    if not has_storage:
        raise _error(
            f"tensor '{path}' is a {name}, a torch.Tensor subclass without storage of its own that does not "
            "describe its parts (__tensor_flatten__); weightferry cannot stream it: leave its module out of the "
            "offloaded components"
        )


def _state_tensors(t: torch.Tensor, path: str) -> list[tuple[str, Any, str, torch.Tensor]]:
    """The tensors a tensor subclass's Python state holds (its ``__dict__`` and slots, not what a ``__getstate__``
    makes of them), directly or as attributes of plain objects there, nested (bitsandbytes' ``quant_state`` and its
    ``state2``), as ``(part name, holder object, attribute, tensor)``; the part name joins the attribute names with
    ``#``. These are the subclass's attached parts: its kernels read them beside its data, so they stream with it.
    Modules and classes there are references, not state. A tensor inside a container (list, dict) or itself a
    subclass is refused (``PipelineError``): weightferry could not bind it in place."""
    import torch
    import torch.nn as nn

    slots = {n: getattr(t, n) for n in copyreg._slotnames(type(t)) if hasattr(t, n)}  # type: ignore[attr-defined]
    found: list[tuple[str, Any, str, torch.Tensor]] = []
    seen = {id(t)}

    def walk(holder: Any, items: Mapping[str, Any], prefix: str) -> None:
        for attr, value in items.items():
            name = f"{prefix}{attr}"
            if isinstance(value, torch.Tensor):
                if type(value) is not torch.Tensor and type(value) is not nn.Parameter:
                    raise _refused_part(t, path, name, f"a {type(value).__qualname__}, a tensor subclass")
                found.append((name, holder, attr, value))
            elif isinstance(value, (list, tuple, dict, set)):
                inner = value.values() if isinstance(value, dict) else value
                if any(isinstance(v, torch.Tensor) for v in inner):
                    raise _refused_part(t, path, name, f"a {type(value).__name__} of tensors")
            elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)) and id(value) not in seen:
                seen.add(id(value))
                walk(value, vars(value), f"{name}{SEP}")

    walk(t, {**vars(t), **slots}, "")
    return found


def _check_aliases(m: nn.Module, path: str) -> None:
    """Refuses (``PipelineError``) a module that holds, outside its parameters and buffers, a tensor over the bytes
    of one of its weights: in a plain attribute, or an attribute of a plain object there (bitsandbytes'
    ``Linear8bitLt`` keeps its int8 weight in ``state.CB`` after its first forward and puts it back into the weight
    each forward). weightferry moves the weight's bytes, not that tensor, which would keep the host bytes."""
    import torch
    import torch.nn as nn

    prefix = f"{path}." if path else ""
    own: dict[int, str] = {}
    for name, w in [*m._parameters.items(), *m._buffers.items()]:
        if w is not None and not is_composite(w) and not w.is_meta and w.untyped_storage().data_ptr():
            own.setdefault(w.untyped_storage().data_ptr(), prefix + name)
    if not own:
        return
    candidates: list[tuple[str, Any]] = []
    for attr, value in vars(m).items():
        if isinstance(value, torch.Tensor):
            candidates.append((attr, value))
        elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module, torch.Tensor)):
            candidates.extend((f"{attr}.{k}", v) for k, v in vars(value).items() if isinstance(v, torch.Tensor))
    for name, t in candidates:
        ptr = t.untyped_storage().data_ptr() if not t.is_meta else 0
        if ptr in own:
            raise _error(
                f"module '{path}' ({type(m).__qualname__}) holds in its attribute '{name}' a tensor over the bytes of "
                f"its weight '{own[ptr]}', outside its parameters and buffers: weightferry moves the weight's bytes "
                "and cannot move that tensor; build the module anew without running it before enable, or leave it "
                "out of the offloaded components"
            )


def _refused_part(t: torch.Tensor, path: str, name: str, what: str) -> _core.PipelineError:
    return _error(
        f"tensor '{path}' is a {type(t).__module__}.{type(t).__qualname__} whose attribute '{name.replace(SEP, '.')}' "
        f"holds {what}, which weightferry cannot bind in place beside its data: leave its module out of the "
        "offloaded components"
    )


def describe(
    pipeline: PipelineLike,
    *,
    dit: list[str] | None = None,
    encoders: list[str] | None = None,
    vaes: list[str] | None = None,
    blocks: Mapping[str, list[str]] | None = None,
) -> Description:
    """Describes ``pipeline`` as a dict in the pipeline-description format (``json.dumps`` of it is a file
    ``weightferry plan --pipeline`` reads).

    ``pipeline`` is a diffusers pipeline (its ``components``), any object whose public attributes are the
    components, a dict of name -> ``torch.nn.Module``, or one ``torch.nn.Module`` (its children are the
    components). Reads metadata only: nothing is moved, copied or written.

    The components and their block lists are found from the models' own metadata (see :mod:`weightferry` docs,
    "Discovery"); the keywords declare what a dict pipeline cannot: ``dit``, ``encoders`` and ``vaes`` name the
    components of each kind (a kind given here is not discovered), ``blocks`` maps a DiT's or an encoder's name to
    the dotted paths of its block lists (lists of blocks such as an ``nn.ModuleList``, in the order its forward runs
    them).

    Raises :class:`weightferry.PipelineError` for a tensor of an unsupported dtype, storages shared across dtypes,
    or malformed declarations, naming the keyword or attribute to fix.
    """
    return _describe(pipeline, Declared.of(dit, encoders, vaes, blocks))[0]


def _describe(
    pipeline: PipelineLike, py: Declared | None = None
) -> tuple[Description, Bound, Modules, Composites]:
    """``(description, {tensor path: (holder, attribute)}, {module path: module}, {tensor path: composite})``:
    :func:`describe` with the objects its paths name (the root module, if any, at path ``""``); ``py`` is what the
    caller declared in keyword arguments."""
    cls, root, items = _root_modules(pipeline)
    items = [(name, _compiled_original(m)) for name, m in items]
    d = _Describer()
    desc: Description = {"format": FORMAT, "class": cls}
    if root is not None:
        d.modules[""] = root
        tensors = d.tensors(root, "")
        if tensors:
            desc["tensors"] = tensors
        d._class_decls(root, "")
    active = {id(root)} if root is not None else set()
    desc["modules"] = {name: d.module(m, name, active) for name, m in items}
    storages = d.storage_table()
    if storages:
        desc["storages"] = storages

    declared: dict[str, list[str]] = {}
    if not isinstance(pipeline, Mapping):
        for attr, key in _COMPONENT_DECLS:
            value = getattr(pipeline, attr, None)
            if value is not None:
                declared[key] = _path_list(value, f"{cls}.{attr}")
        plan_decl = getattr(pipeline, "_offload_plan", None)
        if plan_decl is not None:
            desc["offload_plan"] = _offload_plan(plan_decl, f"{cls}._offload_plan")
    if d.class_attrs:
        desc["class_block_attrs"] = d.class_attrs
    if d.class_attr:
        desc["class_block_attr"] = d.class_attr
    if d.pinned:
        desc["pinned"] = d.pinned
    discover(desc, items, declared, py if py is not None else Declared())
    return desc, d.bound, d.modules, d.composites

