"""Writes into an offloaded pipeline's weights go through weightferry's copy (issue: weights behave). Each case runs
on a tiny diffusers Flux transformer offloaded on ``device="sim"`` beside a deepcopy twin that is not offloaded and
receives the same operation: the offloaded module's outputs, its ``state_dict`` while enabled and its parameters
after ``disable`` equal the twin's bit for bit, or the operation raises a typed error with weights and outputs
unchanged."""

import copy

import pytest
import torch
from test_diffusers import BF16, bf16_inputs, flux, flux_pipeline, forward, layer, run_pipeline

import weightferry as wf
from weightferry._binders import is_placeholder

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")

CONFIGS = {
    "depth2": layer(2),
    "resident1": layer(1, resident_layers=1),
    "depth1": layer(1),
}


def model():
    m, x, _ = flux()
    return m.to(BF16).eval(), bf16_inputs(x)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def shifted(m, keys=None, by=0.25):
    return {k: (v.float() + by).to(v.dtype) for k, v in m.state_dict().items() if keys is None or k in keys}


@pytest.mark.parametrize("cfg", CONFIGS)
def test_a_full_strict_load_while_offloaded_equals_the_same_load_on_the_resident_twin(cfg):
    m, x = model()
    twin = copy.deepcopy(m)
    new = shifted(m)
    with wf.enable({"transformer": m}, CONFIGS[cfg], device="sim"):
        forward(m, x)  # slots hold the old bytes, and the next pass's first blocks are prefetched
        got = m.load_state_dict(new)
        want = twin.load_state_dict(new)
        assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys) == ([], [])
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)
    assert torch.equal(forward(m, x), forward(twin, x))


def test_partial_loads_of_streamed_fixed_and_foreign_keys_report_what_torch_reports():
    m, x = model()
    twin = copy.deepcopy(m)
    keys = {"transformer_blocks.1.attn.to_q.weight", "single_transformer_blocks.2.proj_out.bias", "x_embedder.weight"}
    new = shifted(m, keys)
    new["not.a.weight"] = torch.zeros(3)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        forward(m, x)
        got = m.load_state_dict(new, strict=False)
        want = twin.load_state_dict(new, strict=False)
        assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)
        assert got.unexpected_keys == ["not.a.weight"] and len(got.missing_keys) > 100
        assert torch.equal(forward(m, x), forward(twin, x))
        # From a block: the keys are the block's own.
        block = shifted(twin.transformer_blocks[0], {"ff.net.2.weight"}, by=-0.5)
        got = m.transformer_blocks[0].load_state_dict(block, strict=False)
        assert got == twin.transformer_blocks[0].load_state_dict(block, strict=False)
        # float32 values into the bf16 weights convert as torch's copy_ converts.
        wide = {"norm_out.linear.weight": torch.randn(twin.norm_out.linear.weight.shape)}
        m.load_state_dict(wide, strict=False)
        twin.load_state_dict(wide, strict=False)
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
    same_weights(m, twin)


def test_a_strict_load_missing_keys_raises_torch_s_error_after_loading_what_it_has():
    m, x = model()
    twin = copy.deepcopy(m)
    new = shifted(m, {"transformer_blocks.0.attn.to_k.weight"})
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        with pytest.raises(RuntimeError) as got:
            m.load_state_dict(new)
        with pytest.raises(RuntimeError) as want:
            twin.load_state_dict(new)
        assert str(got.value) == str(want.value) and "Missing key(s)" in str(got.value)
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_a_size_mismatch_or_assign_is_refused_before_anything_loads():
    m, x = model()
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    new = shifted(m)
    new["transformer_blocks.1.attn.to_q.weight"] = torch.zeros(3, 3, dtype=BF16)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        before = forward(m, x)
        with pytest.raises(wf.OffloadError) as e:
            m.load_state_dict(new)
        assert str(e.value) == (
            "load_state_dict: size mismatch for 'transformer.transformer_blocks.1.attn.to_q.weight': the new value "
            "has shape [3, 3], the weight [32, 32] (nothing was written)"
        )
        with pytest.raises(wf.OffloadError) as e:
            m.load_state_dict(shifted(m), assign=True)
        assert "load_state_dict(assign=True)" in str(e.value) and str(e.value).endswith("(nothing was loaded)")
        assert torch.equal(forward(m, x), before)
        assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())
    assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())


