"""Real diffusers and transformers models offloaded on ``device="sim"`` (CI): tiny configurations of diffusers'
``FluxTransformer2DModel``, ``WanTransformer3DModel`` and ``QwenImageTransformer2DModel`` and of transformers'
``T5EncoderModel``, found from their own metadata (no declarations), at every prefetch
depth 1-4, with resident layers, under a device budget, and model-level with the T5 encoder: outputs bit-identical to
the same modules not offloaded, every parameter bit-identical after disable, T5's tied embedding kept as one
storage."""

import copy
import warnings

import diffusers  # installed by python/install-test-deps.sh: missing is an error of the test environment
import pytest
import torch
import transformers
import zoo

import weightferry as wf

BF16 = torch.bfloat16


def flux():
    torch.manual_seed(0)
    m = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
    )
    g = torch.Generator().manual_seed(3)
    x = dict(
        hidden_states=torch.randn(1, 16, 8, generator=g), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
        img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.randn(7, 3, generator=g),
    )
    return m, x, 5


def wan():
    torch.manual_seed(0)
    m = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=4, rope_max_seq_len=32,
    )
    g = torch.Generator().manual_seed(3)
    x = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 7, 16, generator=g),
    )
    return m, x, 4


def qwen():
    torch.manual_seed(0)
    m = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
    )
    g = torch.Generator().manual_seed(3)
    x = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 7, 16, generator=g),
        encoder_hidden_states_mask=torch.ones(1, 7), timestep=torch.tensor([0.5]), img_shapes=[(1, 4, 4)],
    )
    return m, x, 3


MODELS = {"flux": flux, "wan": wan, "qwen": qwen}


def bf16_inputs(x):
    return {k: v.to(BF16) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
            for k, v in x.items()}


def forward(m, x):
    with torch.no_grad():
        return m(**x, return_dict=False)[0]


def state(m):
    return {k: (t.dtype, tuple(t.shape), t.detach().contiguous().view(torch.uint8).flatten().tolist())
            for k, t in list(m.state_dict(keep_vars=True).items())}


def layer(depth=2, **dit):
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                         "layer_options": {"dit": {"prefetch_depth": depth, **dit}}}}


def config(name, pipeline, weight_bytes):
    if name.startswith("depth"):
        return layer(int(name[5:]))
    if name == "resident1":
        return layer(1, resident_layers=1)
    # A budget between the smallest ring and every weight: the planner keeps some blocks resident, streams the rest.
    smallest = wf.plan(pipeline, layer(1))["device_weight_bytes"]
    budget = smallest + (weight_bytes - smallest) // 2
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": budget}}


