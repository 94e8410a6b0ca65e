""":class:`Handle`, what :func:`weightferry.enable` returns: an offloaded pipeline, disabled by its
:meth:`Handle.disable` (or by leaving its ``with`` block), retuned by :meth:`Handle.retune`, read by
:meth:`Handle.state_dict` and :meth:`Handle.stats`."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from . import _core
from ._added import AddedTensors
from ._binders import CudaBinder, SentinelProbe, repoison, stray_writes
from ._config import ConfigLike, config_arg
from ._edits import Signatures, check, drifted, editing
from ._guards import ConversionGuard
from ._hooks import Hooks, StreamCheck
from ._loads import LoadHooks
from ._lora import LoraGuard
from ._pickling import CopyGuard
from ._registry import mark
from ._state_dict import StateDictHooks
from ._walks import WalkGuard
from ._warnings import WeightferryWarning
from ._writes import Writer

if TYPE_CHECKING:
    import torch

    from ._binders import Binder
    from ._describe import Bound, Modules
    from ._storages import StorageMap, View

__all__ = ["Handle"]


class Handle:
    """An offloaded pipeline. :meth:`disable` gives every tensor ordinary CPU storage back (bit-identical);
    :meth:`stats` reports what the backend holds and did. A context manager: leaving the ``with`` block disables."""

    def __init__(
        self,
        session: _core.Session,
        storages: StorageMap,
        modules: Modules,
        bound: Bound,
        binder: Binder,
        stream: StreamCheck | None,
        config: dict[str, Any] | None,
        pipeline: object = None,
    ) -> None:
        """Made by ``enable`` (``pipeline``: what it was given), which then offloads (:meth:`_offload`) or not."""
        self._session = session
        self._storages = storages
        self._binder = binder
        self._stream = stream  # on CUDA only
        self._modules = modules
        # What each managed tensor held when weightferry bound it: an edit made outside editing() is found by it.
        self._sigs = Signatures(storages)
        self._hooks = Hooks(session, storages, binder, modules, stream, self._sigs)
        # While offloaded, the modules' own state_dict reads the true weights from the session.
        self._state_hooks = StateDictHooks(session, storages, bound, self._sigs, partial(self._check, thorough=True))
        # While offloaded, converting a module (.to(dtype), .cuda(), ...) is refused before anything changes.
        self._guard = ConversionGuard(modules, lambda: self._forwards > 0 or self._hooks.busy())
        self._forwards = 0  # component forwards under way (a cast of dtype on the device is taken inside one)
        # On CUDA, the placeholders read around each outermost component forward, without a wait (``_edits``).
        self._probe = SentinelProbe(binder.device) if isinstance(binder, CudaBinder) else None
        # While offloaded, copying or pickling a module (deepcopy, torch.save of the module) is refused.
        self._copies = CopyGuard(modules)
        # While offloaded, Module.apply (diffusers' fuse_lora / unfuse_lora), attention projection fusion and peft's
        # layer merges run on the true weights in editing() (_walks.WALKS).
        self._walks = WalkGuard(modules, self.editing, self._walk_as_is)
        # While offloaded, a diffusers pipeline's LoRA methods (load, fuse, unfuse, unload) run in editing().
        self._lora = LoraGuard(pipeline, modules, self.editing, self._walk_as_is)
        # Writes into the weights go through weightferry's copy: load_state_dict's, and edits inside editing().
        self._writer = Writer(session, storages, self._hooks.refreshed)
        self._load_hooks = LoadHooks(modules, storages, bound, self._writer, self._sigs)
        self._watch: list[Any] = []  # forward pre-hooks of the components: edits are checked before each forward
        self._config = config  # the config dict given to enable (or the last retune), for retune's keyword edits
        self._added: AddedTensors | None = None  # tensors the components gained after enable (adapter layers)
        self._warned_added = 0  # the added bytes the last warning counted (one warning per count)
        self._offloaded = False
        self._disabled = False

    def _walk_as_is(self) -> bool:
        """Whether a walk over the weights (``apply``, a LoRA load) runs as it is now: inside an editing block or a
        forward, where the weights are already what the walk needs."""
        return self._sigs.editing is not None or self._forwards > 0 or self._hooks.busy()

    def _offload(self) -> None:
        """Binds the fixed placement, installs the hooks and registers the tensors as offloaded (after the session
        enabled). ``enable``'s undo stack undoes each step."""
        self._offloaded = True
        self._hooks.install()
        self._state_hooks.install()
        self._guard.install()
        self._walks.install()
        self._lora.install()
        self._copies.install()
        self._load_hooks.install()
        self._install_watch()
        mark(self._storages.tensors(), True)
        self._added = AddedTensors([m for _, m, _ in self._components()], self._binder.device)
        self._added.watch()

    def _components(self) -> Iterator[tuple[str, torch.nn.Module, set[int]]]:
        """``(name, module, its storages)`` of every component: a top-level module with managed weights."""
        for comp, module in self._modules.items():
            if not comp or "." in comp:
                continue
            sids = {sid for sid, vs in self._storages.views.items() if vs[0].path.startswith(comp + ".")}
            if sids:
                yield comp, module, sids

    def _install_watch(self) -> None:
        """A forward pre-hook on every component (a top-level module with managed weights), first of its hooks:
        tensors of the component changed outside weightferry are refused before its forward binds anything; and a
        forward hook that makes a backward from its output raise (``_grad``). Between the two the component's forward
        is counted as under way (``ConversionGuard`` takes a cast of dtype on the device then), and a static
        schedule's tensors view their places (``_static``): compiled code sees them so on every call."""
        import torch

        from ._compiler import compiler_disabled
        from ._grad import inference_only

        for comp, module, sids in list(self._components()):

            def pre(module: Any, args: Any, sids: set[int] = sids) -> None:
                self._check(sids)
                self._forwards += 1
                if self._forwards == 1:
                    if self._probe is not None:
                        self._probe.queue()
                    if self._added is not None and self._added.maybe_grew:
                        self._added.maybe_grew = False
                        self._over_budget(fit=False)
                    self._hooks.bind_static()

            def post(module: Any, args: Any, output: Any, comp: str = comp) -> Any:
                self._forwards = max(0, self._forwards - 1)
                if not self._forwards:
                    self._guard.forward_ended()
                    self._hooks.idle_static()
                    if self._probe is not None and self._probe.written() and output is not None:
                        self._check(set(self._storages.views), devices=True)  # names the placeholders reached
                if output is None or not torch.is_grad_enabled():  # None: the forward raised
                    return None
                return inference_only(output, comp)

            hook = compiler_disabled(pre)
            self._watch.append(module.register_forward_pre_hook(hook, prepend=True))
            # A backward is refused at the component's output, before any of its parameters gets a gradient; and
            # the casts a forward made (diffusers' layerwise casting, see `_guards`) end with it, even when it raised.
            self._watch.append(module.register_forward_hook(compiler_disabled(post), always_call=True))

    def _unwatch_added(self) -> None:
        if self._added is not None:
            self._added.unwatch()

    def _remove_watch(self) -> None:
        while self._watch:
            self._watch.pop().remove()

    def _check(
        self, sids: set[int], when: str = "so it was put back", thorough: bool = False, devices: bool = False
    ) -> None:
        """Refuses tensors of ``sids`` changed outside weightferry (see ``_edits``), after putting them back; not
        while a forward is under way (its open block's tensors are bound, and another thread is refused anyway).
        ``thorough`` (not before a forward): the bytes of those kept on the device are compared too, and the
        devices' placeholders read; ``devices``: only the latter."""
        if self._hooks.busy():
            return
        check(self._sigs, sids, self._repair, when, self._drifted if thorough else None, thorough or devices)

    def _drifted(self, sids: set[int]) -> list[tuple[int, View]]:
        """Tensors of ``sids`` kept on the device whose bytes differ from weightferry's copy (``_edits.drifted``)."""
        return drifted(self._session, self._storages, sids)

    def _repair(self, sids: set[int]) -> None:
        """Rewrites every device copy of ``sids`` from weightferry's copy and binds their tensors again."""
        self._writer.rewrite(sids)
        self._hooks.rebind_idle(sids)

    @contextmanager
    def editing(self, *modules: torch.nn.Module) -> Iterator[None]:
        """A ``with`` block in which the weights of ``modules`` (default: every module of the pipeline) are ordinary
        CPU tensors holding their true values, so they can be edited as on the module not offloaded: peft's
        ``fuse_lora`` / ``unfuse_lora`` / ``merge_and_unload``, in-place edits under ``torch.no_grad()``, ``.data``
        replacements of the same shape. On leaving (also when the block raised), every changed tensor is written
        through to weightferry's copy and every device copy, and the tensors are offloaded again. It holds one host
        copy of the selected weights while it lasts; the pipeline cannot run inside it. A changed shape raises
        :class:`weightferry.OffloadError` naming the tensor (nothing of that write applied)."""
        if not self.enabled:
            raise _core.OffloadError("editing() needs an enabled handle; this one is disabled or offloads nothing")
        chosen = list(modules) or [m for p, m in self._modules.items() if p and "." not in p]
        paths = {id(m): p for p, m in self._modules.items()}
        unknown = [type(m).__name__ for m in chosen if id(m) not in paths]
        if unknown:
            raise _core.OffloadError(
                f"editing(): a {unknown[0]} that is not a module of this pipeline; pass the pipeline's own modules "
                "(e.g. pipe.transformer)"
            )
        prefixes = tuple(paths[id(m)] + "." if paths[id(m)] else "" for m in chosen)
        sids = {sid for sid, vs in self._storages.views.items() if any(v.path.startswith(prefixes) for v in vs)}
        self._check(sids, thorough=True)
        added = self._added_bytes()
        with editing(
            self._sigs, self._storages, self._session, self._writer, sids, chosen, self._hooks.rebind_idle,
            self._binder.device,
        ):
            yield
        if self._added_bytes() > added:
            self._over_budget(fit=True)
        if self._added is not None:
            self._added.maybe_grew = False  # counted just now

    def _added_bytes(self) -> int:
        return self._added.device_bytes() if self._added is not None else 0

    def _over_budget(self, fit: bool) -> None:
        """Tensors were added to the components (a LoRA load): when the plan under a device budget no longer fits
        beside them, retunes under the same config so it does (``fit``: after an editing block; more blocks
        stream), or warns naming the fix (no plan fits, or before a forward: call retune). Warns once per count."""
        plan = json.loads(self._session.plan_json())
        budget = (plan.get("budget") or {}).get("budget")
        added = self._added_bytes()
        if budget is None or plan["device_weight_bytes"] + added <= budget or added == self._warned_added:
            return
        if not fit:
            why = "call handle.retune() to plan the weights beside them (more blocks stream)"
        elif self._config is None:
            why = "this handle was enabled from a config file: call handle.retune(<the config>) to plan beside them"
        else:
            try:
                self.retune()
                return
            except _core.PlanError as e:
                why = f"no plan fits beside them ({e}); raise device_budget or remove adapters, then call retune()"
        self._warned_added = added
        warnings.warn(
            f"the {added} bytes of tensors added to the offloaded modules after enable (adapter layers) and the "
            f"plan's {plan['device_weight_bytes']} bytes exceed device_budget ({budget} bytes): {why}",
            WeightferryWarning,
            stacklevel=4,
        )

    def _unmark(self) -> None:
        mark(self._storages.tensors(), False)

    @property
    def enabled(self) -> bool:
        """Whether the pipeline is offloaded now (``False`` after :meth:`disable`, and when the plan streamed
        nothing)."""
        return self._offloaded and not self._disabled

    def disable(self) -> None:
        """Removes the hooks, disables the backend and rebinds every tensor to an ordinary CPU tensor rebuilt from
        the host model: bit-identical to before :func:`enable`, tensors that shared a storage sharing one again.
        Idempotent. If the backend cannot finish, raises :class:`weightferry.OffloadError` and can be called
        again."""
        if self._disabled:
            return
        if self._sigs.editing is not None:
            raise _core.OffloadError("disable() inside Handle.editing(): leave the editing block first")
        changed, reached = [], []
        if self._offloaded:
            changed = self._sigs.changed(set(self._storages.views))
            seen = {sid for sid, _ in changed}
            changed += [(sid, v) for sid, v in self._drifted(set(self._storages.views)) if sid not in seen]
            reached = self._sigs.placeholders(stray_writes(devices=True))
            if reached:
                repoison()
        self._remove_watch()
        self._unwatch_added()
        self._hooks.remove()
        self._session.disable()
        self._binder.clear()
        if self._offloaded:
            self._storages.rebuild(self._session, self._binder.set_data)
            self._unmark()
        # Kept until every tensor is ordinary again: a state_dict between a failed disable and its retry is right.
        self._state_hooks.remove()
        self._guard.remove()
        self._walks.remove()
        self._lora.remove()
        self._copies.remove()
        self._load_hooks.remove()
        self._disabled = True
        if changed or reached:
            paths = sorted({v.path for _, v in changed}) or reached
            raise _core.OffloadError(
                f"'{paths[0]}' changed while offloaded, outside Handle.editing() (an in-place edit, or .data "
                "replaced): disable gave back the weights weightferry held, without the change; make weight edits "
                "inside `with handle.editing():` (or disable, edit, and enable again)"
            )

    def stats(self) -> dict[str, Any]:
        """The backend's report as a dict: ``strategy``, ``enabled``, ``stacks`` (per stack: ``loads``,
        ``h2d_bytes``, ``prefetch_hits``, ``reuse_hits``, ``sync_fetches`` (blocks not prefetched in time: the
        forward waited for their copy), ``record_waits`` (hook calls that waited on the host for the copy actor to
        enqueue their block's load), ``device_bytes``, ...), ``fixed_device_bytes``, ``master_host_bytes``,
        ``mapped_host_bytes`` (blocks served straight from a checkpoint file, no master), ``disk_bytes`` (blocks the
        disk tier reads from their checkpoint file on every pass), ``staging_host_bytes`` (its staging buffers) and
        ``buffered_files`` (checkpoint files it reads through the page cache: their filesystem refused ``O_DIRECT``),
        ``pinned``; and the totals
        ``bytes_streamed`` (host-to-device bytes of every stack), ``device_bytes`` (fixed placement and every
        stack's slots), ``host_bytes`` (the masters and staging buffers), ``stalls`` (the stacks'
        ``sync_fetches``), ``hooks`` (the torch hooks' own latency: ``calls``, ``p50_us``, ``p99_us`` over the last
        4096 calls, ``max_us``, ``total_ms``), and ``plan_host``: the host memory the plan predicted before
        anything was allocated (``master_bytes``, ``mapped_bytes``, ``sharded_bytes``, ``pinned``, ``budget``: the
        ``host_budget`` enable checked it against); ``captured``: whether a forward was captured in a CUDA graph
        (``torch.cuda.graph``) since enable, and ``captured_bytes_per_replay``, the host-to-device bytes a replay of
        the last one copies (replays do not count in ``stacks``: the session's scheduler does not run in them);
        ``added_device_bytes``: tensors the offloaded modules gained after enable (adapter layers peft added) on their
        device, outside the plan (:meth:`retune` counts them against a byte-count ``device_budget``)."""
        report: dict[str, Any] = json.loads(self._session.report())
        stacks = report.get("stacks", [])
        report["bytes_streamed"] = sum(s.get("h2d_bytes", 0) for s in stacks)
        report["device_bytes"] = report.get("fixed_device_bytes", 0) + sum(s.get("device_bytes", 0) for s in stacks)
        report["host_bytes"] = report.get("master_host_bytes", 0) + report.get("staging_host_bytes", 0)
        report["stalls"] = sum(s.get("sync_fetches", 0) for s in stacks)
        report["hooks"] = self._hooks.clock.summary()
        report["plan_host"] = json.loads(self._session.plan_json())["host"]
        report["captured"] = self._hooks.captured
        report["captured_bytes_per_replay"] = self._hooks.captured_bytes
        report["added_device_bytes"] = self._added_bytes()
        return report

    def retune(
        self,
        config: ConfigLike | None = None,
        *,
        prefetch_depth: int | None = None,
        resident_layers: int | None = None,
        device_budget: int | str | None = None,
    ) -> dict[str, Any]:
        """Changes the DiT's prefetch depth, its resident layers and the device budget without rebuilding host
        masters or the fixed placement, and returns the new plan (the dict :func:`weightferry.plan` gives).

        ``config`` is a whole new config (dict or path, same vocabulary); without it the keywords edit the config
        dict given to :func:`enable` (``layer_options.dit.prefetch_depth``, ``layer_options.dit.resident_layers``,
        ``device_budget``; ``device_budget="auto"`` is planned from the device's free memory now). A config that
        would offload other components or blocks raises :class:`weightferry.OffloadError` and changes nothing
        (disable and enable instead); a bad config raises :class:`weightferry.ConfigError` /
        :class:`weightferry.PlanError`. Each streamed block is rebound to its new slot at its next forward.

        Tensors the offloaded modules gained after enable (adapter layers) stay where they are, outside the plan: a
        byte-count ``device_budget`` holds them beside the plan's weights (``stats()["added_device_bytes"]``); an
        ``editing()`` block that adds some (a pipeline's ``load_lora_weights``) retunes so by itself when the plan
        no longer fits beside them."""
        if not self.enabled:
            raise _core.OffloadError("retune needs an enabled handle; this one is disabled or offloads nothing")
        self._check(set(self._storages.views), thorough=True)
        config = self._edited(config, prefetch_depth, resident_layers, device_budget)
        text, fmt = config_arg(config)
        free = 0
        if self._stream is not None:
            import torch

            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self._binder.device)[0]
        try:
            plan = self._session.retune(text, fmt, free, self._added_bytes())
        except _core.Error:
            if not self._session.hooked_modules():
                self._hooks.broken = (
                    "a retune failed after the old block stacks were taken down, so this pipeline has no offload "
                    "hooks; call disable() (which restores every weight) and enable again"
                )
            raise
        self._hooks.forget_slots()  # the slots are new: every streamed block is bound again at its next forward
        self._binder.clear()
        self._hooks.restatic()  # a static block is bound at its new place now
        self._config = config if isinstance(config, dict) else None
        result: dict[str, Any] = json.loads(plan)
        return result

    def _edited(
        self,
        config: ConfigLike | None,
        prefetch_depth: int | None,
        resident_layers: int | None,
        device_budget: int | str | None,
    ) -> ConfigLike:
        """The config :meth:`retune` applies: ``config`` (default: enable's) with the keywords' edits."""
        edits = {"prefetch_depth": prefetch_depth, "resident_layers": resident_layers}
        if config is None:
            if self._config is None:
                raise _core.ConfigError(
                    "invalid config: <root>: retune(prefetch_depth=..., resident_layers=..., device_budget=...) "
                    "edits the config dict given to enable, but this handle was enabled from a file; pass the new "
                    "config to retune instead"
                )
            config = json.loads(json.dumps(self._config))
        if any(v is not None for v in edits.values()) or device_budget is not None:
            if not isinstance(config, dict):
                raise _core.ConfigError("invalid config: <root>: retune's keywords edit a config dict, not a path")
            edited: dict[str, Any] = json.loads(json.dumps(config))
            dcfg = edited.setdefault("diffusion_offload_config", {})
            for key, value in edits.items():
                if value is not None:
                    dcfg.setdefault("layer_options", {}).setdefault("dit", {})[key] = value
            if device_budget is not None:
                dcfg["device_budget"] = device_budget
            return edited
        return config

    def state_dict(self, component: str | None = None) -> dict[str, torch.Tensor]:
        """The pipeline's weights as ordinary CPU tensors read from weightferry's own copy (the host masters while
        offloaded): bit-identical to what :func:`enable` took, and the right values while enabled, when a streamed
        module's own tensors view recycled device slots. Parameters and persistent buffers, as torch's
        ``state_dict`` has them; names are ``describe()``'s (dotted from the pipeline), or relative to
        ``component`` (``handle.state_dict("transformer")`` has the keys of ``transformer.state_dict()``). Tensors
        that shared a storage share one here too."""
        if self.enabled:
            self._check(set(self._storages.views), thorough=True)
        return self._storages.state_dict(self._session, component)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.disable()
        return False
