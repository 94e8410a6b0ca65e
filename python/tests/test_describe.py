"""``weightferry.describe``: the torch module tree as a pipeline description (tensors, kinds, storage identity,
declarations), checked field by field and through the Rust loader."""

import json

import pytest
import torch
import torch.nn as nn
from tiny import BF16, TinyDiT, TinyPipeline, TinyVAE, UndeclaredPipeline

import weightferry as wf


def test_tensors_kinds_strides_and_order():
    desc = wf.describe({"transformer": TinyDiT(2)})
    assert desc["format"] == "weightferry-pipeline/1"
    assert desc["class"] == "dict"
    dit = desc["modules"]["transformer"]
    assert dit["class"] == "TinyDiT"
    # Registration order is execution order.
    assert list(dit["children"]) == ["x_embedder", "blocks", "proj_out"]
    assert dit["tensors"] == {
        "rope": {"dtype": "f32", "shape": [64, 8], "strides": [8, 1], "kind": "non_persistent_buffer",
                 "storage_offset": 0},
    }
    blocks = dit["children"]["blocks"]
    assert blocks["class"] == "ModuleList"
    assert list(blocks["children"]) == ["0", "1"]
    assert blocks["children"]["1"]["children"]["norm"]["tensors"]["bias"] == {
        "dtype": "bf16", "shape": [64], "strides": [1], "kind": "parameter", "storage_offset": 0,
    }
    assert desc["class_block_attrs"] == {"TinyDiT": ["blocks"]}
    # Its class declares block lists: discovery takes it for a DiT, and says so as a declaration.
    assert desc["components"] == {"dit": ["transformer"]} and "storages" not in desc


def test_persistent_buffers_and_transposed_strides():
    m = nn.Module()
    m.register_buffer("steps", torch.arange(6, dtype=torch.int64))
    m.w = nn.Parameter(torch.zeros(4, 8, dtype=torch.float16).t())
    t = wf.describe({"m": m})["modules"]["m"]["tensors"]
    assert t["steps"] == {"dtype": "i64", "shape": [6], "strides": [1], "kind": "persistent_buffer",
                          "storage_offset": 0}
    assert t["w"] == {"dtype": "f16", "shape": [8, 4], "strides": [1, 8], "kind": "parameter", "storage_offset": 0}


def test_every_supported_dtype_maps_and_others_are_refused():
    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "f8e4m3",
             torch.float8_e5m2: "f8e5m2", torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8"}
    m = nn.Module()
    for i, dt in enumerate(names):
        m.register_buffer(f"b{i}", torch.zeros(2, dtype=dt))
    t = wf.describe({"m": m})["modules"]["m"]["tensors"]
    assert [v["dtype"] for v in t.values()] == list(names.values())

    bad = TinyDiT(2)
    bad.proj_out.weight = nn.Parameter(torch.zeros(16, 64, dtype=torch.float64))
    with pytest.raises(wf.PipelineError) as e:
        wf.describe({"transformer": bad})
    assert str(e.value) == (
        "tensor 'transformer.proj_out.weight' has dtype torch.float64, which weightferry does not support; use one "
        "of float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int64, int32, int8, uint8 (e.g. cast the module "
        "with .to(torch.bfloat16))"
    )
    assert isinstance(e.value, wf.Error)


def test_tied_weights_are_one_storage():
    desc = wf.describe(TinyPipeline())
    enc = desc["modules"]["text_encoder"]["children"]
    embed = enc["embed"]["tensors"]["weight"]
    head = enc["head"]["tensors"]["weight"]
    assert embed["storage"] == head["storage"]
    assert desc["storages"] == {embed["storage"]: {"dtype": "bf16", "numel": 128 * 64}}


def test_views_of_one_flat_buffer_share_its_storage():
    flat = torch.zeros(432 + 216, dtype=BF16)
    vae = TinyVAE()
    vae.enc.weight = nn.Parameter(flat[:216].view(8, 3, 3, 3))
    vae.dec.weight = nn.Parameter(flat[216:432].view(3, 8, 3, 3))
    desc = wf.describe({"vae": vae})
    enc = desc["modules"]["vae"]["children"]["enc"]["tensors"]["weight"]
    dec = desc["modules"]["vae"]["children"]["dec"]["tensors"]["weight"]
    assert (enc["storage_offset"], dec["storage_offset"]) == (0, 216)
    assert enc["storage"] == dec["storage"]
    # The whole flat storage (648 elements, also the unused tail) is one storage, counted once.
    assert desc["storages"] == {enc["storage"]: {"dtype": "bf16", "numel": 648}}


def test_declarations_are_read_from_the_pipeline():
    desc = wf.describe(TinyPipeline())
    assert desc["components"] == {"dit": ["transformer"], "encoders": ["text_encoder"], "vaes": ["vae"]}
    assert desc["offload_plan"] == {"encoder_block_attrs": {"text_encoder": ["layers"]},
                                    "on_demand_component_paths": ["vae"]}
    assert desc["modules"]["vae"]["has_lifecycle"] is True
    assert "has_lifecycle" not in desc["modules"]["transformer"]
    # scheduler (an object) and tokenizer (None) are not modules.
    assert list(desc["modules"]) == ["transformer", "text_encoder", "vae"]
    # Undeclared: the DiT by its class's block lists, the rest (no metadata) by name, each with its own warning.
    with pytest.warns(wf.WeightferryWarning) as record:
        undeclared = wf.describe(UndeclaredPipeline())
    assert undeclared["components"] == {"dit": ["transformer"], "encoders": ["text_encoder"], "vaes": ["vae"]}
    assert [str(w.message) for w in record] == [
        "'text_encoder' (TinyTextEncoder): its class says neither what it is (a transformers model, a VAE with encode "
        "and decode) nor which blocks it repeats (_repeated_blocks, _no_split_modules); taken for a text encoder by "
        "its name; its block lists by their conventional names: layers. Pass encoders=[\"text_encoder\"] and "
        "blocks={\"text_encoder\": [\"layers\"]} to enable to say so, or declare _repeated_blocks on TinyTextEncoder",
        "'vae' (TinyVAE): its class says neither what it is (a transformers model, a VAE with encode and decode) nor "
        "which blocks it repeats (_repeated_blocks, _no_split_modules); taken for a VAE by its name. Pass "
        "vaes=[\"vae\"] to enable to say so",
    ]