CASES = [(name, cfg) for name in MODELS for cfg in ("depth1", "depth2", "depth3", "depth4", "resident1", "budget")]


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
@pytest.mark.parametrize("name,cfg", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_a_diffusers_transformer_offloaded_is_bit_identical_and_restored(name, cfg):
    m, x, blocks = MODELS[name]()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    expected = forward(m, x)
    before = state(m)
    weight_bytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    cfg = config(cfg, {"transformer": m}, weight_bytes)
    report = wf.plan({"transformer": m}, cfg)
    (stack,) = [s for c in report["components"] for s in c.get("stacks", [])]
    assert stack["blocks"] == blocks
    with wf.enable({"transformer": m}, cfg, device="sim") as h:
        for _ in range(2):
            assert torch.equal(forward(m, x), expected)
        assert h._session.hazard_violations() == []
        assert sum(s["loads"] for s in h.stats()["stacks"]) > 0
    assert state(m) == before
    assert torch.equal(forward(m, x), expected)


def t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return transformers.T5EncoderModel(cfg).to(BF16).eval()


def test_a_t5_text_encoder_streams_its_blocks_with_the_transformer():
    dit, x, blocks = flux()
    dit = dit.to(BF16).eval()
    x = bf16_inputs(x)
    enc = t5()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(5))

    class FakeFluxPipeline:  # a diffusers-like pipeline declaring nothing: the models' metadata says everything
        def __init__(self):
            self.transformer = dit
            self.text_encoder = enc

    pipe = FakeFluxPipeline()
    with torch.no_grad():
        expected_enc = enc(input_ids=ids).last_hidden_state
    expected_dit = forward(dit, x)
    desc = wf.describe(pipe)
    # T5's tied embedding (`shared` and `encoder.embed_tokens`) is one storage.
    enc_node = desc["modules"]["text_encoder"]
    shared = enc_node["children"]["shared"]["tensors"]["weight"]
    embed = enc_node["children"]["encoder"]["children"]["embed_tokens"]["tensors"]["weight"]
    assert "storage" in shared and shared["storage"] == embed["storage"]
    assert desc["components"] == {"dit": ["transformer"], "encoders": ["text_encoder"]}
    assert desc["offload_plan"] == {
        "block_attrs": {"transformer": ["transformer_blocks", "single_transformer_blocks"]},  # _repeated_blocks
        "resident_dit_paths": ["transformer"],
        "encoder_component_types": {"text_encoder": "text_encoder"},  # a transformers model
        "encoder_block_attrs": {"text_encoder": ["encoder.block"]},  # T5's _no_split_modules: T5Block
    }
    config = {"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
                                           "layer_options": {"dit": {"prefetch_depth": 2},
                                                             "text_encoder": {"prefetch_depth": 1}}}}
    before = (state(dit), state(enc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found from metadata: nothing to warn about
        report = wf.plan(pipe, config)
    stacks = {c["path"]: [s["blocks"] for s in c.get("stacks", [])] for c in report["components"]}
    assert stacks["transformer"] == [blocks] and stacks["text_encoder"] == [3]
    with wf.enable(pipe, config, device="sim") as h:
        with torch.no_grad():
            assert torch.equal(enc(input_ids=ids).last_hidden_state, expected_enc)
        assert torch.equal(forward(dit, x), expected_dit)
        assert {s["name"] for s in h.stats()["stacks"]} >= {"text_encoder[encoder.block]"}
        assert enc.shared.weight is enc.encoder.embed_tokens.weight
    assert (state(dit), state(enc)) == before
    model_level = {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}
    with wf.enable(pipe, model_level, device="sim"):
        with torch.no_grad():
            assert torch.equal(enc(input_ids=ids).last_hidden_state, expected_enc)
        assert torch.equal(forward(dit, x), expected_dit)
    assert (state(dit), state(enc)) == before


def test_a_model_without_metadata_is_scanned_by_name_with_one_warning_per_model():
    class Bare(diffusers.FluxTransformer2DModel):  # a user's subclass that drops the block metadata
        _repeated_blocks = []
        _no_split_modules = None

    m, _, _ = flux()
    bare = [Bare.from_config(m.config) for _ in range(2)]

    def scans(pipeline):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            desc = wf.describe(pipeline)
        assert desc["offload_plan"]["block_attrs"]["transformer"] == ["transformer_blocks", "single_transformer_blocks"]
        return [str(w.message) for w in seen if "its class says neither" in str(w.message)]

    message = (
        "'transformer' (Bare): its class says neither what it is (a transformers model, a VAE with encode and decode) "
        "nor which blocks it repeats (_repeated_blocks, _no_split_modules); taken for a DiT by its name; its block "
        "lists by their conventional names: transformer_blocks, single_transformer_blocks. Pass dit=[\"transformer\"] "
        "and blocks={\"transformer\": [\"transformer_blocks\", \"single_transformer_blocks\"]} to enable to say so, "
        "or declare _repeated_blocks on Bare"
    )
    # Two dict pipelines (one pipeline class, `dict`): each model is reported, once.
    assert scans({"transformer": bare[0]}) == [message]
    assert scans({"transformer": bare[1]}) == [message]
    assert scans({"transformer": bare[0]}) == []
    assert scans({"transformer": m}) == []  # diffusers' own class: found from its metadata


def test_declared_block_lists_win_over_the_scan():
    m, x, _ = flux()
    m = m.to(BF16).eval()

    class Declared:
        _dit_modules = ["transformer"]
        _offload_plan = {"block_attrs": {"transformer": ["single_transformer_blocks"]}}

        def __init__(self):
            self.transformer = m

    report = wf.plan(Declared(), layer(1))
    (stack,) = [s for c in report["components"] for s in c.get("stacks", [])]
    assert stack["blocks"] == 3 and stack["name"] == "transformer[single_transformer_blocks]"
    expected = forward(copy.deepcopy(m), bf16_inputs(x))
    with wf.enable(Declared(), layer(1), device="sim"):
        assert torch.equal(forward(m, bf16_inputs(x)), expected)


def test_torch_compile_runs_the_offloaded_transformer_with_one_break_per_block():
    import torch._dynamo as dynamo

    m, x, blocks = flux()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    expected = forward(m, x)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        dynamo.reset()
        with torch.no_grad():  # inference, as pipelines run (with grad, outputs pass the backward refusal too)
            explained = dynamo.explain(m)(**x, return_dict=False)
        # The hooks are never traced (torch.compiler.disable): the graph breaks where a block's hooks run, and
        # nowhere else; no recompilation when a block's tensors are rebound.
        assert explained.graph_break_count == blocks, [str(r.reason) for r in explained.break_reasons]
        compiled = torch.compile(m, backend="eager")
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(compiled(**x, return_dict=False)[0], expected)
    dynamo.reset()


def test_the_module_s_own_state_dict_and_save_pretrained_give_the_true_weights_while_offloaded(tmp_path):
    m, x, _ = flux()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    block = {k: v.clone() for k, v in m.transformer_blocks[1].state_dict().items()}
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        forward(m, x)  # the blocks' tensors have been bound to device slots and back to placeholders
        got = m.state_dict()
        assert list(got) == list(expected)
        for k, v in expected.items():
            assert got[k].device.type == "cpu" and got[k].dtype == v.dtype and torch.equal(got[k], v), k
        # A block's own state_dict (its hooks see their prefix from any entry point).
        sub = m.transformer_blocks[1].state_dict()
        assert list(sub) == list(block) and all(torch.equal(sub[k], v) for k, v in block.items())
        m.save_pretrained(tmp_path / "saved")
        out_enabled = forward(m, x)
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "saved", torch_dtype=BF16).eval()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    assert torch.equal(forward(loaded, x), out_enabled)
    # After disable the hooks are gone: the state dict holds the module's own tensors again.
    assert all(m.state_dict()[k].data_ptr() == t.data_ptr() for k, t in m.named_parameters())


def test_converting_an_offloaded_module_is_refused_before_anything_changes():
    m, x, _ = flux()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        before = forward(m, x)
        dtypes = {k: t.dtype for k, t in m.named_parameters()}
        for convert in (lambda: m.to(torch.float32), m.float, m.half, m.cpu, lambda: m.transformer_blocks[0].double()):
            with pytest.raises(wf.OffloadError) as e:
                convert()
            assert "is offloaded by weightferry: converting it" in str(e.value)
            assert "call disable() on the handle, convert the module, and enable again" in str(e.value)
        with pytest.raises(wf.OffloadError) as e:
            m.to(torch.float32)
        assert str(e.value).startswith("'transformer' is offloaded by weightferry")
        assert {k: t.dtype for k, t in m.named_parameters()} == dtypes
        assert torch.equal(forward(m, x), before)
    # After disable the module converts as any module, from its true weights.
    assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())
    m.to(torch.float32)
    assert all(t.dtype == torch.float32 for t in m.parameters())
    assert "_apply" not in vars(m) and "_apply" not in vars(m.transformer_blocks[0])


