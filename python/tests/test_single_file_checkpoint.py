"""An original model's single file as a checkpoint (``enable(..., checkpoint=...)`` on ``device="sim"``): the file
names the model's tensors otherwise (Wan's and Black Forest Labs' own names, Flux's fused ``qkv``), and weightferry
works out each model tensor as rows of the file's tensors by running diffusers' own single-file conversion over
the file's header. A Wan GGUF in the original names, loaded by diffusers' ``from_single_file``, binds to its file and
runs bit-identical, also with the disk tier reading it; the views of a Flux file in Black Forest Labs' names are
exactly the rows diffusers' conversion takes (``to_q`` / ``to_k`` / ``to_v`` thirds of ``qkv``, the final
modulation as scale then shift); a conversion that computes values instead of selecting rows leaves those tensors
to the module."""

import os

import diffusers
import pytest
import torch
from quantized import BF16, gguf_file, wan, weights
from safetensors.torch import save_file
from test_gguf_checkpoint import LAYER, forward, stream_under_budget

import weightferry as wf
from weightferry._single_file import checkpoint_views

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")

# diffusers' names of a Wan transformer's tensors -> the original release's (what city96's GGUF files use).
_WAN_WHOLE = {"scale_shift_table": "head.modulation", "proj_out.weight": "head.head.weight",
              "proj_out.bias": "head.head.bias"}
_WAN_PARTS = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    (".to_out.0.", ".o."), (".norm2.", ".norm3."), (".scale_shift_table", ".modulation"),
    (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
]


def wan_original_name(key):
    if key in _WAN_WHOLE:
        return _WAN_WHOLE[key]
    for ours, theirs in _WAN_PARTS:
        key = key.replace(ours, theirs)
    return key


class _Renamed(torch.nn.Module):
    """A module whose state dict is another's under the original names (for writing the file)."""

    def __init__(self, model):
        super().__init__()
        self.sd = {wan_original_name(k): v for k, v in model.state_dict().items()}

    def state_dict(self, *args, **kwargs):
        return dict(self.sd)


@pytest.fixture(scope="module")
def wan_original(tmp_path_factory):
    """``(loaded model, inputs, output, file)``: a tiny Wan written as GGUF Q8_0 in the original names and loaded by
    diffusers' ``from_single_file`` (which converts the names)."""
    folder = str(tmp_path_factory.mktemp("single_file"))
    model, x, _ = wan()
    model = model.to(BF16)
    # The fixture's own check: diffusers' conversion maps the original names back to the model's exactly.
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    renamed = _Renamed(model)
    assert set(convert_wan_transformer_to_diffusers(dict(renamed.sd))) == set(model.state_dict())
    assert not set(renamed.sd) & set(model.state_dict()) - {"patch_embedding.weight", "patch_embedding.bias"}
    model.save_config(os.path.join(folder, "wan"))
    path = os.path.join(folder, "wan-original-Q8_0.gguf")
    gguf_file(renamed, path, "Q8_0")
    loaded = diffusers.WanTransformer3DModel.from_single_file(
        path, config=os.path.join(folder, "wan"), torch_dtype=BF16,
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=BF16),
    )
    x = {k: v.to(BF16) if v.is_floating_point() else v for k, v in x.items()}
    return loaded, x, forward(loaded, x), path


