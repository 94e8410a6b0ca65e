"""Whole tiny diffusers pipelines (``pipelines.py``: SD3 with three text encoders, Wan 2.2 with two transformers,
LTX-Video, Qwen-Image with a Qwen2.5-VL text encoder, HunyuanVideo with a Llama text encoder and a token refiner)
offloaded on ``device="sim"`` with no declaration at all: ``enable(pipe, config)`` finds every transformer, text
encoder and VAE from the models' metadata, and ``pipe(...)`` runs end to end in layer mode (every block list
streamed) and in module mode (components swapped whole, the VAE's decode included), bit-identical to a deep copy of
the same pipeline not offloaded, with every weight given back bit-identical."""

import copy
import warnings

import pipelines
import pytest
import torch

import weightferry as wf

PIPELINES = {
    "sd3": (pipelines.sd3_pipeline, pipelines.run_sd3),
    "wan22": (pipelines.wan22_pipeline, pipelines.run_wan22),
    "ltx": (pipelines.ltx_pipeline, pipelines.run_ltx),
    "qwen_image": (pipelines.qwen_image_pipeline, pipelines.run_qwen_image),
    "hunyuan_video": (pipelines.hunyuan_video_pipeline, pipelines.run_hunyuan_video),
}
MODES = {
    "layer": {"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
                                           "layer_options": {"dit": {"prefetch_depth": 1},
                                                             "text_encoder": {"prefetch_depth": 1}}}},
    "module": {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}},
}
CASES = [(p, m) for p in PIPELINES for m in MODES]


def modules(pipe):
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_a_whole_pipeline_runs_offloaded_bit_identical_with_no_declaration(name, mode):
    build, run = PIPELINES[name]
    pipe = build()
    twin = copy.deepcopy(pipe)
    want = run(twin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every component is found from its metadata: nothing to warn about
        report = wf.plan(pipe, MODES[mode])
    kinds = {c["path"]: c["kind"] for c in report["components"]}
    comps = modules(pipe)
    # Every model of the pipeline is a component of the right kind, whatever its attribute name.
    assert set(kinds) == set(comps)
    for path, m in comps.items():
        want_kind = "vae" if hasattr(m, "decode") else "text_encoder" if path.startswith("text_encoder") else "dit"
        assert kinds[path] == want_kind, path
    with wf.enable(pipe, MODES[mode], device="sim") as h:
        hooked = h._session.hooked_modules()
        if mode == "layer":
            # Every transformer and text encoder streams blocks.
            streamed = {c["path"] for c in report["components"] if c["selected"] and c["stacks"]}
            assert streamed == {p for p, k in kinds.items() if k != "vae"}
        else:
            assert hooked == sorted(comps)
        assert torch.equal(run(pipe), want)
        assert h._session.hazard_violations() == []
    for path, m in comps.items():
        a, b = m.state_dict(), modules(twin)[path].state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b), path