def test_a_to_that_changes_nothing_returns_the_module_and_one_that_changes_anything_is_refused():
    # diffusers' LoRA loader calls text_encoder.to(device=text_encoder.device, dtype=text_encoder.dtype).
    m, x, _ = flux()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        before = forward(m, x)
        for args in [(), ("cpu",), (BF16,), ("cpu", BF16), (torch.device("cpu"), BF16, False)]:
            assert m.to(*args) is m, args
        assert m.to(device=m.device, dtype=m.dtype) is m
        assert m.transformer_blocks[0].to(dtype=BF16) is m.transformer_blocks[0]
        for kwargs in [{"dtype": torch.float32}, {"device": "meta"}, {"memory_format": torch.channels_last}]:
            with pytest.raises(wf.OffloadError, match="is offloaded by weightferry: converting it"):
                m.to(**kwargs)
        with pytest.raises(TypeError, match="floating point or complex"):  # what torch says of the module resident
            m.to(torch.int8)
        assert all(t.dtype == BF16 for t in m.parameters())
        assert torch.equal(forward(m, x), before)
    assert "to" not in vars(m) and "to" not in vars(m.transformer_blocks[0])


def test_a_second_thread_forwarding_the_same_offloaded_module_is_refused_and_the_first_is_unharmed():
    import threading

    m, x, _ = flux()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    expected = forward(m, x)
    with wf.enable({"transformer": m}, layer(2), device="sim"):
        inside, release = threading.Event(), threading.Event()

        def hold(module, args):  # runs after weightferry's pre-hook: the block is open while this waits
            inside.set()
            assert release.wait(30)

        holding = m.transformer_blocks[1].register_forward_pre_hook(hold)
        result = {}
        first = threading.Thread(target=lambda: result.setdefault("out", forward(m, x)))
        first.start()
        assert inside.wait(30)
        holding.remove()
        with pytest.raises(wf.OffloadError) as e:
            forward(m, x)
        assert str(e.value).startswith(
            "weightferry runs one forward of an offloaded pipeline at a time: another thread is inside "
            "'transformer.transformer_blocks.1' while this one enters 'transformer.transformer_blocks.0'"
        )
        release.set()
        first.join(30)
        assert torch.equal(result["out"], expected)
        # Once the other thread is out, this one runs.
        assert torch.equal(forward(m, x), expected)


