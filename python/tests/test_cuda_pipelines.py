"""Whole tiny diffusers pipelines on ``device="cuda"`` (skipped without a GPU; CI has none, the lent H200 runs them),
as the README's quick start uses them: ``enable(pipe, config)`` with no declaration and no ``device`` (torch's CUDA
device is the default), then ``pipe(...)``, bit-identical to a deep copy of the pipeline resident on the GPU; in
layer mode (transformers and text encoders streamed) and module mode (every
component swapped whole, the VAE's decode included), every weight given back bit-identical on the CPU after
disable. In layer mode the VAE, not selected, is put on the GPU by enable (the fixed placement): the caller moves
nothing. Flux, SD3, Wan 2.2 (two transformers), LTX-Video, Qwen-Image and HunyuanVideo. A saved FluxPipeline
through ``weightferry.from_pretrained`` (offloaded components bound from their files on the GPU) equals its
resident twin too."""

import copy
import warnings

import pytest
import test_pipelines
import torch
from test_diffusers import flux_pipeline, run_pipeline

import weightferry as wf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)
PIPELINES = {"flux": (flux_pipeline, run_pipeline), **test_pipelines.PIPELINES}
MODES = {
    "layer": {"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}},
    "module": test_pipelines.MODES["module"],
}
CASES = [(p, m) for p in PIPELINES for m in MODES]


def cpu_state(pipe):
    parts = test_pipelines.modules(pipe)
    return {path: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()} for path, m in parts.items()}


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_a_whole_pipeline_on_cuda_equals_its_resident_twin(name, mode):
    build, run = PIPELINES[name]
    pipe = build()
    before = cpu_state(pipe)
    twin = copy.deepcopy(pipe).to(CUDA)
    want = run(twin).cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found from the models' metadata: nothing to warn about
        handle = wf.enable(pipe, MODES[mode])
    with handle:
        assert handle.stats()["stacks"] or mode == "module"
        got = run(pipe).cpu()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert next(pipe.vae.parameters()).device == CUDA  # selected or not, the VAE ran on the GPU
    after = cpu_state(pipe)
    for path, state in before.items():
        assert list(after[path]) == list(state), path
        assert all(torch.equal(after[path][k], v) for k, v in state.items()), path


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_saved_pipeline_from_its_folder_on_cuda_equals_its_resident_twin(tmp_path, mode):
    # weightferry.from_pretrained: the offloaded components built on meta and bound from their files on the GPU,
    # the others loaded as usual; the predicted host masters are the ones held.
    saved = flux_pipeline()
    want = run_pipeline(copy.deepcopy(saved).to(CUDA)).cpu()
    saved.save_pretrained(tmp_path)
    pipe, handle = wf.from_pretrained(type(saved), tmp_path, MODES[mode])
    with handle:
        got = run_pipeline(pipe).cpu()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        stats = handle.stats()
        assert stats["plan_host"]["master_bytes"] == stats["master_host_bytes"]
        assert stats["plan_host"]["mapped_bytes"] == stats["mapped_host_bytes"]
