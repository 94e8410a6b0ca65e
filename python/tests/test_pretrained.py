"""``weightferry.from_pretrained`` on ``device="sim"``: a diffusers transformer and a transformers text encoder saved
with ``save_pretrained`` (one file and sharded, bf16 and f32, tied weights), built on ``meta`` and bound from their
files: outputs bit-identical to the model saved, the weights after ``disable`` the saved ones (ties kept), the
model never materialized before binding; with a ``host_budget`` below its masters the last blocks are read from the
saved files on every pass (the disk tier), exact, one file and sharded; a whole saved FluxPipeline, its offloaded
components from their files and the rest loaded as usual, runs bit-identical to the pipeline saved; a folder
weightferry cannot read is a ``CheckpointError`` naming it."""

import copy
import os

import diffusers
import pytest
import torch
import transformers
from test_checkpoint import CONFIG, LAYER, forward, inputs
from test_diffusers import flux_pipeline, run_pipeline

import weightferry as wf

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
ENCODER = {"diffusion_offload_config": {"mode": "layer", "components": ["text_encoder"]}}


def flux(dtype=torch.bfloat16):
    """A tiny Flux in ``dtype`` (the class builds f32: a bf16 folder is read as bf16, from its files' headers)."""
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(**CONFIG).to(dtype).eval()


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("shard, dtype", [(None, torch.bfloat16), ("40KB", torch.float32)])
def test_a_diffusers_transformer_streams_from_its_saved_folder_bit_identical(tmp_path, shard, dtype):
    ref = flux(dtype)
    ref.save_pretrained(tmp_path / "transformer", **({"max_shard_size": shard} if shard else {}))
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs().items()}
    expected = forward(ref, x)
    model, h = wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, LAYER, device="sim",
                                  subfolder="transformer")
    with h:
        assert h.stats()["plan_host"]["master_bytes"] > 0
        for _ in range(2):
            assert torch.equal(forward(model, x), expected)
    assert same_weights(model, ref)


@pytest.mark.parametrize("shard", [None, "2MB"])
def test_a_saved_transformer_larger_than_its_host_budget_streams_its_last_blocks_from_disk(tmp_path, shard):
    # The way a user reaches the disk tier: from_pretrained with a host_budget below the model's masters. Blocks of
    # 128-dim heads (each well above a direct read's 4 KiB alignment), one file and sharded.
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**dict(
        CONFIG, attention_head_dim=128, axes_dims_rope=(16, 56, 56), num_layers=1, num_single_layers=12,
    )).to(torch.bfloat16).eval()
    ref.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    x = inputs()
    expected = forward(ref, x)
    cfg = copy.deepcopy(LAYER)
    cfg["diffusion_offload_config"]["host_masters"] = "pinned"
    model, h = wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, cfg, device="sim")
    with h:
        masters = h.stats()["master_host_bytes"]
    cfg["diffusion_offload_config"]["host_budget"] = masters * 6 // 10
    model, h = wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, cfg, device="sim")
    with h:
        s = h.stats()
        assert s["disk_bytes"] > 0 and s["master_host_bytes"] + s["staging_host_bytes"] <= masters * 6 // 10
        assert s["plan_host"]["disk_bytes"] == s["disk_bytes"]
        for _ in range(2):
            assert torch.equal(forward(model, x), expected)
    assert same_weights(model, ref)


def test_a_transformers_encoder_with_tied_weights_streams_from_its_sharded_folder(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4)
    ref = transformers.T5EncoderModel(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = ref(ids).last_hidden_state
    model, h = wf.from_pretrained(transformers.T5EncoderModel, tmp_path, ENCODER, device="sim", name="text_encoder")
    with h:
        (stack,) = h.stats()["stacks"]
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(ids).last_hidden_state, expected)
        assert stack["h2d_bytes"] > 0
    assert model.shared.weight is model.encoder.embed_tokens.weight
    assert same_weights(model, ref)


