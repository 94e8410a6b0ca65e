"""``weightferry.enable`` on ``device="cuda"`` (skipped without a GPU; CI has none, the lent H200 runs them): the
offloaded forwards equal the same pipeline resident on the GPU bit for bit (layerwise at depths 1-3, resident
layers, a device budget, model-level), every tensor is bit-identical on the CPU after disable, weights are bound in
place (views made once per block and slot; empty placeholders on the device between forwards), a forward on another
stream is refused, the shared-context check, a tiny diffusers Flux transformer found from its metadata (its own
state_dict the true weights while offloaded, converting it refused), and writes into it (loads, edits, LoRA) and a
VAE in module mode against a resident twin."""

import warnings

import pytest
import torch
from test_enable import MODEL, assert_outputs_equal, layer, pipe, snapshot
from tiny import BF16

import weightferry as wf
from weightferry._binders import is_placeholder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)


def run_on(p, dev, steps=2):
    """Text encoder, ``steps`` DiT steps, VAE on ``dev``: every output, on the CPU."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 5), generator=g).to(dev)
    x = torch.randn(2, 5, 16, generator=g).to(BF16).to(dev)
    img = torch.randn(1, 3, 6, 6, generator=g).to(BF16).to(dev)
    with torch.no_grad():
        out = [p.text_encoder(ids)]
        for _ in range(steps):
            out.append(p.transformer(x))
        out.append(p.vae(img))
    torch.cuda.synchronize(dev)
    return [o.cpu() for o in out]


def resident(n=4):
    """The same pipeline (same seed), every module on the GPU: the reference."""
    r = pipe(n)
    for m in (r.transformer, r.text_encoder, r.vae):
        m.to(CUDA)
    return run_on(r, CUDA)


BUDGET = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": 80000}}
CONFIGS = [layer(1), layer(2), layer(3), layer(2, resident_layers=1), BUDGET, MODEL]
IDS = ["depth1", "depth2", "depth3", "resident1", "budget", "model"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_cuda_offload_is_bit_identical_to_resident_and_disable_restores(config):
    expected = resident()
    p = pipe()
    before = snapshot(p)
    with wf.enable(p, config, device="cuda") as h:
        assert h.enabled
        # Fixed-placement tensors live on the GPU after enable; streamed ones are bound at their forward.
        assert p.transformer.x_embedder.weight.device == CUDA
        assert_outputs_equal(run_on(p, CUDA), expected)
        assert_outputs_equal(run_on(p, CUDA, steps=3)[:3], expected[:3])
        stats = h.stats()
        assert stats["enabled"] is True and sum(s["loads"] for s in stats["stacks"]) > 0
    after = snapshot(p)
    assert after == before
    assert all(t.device.type == "cpu" for t in p.transformer.parameters())


def test_views_are_made_once_per_block_and_slot_and_tensors_are_placeholders_between_forwards():
    p = pipe(6)
    with wf.enable(p, layer(2), device="cuda") as h:
        made = []
        original = h._binder.rebinding

        def counting(items):
            made.append(len(items))
            return original(items)

        h._binder.rebinding = counting
        seen = []
        w = p.transformer.blocks[0].fc.weight
        p.transformer.blocks[0].fc.register_forward_pre_hook(
            lambda m, a: seen.append((w.device, w.untyped_storage().nbytes() > w.numel() * w.element_size()))
        )
        run_on(p, CUDA, steps=4)
        third = len(made)
        run_on(p, CUDA, steps=4)
        # The slots a block lands in repeat, so no view is made again once each block met each of its slots.
        assert len(made) == third, (third, len(made))
        assert set(seen) == {(CUDA, True)}, "inside its forward the weight views a slot of a larger device buffer"
        assert w.device == CUDA and is_placeholder(w), "between forwards: a placeholder on the device"


def test_an_edit_through_data_is_refused_by_name_and_changes_nothing():
    # Through .data no version counter moves: a streamed weight's write reaches its placeholder's shared elements
    # (whose signalling NaN the device's arithmetic turns into other bytes), a fixed weight's its device copy. The
    # placeholders are read around each forward (refused at its end, its output dropped) and at state_dict; a fixed
    # weight's bytes at state_dict: refused by name and put back, and the outputs stay the resident run's.
    want = resident()
    p = pipe()
    stray = r"was written between its block's forwards through \.data"
    with wf.enable(p, layer(2), device="cuda") as h:
        assert_outputs_equal(run_on(p, CUDA), want)
        w = p.transformer.blocks[0].fc.weight
        assert is_placeholder(w)
        w.data += 0.5
        with pytest.raises(wf.OffloadError, match=stray):
            run_on(p, CUDA)
        assert torch.isnan(w).all(), "NaN again after the refusal"
        assert_outputs_equal(run_on(p, CUDA), want)
        w.data.mul_(2)
        with pytest.raises(wf.OffloadError, match=stray):
            h.state_dict()
        assert_outputs_equal(run_on(p, CUDA), want)
        p.transformer.x_embedder.weight.data += 0.5
        with pytest.raises(wf.OffloadError, match=r"^'transformer\.x_embedder\.weight' changed while offloaded"):
            p.transformer.state_dict()
        assert_outputs_equal(run_on(p, CUDA), want)


def test_a_forward_on_another_stream_is_ordered_with_the_enable_stream_and_exact():
    # The session orders its copies on the stream weightferry was enabled on; a forward on a side stream (as CUDA
    # graph trees warm up on) is bridged to it by events around each block: the outputs equal the resident run's,
    # and forwards on the enabling stream after it too.
    want = resident()
    p = pipe()
    with wf.enable(p, layer(1), device="cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = run_on(p, CUDA)
        assert_outputs_equal(got, want)
        assert_outputs_equal(run_on(p, CUDA), want)


def test_tensors_already_on_the_gpu_are_refused_before_anything_moves():
    p = pipe()
    p.vae.to(CUDA)
    before = snapshot(p)
    with pytest.raises(wf.PipelineError) as e:
        wf.enable(p, layer(1), device="cuda")
    assert "is on cuda:0; weightferry offloads a pipeline whose weights are on the CPU" in str(e.value)
    assert snapshot(p) == before


def test_a_tiny_diffusers_flux_transformer_is_bit_identical():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
    ).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(3)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 8, generator=g).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=g).to(torch.bfloat16),
        pooled_projections=torch.randn(1, 16, generator=g).to(torch.bfloat16),
        timestep=torch.tensor([0.5]).to(torch.bfloat16),
        img_ids=torch.randn(16, 3, generator=g),
        txt_ids=torch.randn(7, 3, generator=g),
    )
    on_gpu = {k: v.to(CUDA) for k, v in inputs.items()}
    import copy

    ref = copy.deepcopy(model).to(CUDA)
    with torch.no_grad():
        expected = ref(**on_gpu, return_dict=False)[0].cpu()
    del ref
    cfg = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                        "layer_options": {"dit": {"prefetch_depth": 2}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its class names its blocks: found without a word
        report = wf.plan({"transformer": model}, cfg)
    assert [s["blocks"] for c in report["components"] for s in c.get("stacks", [])] == [5]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with wf.enable({"transformer": model}, cfg, device="cuda"):
        for _ in range(2):
            with torch.no_grad():
                got = model(**on_gpu, return_dict=False)[0].cpu()
            assert torch.equal(got, expected)
        # The module's own state_dict is the true weights while offloaded (its tensors are empty placeholders).
        sd = model.state_dict()
        assert list(sd) == list(weights)
        assert all(sd[k].device.type == "cpu" and torch.equal(sd[k], v) for k, v in weights.items())
        # Converting it is refused, and the offloaded forward is untouched.
        with pytest.raises(wf.OffloadError):
            model.to(torch.float32)
        with torch.no_grad():
            assert torch.equal(model(**on_gpu, return_dict=False)[0].cpu(), expected)


def test_retune_on_cuda_rebinds_to_the_new_slots():
    expected = resident()
    p = pipe()
    with wf.enable(p, layer(1), device="cuda") as h:
        assert_outputs_equal(run_on(p, CUDA), expected)
        h.retune(prefetch_depth=3)
        assert_outputs_equal(run_on(p, CUDA), expected)
        h.retune(device_budget="auto")  # the GPU's free memory: every block fits, so all are resident
        assert_outputs_equal(run_on(p, CUDA), expected)


def test_a_meta_transformer_from_a_checkpoint_runs_on_cuda(tmp_path):
    pytest.importorskip("diffusers")
    from safetensors.torch import save_file
    from test_checkpoint import LAYER, forward, inputs, on_meta, reference

    ref = reference()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "t.safetensors"))
    x = {k: v.to(CUDA) for k, v in inputs().items()}
    expected = forward(ref.to(CUDA), x).cpu()
    m = on_meta()
    with wf.enable({"transformer": m}, LAYER, device="cuda", checkpoint=tmp_path / "t.safetensors"):
        for _ in range(2):
            assert torch.equal(forward(m, x).cpu(), expected)


def test_inductor_compiles_the_offloaded_transformer_bit_exact_to_the_same_graphs_resident():
    # torch.compile's default backend (inductor, Triton kernels) on an offloaded diffusers transformer. The hooks
    # break the graph at every block; the reference is the same module resident with no-op hooks that break it at
    # the same places, so both run the same generated kernels and must agree bit for bit. A second pass compiles
    # nothing new although every streamed block's tensors were rebound to other device bytes.
    pytest.importorskip("diffusers")
    import copy

    import torch._dynamo as dynamo
    from test_checkpoint import LAYER, forward, inputs, reference

    model = reference()
    x = {k: v.to(CUDA) for k, v in inputs().items()}
    ref = copy.deepcopy(model).to(CUDA)
    noop = torch.compiler.disable(lambda *a: None)
    for block in [*ref.transformer_blocks, *ref.single_transformer_blocks]:
        block.register_forward_pre_hook(noop)
        block.register_forward_hook(noop)
    dynamo.reset()
    expected = forward(torch.compile(ref), x).cpu()
    del ref
    dynamo.reset()
    with wf.enable({"transformer": model}, LAYER, device="cuda"):
        compiled = torch.compile(model)
        assert torch.equal(forward(compiled, x).cpu(), expected)
        graphs = dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(2):
            assert torch.equal(forward(compiled, x).cpu(), expected)
        assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    dynamo.reset()


def test_a_model_compiled_with_inductor_and_run_before_enable_is_traced_again_with_the_hooks():
    # Compiled and run on the GPU before enable (its graphs have no hooks), moved back to the CPU and offloaded: the
    # compiled wrapper must give the hook-broken graphs' result, and the plain compiled result after disable.
    pytest.importorskip("diffusers")
    import copy

    import torch._dynamo as dynamo
    from test_checkpoint import LAYER, forward, inputs, reference

    model = reference()
    x = {k: v.to(CUDA) for k, v in inputs().items()}
    ref = copy.deepcopy(model).to(CUDA)
    noop = torch.compiler.disable(lambda *a: None)
    for block in [*ref.transformer_blocks, *ref.single_transformer_blocks]:
        block.register_forward_pre_hook(noop)
        block.register_forward_hook(noop)
    dynamo.reset()
    expected = forward(torch.compile(ref), x).cpu()
    del ref
    dynamo.reset()
    compiled = torch.compile(model.to(CUDA))
    plain = forward(compiled, x).cpu()
    model.to("cpu")
    with wf.enable({"transformer": compiled}, LAYER, device="cuda"):
        assert torch.equal(forward(compiled, x).cpu(), expected)
    model.to(CUDA)
    assert torch.equal(forward(compiled, x).cpu(), plain)
    dynamo.reset()


def _flux_on_gpu():
    from test_writes import model

    m, x = model()
    return m, {k: v.to(CUDA) if torch.is_tensor(v) else v for k, v in x.items()}


def _out(m, x):
    with torch.no_grad():
        return m(**x, return_dict=False)[0].cpu()


def _fuse_on_cpu(twin, **kw):
    """The twin fuses on the CPU (as editing() does) and goes back to the GPU."""
    twin.to("cpu")
    twin.fuse_lora(**kw)
    twin.to(CUDA)


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
@pytest.mark.parametrize("cfg", ["depth2", "resident1"])
def test_loads_edits_and_lora_on_cuda_equal_a_resident_twin(cfg):
    pytest.importorskip("peft")
    import copy

    from test_writes import CONFIGS, FIXED, STREAMED, lora, shifted, with_adapters

    m, x = _flux_on_gpu()
    with_adapters(m)
    twin = copy.deepcopy(m).to(CUDA)
    with wf.enable({"transformer": m}, CONFIGS[cfg], device="cuda") as h:
        assert torch.equal(_out(m, x), _out(twin, x))
        new = shifted(twin)
        m.load_state_dict(new)
        twin.load_state_dict(new)
        assert torch.equal(_out(m, x), _out(twin, x))
        for key in (STREAMED, FIXED):  # an edit outside editing() is put back and refused
            with torch.no_grad():
                m.get_parameter(key).mul_(2)
            with pytest.raises(wf.OffloadError):
                _out(m, x)
            assert torch.equal(_out(m, x), _out(twin, x))
        with h.editing():
            m.fuse_lora(adapter_names=["a", "b"])
        _fuse_on_cpu(twin, adapter_names=["a", "b"])
        assert torch.equal(_out(m, x), _out(twin, x))
        with h.editing():
            m.unfuse_lora()
        twin.to("cpu")
        twin.unfuse_lora()
        twin.to(CUDA)
        assert torch.equal(_out(m, x), _out(twin, x))
        for mod in (m, twin):
            mod.add_adapter(lora(seed=3), "late")
        assert m.transformer_blocks[1].attn.to_q.lora_A["late"].weight.device == CUDA, "a new adapter is on the GPU"
        assert torch.equal(_out(m, x), _out(twin, x))
        m.fuse_lora(adapter_names=["late"])  # no editing block: Module.apply walks the true weights in one
        assert m.transformer_blocks[1].attn.to_q.lora_A["late"].weight.device == CUDA, "back on the GPU"
        _fuse_on_cpu(twin, adapter_names=["late"])
        assert torch.equal(_out(m, x), _out(twin, x))
    want = {k: v.cpu() for k, v in twin.state_dict().items()}
    assert all(torch.equal(v.cpu(), want[k]) for k, v in m.state_dict().items())  # the late adapter stays on the GPU


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
def test_a_pipeline_loads_a_lora_without_editing_on_cuda_and_its_adapter_runs_on_the_gpu():
    # The pipeline's load_lora_weights runs inside editing() (weightferry/_lora.py), where peft places the new
    # adapter by its base weight (a CPU tensor there); after it the adapter is on the GPU, with the transformer.
    pytest.importorskip("peft")
    import copy

    from test_diffusers import flux_pipeline
    from test_writes import CONFIGS, pipeline_lora

    state = pipeline_lora(5)
    pipe, twin = flux_pipeline(), flux_pipeline()
    twin.load_lora_weights(copy.deepcopy(state), adapter_name="x")
    twin.transformer.to(CUDA)
    g = torch.Generator().manual_seed(0)
    x = {"hidden_states": torch.randn(1, 16, 4, generator=g),
         "encoder_hidden_states": torch.randn(1, 7, 32, generator=g),
         "pooled_projections": torch.randn(1, 32, generator=g), "timestep": torch.tensor([0.5]),
         "img_ids": torch.randn(16, 3, generator=g), "txt_ids": torch.randn(7, 3, generator=g)}
    x = {k: v.to(CUDA) if k.endswith("_ids") else v.to(CUDA, BF16) for k, v in x.items()}
    with wf.enable(pipe, CONFIGS["depth2"], device="cuda"):
        pipe.load_lora_weights(copy.deepcopy(state), adapter_name="x")
        adapter = pipe.transformer.transformer_blocks[0].attn.to_q.lora_A["x"].weight
        assert adapter.device == CUDA
        assert torch.equal(_out(pipe.transformer, x), _out(twin.transformer, x))
        pipe.unload_lora_weights()
        twin.unload_lora_weights()
        assert torch.equal(_out(pipe.transformer, x), _out(twin.transformer, x))


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
def test_module_mode_runs_vae_decode_and_encode_on_cuda():
    import copy

    from test_diffusers import t5
    from test_writes import vae

    m, x = _flux_on_gpu()
    pipe = {"transformer": m, "text_encoder": t5(), "vae": vae()}
    twin = {k: copy.deepcopy(v).to(CUDA) for k, v in pipe.items()}
    z, img = torch.randn(1, 4, 8, 8).to(CUDA), torch.randn(1, 3, 16, 16).to(CUDA)

    def run(p):
        with torch.no_grad():
            vae = p["vae"]
            return [vae.decode(z).sample.cpu(), vae.encode(img).latent_dist.mean.cpu(), _out(p["transformer"], x)]

    config = {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder", "vae"]}}
    with wf.enable(pipe, config, device="cuda"):
        for got, want in zip(run(pipe), run(twin)):
            assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
def test_a_part_of_a_block_called_outside_it_brings_the_block_in_on_cuda():
    import zoo

    (case,) = [c for c in zoo.DITS if c.name == "DiTTransformer2DModel"]
    m, x = case.build(), case.inputs()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    twin = case.build().to(CUDA)
    xg = {k: v.to(CUDA) for k, v in x.items()}
    want = case.run(twin, xg).cpu()
    cfg = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                        "layer_options": {"dit": {"prefetch_depth": 1}}}}
    with wf.enable({"transformer": m}, cfg, device="cuda"):
        for _ in range(2):
            assert torch.equal(case.run(m, xg).cpu(), want)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
def test_blocks_beyond_the_host_budget_are_read_from_disk_on_cuda(tmp_path):
    from test_checkpoint import LAYER, inputs
    from test_disk_tier import checkpoint, masters_of
    from test_host_memory import with_key

    ref, m, path = checkpoint(tmp_path, 128)
    x = inputs()
    twin = ref.to(CUDA)
    xg = {k: v.to(CUDA) for k, v in x.items()}
    with torch.no_grad():
        want = twin(**xg, return_dict=False)[0].cpu()
    budget = masters_of(m, path) * 6 // 10
    cfg = with_key(LAYER, host_masters="pinned", host_budget=budget)
    with wf.enable({"transformer": m}, cfg, device="cuda", checkpoint=path) as h:
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(m(**xg, return_dict=False)[0].cpu(), want)
        s = h.stats()
        assert s["disk_bytes"] > 0 and s["master_host_bytes"] + s["staging_host_bytes"] <= budget