def test_a_malformed_declaration_is_a_pipeline_error():
    p = UndeclaredPipeline()
    p._dit_modules = "transformer"
    with pytest.raises(wf.PipelineError) as e:
        wf.describe(p)
    assert str(e.value) == (
        "UndeclaredPipeline._dit_modules must be a list of dotted module paths (str), got 'transformer'"
    )


def test_the_description_is_valid_for_the_rust_loader():
    text = json.dumps(wf.describe(TinyPipeline()))
    assert wf._core.check_pipeline(text) is None
    with pytest.raises(wf.PipelineError) as e:
        wf._core.check_pipeline(json.dumps({"modules": {}}), "p.json")
    assert str(e.value) == (
        'pipeline p.json: class: required key is missing; give the pipeline class, e.g. "class": "FluxPipeline"'
    )


def test_a_dict_entry_that_is_not_a_module_is_refused():
    with pytest.raises(wf.PipelineError) as e:
        wf.describe({"transformer": TinyDiT(2), "scheduler": object()})
    assert str(e.value) == "pipeline dict entry 'scheduler' (object) is not a torch.nn.Module; pass only modules"


def test_a_diffusers_like_components_property_gives_the_components_in_order():
    class DiffusersLike:
        _dit_modules = ["transformer"]

        def __init__(self):
            self._parts = {"vae": TinyVAE(), "scheduler": object(), "transformer": TinyDiT(2), "tokenizer": None}

        @property
        def components(self):
            return dict(self._parts)

    desc = wf.describe(DiffusersLike())
    assert desc["class"] == "DiffusersLike"
    assert list(desc["modules"]) == ["vae", "transformer"]
    assert desc["components"] == {"dit": ["transformer"]}


def test_a_module_as_the_pipeline_has_its_own_tensors_at_the_root():
    root = nn.Module()
    root.scale = nn.Parameter(torch.ones(4, dtype=BF16))
    root.transformer = TinyDiT(2)
    desc = wf.describe(root)
    assert desc["class"] == "Module"
    assert desc["tensors"] == {"scale": {"dtype": "bf16", "shape": [4], "strides": [1], "kind": "parameter",
                                         "storage_offset": 0}}
    assert list(desc["modules"]) == ["transformer"]


def test_the_deprecated_singular_block_attribute_is_passed_on_and_warned_about():
    class OldDiT(TinyDiT):
        _layerwise_offload_blocks_attrs = None
        _layerwise_offload_blocks_attr = "blocks"

    desc = wf.describe({"transformer": OldDiT(3)})
    assert desc["class_block_attr"] == {"OldDiT": "blocks"}
    assert "class_block_attrs" not in desc
    with pytest.warns(wf.WeightferryWarning) as record:
        report = wf.plan({"transformer": OldDiT(3)}, {"diffusion_offload_config": {"mode": "layer",
                                                                                    "components": ["dit"]}})
    assert report["components"][0]["stacks"][0]["blocks"] == 3
    assert [str(w.message) for w in record] == [
        "DiT class OldDiT uses the deprecated singular block attribute declaration; declare a list in "
        "class_block_attrs",
    ]


def test_two_classes_of_one_name_with_different_block_lists_are_refused():
    def make(attrs):
        return type("Twin", (TinyDiT,), {"_layerwise_offload_blocks_attrs": attrs})

    a, b = make(["blocks"])(2), make(["other"])(2)
    with pytest.raises(wf.PipelineError) as e:
        wf.describe({"a": a, "b": b})
    assert str(e.value) == (
        "two module classes named Twin (test_describe and test_describe, the second at 'b') declare different "
        "_layerwise_offload_blocks_attrs; the description keys block attributes by class name, so rename one class"
    )


def test_a_module_holding_a_view_of_its_weight_outside_its_parameters_is_refused():
    # A tensor over a weight's bytes in a plain attribute (or an attribute of a plain object there) would keep the
    # host bytes while weightferry moved the weight's: describe refuses it, naming the attribute and the weight.
    import types

    p = TinyPipeline()
    lin = p.transformer.blocks[1].fc
    lin.cache = lin.weight.detach().t()
    with pytest.raises(wf.PipelineError) as e:
        wf.describe(p)
    assert str(e.value) == (
        "module 'transformer.blocks.1.fc' (Linear) holds in its attribute 'cache' a tensor over the bytes of its "
        "weight 'transformer.blocks.1.fc.weight', outside its parameters and buffers: weightferry moves the weight's "
        "bytes and cannot move that tensor; build the module anew without running it before enable, or leave it out "
        "of the offloaded components"
    )
    del lin.cache
    lin.state = types.SimpleNamespace(scale=torch.ones(3), w=lin.weight[0])
    with pytest.raises(wf.PipelineError, match=r"its attribute 'state\.w' a tensor over the bytes of its weight"):
        wf.describe(p)
    lin.state = types.SimpleNamespace(scale=torch.ones(3))  # a tensor of its own: not the weight's bytes
    wf.describe(p)