def test_a_folder_weightferry_cannot_read_is_refused_naming_it(tmp_path):
    with pytest.raises(wf.CheckpointError) as e:
        wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, LAYER, device="sim")
    assert str(e.value) == (
        f"{str(tmp_path)!r} holds no config.json: from_pretrained reads a model saved with save_pretrained (pass the "
        "pipeline folder with subfolder='transformer', for instance)"
    )
    flux().save_pretrained(tmp_path)
    os.link(tmp_path / "diffusion_pytorch_model.safetensors", tmp_path / "other.safetensors")
    with pytest.raises(wf.CheckpointError) as e:
        wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, LAYER, device="sim")
    assert str(e.value) == (
        f"{str(tmp_path)!r} must hold one .safetensors file or one *.safetensors.index.json of no variant (found: "
        "diffusion_pytorch_model.safetensors, other.safetensors); pass variant= to pick one, or call "
        "weightferry.enable(model, config, checkpoint=FILE) with the file to read"
    )
    with pytest.raises(wf.CheckpointError, match=r"of variant 'fp8' \(found: "):
        wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, LAYER, device="sim", variant="fp8")
    with pytest.raises(wf.PipelineError, match=r"^from_pretrained builds diffusers \(ModelMixin\) and transformers"):
        (tmp_path / "other.safetensors").unlink()
        wf.from_pretrained(torch.nn.Linear, tmp_path, LAYER, device="sim")


def test_nothing_is_materialized_before_the_files_bind_it(tmp_path, monkeypatch):
    # The model enable receives has every parameter on meta: no copy of the weights is made on the way.
    flux().save_pretrained(tmp_path)
    seen = {}
    real = wf._pretrained.enable

    def spy(pipeline, config, device=None, **kw):
        (model,) = pipeline.values()
        seen["meta"] = all(p.is_meta for p in model.parameters())
        seen["checkpoint"] = os.path.basename(kw["checkpoint"])
        return real(pipeline, config, device, **kw)

    monkeypatch.setattr(wf._pretrained, "enable", spy)
    _, h = wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, LAYER, device="sim")
    h.disable()
    assert seen == {"meta": True, "checkpoint": "diffusion_pytorch_model.safetensors"}


@pytest.mark.parametrize("mode, components", [("layer", ["dit", "text_encoder"]), ("layer", ["dit"]),
                                              ("module", ["dit", "text_encoder", "vae"])])
def test_a_saved_pipeline_runs_with_its_offloaded_components_bound_from_their_files(tmp_path, mode, components):
    saved = flux_pipeline()
    want = run_pipeline(copy.deepcopy(saved))
    saved.save_pretrained(tmp_path)
    cfg = {"diffusion_offload_config": {"mode": mode, "components": components}}
    pipe, h = wf.from_pretrained(diffusers.FluxPipeline, tmp_path, cfg, device="sim")
    with h:
        offloaded = {c["path"] for c in wf.plan(pipe, cfg)["components"] if c["selected"]}
        assert torch.equal(run_pipeline(pipe), want)
        assert torch.equal(run_pipeline(pipe), want)
        assert h.stats()["plan_host"]["master_bytes"] == h.stats()["master_host_bytes"]
    assert ("text_encoder_2" in offloaded) == ("text_encoder" in components)
    assert ("vae" in offloaded) == ("vae" in components)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        assert same_weights(getattr(pipe, name), getattr(saved, name)), name


def test_variants_are_picked_by_name_as_diffusers_names_them(tmp_path):
    # One folder, the bf16 weights with no variant and an f32 copy as variant "fp32" (sharded): each binds its own.
    bf16, f32 = flux(), flux(torch.float32)
    bf16.save_pretrained(tmp_path)
    f32.save_pretrained(tmp_path, variant="fp32", max_shard_size="40KB")
    assert any("fp32-0000" in p.name for p in tmp_path.iterdir())
    for variant, ref in [(None, bf16), ("fp32", f32)]:
        dtype = next(ref.parameters()).dtype
        x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs().items()}
        model, h = wf.from_pretrained(diffusers.FluxTransformer2DModel, tmp_path, LAYER, device="sim", variant=variant)
        with h:
            assert torch.equal(forward(model, x), forward(ref, x))
        assert same_weights(model, ref)


@pytest.mark.parametrize("name, variant", [
    ("model.safetensors", None), ("model-00001-of-00002.safetensors", None), ("model.safetensors.index.json", None),
    ("diffusion_pytorch_model.fp16.safetensors", "fp16"), ("model.fp16-00001-of-00002.safetensors", "fp16"),
    ("diffusion_pytorch_model.safetensors.index.fp16.json", "fp16"),
])
def test_a_weight_file_s_variant_is_read_from_its_name(name, variant):
    assert wf._pretrained._variant_of(name) == variant
