"""Discovery from the models' own metadata (``_repeated_blocks``, ``_no_split_modules``, transformers' model
classes), on ``device="sim"``: every diffusers transformer and transformers text encoder of ``zoo.py`` offloaded as a
dict pipeline with no declaration streams exactly the block lists its class names (nested ones included, such as a
token refiner's), bit-identical to the model not offloaded, and gives its weights back bit-identical; a class
without the metadata falls back to diffusers' conventional names with one warning per model; the keyword
declarations of ``enable``/``plan``/``describe`` win and their errors name the keyword."""

import warnings

import pytest
import torch
import zoo

import weightferry as wf

# What each class's metadata names, read off the classes by hand (diffusers 0.42.1, transformers 5.24.0), in the
# order the model's forward runs them; the classes without metadata stream their conventional names, with a warning.
FLUX = ["transformer_blocks", "single_transformer_blocks"]
REFINER = "context_embedder.token_refiner.refiner_blocks"
EXPECTED = {
    **dict.fromkeys(["FluxTransformer2DModel", "Flux2Transformer2DModel", "ChromaTransformer2DModel",
                     "OvisImageTransformer2DModel", "LongCatImageTransformer2DModel", "BriaFiboTransformer2DModel"],
                    FLUX),
    "AuraFlowTransformer2DModel": ["joint_transformer_blocks", "single_transformer_blocks"],
    "Lumina2Transformer2DModel": ["context_refiner", "noise_refiner", "layers"],  # execution order, not registration
    "ZImageTransformer2DModel": ["noise_refiner", "context_refiner", "layers"],
    "HiDreamImageTransformer2DModel": ["double_stream_blocks", "single_stream_blocks"],  # HiDreamBlock wrappers
    "OmniGenTransformer2DModel": ["layers"],
    "HunyuanImageTransformer2DModel": [REFINER, *FLUX],
    "HunyuanVideoTransformer3DModel": [REFINER, *FLUX],
    "HunyuanVideoFramepackTransformer3DModel": [REFINER, *FLUX],
    "HunyuanVideo15Transformer3DModel": [REFINER, "transformer_blocks"],
    **{name: ["blocks"] for name in ["WanTransformer3DModel", "SkyReelsV2Transformer3DModel",
                                     "ChronoEditTransformer3DModel"]},
    "WanVACETransformer3DModel": ["vace_blocks", "blocks"],  # the control hints run first
    "Kandinsky5Transformer3DModel": ["text_transformer_blocks", "visual_transformer_blocks"],
    # No metadata: the conventional names.
    "LuminaNextDiT2DModel": ["layers"],
    "HunyuanDiT2DModel": ["blocks"],
    # Encoders.
    "T5EncoderModel": ["encoder.block"],
    "UMT5EncoderModel": ["encoder.block"],
    "CLIPTextModel": ["encoder.layers"],
    "CLIPTextModelWithProjection": ["text_model.encoder.layers"],
    "BertModel": ["encoder.layer"],
}
DEFAULT = {"dit": ["transformer_blocks"], "encoder": ["layers"]}
# The same lists as plan() reports them on the component: (path, blocks).
LEFT_IN_PLAN = {
    "LatteTransformer3DModel": [("temporal_transformer_blocks", 2)],
    "ConsisIDTransformer3DModel": [("local_facial_extractor.layers", 5)],
}
# Lists of blocks no metadata names and no conventional name finds, reported (one warning per model).
LEFT = {
    "LatteTransformer3DModel": [
        "'transformer' (LatteTransformer3DModel) streams transformer_blocks, but these lists of blocks stay on the "
        "device: temporal_transformer_blocks (2 blocks, 0.0 MB, 24% of it); pass blocks={\"transformer\": "
        "[\"transformer_blocks\", \"temporal_transformer_blocks\"]} to enable to stream them too"
    ],
    "ConsisIDTransformer3DModel": [
        "'transformer' (ConsisIDTransformer3DModel) streams transformer_blocks, but these lists of blocks stay on the "
        "device: local_facial_extractor.layers (5 blocks, 0.0 MB, 7% of it); pass blocks={\"transformer\": "
        "[\"transformer_blocks\", \"local_facial_extractor.layers\"]} to enable to stream them too"
    ],
}


def expected(case):
    return EXPECTED.get(case.name, DEFAULT[case.kind])


def state(m):
    return {k: t.detach().clone() for k, t in m.state_dict(keep_vars=True).items()}


def config(case):
    component = "dit" if case.kind == "dit" else "text_encoder"
    return {"diffusion_offload_config": {"mode": "layer", "components": [component],
                                         "layer_options": {component: {"prefetch_depth": 1}}}}


