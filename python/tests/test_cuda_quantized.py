"""Quantized models offloaded on ``device="cuda"`` (skipped without a GPU; CI has none, the lent H200 runs them):
tiny diffusers Flux transformers from a GGUF file (diffusers' GGUF quantizer), quantized by torchao (int8 and
float8 weight-only; int4 weight-only and float8 dynamic, which torchao quantizes only on the GPU) and by
bitsandbytes (NF4, with and without nested scales), offloaded layerwise and under a budget, equal the same quantized
model resident on the GPU bit for bit; a torchao weight (a wrapper subclass streamed by its parts) and a 4-bit
weight's quant_state tensors report the GPU while its block runs, and every weight is back on the CPU,
bit-identical, after disable."""

import pytest
import torch
from quantized import bnb_model, gguf_model, parts, state_tensors, torchao_gpu_model, torchao_model, weights
from test_diffusers import layer
from test_quantized import budget

import weightferry as wf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)
MODELS = [("gguf", "Q8_0"), ("torchao", "Int8WeightOnlyConfig"), ("torchao", "Float8WeightOnlyConfig"),
          ("bnb", "nf4"), ("bnb", "nested"), ("torchao-gpu", "Int4WeightOnlyConfig"),
          ("torchao-gpu", "Float8DynamicActivationFloat8WeightConfig")]


def build(kind, variant, folder):
    if kind == "bnb":  # quantized by bitsandbytes on the CPU, its kernels run on the GPU
        return bnb_model("flux", nested=variant == "nested")
    if kind == "torchao-gpu":  # formats torchao quantizes only on the GPU (int4, float8 dynamic)
        return torchao_gpu_model("flux", variant)
    return gguf_model("flux", variant, folder) if kind == "gguf" else torchao_model("flux", variant)


def devices(w):
    """The device types of a weight, of each of its parts and of the tensors its state holds (a quant_state's)."""
    return [w.device.type] + [p.device.type for _, p in parts(w) + state_tensors(w)]


def on(x, dev):
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in x.items()}


@pytest.mark.parametrize("depth", [2, 0], ids=["depth2", "budget"])
@pytest.mark.parametrize("kind,variant", MODELS, ids=[v for _, v in MODELS])
def test_a_quantized_flux_offloaded_on_cuda_equals_it_resident(tmp_path, kind, variant, depth):
    twin, x = build(kind, variant, str(tmp_path))
    model, _ = build(kind, variant, str(tmp_path))
    with torch.no_grad():
        expected = twin.to(CUDA)(**on(x, CUDA))[0].cpu()
    before = weights(model)
    cfg = layer(depth) if depth else budget(model)
    block = model.transformer_blocks[1].attn.to_q
    seen = []
    block.register_forward_pre_hook(lambda m, a: seen.append(devices(m.weight)))
    h = wf.enable({"transformer": model}, cfg, device="cuda")
    with torch.no_grad():
        got = model(**on(x, CUDA))[0].cpu()
        assert torch.equal(got, expected)
        assert torch.equal(model(**on(x, CUDA))[0].cpu(), expected)
    assert seen and all(d == "cuda" for devices in seen for d in devices), seen
    h.disable()
    assert weights(model) == before
