"""A model another offloader hooks (accelerate's CPU offload hooks, diffusers' group offloading) is refused by
``enable`` before anything changes, with the call that takes that offloader off; taken off, it enables and runs
exactly (``_offloaders``)."""

import copy

import pytest
import torch
from quantized import weights
from test_diffusers import flux, forward, layer

import weightferry as wf


def test_accelerate_offload_hooks_are_refused_and_taken_off_the_model_enables_exactly():
    from accelerate import cpu_offload_with_hook
    from accelerate.hooks import remove_hook_from_module

    m, x, _ = flux()
    want = forward(m, x)
    before = weights(m)
    cpu_offload_with_hook(m, execution_device="cpu")  # what a pipeline's enable_model_cpu_offload() puts on it
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": m}, layer(1), device="sim")
    assert str(e.value) == (
        "'transformer' carries accelerate hooks that move its weights (a pipeline's enable_model_cpu_offload() or "
        "enable_sequential_cpu_offload(), or a model loaded with device_map=...): two offloaders would move the same "
        "weights; call pipe.remove_all_hooks() (or accelerate.hooks.remove_hook_from_module(transformer, "
        "recurse=True)), keep the weights on the CPU, then enable"
    )
    assert weights(m) == before
    remove_hook_from_module(m, recurse=True)
    with wf.enable({"transformer": m}, layer(1), device="sim"):
        assert torch.equal(forward(m, x), want)
    assert weights(m) == before


def test_diffusers_group_offloading_is_refused_and_its_other_hooks_are_not():
    from diffusers.hooks import apply_group_offloading

    m, x, _ = flux()
    before = weights(m)
    apply_group_offloading(m, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": m}, layer(1), device="sim")
    assert str(e.value).startswith("'transformer' has diffusers' group offloading applied (enable_group_offload() or")
    assert str(e.value).endswith("load the model again without group offloading, then enable weightferry")
    assert weights(m) == before
    # A diffusers hook that does not offload (a first-block cache, in diffusers' same hook registry) stays.
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    m, x, _ = flux()
    twin = copy.deepcopy(m)
    for mod in (m, twin):
        apply_first_block_cache(mod, FirstBlockCacheConfig(threshold=0.0))
    with wf.enable({"transformer": m}, layer(1), device="sim"), m.cache_context("cond"), twin.cache_context("cond"):
        assert torch.equal(forward(m, x), forward(twin, x))