@pytest.mark.parametrize("case", zoo.CASES, ids=[c.name for c in zoo.CASES])
def test_every_model_streams_the_block_lists_its_class_names_bit_identical(case):
    m, x = case.build(), case.inputs()
    want = case.run(m, x)
    before = state(m)
    name = "transformer" if case.kind == "dit" else "text_encoder"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = wf.plan({name: m}, config(case))
    ours = [str(w.message) for w in seen if issubclass(w.category, wf.WeightferryWarning)]
    left = [w for w in ours if "stay on the device" in w]
    ours = [w for w in ours if w not in left]
    assert left == LEFT.get(case.name, [])
    (component,) = [c for c in report["components"] if c["selected"]]
    left_in_plan = component.get("left_resident", [])
    assert [(e["path"], e["blocks"]) for e in left_in_plan] == LEFT_IN_PLAN.get(case.name, [])
    for e in left_in_plan:
        held = m.get_submodule(e["path"])
        assert e["bytes"] == sum(t.numel() * t.element_size() for t in [*held.parameters(), *held.buffers()])
    # A stack is named owner[list+list+...].
    attrs = [a for s in component["stacks"] for a in s["name"].split("[", 1)[1][:-1].split("+")]
    assert attrs == expected(case)
    # A class that names its blocks is found without a word; one that does not is scanned by name, and says so.
    assert len(ours) == (0 if case.metadata else 1), ours
    with wf.enable({name: m}, config(case), device="sim") as h:
        for _ in range(2):
            assert torch.equal(case.run(m, x), want)
        assert h._session.hazard_violations() == []
        stacks = h.stats()["stacks"]
        assert sum(s["loads"] for s in stacks) > 0
        # The stacks run in the model's execution order: every block was prefetched before its forward asked.
        assert [s["sync_fetches"] for s in stacks] == [0] * len(stacks)
    after = state(m)
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def bare_flux():
    """Flux without its block metadata, under a name no scan knows: only declarations can say what it is."""
    import diffusers

    class Bare(diffusers.FluxTransformer2DModel):
        _repeated_blocks = []
        _no_split_modules = None

    (case,) = [c for c in zoo.DITS if c.name == "FluxTransformer2DModel"]
    m = case.build()
    bare = Bare.from_config(m.config)
    bare.load_state_dict(m.state_dict())
    return case, bare.eval()


def test_keyword_declarations_say_what_a_dict_cannot_and_win_over_discovery():
    case, m = bare_flux()
    x = case.inputs()
    want = case.run(m, x)
    pipe = {"backbone": m}
    layer = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}
    with pytest.raises(wf.PlanError) as e:  # nothing says it is a DiT: the error names the keyword that would
        wf.plan(pipe, layer)
    assert str(e.value) == (
        "the config cannot be applied to dict: No DiT/transformer modules found for selected DiT offload in pipeline "
        "dict; pass dit=[\"<name>\"] to enable (or plan) naming it, or remove \"dit\" from "
        "diffusion_offload_config.components"
    )
    kw = {"dit": ["backbone"], "blocks": {"backbone": ["single_transformer_blocks"]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = wf.plan(pipe, layer, **kw)
        assert report["components"][0]["stacks"][0]["name"] == "backbone[single_transformer_blocks]"
        with wf.enable(pipe, layer, device="sim", **kw):
            assert torch.equal(case.run(m, x), want)


@pytest.mark.parametrize("kw,message", [
    ({"dit": ["vae"]},
     "dit= names 'vae', which is not a component of the pipeline (it has backbone); pass one of them"),
    ({"dit": "backbone", "blocks": {"backbone": ["x_embedder"]}},
     "blocks[\"backbone\"] names 'x_embedder', which is not a block list (nn.ModuleList) of backbone (Bare); name the "
     "dotted path of a ModuleList of its blocks"),
    ({"blocks": {"backbone": ["transformer_blocks"]}},
     "blocks= names 'backbone', which is neither a DiT nor an encoder of the pipeline (DiTs: none; encoders: none); "
     "pass dit=[\"backbone\"] or encoders=[\"backbone\"] too"),
    ({"encoders": [3]},
     "encoders= must be a list of component names (str), such as encoders=[\"transformer\"]; got [3]"),
    ({"blocks": ["transformer_blocks"]},
     "blocks= must map a component name to the dotted paths of its block lists, such as blocks={\"transformer\": "
     "[\"transformer_blocks\", \"single_transformer_blocks\"]}; got ['transformer_blocks']"),
])
def test_a_bad_keyword_declaration_is_refused_naming_the_keyword_before_anything_changes(kw, message):
    _, m = bare_flux()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"backbone": m}, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}},
                  device="sim", **kw)
    assert str(e.value) == message
    after = m.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA here")
def test_enable_without_a_device_on_a_machine_without_cuda_says_to_name_the_simulated_one():
    case, m = bare_flux()
    with pytest.raises(wf.DeviceError) as e:
        wf.enable({"transformer": m}, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
    assert str(e.value) == (
        "enable() got no device and torch sees no CUDA device; pass device=\"sim\" to run on weightferry's simulated "
        "device (device buffers in host memory), or device=\"cuda:N\" on a machine with a GPU"
    )


def test_a_unet_streams_its_down_and_up_blocks_whole_in_execution_order():
    """A UNet's ``down_blocks`` mix classes (cross-attention and plain down blocks) that each hold named blocks
    (``ResnetBlock2D``): the list is its blocks, each down block one unit, so its resnets and attentions (which its
    forward interleaves) are never fetched out of order. Only the mid block's lists interleave: its forward runs
    resnet, attention, resnet, so three of its units per forward are fetched when asked (counted exactly)."""
    import diffusers

    torch.manual_seed(0)
    m = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, cross_attention_dim=32, norm_num_groups=8,
        attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), sample_size=16,
    ).eval()
    x = dict(sample=torch.randn(1, 4, 16, 16), timestep=torch.tensor([10]), encoder_hidden_states=torch.randn(1, 7, 32))
    with torch.no_grad():
        want = m(**x).sample
    before = state(m)
    cfg = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                        "layer_options": {"dit": {"prefetch_depth": 1}}}}
    report = wf.plan({"unet": m}, cfg)
    (component,) = [c for c in report["components"] if c["selected"]]
    assert (component["path"], component["kind"]) == ("unet", "dit")
    assert [s["name"] for s in component["stacks"]] == [
        "unet[down_blocks+mid_block.attentions+mid_block.resnets+up_blocks]"
    ]
    with wf.enable({"unet": m}, cfg, device="sim") as h:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(**x).sample, want)
        (stack,) = h.stats()["stacks"]
        assert (stack["sync_fetches"], stack["loads"]) == (6, 21)
    after = state(m)
    assert all(torch.equal(after[k], before[k]) for k in before)
