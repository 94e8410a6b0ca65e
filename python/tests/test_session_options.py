"""The native ``Session`` is built from a small options object: ``_core.SessionOptions`` (keyword arguments only,
defaults for each) with a ``_core.TorchCuda`` on CUDA; an unknown option is a ``TypeError``, and a bad option
value raises the error kind the options have always raised."""

import json

import pytest

import weightferry as wf
from weightferry import _core

PIPELINE = json.dumps({
    "class": "P",
    "modules": {"transformer": {"class": "D", "children": {"blocks": {"repeat": 2, "block": {
        "class": "B", "tensors": {"w": {"dtype": "bf16", "shape": [128]}}}}}}},
    "components": {"dit": ["transformer"]},
    "class_block_attrs": {"D": ["blocks"]},
})
LAYER = json.dumps({"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})


def test_a_session_without_options_runs_on_the_simulated_device():
    s = _core.Session(PIPELINE, LAYER)
    assert not s.is_cuda()
    assert json.loads(s.plan_json())["pipeline"] == "<python>"
    assert s.plan_json() == _core.plan(PIPELINE, LAYER)


def test_options_are_keywords_with_defaults():
    options = _core.SessionOptions(name="p", device="sim", config_format="json", torch=_core.TorchCuda(stream=0))
    s = _core.Session(PIPELINE, LAYER, options)
    assert json.loads(s.plan_json())["pipeline"] == "p"
    with pytest.raises(TypeError, match="unexpected keyword argument 'devcie'"):
        _core.SessionOptions(devcie="sim")
    with pytest.raises(TypeError):
        _core.SessionOptions("sim")
    with pytest.raises(TypeError):
        _core.TorchCuda(1)


def test_bad_option_values_raise_their_kinds():
    with pytest.raises(wf.DeviceError):
        _core.Session(PIPELINE, LAYER, _core.SessionOptions(device="tpu"))
    with pytest.raises(wf.CheckpointError, match=r"^component `t` is given two checkpoints; give each component one$"):
        _core.Session(PIPELINE, LAYER, _core.SessionOptions(checkpoints=[("/a", "t"), ("/b", "t")]))
    with pytest.raises(TypeError):
        _core.SessionOptions(checkpoints="/nowhere")
    with pytest.raises(wf.OffloadError, match="sim faults: unknown fault 'x'"):
        _core.Session(PIPELINE, LAYER, _core.SessionOptions(sim_faults='{"x": 1}'))
    with pytest.raises(wf.ConfigError, match="unknown config format 'yaml'"):
        _core.Session(PIPELINE, LAYER, _core.SessionOptions(config_format="yaml"))