def test_two_offloaded_pipelines_run_on_two_threads_at_once():
    import threading

    (a, x, _), (b, _, _) = flux(), flux()
    a, b = a.to(BF16).eval(), b.to(BF16).eval()
    x = bf16_inputs(x)
    expected = forward(a, x)
    with wf.enable({"transformer": a}, layer(1), device="sim"), wf.enable({"transformer": b}, layer(2), device="sim"):
        outs = {}
        start = threading.Barrier(2)

        def run(name, m):
            start.wait(30)
            outs[name] = [forward(m, x) for _ in range(3)]

        threads = [threading.Thread(target=run, args=(n, m)) for n, m in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(torch.equal(o, expected) for n in ("a", "b") for o in outs[n])


def test_the_handle_s_state_dict_is_the_true_weights_while_offloaded():
    m, x, _ = flux()
    m = m.to(BF16).eval()
    x = bf16_inputs(x)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    with wf.enable({"transformer": m}, layer(2), device="sim") as h:
        forward(m, x)
        got = h.state_dict("transformer")
        assert set(got) == set(expected)
        for k, v in expected.items():
            assert got[k].device.type == "cpu" and torch.equal(got[k], v), k
        assert set(h.state_dict()) == {f"transformer.{k}" for k in expected}
        with pytest.raises(wf.PipelineError) as e:
            h.state_dict("vae")
        assert str(e.value) == "the pipeline has no component 'vae' with weights"
    after = h.state_dict("transformer")
    assert all(torch.equal(after[k], v) for k, v in expected.items())


def tokenizer(max_len):
    """A word-level tokenizer built here (no download): the words of the tests' prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["a", "photo", "of", "cat", "dog", "on", "the", "moon"]
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>", model_max_length=max_len
    )


def flux_pipeline():
    """A tiny FluxPipeline: diffusers' own test shapes, two text encoders, a one-level VAE, local tokenizers."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, pad_token_id=0, vocab_size=16, projection_dim=32,
    ))
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=16, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    ))
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=tokenizer(77),
        text_encoder_2=t5, tokenizer_2=tokenizer(16), transformer=transformer,
    )
    for m in (transformer, clip, t5, vae):
        m.to(torch.bfloat16).eval()
    return pipe


def run_pipeline(p):
    return p(prompt="a photo of a cat", num_inference_steps=2, height=32, width=32, max_sequence_length=16,
             output_type="pt", generator=torch.Generator().manual_seed(0)).images


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
@pytest.mark.parametrize("components", [["dit", "text_encoder", "vae"], ["dit", "text_encoder"]],
                         ids=["module-dit-encoders-vae", "layer-dit-encoders"])
def test_a_whole_tiny_flux_pipeline_runs_offloaded_bit_identical_to_its_twin(components):
    pipe = flux_pipeline()
    twin = copy.deepcopy(pipe)
    want = run_pipeline(twin)
    mode = "module" if "vae" in components else "layer"
    config = {"diffusion_offload_config": {"mode": mode, "components": components}}
    with wf.enable(pipe, config, device="sim") as h:
        hooked = h._session.hooked_modules()
        if mode == "module":
            assert hooked == ["text_encoder", "text_encoder_2", "transformer", "vae"]
        else:
            assert "transformer.single_transformer_blocks.1" in hooked and "text_encoder_2.encoder.block.1" in hooked
        assert torch.equal(run_pipeline(pipe), want)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = getattr(pipe, name).state_dict(), getattr(twin, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b), name


def test_a_part_of_a_block_called_outside_the_block_brings_the_block_in_eager_and_compiled():
    # DiT's forward embeds the timestep and class with transformer_blocks[0].norm1.emb before any block runs: the
    # call opens block 0 and closes it after, so it never meets the placeholders, eager or compiled.
    import torch._dynamo as dynamo

    (case,) = [c for c in zoo.DITS if c.name == "DiTTransformer2DModel"]
    m, x = case.build(), case.inputs()
    blocks = len(m.transformer_blocks)
    want = case.run(m, x)
    before = state(m)
    with pytest.warns(wf.WeightferryWarning, match="taken for a DiT by its name"):
        h = wf.enable({"transformer": m}, layer(1), device="sim")
    with h:
        assert torch.equal(case.run(m, x), want)
        # One unit opened per block and one for the call from outside (each opening is a pre and a post hook).
        assert h.stats()["hooks"]["calls"] == 2 * (blocks + 1)
        dynamo.reset()
        with torch.no_grad():
            explained = dynamo.explain(m)(**x, **case.kwargs)
        # A break where each block's hooks run, and one where the call from outside runs (eager, its block open).
        assert explained.graph_break_count == blocks + 1, [str(r.reason) for r in explained.break_reasons]
        compiled = torch.compile(m, backend="eager")
        for _ in range(2):
            assert torch.equal(case.output(compiled(**x, **case.kwargs)), want)
        assert h._session.hazard_violations() == []
    dynamo.reset()
    assert state(m) == before
