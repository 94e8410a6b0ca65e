"""Discovery: which components of a pipeline are DiTs, encoders and VAEs, and which block lists each one streams,
read from the host libraries' own metadata instead of attribute names.

- **Components** are the pipeline's registered modules (a diffusers pipeline's ``components``, a dict's entries, a
  module's children). Each is classified by what it is: a ``transformers.PreTrainedModel`` is an encoder (selected
  by ``"text_encoder"``), a module with ``encode`` and ``decode`` methods is a VAE (diffusers' autoencoders), and a
  module whose block lists the metadata names is a DiT. A module none of these describe is classified by its name
  as the deprecated scan always did (the resolver's own name lists), with one warning per model.
- **Block lists** of a DiT or an encoder are the ``nn.ModuleList`` / ``nn.Sequential`` whose every element is an
  instance of a class the model's class names in ``_repeated_blocks`` (diffusers) or ``_no_split_modules``
  (diffusers and transformers), nested ones included (a token refiner's blocks), in execution order: ordered by
  where the model's own ``forward`` first names the child holding each list (Lumina2 builds its noise refiner
  before its context refiner and runs them the other way round), in registration order where its source cannot be
  read or does not name them all. A list inside a found list is part of its block. A model without that metadata
  falls back to diffusers' conventional names, with one warning per model. A list whose elements each wrap named
  blocks is one block per element, whatever their classes (a UNet's down blocks stream whole, so the resnets and
  attentions their forward interleaves are never out of order). Lists nested in one child keep their registration
  order (a UNet's mid block runs resnet, attention, resnet: those stream correctly but some are fetched when their
  forward asks for them).

Declarations win over discovery: the pipeline's ``_dit_modules`` / ``_encoder_modules`` / ``_vae_modules`` and
``enable``'s ``dit=`` / ``encoders=`` / ``vaes=`` name the components; a class's ``_layerwise_offload_blocks_attrs``,
the pipeline's ``_offload_plan`` and ``enable``'s ``blocks=`` name block lists. Discovery fills in what they leave
open and writes it into the description as declarations (``components``, ``offload_plan.block_attrs``,
``offload_plan.encoder_block_attrs``), so the resolver, the CLI and ``plan`` read one answer.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import _core
from ._warnings import WeightferryWarning

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["Declared", "discover", "execution_order", "left_resident", "metadata_block_lists"]

# Component kinds as the description's `components` keys them.
DIT, ENCODERS, VAES = "dit", "encoders", "vaes"

# The deprecated fallback for models without metadata: diffusers' conventional block-list names of a DiT (in the
# module's registration order) and of a text encoder.
_FALLBACK_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")
_FALLBACK_ENCODER_BLOCKS = ("encoder.block", "text_model.encoder.layers", "encoder.layers", "model.layers", "layers")

# Models a discovery warning was already issued for (one warning per model and reason, not per pipeline class).
_WARNED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
# Per model: the large lists of blocks its discovered lists leave on the device, as plan() reports them.
_LEFT: weakref.WeakKeyDictionary[nn.Module, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Declared:
    """What the caller declares in Python (``enable``'s, ``plan``'s and ``describe``'s keyword arguments): component
    paths by kind (``None``: discover that kind) and block-list paths by component path."""

    dit: tuple[str, ...] | None = None
    encoders: tuple[str, ...] | None = None
    vaes: tuple[str, ...] | None = None
    blocks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(dit: object, encoders: object, vaes: object, blocks: object) -> Declared:
        """Checks the keyword arguments (errors name the argument and the fix)."""
        return Declared(
            _paths(dit, "dit"), _paths(encoders, "encoders"), _paths(vaes, "vaes"), _blocks_arg(blocks)
        )


def _paths(value: object, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise _core.PipelineError(
        f"{name}= must be a list of component names (str), such as {name}=[\"transformer\"]; got {value!r}"
    )


def _blocks_arg(value: object) -> dict[str, tuple[str, ...]]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out: dict[str, tuple[str, ...]] = {}
        for k, v in value.items():
            paths = _paths(v, f"blocks[{k!r}]") if isinstance(k, str) and k else None
            if paths is None:
                break
            out[k] = paths
        else:
            return out
    raise _core.PipelineError(
        "blocks= must map a component name to the dotted paths of its block lists, such as "
        f"blocks={{\"transformer\": [\"transformer_blocks\", \"single_transformer_blocks\"]}}; got {value!r}"
    )


def _class_names(cls: type, attr: str) -> set[str]:
    value = getattr(cls, attr, None)
    if isinstance(value, str):
        return {value}
    if isinstance(value, (list, tuple, set, frozenset)):
        return {v for v in value if isinstance(v, str)}
    return set()


def _is_block_list(m: nn.Module) -> bool:
    import torch.nn as nn

    return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0


def metadata_block_lists(model: nn.Module) -> list[str]:
    """The dotted paths (relative to ``model``) of its block lists by its class's ``_repeated_blocks`` and
    ``_no_split_modules``, nested ones included, in registration order (not those inside a found list):

    - a ``ModuleList`` / ``Sequential`` whose elements are all instances of the named classes;
    - one whose elements each wrap an instance of a named class, of one class (HiDream's ``HiDreamBlock`` around
      its transformer blocks) or several (a UNet's cross-attention and plain down blocks, each holding
      ``ResnetBlock2D``s): each element is one block;
    - inside a named module that is not itself in a list (a token refiner), a list of at least two modules of one
      class with modules of their own: that module's blocks.
    """
    names = _class_names(type(model), "_repeated_blocks") | _class_names(type(model), "_no_split_modules")
    if not names:
        return []

    def named(m: nn.Module) -> bool:
        return any(c.__name__ in names for c in type(m).__mro__)

    def is_blocks(child: nn.Module, inside_named: bool) -> bool:
        if not _is_block_list(child):
            return False
        blocks = [b for b in child._modules.values() if b is not None]
        if all(named(b) for b in blocks):
            return True
        if not all(len(b._modules) > 0 for b in blocks):
            return False
        if all(any(named(d) for d in b.modules()) for b in blocks):
            return True  # wrappers of named blocks, of one class (HiDream's) or several (a UNet's down blocks)
        return inside_named and len(blocks) > 1 and all(type(b) is type(blocks[0]) for b in blocks)

    found: list[str] = []

    def walk(m: nn.Module, prefix: str, inside_named: bool) -> None:
        for name, child in m._modules.items():
            if child is None:
                continue
            path = f"{prefix}{name}"
            if is_blocks(child, inside_named):
                found.append(path)
            else:
                walk(child, path + ".", inside_named or named(child))

    walk(model, "", False)
    return found


def _declared_lists(m: nn.Module) -> bool:
    cls = type(m)
    return (
        getattr(cls, "_layerwise_offload_blocks_attrs", None) is not None
        or getattr(cls, "_layerwise_offload_blocks_attr", None) is not None
    )


def _is_pretrained(m: nn.Module) -> bool:
    try:
        import transformers
    except ImportError:  # pragma: no cover - transformers is optional
        return False
    return isinstance(m, transformers.PreTrainedModel)


def _kind(name: str, m: nn.Module) -> tuple[str | None, bool]:
    """``(kind, by_name)``: the component kind of ``m`` by what it is, else by its name (the deprecated scan)."""
    if _is_pretrained(m):
        return ENCODERS, False
    if callable(getattr(m, "encode", None)) and callable(getattr(m, "decode", None)):
        return VAES, False
    if _declared_lists(m) or metadata_block_lists(m):
        return DIT, False
    for kind, names in _core.FALLBACK_COMPONENT_NAMES.items():
        if name in names:
            return kind, True
    return None, False


class _Scans:
    """What discovery took by name for each model (the deprecated scan), said in one warning per model: once per
    model object, however many pipelines it is described in."""

    def __init__(self) -> None:
        self.kinds: dict[str, str] = {}  # path -> kind taken by name
        self.lists: dict[str, list[str]] = {}  # path -> block lists taken by name

    def warn(self, by_path: Mapping[str, nn.Module]) -> None:
        for path in dict.fromkeys([*self.kinds, *self.lists]):
            m = by_path[path]
            seen = _WARNED.setdefault(m, set())
            if "scan" in seen:
                continue
            seen.add("scan")
            cls = type(m).__name__
            taken, fixes = [], []
            if path in self.kinds:
                kind = self.kinds[path]
                taken.append(f"taken for a {_KIND_WORD[kind]} by its name")
                fixes.append(f"{kind}=[\"{path}\"]")
            if path in self.lists:
                lists = self.lists[path]
                taken.append(f"its block lists by their conventional names: {', '.join(lists)}")
                fixes.append(f"blocks={{\"{path}\": {lists!r}}}".replace("'", '"'))
            declare = "" if self.kinds.get(path) == VAES else f", or declare _repeated_blocks on {cls}"
            warnings.warn(
                f"'{path}' ({cls}): its class says neither what it is (a transformers model, a VAE with encode and "
                f"decode) nor which blocks it repeats (_repeated_blocks, _no_split_modules); {'; '.join(taken)}. "
                f"Pass {' and '.join(fixes)} to enable to say so{declare}",
                WeightferryWarning,
                stacklevel=5,
            )


def _components(
    items: list[tuple[str, nn.Module]], declared: dict[str, list[str]], py: Declared, scans: _Scans
) -> dict[str, list[str]]:
    """Component paths by kind: the Python keywords, then the pipeline's declarations, then discovery."""
    kinds = {DIT: py.dit, ENCODERS: py.encoders, VAES: py.vaes}
    out: dict[str, list[str]] = {}
    taken: set[str] = set()
    for kind, given in kinds.items():
        if given is not None:
            out[kind] = list(given)
            taken.update(given)
    if declared:  # the pipeline's own declarations fill the kinds the keywords leave open
        for kind, paths in declared.items():
            out.setdefault(kind, [p for p in paths if p not in taken])
        return out
    for name, m in items:
        found, by_name = _kind(name, m)
        if found is None or name in taken or kinds.get(found) is not None:
            continue
        if by_name:
            scans.kinds[name] = found
        out.setdefault(found, []).append(name)
    return out


_KIND_WORD = {DIT: "DiT", ENCODERS: "text encoder", VAES: "VAE"}


def execution_order(m: nn.Module, lists: list[str]) -> list[str]:
    """``lists`` (dotted paths in ``m``) in the order ``m``'s forward runs them: sorted by where the source of its
    class's ``forward`` first names the child of ``m`` holding each (``self.<child>``), lists under one child in
    their given order; as given when the source cannot be read or does not name every such child."""
    try:
        source = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return lists
    first: dict[str, int] = {}
    for hit in re.finditer(r"\bself\.(\w+)", source):
        first.setdefault(hit.group(1), hit.start())
    if not all(p.split(".")[0] in first for p in lists):
        return lists
    return sorted(lists, key=lambda p: first[p.split(".")[0]])


def _dit_lists(path: str, m: nn.Module, scans: _Scans) -> list[str]:
    found = metadata_block_lists(m)
    if found:
        return execution_order(m, found)
    found = [a for a in m._modules if a in _FALLBACK_BLOCK_LISTS and _has_list(m, a)]
    if found:
        scans.lists[path] = found
    return execution_order(m, found)


def _encoder_lists(path: str, m: nn.Module, scans: _Scans) -> list[str]:
    found = [a for a in metadata_block_lists(m) if len(_module_at(m, a)._modules) > 1]  # type: ignore[union-attr]
    if found:
        return execution_order(m, found)
    attr = next((a for a in _FALLBACK_ENCODER_BLOCKS if _has_list(m, a)), None)
    if attr is None:
        return []
    scans.lists[path] = [attr]
    return [attr]


def _module_at(m: nn.Module, dotted: str) -> nn.Module | None:
    cur: nn.Module | None = m
    for part in dotted.split("."):
        cur = cur._modules.get(part) if cur is not None else None
    return cur


def _nbytes(m: nn.Module) -> int:
    tensors = [*m.parameters(), *m.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _left_resident(m: nn.Module, lists: list[str], total: int) -> list[tuple[str, int, int]]:
    """``(path, blocks, bytes)`` of the lists of blocks in ``m`` (of ``total`` bytes) that no streamed list holds and
    that weigh at least a twentieth of it: large weights that stay on the device although the model streams its
    blocks."""
    out: list[tuple[str, int, int]] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, child in mod._modules.items():
            path = f"{prefix}{name}"
            if child is None or path in lists:
                continue
            blocks = [b for b in child._modules.values() if b is not None]
            uniform = all(type(b) is type(blocks[0]) and len(b._modules) > 0 for b in blocks)
            if _is_block_list(child) and len(blocks) > 1 and uniform:
                n = _nbytes(child)
                if n * 20 >= total:
                    out.append((path, len(blocks), n))
                    continue
            walk(child, path + ".")

    walk(m, "")
    return out


def left_resident(m: nn.Module) -> list[dict[str, Any]]:
    """The large lists of blocks (``path`` in ``m``, ``blocks``, ``bytes``) that the block lists discovery found in
    ``m`` leave on the device, as of its last discovery; empty when none or not discovered."""
    return list(_LEFT.get(m, []))


def _warn_left_resident(path: str, m: nn.Module, lists: list[str]) -> None:
    """Records the large lists of blocks that stay on the device (:func:`left_resident`), and names them in one
    warning per model."""
    seen = _WARNED.setdefault(m, set())
    if "left" in seen:
        return
    total = _nbytes(m)
    left = _left_resident(m, lists, total)
    _LEFT[m] = [{"path": p, "blocks": n, "bytes": b} for p, n, b in left]
    if not left:
        return
    seen.add("left")
    what = ", ".join(f"{p} ({n} blocks, {b / 1e6:.1f} MB, {100 * b / total:.0f}% of it)" for p, n, b in left)
    every = [*lists, *(p for p, _, _ in left)]
    warnings.warn(
        f"'{path}' ({type(m).__name__}) streams {', '.join(lists)}, but these lists of blocks stay on the device: "
        f"{what}; pass blocks={json.dumps({path: every})} to enable to stream them too",
        WeightferryWarning,
        stacklevel=5,
    )


def _has_list(m: nn.Module, dotted: str) -> bool:
    found = _module_at(m, dotted)
    return found is not None and _is_block_list(found)


def discover(
    desc: dict[str, Any],
    items: Iterable[tuple[str, nn.Module]],
    declared: dict[str, list[str]],
    py: Declared,
) -> None:
    """Writes the pipeline's components and their block lists into ``desc`` as declarations: ``components`` from
    ``py``, the pipeline's ``declared`` components, or discovery; then, for every DiT and encoder whose block lists
    nothing declares, ``offload_plan.block_attrs`` / ``encoder_block_attrs`` from its metadata."""
    items = list(items)
    by_path = dict(items)
    scans = _Scans()
    comps = _components(items, declared, py, scans)
    for kind, paths in comps.items():
        for p in paths:
            if p not in by_path and "." not in p:
                raise _core.PipelineError(
                    f"{kind}= names '{p}', which is not a component of the pipeline (it has "
                    f"{', '.join(sorted(by_path)) or 'none'}); pass one of them"
                )
    if any(comps.values()):
        desc["components"] = {k: v for k, v in comps.items() if v}
    plan: dict[str, Any] = desc.setdefault("offload_plan", {})
    class_declared = set(desc.get("class_block_attrs", {})) | set(desc.get("class_block_attr", {}))
    _apply_blocks(plan, comps, py, by_path)
    for p in comps.get(DIT, []):
        m = by_path.get(p)
        if m is None or p in plan.get("block_attrs", {}) or type(m).__name__ in class_declared:
            continue
        lists = _dit_lists(p, m, scans)
        _warn_left_resident(p, m, lists)
        if lists:
            plan.setdefault("block_attrs", {})[p] = lists
            if p not in plan.setdefault("resident_dit_paths", []):
                plan["resident_dit_paths"].append(p)
    for p in comps.get(ENCODERS, []):
        m = by_path.get(p)
        if m is None:
            continue
        if _is_pretrained(m):
            plan.setdefault("encoder_component_types", {}).setdefault(p, "text_encoder")
        if p in plan.get("encoder_block_attrs", {}):
            continue
        lists = _encoder_lists(p, m, scans)
        _warn_left_resident(p, m, lists)
        if lists:
            plan.setdefault("encoder_block_attrs", {})[p] = lists
    if not plan.get("resident_dit_paths", True):
        del plan["resident_dit_paths"]
    if not plan:
        del desc["offload_plan"]
    scans.warn(by_path)


def _apply_blocks(
    plan: dict[str, Any], comps: dict[str, list[str]], py: Declared, by_path: Mapping[str, nn.Module]
) -> None:
    """``blocks=``: each path's block lists into the plan, by the component's kind."""
    for path, lists in py.blocks.items():
        if path in comps.get(DIT, []):
            plan.setdefault("block_attrs", {})[path] = list(lists)
            if path not in plan.setdefault("resident_dit_paths", []):
                plan["resident_dit_paths"].append(path)
        elif path in comps.get(ENCODERS, []):
            plan.setdefault("encoder_block_attrs", {})[path] = list(lists)
        else:
            raise _core.PipelineError(
                f"blocks= names '{path}', which is neither a DiT nor an encoder of the pipeline (DiTs: "
                f"{', '.join(comps.get(DIT, [])) or 'none'}; encoders: {', '.join(comps.get(ENCODERS, [])) or 'none'}"
                f"); pass dit=[\"{path}\"] or encoders=[\"{path}\"] too"
            )
        m = by_path.get(path)
        for a in lists:
            if m is not None and not _has_list(m, a):
                raise _core.PipelineError(
                    f"blocks[\"{path}\"] names '{a}', which is not a block list (nn.ModuleList) of {path} "
                    f"({type(m).__name__}); name the dotted path of a ModuleList of its blocks"
                )