STREAMED = "transformer_blocks.1.attn.to_q.weight"
FIXED = "x_embedder.weight"


def param(m, key):
    return m.get_parameter(key)


@pytest.mark.parametrize("key", [STREAMED, FIXED])
@pytest.mark.parametrize("how", ["in_place", "data"])
def test_an_edit_outside_editing_is_refused_at_the_next_forward_and_put_back(key, how):
    m, x = model()
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        before = forward(m, x)
        with torch.no_grad():
            if how == "in_place":
                param(m, key).mul_(2)
            else:
                param(m, key).data = torch.ones(expected[key].shape, dtype=BF16)
        with pytest.raises(wf.OffloadError) as e:
            forward(m, x)
        assert str(e.value) == (
            f"'transformer.{key}' changed while offloaded, outside Handle.editing() (an in-place edit, or .data "
            "replaced): weightferry's copy of the weights does not have the change, so it was put back; make weight "
            "edits inside `with handle.editing():` (or disable, edit, and enable again)"
        )
        assert torch.equal(forward(m, x), before)
        assert all(torch.equal(v, expected[k]) for k, v in h.state_dict("transformer").items())
    assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())


def test_a_streamed_weight_between_forwards_has_its_true_shape_and_reads_nan_even_after_a_refused_edit():
    m, x = model()
    twin = copy.deepcopy(m)
    planned = wf.plan({"transformer": m}, layer(2))
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        expected = forward(m, x)
        assert wf.plan({"transformer": m}, layer(2)) == planned, "a plan made while enabled sees the true sizes"
        w = param(m, STREAMED)
        placeholders = [n for n, p in m.named_parameters() if is_placeholder(p)]
        assert STREAMED in placeholders and "x_embedder.weight" not in placeholders
        # What the module reports without reading values is the module's: names, shapes, dtypes, counts.
        assert [(n, p.shape, p.dtype) for n, p in m.named_parameters()] == [
            (n, p.shape, p.dtype) for n, p in twin.named_parameters()
        ]
        assert m.num_parameters() == twin.num_parameters() > 0
        # Its values are NaN, never a plausible weight: every placeholder views a few shared 0xff elements.
        assert all(torch.isnan(m.get_parameter(n)).all() for n in placeholders)
        with torch.no_grad():
            w.zero_()  # outside editing(): runs (into the shared elements), reaching no weight
        assert not torch.isnan(w).any()
        with pytest.raises(wf.OffloadError) as e:
            forward(m, x)
        assert str(e.value).startswith(f"'transformer.{STREAMED}' changed while offloaded, outside Handle.editing()")
        assert all(torch.isnan(m.get_parameter(n)).all() for n in placeholders), "NaN again after the refusal"
        assert torch.equal(forward(m, x), expected) and torch.equal(expected, forward(twin, x))
        # Through .data no version counter moves, but the shared elements' bytes (a signalling NaN) change: refused
        # at the next forward, naming the placeholders that reach them, and nothing changed.
        w.data += 0.5
        with pytest.raises(wf.OffloadError) as e:
            forward(m, x)
        reached = sorted(f"transformer.{n}" for n in placeholders)  # all bf16, all reaching element 0
        assert str(e.value) == (
            f"'{reached[0]}' or one of {len(reached) - 1} more was written between its block's forwards through "
            ".data, outside Handle.editing() (weight.data += delta, weight.data.mul_(...)): between forwards a "
            "streamed weight holds a placeholder, so the write reached no weight and nothing changed; make weight "
            "edits inside `with handle.editing():` (or disable, edit, and enable again)"
        )
        assert torch.equal(forward(m, x), expected)
        # A weight kept on the device edited through .data: its bytes differ from weightferry's copy, so a
        # state_dict refuses it by name and puts it back, rather than read the copy without the edit.
        param(m, FIXED).data += 0.5
        with pytest.raises(wf.OffloadError) as e:
            m.state_dict()
        assert str(e.value).startswith(f"'transformer.{FIXED}' changed while offloaded, outside Handle.editing()")
        assert torch.equal(forward(m, x), expected)


