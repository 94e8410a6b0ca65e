"""Another offloader's hooks on a pipeline given to ``enable``. Two offloaders moving the same weights fight: each
moves or rebinds what the other placed, so the run fails halfway through a pipeline (a ``.to()`` the conversion
guard refuses, inputs sent to another device) or streams twice. ``enable`` refuses them before anything changes,
found by the host libraries' own markers: accelerate's hook attribute (``_hf_hook``: a pipeline's
``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload``, a ``device_map`` dispatch) and the group-offloading
hook in diffusers' hook registry (``enable_group_offload`` / ``apply_group_offloading``); the error names the call
that removes them. diffusers' other hooks (layerwise casting, caches) are not offloaders and stay."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _core

if TYPE_CHECKING:
    from ._describe import Modules

__all__ = ["refuse_other_offloaders"]


def _group_offloading_name() -> str | None:
    """The name diffusers registers its group-offloading hook under, when diffusers is there."""
    try:
        from diffusers.hooks import group_offloading
    except ImportError:
        return None
    name = getattr(group_offloading, "_GROUP_OFFLOADING", None)
    return name if isinstance(name, str) else None


def refuse_other_offloaders(modules: Modules) -> None:
    """Raises :class:`weightferry.PipelineError` naming the first module another offloader hooks (see the module
    doc), and how to take that offloader off."""
    group = _group_offloading_name()
    for path, module in modules.items():
        where = f"'{path}'" if path else "the pipeline"
        component = path.split(".")[0] or "<module>"
        if getattr(module, "_hf_hook", None) is not None:
            raise _core.PipelineError(
                f"{where} carries accelerate hooks that move its weights (a pipeline's enable_model_cpu_offload() or "
                "enable_sequential_cpu_offload(), or a model loaded with device_map=...): two offloaders would move "
                "the same weights; call pipe.remove_all_hooks() (or accelerate.hooks.remove_hook_from_module("
                f"{component}, recurse=True)), keep the weights on the CPU, then enable"
            )
        registry = getattr(module, "_diffusers_hook", None)
        get_hook = getattr(registry, "get_hook", None)
        if group is not None and callable(get_hook) and get_hook(group) is not None:
            raise _core.PipelineError(
                f"{where} has diffusers' group offloading applied (enable_group_offload() or apply_group_offloading()):"
                " two offloaders would move the same weights; load the model again without group offloading, then "
                "enable weightferry"
            )