def test_a_wan_gguf_in_the_original_names_binds_to_the_model_diffusers_converted_bit_identical(wan_original):
    model, x, want, path = wan_original
    before = weights(model)
    with wf.enable({"transformer": model}, LAYER, device="sim", checkpoint=path) as h:
        for _ in range(2):
            assert torch.equal(forward(model, x), want)
        masters = h.stats()["master_host_bytes"]
        assert h._session.hazard_violations() == []
    assert weights(model) == before
    # Under a host budget the blocks beyond it are read from the original file on every pass.
    stream_under_budget(model, x, want, path, masters * 4 // 5)
    assert weights(model) == before
    assert torch.equal(forward(model, x), want)


def test_the_views_of_a_wan_file_in_the_original_names_are_renamed_whole_tensors(wan_original):
    model, _, _, path = wan_original
    keys = ["blocks.1.attn1.to_q.weight", "blocks.3.norm2.bias", "proj_out.weight", "patch_embedding.weight"]
    views = checkpoint_views(model, path, keys)
    # patch_embedding is in the file under its own name: no view.
    assert views == {
        "blocks.1.attn1.to_q.weight": [("blocks.1.self_attn.q.weight", 0, 32)],
        "blocks.3.norm2.bias": [("blocks.3.norm3.bias", 0, 32)],
        "proj_out.weight": [("head.head.weight", 0, 16)],
    }


# Rows of FLUX.1-dev's tensors as Black Forest Labs' file holds them (one double and one single block): the shapes
# diffusers' conversion splits by (it fixes the inner width at 3072); one column each keeps the file small.
_H, _MLP = 3072, 12288


def _bfl_flux_header():
    rows = {"img_in": _H, "txt_in": _H, "time_in.in_layer": _H, "time_in.out_layer": _H,
            "vector_in.in_layer": _H, "vector_in.out_layer": _H, "guidance_in.in_layer": _H,
            "guidance_in.out_layer": _H, "final_layer.linear": 64, "final_layer.adaLN_modulation.1": 2 * _H,
            "double_blocks.0.img_mod.lin": 6 * _H, "double_blocks.0.txt_mod.lin": 6 * _H,
            "double_blocks.0.img_attn.qkv": 3 * _H, "double_blocks.0.txt_attn.qkv": 3 * _H,
            "double_blocks.0.img_attn.proj": _H, "double_blocks.0.txt_attn.proj": _H,
            "double_blocks.0.img_mlp.0": _MLP, "double_blocks.0.img_mlp.2": _H,
            "double_blocks.0.txt_mlp.0": _MLP, "double_blocks.0.txt_mlp.2": _H,
            "single_blocks.0.modulation.lin": 3 * _H, "single_blocks.0.linear1": 3 * _H + _MLP,
            "single_blocks.0.linear2": _H}
    tensors = {}
    for name, n in rows.items():
        tensors[f"{name}.weight"] = torch.zeros(n, 1)
        tensors[f"{name}.bias"] = torch.zeros(n)
    for norm in ("double_blocks.0.img_attn.norm", "double_blocks.0.txt_attn.norm", "single_blocks.0.norm"):
        tensors[f"{norm}.query_norm.scale"] = torch.zeros(128)
        tensors[f"{norm}.key_norm.scale"] = torch.zeros(128)
    return tensors


def test_the_views_of_a_flux_file_in_black_forest_labs_names_are_the_rows_diffusers_conversion_takes(tmp_path):
    path = str(tmp_path / "flux1-bfl.safetensors")
    save_file(_bfl_flux_header(), path)
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(num_layers=1, num_single_layers=1)
    keys = ["transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_k.weight",
            "transformer_blocks.0.attn.add_v_proj.bias", "single_transformer_blocks.0.proj_mlp.weight",
            "single_transformer_blocks.0.attn.to_v.bias", "norm_out.linear.weight", "x_embedder.weight",
            "transformer_blocks.0.attn.norm_added_k.weight"]
    assert checkpoint_views(model, path, keys) == {
        "transformer_blocks.0.attn.to_q.weight": [("double_blocks.0.img_attn.qkv.weight", 0, _H)],
        "transformer_blocks.0.attn.to_k.weight": [("double_blocks.0.img_attn.qkv.weight", _H, 2 * _H)],
        "transformer_blocks.0.attn.add_v_proj.bias": [("double_blocks.0.txt_attn.qkv.bias", 2 * _H, 3 * _H)],
        "single_transformer_blocks.0.proj_mlp.weight": [("single_blocks.0.linear1.weight", 3 * _H, 3 * _H + _MLP)],
        "single_transformer_blocks.0.attn.to_v.bias": [("single_blocks.0.linear1.bias", 2 * _H, 3 * _H)],
        # diffusers stores the final modulation as (scale, shift), the original as (shift, scale): two pieces.
        "norm_out.linear.weight": [("final_layer.adaLN_modulation.1.weight", _H, 2 * _H),
                                   ("final_layer.adaLN_modulation.1.weight", 0, _H)],
        "x_embedder.weight": [("img_in.weight", 0, _H)],
        "transformer_blocks.0.attn.norm_added_k.weight": [("double_blocks.0.txt_attn.norm.key_norm.scale", 0, 128)],
    }


def test_a_conversion_that_computes_values_leaves_them_to_the_module_and_selections_stay_views(tmp_path, monkeypatch):
    from diffusers.loaders import single_file_model

    path = str(tmp_path / "computed.safetensors")
    save_file({"w": torch.zeros(6, 4), "b": torch.zeros(6)}, path)

    def convert(checkpoint, **kwargs):
        w, b = checkpoint["w"], checkpoint["b"]
        return {"scaled": w * 2, "shifted": w + 1, "flipped": w.flip(0), "transposed": w.t(), "summed": w[:2] + w[2:4],
                "odd": w[1::2], "bias": torch.cat([b[3:], b[:3]]), "reshaped": w.reshape(12, 2)}

    class Original(torch.nn.Module):
        pass

    monkeypatch.setitem(single_file_model.SINGLE_FILE_LOADABLE_CLASSES, "Original",
                        {"checkpoint_mapping_fn": convert})
    keys = ["scaled", "shifted", "flipped", "transposed", "summed", "odd", "bias", "reshaped", "absent", "w"]
    assert checkpoint_views(Original(), path, keys) == {
        "scaled": None, "shifted": None, "transposed": None, "summed": None, "reshaped": None,
        "flipped": [("w", r, r + 1) for r in range(5, -1, -1)],
        "odd": [("w", 1, 2), ("w", 3, 4), ("w", 5, 6)],
        "bias": [("b", 3, 6), ("b", 0, 3)],
    }
    # A class diffusers cannot convert, or a conversion that fails on the file's names, gives no views.
    assert checkpoint_views(torch.nn.Linear(2, 2), path, ["weight"]) == {}
    monkeypatch.setitem(single_file_model.SINGLE_FILE_LOADABLE_CLASSES, "Original",
                        {"checkpoint_mapping_fn": lambda checkpoint, **kw: checkpoint.pop("missing")})
    assert checkpoint_views(Original(), path, ["scaled"]) == {}
