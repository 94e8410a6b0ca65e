"""Quantized models offloaded on ``device="sim"`` (CI): tiny diffusers Flux and Wan transformers loaded from GGUF
files through diffusers' GGUF quantizer (``GGUFParameter``: a tensor subclass over its own quantized bytes, with its
``quant_type`` as a Python attribute). Outputs bit-identical to the same quantized model resident, the bytes
streamed per pass equal to the stored (quantized) bytes of the streamed blocks, every parameter (class, attributes
and bytes) bit-identical after disable and after a failure at every allocation and copy of enable; tensor subclasses
weightferry cannot stream are refused naming the tensor before anything changes."""

import math

import pytest
import torch
from quantized import gguf_model, gguf_parameters, weights
from test_diffusers import layer

import weightferry as wf
from weightferry._enable import Seams

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gguf"))


def block_bytes(model, align=1):
    """Stored bytes of every tensor in the model's block lists, each rounded up to ``align`` (a fully streamed pass
    copies them at the device's 256-byte alignment)."""
    return sum(-(-t.untyped_storage().nbytes() // align) * align for attr in BLOCK_LISTS if hasattr(model, attr)
               for t in getattr(model, attr).state_dict().values())


def budget(model):
    """A device budget of the smallest ring plus half the streamed blocks, so the planner keeps some resident."""
    pipeline = {"transformer": model}
    smallest = wf.plan(pipeline, layer(1))
    (stack,) = smallest["components"][0]["stacks"]
    total = smallest["device_weight_bytes"] + stack["bytes"] // 2
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": total}}


CASES = [("flux", "Q8_0"), ("flux", "Q4_0"), ("wan", "Q8_0"), ("wan", "Q5_0")]


@pytest.mark.parametrize("depth", [1, 2, 0], ids=["depth1", "depth2", "budget"])
@pytest.mark.parametrize("name,qtype", CASES, ids=[f"{n}-{q}" for n, q in CASES])
def test_a_gguf_model_streams_its_quantized_bytes_bit_identical_to_resident(folder, name, qtype, depth):
    model, x = gguf_model(name, qtype, folder)
    twin, _ = gguf_model(name, qtype, folder)
    assert len(gguf_parameters(model)) > 4
    before = weights(model)
    with torch.no_grad():
        expected = twin(**x)[0]
    cfg = layer(depth) if depth else budget(model)
    h = wf.enable({"transformer": model}, cfg, device="sim")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
        streamed = h.stats()["bytes_streamed"]
        assert torch.equal(model(**x)[0], expected)
    per_pass = h.stats()["bytes_streamed"] - streamed
    if depth:
        # Every block streams once a pass: exactly the stored bytes (each storage at the device alignment), GGUF
        # weights as their quantized bytes.
        assert per_pass == block_bytes(twin, align=256)
        # What the same blocks hold in bf16 (a GGUF weight's values: its quant_shape).
        bf16 = sum(2 * math.prod(getattr(t, "quant_shape", t.shape)) for attr in BLOCK_LISTS
                   if hasattr(twin, attr) for t in getattr(twin, attr).parameters())
        assert block_bytes(twin) < (0.6 if qtype == "Q8_0" else 0.45) * bf16, (block_bytes(twin), bf16)
    else:
        # Some blocks stay resident (and the streamed ones may stay in their slots between passes).
        assert h.stats()["stacks"][0]["resident"] > 0
        assert per_pass < block_bytes(twin, align=256)
    h.disable()
    assert weights(model) == before
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


@pytest.mark.parametrize("fault", ["oom_at_alloc", "fail_host_alloc", "fail_h2d_copy"])
def test_a_failure_at_every_allocation_and_copy_of_enable_leaves_a_gguf_model_as_it_was(folder, fault):
    model, x = gguf_model("flux", "Q8_0", folder)
    before = weights(model)
    with torch.no_grad():
        expected = model(**x)[0]
    n = 0
    while True:
        try:
            h = wf.enable({"transformer": model}, layer(2), device="sim", _seams=Seams(sim_faults={fault: n}))
        except wf.OffloadError:
            assert weights(model) == before, f"{fault} at call {n}"
            n += 1
            continue
        try:
            h.disable()
        except wf.OffloadError:
            h.disable()
        break
    assert n > 0 and weights(model) == before
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


class Scaled(torch.Tensor):
    """A tensor subclass over its own bytes whose scale is a tensor in its Python state (as bitsandbytes keeps a
    4-bit weight's ``quant_state``)."""


class Shell(torch.Tensor):
    """A wrapper tensor subclass (no storage of its own) that does not name its parts."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def test_tensor_subclasses_weightferry_cannot_stream_are_refused_before_anything_changes(folder):
    model, _ = gguf_model("flux", "Q8_0", folder)
    before = weights(model)
    lin = model.transformer_blocks[0].attn.to_q
    weight = lin.weight
    scaled = torch.zeros(32, 32, dtype=torch.bfloat16).as_subclass(Scaled)
    scaled.scale = torch.ones(32)
    lin._parameters["weight"] = scaled
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": model}, layer(2), device="sim")
    assert str(e.value) == (
        "tensor 'transformer.transformer_blocks.0.attn.to_q.weight' is a test_quantized.Scaled whose attribute "
        "'scale' holds a tensor (Tensor, (32,)) that weightferry would leave on the host while the data moved; "
        "weightferry streams tensor subclasses whose parts it can name: leave its module out of the offloaded "
        "components"
    )
    lin._parameters["weight"] = Shell(torch.zeros(32, 32))
    with pytest.raises(wf.PipelineError) as e:
        wf.plan({"transformer": model}, layer(2))
    assert str(e.value) == (
        "tensor 'transformer.transformer_blocks.0.attn.to_q.weight' is a test_quantized.Shell, a torch.Tensor "
        "subclass without storage of its own that does not describe its parts (__tensor_flatten__); weightferry "
        "cannot stream it: leave its module out of the offloaded components"
    )
    lin._parameters["weight"] = weight
    assert weights(model) == before
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())


def test_a_gguf_model_s_state_dict_while_offloaded_is_the_resident_one(folder):
    model, x = gguf_model("flux", "Q8_0", folder)
    twin, _ = gguf_model("flux", "Q8_0", folder)
    expected = state_of(twin.state_dict())
    with wf.enable({"transformer": model}, layer(2), device="sim") as h:
        with torch.no_grad():
            model(**x)
        assert state_of(model.state_dict()) == expected
        assert state_of({f"transformer.{k}": v for k, v in model.state_dict().items()}) == state_of(h.state_dict())


def state_of(sd):
    """Each entry's class, quant_type and bytes."""
    out = {}
    for k, t in sd.items():
        with torch._C.DisableTorchFunctionSubclass():
            data = t.detach().contiguous().view(torch.uint8).flatten().numpy().tobytes()
        out[k] = (type(t).__name__, getattr(t, "quant_type", None), t.dtype, tuple(t.shape), data)
    return out