def test_disable_after_an_edit_outside_editing_gives_back_the_true_weights_and_says_so():
    m, x = model()
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    h = wf.enable({"transformer": m}, layer(2), device="sim")
    forward(m, x)
    with torch.no_grad():
        param(m, FIXED).add_(1)
    with pytest.raises(wf.OffloadError) as e:
        h.disable()
    assert "disable gave back the weights weightferry held, without the change" in str(e.value)
    assert not h.enabled
    assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())
    # An edit through .data of a fixed weight bumps no version counter: disable finds it by its bytes.
    h = wf.enable({"transformer": m}, layer(2), device="sim")
    forward(m, x)
    param(m, FIXED).data += 0.5
    with pytest.raises(wf.OffloadError) as e:
        h.disable()
    assert str(e.value).startswith(f"'transformer.{FIXED}' changed while offloaded, outside Handle.editing()")
    assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())
    # …and a module state_dict while enabled refuses a pending edit the same way.
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        with torch.no_grad():
            param(m, STREAMED).zero_()
        with pytest.raises(wf.OffloadError):
            m.state_dict()
        assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize("cfg", CONFIGS)
def test_edits_inside_editing_equal_the_same_edits_on_the_twin(cfg):
    m, x = model()
    twin = copy.deepcopy(m)

    def edit(mod):
        with torch.no_grad():
            param(mod, STREAMED).mul_(2)
            param(mod, FIXED).add_(0.5)
            param(mod, "single_transformer_blocks.0.norm.linear.weight").data = torch.full(
                param(mod, "single_transformer_blocks.0.norm.linear.weight").shape, 0.125, dtype=BF16
            )

    with wf.enable({"transformer": m}, CONFIGS[cfg], device="sim") as h:
        forward(m, x)
        with h.editing():
            assert torch.equal(param(m, STREAMED), param(twin, STREAMED)), "the true weights inside editing"
            edit(m)
            with pytest.raises(wf.OffloadError) as e:
                forward(m, x)
            assert "runs inside Handle.editing()" in str(e.value)
        edit(twin)
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        assert is_placeholder(param(m, STREAMED)), "offloaded again"
        with h.editing(m.transformer_blocks[0]):  # one module: only its weights are materialized
            assert is_placeholder(param(m, STREAMED))
            assert not is_placeholder(param(m, "transformer_blocks.0.attn.to_q.weight"))
            with torch.no_grad():
                param(m, "transformer_blocks.0.attn.to_q.weight").neg_()
        with torch.no_grad():
            param(twin, "transformer_blocks.0.attn.to_q.weight").neg_()
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_an_edit_that_raises_inside_editing_keeps_what_it_changed_as_the_module_would():
    m, x = model()
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        with pytest.raises(ZeroDivisionError), h.editing(), torch.no_grad():
            param(m, STREAMED).add_(1)
            raise ZeroDivisionError
        with torch.no_grad():
            param(twin, STREAMED).add_(1)
        assert torch.equal(forward(m, x), forward(twin, x))
        with pytest.raises(wf.OffloadError) as e, h.editing():
            param(m, STREAMED).data = torch.zeros(2, dtype=BF16)
        assert str(e.value).startswith(f"editing: size mismatch for 'transformer.{STREAMED}'")
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def lora(rank=4, seed=0):
    from peft import LoraConfig

    torch.manual_seed(seed)
    return LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights=False,
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.2", "proj_mlp"],
    )


def with_adapters(m):
    m.add_adapter(lora(seed=1), "a")
    m.add_adapter(lora(seed=2), "b")
    m.set_adapters(["a", "b"], [1.0, 0.5])


@pytest.mark.parametrize("cfg", CONFIGS)
def test_lora_loaded_before_enable_sets_fuses_and_unfuses_inside_editing_as_on_the_twin(cfg):
    m, x = model()
    with_adapters(m)
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, CONFIGS[cfg], device="sim") as h:
        assert torch.equal(forward(m, x), forward(twin, x))
        for mod in (m, twin):
            mod.set_adapters(["a", "b"], [0.25, 1.0])
        assert torch.equal(forward(m, x), forward(twin, x))
        with h.editing():
            m.fuse_lora(adapter_names=["a", "b"])
        twin.fuse_lora(adapter_names=["a", "b"])
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        with h.editing():
            m.unfuse_lora()
        twin.unfuse_lora()
        assert torch.equal(forward(m, x), forward(twin, x))
        for mod in (m, twin):
            mod.delete_adapters("b")
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)
    assert torch.equal(forward(m, x), forward(twin, x))


