"""A ``.gguf`` file as a checkpoint (``enable(..., checkpoint="model.gguf")``) on ``device="sim"``: its quantized
tensors fill the module's ``GGUFParameter`` storages byte for byte (served from the file, or read from it by the disk
tier under a ``host_budget``), its F32 tensors are converted to the dtype the module holds them in (bf16, rounded as
torch rounds), and a tensor the module holds in another form (quantized in the file, dequantized in the module, as
diffusers does for the layers a model keeps in float32) comes from the module. A model loaded by diffusers' GGUF
quantizer, and the same model rebuilt on ``meta`` (every parameter of its own class), run bit-identical to the
loaded one; a ``meta`` tensor the file cannot fill is refused by name before anything changes."""

import os

import pytest
import torch
from quantized import gguf_model, weights
from test_host_memory import with_key

import weightferry as wf

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")

LAYER = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                      "layer_options": {"dit": {"prefetch_depth": 2}}, "host_masters": "pinned"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gguf_checkpoint"))


def loaded(folder, name, qtype):
    """The model diffusers loads from the file, its inputs, its output and the file's path."""
    model, x = gguf_model(name, qtype, folder)
    with torch.no_grad():
        want = model(**x, return_dict=False)[0]
    return model, x, want, os.path.join(folder, f"{name}-{qtype}.gguf")


def on_meta(model):
    """``model`` with every parameter replaced by a ``meta`` one of its own class and attributes (a module built
    without its weights, as a loader that binds them later does)."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    for module in model.modules():
        for n, p in list(module._parameters.items()):
            if p is not None:
                empty = torch.empty(p.shape, dtype=p.dtype, device="meta")
                module._parameters[n] = (GGUFParameter(empty, quant_type=p.quant_type) if isinstance(p, GGUFParameter)
                                         else torch.nn.Parameter(empty, requires_grad=False))
    return model


def stream_under_budget(model, x, want, path, budget):
    """Enables ``model`` from ``path`` under ``budget`` of host memory: two passes equal to ``want``, blocks read
    from the file, the held bytes within the budget and as predicted, no hazard."""
    with wf.enable({"transformer": model}, with_key(LAYER, host_budget=budget), device="sim", checkpoint=path) as h:
        for _ in range(2):
            assert torch.equal(forward(model, x), want)
        s = h.stats()
        assert s["disk_bytes"] > 0 and s["master_host_bytes"] + s["staging_host_bytes"] <= budget
        host = s["plan_host"]
        assert (s["master_host_bytes"], s["disk_bytes"]) == (host["master_bytes"], host["disk_bytes"])
        assert h._session.hazard_violations() == []


def forward(model, x):
    with torch.no_grad():
        return model(**x, return_dict=False)[0]


@pytest.mark.parametrize("name,qtype", [("flux", "Q8_0"), ("flux", "Q4_0"), ("wan", "Q8_0"), ("wan", "Q5_0")])
def test_a_model_diffusers_loaded_binds_to_its_gguf_file_bit_identical(folder, name, qtype):
    model, x, want, path = loaded(folder, name, qtype)
    before = weights(model)
    with wf.enable({"transformer": model}, LAYER, device="sim", checkpoint=path) as h:
        for _ in range(2):
            assert torch.equal(forward(model, x), want)
        assert h.stats()["master_host_bytes"] > 0
    assert weights(model) == before
    assert torch.equal(forward(model, x), want)


def test_a_model_built_on_meta_is_filled_from_the_gguf_file_and_its_disk_tier_reads_it(folder):
    model, x, want, path = loaded(folder, "flux", "Q8_0")
    on_meta(model)
    with wf.enable({"transformer": model}, LAYER, device="sim", checkpoint=path) as h:
        masters = h.stats()["master_host_bytes"]
        assert torch.equal(forward(model, x), want)
    # Under a host budget of 4/5 of the masters, the blocks beyond it are read from the GGUF file on every pass (their
    # quantized tensors; the F32 ones converted to bf16 keep masters).
    stream_under_budget(model, x, want, path, masters * 4 // 5)


def test_a_meta_tensor_the_gguf_file_holds_only_quantized_is_refused_by_name_before_anything_changes(folder):
    model, _, _, path = loaded(folder, "wan", "Q8_0")
    on_meta(model)
    before = {n: (type(p), p.device.type) for n, p in model.named_parameters()}
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": model}, LAYER, device="sim", checkpoint=path)
    # diffusers keeps Wan's time embedder in float32: dequantized in the module, quantized in the file.
    assert str(e.value).startswith(
        "tensor 'transformer.condition_embedder.time_embedder.linear_1.weight' is on the meta device, and the "
        "checkpoint holds it in another form")
    assert {n: (type(p), p.device.type) for n, p in model.named_parameters()} == before


def test_a_loaded_model_with_dequantized_layers_streams_from_its_gguf_file_under_a_host_budget(folder):
    # Wan: its time embedder dequantized by diffusers (the module's own bytes), the rest from the file, the blocks
    # beyond the budget read from it on every pass.
    model, x, want, path = loaded(folder, "wan", "Q8_0")
    before = weights(model)
    with wf.enable({"transformer": model}, LAYER, device="sim", checkpoint=path) as h:
        masters = h.stats()["master_host_bytes"]
    stream_under_budget(model, x, want, path, masters * 4 // 5)
    assert weights(model) == before
