"""The tiny whole pipelines of ``pipelines.py`` run end to end on the CPU and deterministically: a second run, and a
run of a deep copy, are bit-identical to the first (the property the offload tests compare against), and every
output is finite. Wan 2.2's run uses both of its transformers."""

import copy

import pipelines
import pytest
import torch

NAMES = ["sd3", "wan22", "ltx", "qwen_image", "hunyuan_video"]


@pytest.mark.parametrize("name", NAMES)
def test_a_tiny_pipeline_runs_deterministically_and_as_its_deep_copy(name):
    pipe = getattr(pipelines, f"{name}_pipeline")()
    run = getattr(pipelines, f"run_{name}")
    twin = copy.deepcopy(pipe)
    first = run(pipe)
    assert first.dtype == torch.bfloat16 and torch.isfinite(first).all()
    assert torch.equal(run(pipe), first)
    assert torch.equal(run(twin), first)


def test_wan22_runs_both_transformers():
    pipe = pipelines.wan22_pipeline()
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        def count(module, args, name=name):
            calls[name] += 1

        getattr(pipe, name).register_forward_pre_hook(count)
    pipelines.run_wan22(pipe)
    # One step each, the conditional and the unconditional (classifier-free guidance) pass.
    assert calls == {"transformer": 2, "transformer_2": 2}