def test_lora_added_after_enable_runs_and_fuses_inside_editing_as_on_the_twin():
    m, x = model()
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        forward(m, x)
        for mod in (m, twin):
            mod.add_adapter(lora(seed=3), "late")
        assert torch.equal(forward(m, x), forward(twin, x))
        with h.editing():
            m.fuse_lora(safe_fusing=True)
        twin.fuse_lora(safe_fusing=True)
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        for mod in (m, twin):
            mod.unload_lora()
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_fuse_and_unfuse_lora_without_editing_walk_the_true_weights_as_on_the_twin(cfg, when):
    # diffusers' fuse_lora / unfuse_lora walk the module with Module.apply, which runs inside editing() while
    # enabled: the merge meets the true weights (never a placeholder), and the change is written through.
    m, x = model()
    if when == "before":
        with_adapters(m)
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, CONFIGS[cfg], device="sim"):
        forward(m, x)
        if when == "after":
            for mod in (m, twin):
                with_adapters(mod)
        for mod in (m, twin):
            mod.fuse_lora(adapter_names=["a", "b"])
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        for mod in (m, twin):
            mod.unfuse_lora()
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
    same_weights(m, twin)


def pipeline_lora(seed, text_encoder=False):
    """A LoRA of the tiny FluxPipeline's transformer (and its CLIP text encoder) as diffusers loads it: peft's keys
    under ``transformer.`` (and ``text_encoder.``)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = flux_pipeline()
    pipe.transformer.add_adapter(lora(seed=seed), "x")
    parts = {"transformer": pipe.transformer}
    if text_encoder:
        torch.manual_seed(seed + 1)
        config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj", "v_proj", "out_proj"])
        parts["text_encoder"] = inject_adapter_in_model(config, pipe.text_encoder, adapter_name="x")
    return {f"{name}.{k}": v.clone() for name, part in parts.items()
            for k, v in get_peft_model_state_dict(part, adapter_name="x").items()}


PIPELINE_CONFIGS = {
    "depth2": CONFIGS["depth2"],
    "resident1": CONFIGS["resident1"],
    "encoders-layer": {"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}},
    "encoders-module": {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}},
}


@pytest.mark.parametrize("cfg", sorted(PIPELINE_CONFIGS))
def test_a_pipeline_loads_fuses_unfuses_and_unloads_a_lora_without_editing_as_its_twin(cfg):
    # The pipeline's LoRA methods read the components' weights directly (FLUX's load_lora_weights reads each targeted
    # layer's weight shape, unfuse_lora unmerges layer by layer, the text encoder's load calls a .to() that changes
    # nothing): while enabled they run in editing() of the offloaded components the LoRA goes into.
    state = pipeline_lora(5, text_encoder=cfg.startswith("encoders"))
    pipe, twin = flux_pipeline(), flux_pipeline()
    with wf.enable(pipe, PIPELINE_CONFIGS[cfg], device="sim"):
        assert torch.equal(run_pipeline(pipe), run_pipeline(twin))
        for p in (pipe, twin):
            p.load_lora_weights(copy.deepcopy(state), adapter_name="x")
        assert torch.equal(run_pipeline(pipe), run_pipeline(twin)), "load_lora_weights"
        assert not torch.equal(run_pipeline(pipe), run_pipeline(flux_pipeline())), "the LoRA changes the output"
        if cfg.startswith("encoders"):
            assert any("lora_A" in name for name, _ in pipe.text_encoder.named_modules()), "into the text encoder"
            same_weights(pipe.text_encoder, twin.text_encoder)
        for step in ("fuse_lora", "unfuse_lora", "unload_lora_weights"):
            for p in (pipe, twin):
                getattr(p, step)()
            assert torch.equal(run_pipeline(pipe), run_pipeline(twin)), step
            same_weights(pipe.transformer, twin.transformer)
    assert "load_lora_weights" not in vars(pipe), "disable gives the pipeline its methods back"
    same_weights(pipe.transformer, twin.transformer)
    same_weights(pipe.text_encoder, twin.text_encoder)


def lora_round_trip(pipe, twin, state, run):
    """Loads ``state``, fuses, unfuses and unloads it on both pipelines; their runs equal after each step."""
    for p in (pipe, twin):
        p.load_lora_weights(copy.deepcopy(state), adapter_name="x")
    assert torch.equal(run(pipe), run(twin)), "load_lora_weights"
    for step in ("fuse_lora", "unfuse_lora", "unload_lora_weights"):
        for p in (pipe, twin):
            getattr(p, step)()
        assert torch.equal(run(pipe), run(twin)), step


@pytest.mark.parametrize("how", ["whole", "regional"])
def test_a_pipeline_lora_on_a_static_schedule_compiled_fullgraph_runs_as_on_its_twin(how):
    # The LoRA methods on a transformer compiled in place (Module.compile, fullgraph; or block by block, diffusers'
    # compile_repeated_blocks) over a static schedule: the new adapter layers are modules of the blocks, so
    # torch.compile traces again; the hazard detector sees no race.
    from test_static_compile import config as static_config

    state = pipeline_lora(5)
    pipe, twin = flux_pipeline(), flux_pipeline()
    with wf.enable(pipe, static_config(), device="sim") as h:
        torch._dynamo.reset()
        if how == "whole":
            pipe.transformer.compile(fullgraph=True, backend="eager")
        else:
            pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
        assert torch.equal(run_pipeline(pipe), run_pipeline(twin))
        lora_round_trip(pipe, twin, state, run_pipeline)
        assert h._session.hazard_violations() == []
        torch._dynamo.reset()


ZOO = ["sd3", "wan22", "ltx", "qwen_image", "hunyuan_video"]


@pytest.mark.parametrize("name", ZOO)
def test_the_lora_methods_of_other_pipelines_run_on_an_enabled_pipeline_as_on_its_twin(name):
    # Without weightferry/_lora.py each of these fails at the pipeline's unfuse_lora (peft's unmerge meets a
    # placeholder). A LoRA on the attention projections every diffusers transformer has.
    import pipelines
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    build, run = getattr(pipelines, f"{name}_pipeline"), getattr(pipelines, f"run_{name}")
    source = build()
    torch.manual_seed(3)
    source.transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"]), "x"
    )
    state = {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(source.transformer, None, "x").items()}
    pipe, twin = build(), build()
    with wf.enable(pipe, layer(2), device="sim"):
        lora_round_trip(pipe, twin, state, run)
    same_weights(pipe.transformer, twin.transformer)


def fused(m):
    return sum(hasattr(mod, "to_qkv") for mod in m.modules())


def test_fuse_qkv_projections_and_unfuse_while_offloaded_equal_the_twin_inside_editing_or_not():
    # diffusers' fuse_qkv_projections calls each attention's fuse_projections, which concatenates its q, k and v
    # weights into new layers: while enabled each call runs inside editing() of that attention, so it reads the true
    # weights (the fused layers are new tensors outside weightferry's plan).
    m, x = model()
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        forward(m, x)
        m.fuse_qkv_projections()
        twin.fuse_qkv_projections()
        assert fused(m) == fused(twin) > 0
        assert torch.equal(forward(m, x), forward(twin, x))
        m.unfuse_qkv_projections()
        twin.unfuse_qkv_projections()
        assert fused(m) == fused(twin) == 0
        assert torch.equal(forward(m, x), forward(twin, x))
        with h.editing():
            m.fuse_qkv_projections()
        twin.fuse_qkv_projections()
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
    same_weights(m, twin)
    assert torch.equal(forward(m, x), forward(twin, x))


def test_a_vae_offloaded_whole_fuses_its_attention_projections_as_its_twin():
    # AutoencoderKL's fuse_qkv_projections calls the older Attention class's fuse_projections(fuse=True), which runs
    # inside editing() of that attention (a component offloaded whole keeps its weights on the device between calls,
    # so this passed before too: the test holds the contract, the FLUX test above the editing).
    pipe = {"vae": vae()}
    twin = copy.deepcopy(pipe["vae"])
    z = torch.randn(1, 4, 8, 8)
    config = {"diffusion_offload_config": {"mode": "module", "components": ["vae"]}}
    with wf.enable(pipe, config, device="sim"), torch.no_grad():
        pipe["vae"].decode(z)
        pipe["vae"].fuse_qkv_projections()
        twin.fuse_qkv_projections()
        assert fused(pipe["vae"]) == fused(twin) > 0
        assert torch.equal(pipe["vae"].decode(z).sample, twin.decode(z).sample)
    same_weights(pipe["vae"], twin)


def test_peft_merge_and_unmerge_of_each_adapter_layer_while_offloaded_equal_the_twin():
    # peft's merge_and_unload merges each tuner layer's delta into its base weight (layer.merge()); while enabled a
    # tuner layer's merge and unmerge run inside editing() of that layer.
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    m, x = model()
    torch.manual_seed(5)
    m.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "proj_out"]), "x")
    twin = copy.deepcopy(m)

    def layers(model):
        return [mod for mod in model.modules() if isinstance(mod, BaseTunerLayer)]

    with wf.enable({"transformer": m}, layer(2), device="sim"):
        forward(m, x)
        for a, b in zip(layers(m), layers(twin)):
            a.merge()
            b.merge()
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        for a, b in zip(layers(m), layers(twin)):
            a.unmerge()
            b.unmerge()
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_tensors_an_editing_block_gives_the_modules_are_the_ones_placed_on_the_device_after_it():
    # On CUDA what an editing block added (peft places a new adapter by its base weight, a CPU tensor inside the
    # block) goes to the device the pipeline runs on; the tensors the modules had before stay where they are.
    from weightferry._edits import new_on_cpu

    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    known = {id(t) for t in m.parameters()}
    added = torch.nn.Linear(2, 3)
    m.append(added)
    m.append(added)  # reachable twice, moved once
    assert [id(t) for t in new_on_cpu([m], known)] == [id(added.weight), id(added.bias)]
    assert new_on_cpu([m], known | {id(added.weight), id(added.bias)}) == []


def test_a_walk_of_one_block_edits_its_true_weights_and_a_walk_inside_editing_runs_as_is():
    m, x = model()
    twin = copy.deepcopy(m)

    def halve(mod):
        if isinstance(mod, torch.nn.Linear):
            with torch.no_grad():
                mod.weight.mul_(0.5)

    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        for mod in (m, twin):
            assert mod.single_transformer_blocks[1].apply(halve) is mod.single_transformer_blocks[1]
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        with h.editing(m.transformer_blocks[0]):
            m.transformer_blocks[0].apply(halve)  # the editing block open: the walk runs as is, inside it
        twin.transformer_blocks[0].apply(halve)
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)
    assert "apply" not in m.transformer_blocks[0].__dict__


def test_copying_or_pickling_an_offloaded_module_is_refused_before_anything_is_read_and_works_after_disable():
    import io
    import pickle

    m, x = model()
    want = forward(m, x)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        for copy_it in (copy.deepcopy, pickle.dumps, lambda mod: torch.save(mod, io.BytesIO())):
            with pytest.raises(wf.OffloadError) as e:
                copy_it(m)
            assert str(e.value).startswith("'transformer' is offloaded by weightferry: copying or pickling it")
        with pytest.raises(wf.OffloadError, match=r"^'transformer\.transformer_blocks\.1' is offloaded"):
            copy.deepcopy(m.transformer_blocks[1])
        assert torch.equal(forward(m, x), want)
    copied = copy.deepcopy(m)
    assert torch.equal(forward(copied, x), want)
    assert "__getstate__" not in m.__dict__


def vae():
    import diffusers

    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=16,
    ).eval()


def test_module_mode_keeps_a_whole_component_resident_for_every_entry_point_not_only_forward():
    from test_diffusers import t5

    m, x = model()
    pipe = {"transformer": m, "text_encoder": t5(), "vae": vae()}
    twin = copy.deepcopy(pipe)
    z, img = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 16, 16)
    ids = torch.tensor([[1, 5, 9, 2]])

    def run(p):
        with torch.no_grad():
            out = [p["vae"].decode(z).sample, p["vae"].encode(img).latent_dist.mean, forward(p["transformer"], x)]
            out.append(p["text_encoder"](input_ids=ids).last_hidden_state)
            p["vae"].enable_tiling()  # tiles of sample_size 16 px: latents of 4 px
            out.append(p["vae"].decode(torch.randn(1, 4, 12, 12, generator=torch.Generator().manual_seed(1))).sample)
            p["vae"].disable_tiling()
            return out

    config = {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}
    with wf.enable(pipe, config, device="sim") as h:
        assert h._session.hooked_modules() == ["text_encoder", "transformer", "vae"]
        for got, want in zip(run(pipe), run(twin)):
            assert torch.equal(got, want)
    for name in pipe:
        same_weights(pipe[name], twin[name])


@pytest.mark.parametrize("how", ["module.compile", "torch.compile wrapper as the component"])
def test_a_model_compiled_and_run_before_enable_gives_the_resident_result_while_offloaded_and_after(how):
    m, x = model()
    want = forward(copy.deepcopy(m), x)
    if how == "module.compile":
        m.compile(backend="aot_eager")
        component = run = m
    else:
        component = run = torch.compile(m, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(run(**x, return_dict=False)[0], want)
        with wf.enable({"transformer": component}, layer(2), device="sim") as h:
            assert h._session.hooked_modules()[0] == "transformer.single_transformer_blocks.0"
            assert torch.equal(run(**x, return_dict=False)[0], want)  # traced again, with the hooks
        assert torch.equal(run(**x, return_dict=False)[0], want)  # traced again, without them
    torch.compiler.reset()


def test_a_backward_through_offloaded_blocks_is_refused_naming_the_fix():
    m, x = model()
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        out = m(**x, return_dict=False)[0]  # grad enabled: the parameters require grad
        assert torch.equal(out.detach(), forward(twin, x))
        with pytest.raises(wf.OffloadError) as e:
            out.float().sum().backward()
        assert str(e.value).startswith("backward through 'transformer', whose weights weightferry offloads")
        assert "run the pipeline under torch.no_grad() or torch.inference_mode()" in str(e.value)
        assert all(p.grad is None for p in m.parameters())
        # Gradients of the input need the weights too.
        xs = dict(x, hidden_states=x["hidden_states"].clone().requires_grad_())
        m.requires_grad_(False)
        with pytest.raises(wf.OffloadError):
            m(**xs, return_dict=False)[0].float().sum().backward()
        # A block called on its own refuses at its own output.
        block = m.single_transformer_blocks[0]
        h = torch.randn(1, 16, 32, dtype=BF16, requires_grad=True)
        enc, temb = torch.randn(1, 7, 32, dtype=BF16), torch.randn(1, 32, dtype=BF16)
        with pytest.raises(wf.OffloadError) as e:
            block(h, enc, temb)[1].float().sum().backward()
        assert str(e.value).startswith("backward through 'transformer.single_transformer_blocks.0'")
        with torch.inference_mode():
            assert torch.equal(m(**x, return_dict=False)[0], forward(twin, x))
    same_weights(m, twin)


def test_adapters_loaded_before_enable_stay_on_the_device_instead_of_streaming():
    m, x = model()
    plain = wf.plan({"transformer": m}, layer(2))
    with_adapters(m)
    desc = wf.describe({"transformer": m})
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A" in desc["pinned"]
    assert "transformer.single_transformer_blocks.2.proj_mlp.lora_B" in desc["pinned"]
    adapters = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".lora_" in n)
    plan = wf.plan({"transformer": m}, layer(2))
    resident = plan["budget"]["always_resident_bytes"] - plain["budget"]["always_resident_bytes"]
    assert adapters <= resident <= adapters + 256 * len(desc["pinned"]) * 2, (adapters, resident)
    assert [s["bytes"] for c in plan["components"] for s in c["stacks"]] == [
        s["bytes"] for c in plain["components"] for s in c["stacks"]
    ], "the blocks stream what they streamed without adapters"
    twin = copy.deepcopy(m)
    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        assert h.stats()["fixed_device_bytes"] == plan["budget"]["always_resident_bytes"]
        assert torch.equal(forward(m, x), forward(twin, x))
        with h.editing():
            m.fuse_lora()
        twin.fuse_lora()
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_a_module_mode_component_s_buffers_hold_their_true_values_between_phases_and_after_a_load():
    from test_diffusers import t5

    m, x = model()
    v = vae()
    v.register_buffer("shift_table", torch.arange(4, dtype=torch.float32))  # read by pipelines outside any forward
    pipe = {"transformer": m, "text_encoder": t5(), "vae": v}
    twin = copy.deepcopy(pipe)
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    config = {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}
    with wf.enable(pipe, config, device="sim"), torch.no_grad():
        for _ in range(2):  # before any phase of the VAE, and after one
            assert torch.equal(v.shift_table, twin["vae"].shift_table)
            assert is_placeholder(v.encoder.conv_in.weight)  # parameters stay placeholders between phases
            assert torch.equal(v.decode(z).sample, twin["vae"].decode(z).sample)
        # A load writes through: the buffer reads its new value between phases, and the next phase uses it.
        new = {"shift_table": torch.full((4,), 0.5)}
        v.load_state_dict(new, strict=False)
        twin["vae"].load_state_dict(new, strict=False)
        assert torch.equal(v.shift_table, new["shift_table"])
        assert torch.equal(v.decode(z).sample, twin["vae"].decode(z).sample)
        assert torch.equal(v.shift_table, new["shift_table"])
    same_weights(v, twin["vae"])
