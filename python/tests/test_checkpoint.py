"""``weightferry.enable(..., checkpoint=PATH)`` on ``device="sim"``: a diffusers transformer built on the ``meta``
device is filled from a safetensors file (one file, and a sharded folder with its index) without the weights
passing through torch, bit-identical to the module the file was saved from; a file that does not match (a missing
tensor, another shape) raises ``CheckpointError`` naming the file and the tensor, with the module left as it was;
a pipeline of several components takes one file per component it names (``checkpoint={component: path}``), the
others keeping their own tensors. With ``host_masters`` the blocks are served from the file itself
(``auto``, ``mapped``) or from pinned masters (``pinned``), bit-exact either way; ``mapped`` refuses a layout the file
cannot serve; served from the file, a 141 MB transformer grows the process by under 0.3 × its weights (the
simulated device's own memory), against more than 0.9 × with pinned masters."""

import copy
import json
import re

import diffusers
import pytest
import torch
from safetensors.torch import save_file

import weightferry as wf

BF16 = torch.bfloat16
CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
LAYER = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                      "layer_options": {"dit": {"prefetch_depth": 2}}}}
pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")


def reference():
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(**CONFIG).to(BF16).eval()


def on_meta():
    with torch.device("meta"):
        return diffusers.FluxTransformer2DModel(**CONFIG).to(BF16).eval()


def inputs():
    g = torch.Generator().manual_seed(3)
    x = dict(hidden_states=torch.randn(1, 16, 8, generator=g), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
             pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
             img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.randn(7, 3, generator=g))
    return {k: v.to(BF16) if k not in ("img_ids", "txt_ids") else v for k, v in x.items()}


def forward(m, x):
    with torch.no_grad():
        return m(**x, return_dict=False)[0]


def weights(m):
    return {k: t.detach().clone() for k, t in m.state_dict().items()}


def save_sharded(state, folder, cut):
    """Two shards: the first ``cut`` names (sorted) in one file, the rest in the other, and the index."""
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / file))
        weight_map.update(dict.fromkeys(keys, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_meta_transformer_is_filled_from_the_checkpoint(tmp_path, layout):
    ref = reference()
    x = inputs()
    expected = forward(ref, x)
    state = weights(ref)
    if layout == "file":
        path = tmp_path / "transformer.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        path = tmp_path
        save_sharded(state, tmp_path, len(state) // 2)
    m = on_meta()
    assert all(p.device.type == "meta" for p in m.parameters())
    with wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=path) as h:
        assert h.enabled
        for _ in range(2):
            assert torch.equal(forward(m, x), expected)
    # Disabled: the module holds the checkpoint's weights as ordinary CPU tensors.
    got = m.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].device.type == "cpu" and torch.equal(got[k], v), k
    assert torch.equal(forward(m, x), expected)


def test_a_checkpoint_that_does_not_match_raises_and_leaves_the_module(tmp_path):
    state = weights(reference())
    missing = dict(state)
    gone = "single_transformer_blocks.1.proj_out.weight"
    del missing[gone]
    path = tmp_path / "missing.safetensors"
    save_file({k: v.contiguous() for k, v in missing.items()}, str(path))
    m = on_meta()
    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=path)
    assert str(path) in str(e.value) and gone in str(e.value)
    assert all(p.device.type == "meta" for p in m.parameters())
    assert not any(mod._forward_pre_hooks for mod in m.modules())

    reshaped = dict(state)
    reshaped["proj_out.weight"] = torch.zeros(3, 3, dtype=BF16)
    path = tmp_path / "reshaped.safetensors"
    save_file({k: v.contiguous() for k, v in reshaped.items()}, str(path))
    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=path)
    assert "proj_out.weight" in str(e.value) and "[3, 3]" in str(e.value)
    assert all(p.device.type == "meta" for p in m.parameters())

    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=tmp_path / "absent.safetensors")
    assert "absent.safetensors" in str(e.value)
    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=42)
    assert str(e.value) == (
        "checkpoint must be a path (str or os.PathLike) to a .safetensors or .gguf file or a sharded folder, got int"
    )


def test_a_checkpoint_path_fills_one_component_and_a_mapping_names_each():
    m = on_meta()
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": m, "transformer_2": on_meta()}, LAYER, device="sim", checkpoint="x.safetensors")
    assert str(e.value) == (
        "checkpoint= fills one component, but pipeline dict has transformer, transformer_2; pass the module the "
        "file holds alone, e.g. {'transformer': model}, or key each file by the component it fills: "
        "checkpoint={'transformer': path}"
    )
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint={"unet": "x.safetensors"})
    assert str(e.value) == (
        "checkpoint= names 'unet', but pipeline dict has components transformer; key each file by the component it "
        "fills, e.g. {'transformer': 'transformer/diffusion_pytorch_model.safetensors'}"
    )
    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint={"transformer": 7})
    assert str(e.value) == (
        "checkpoint['transformer'] must be a path (str or os.PathLike) to a .safetensors or .gguf file or a sharded "
        "folder, got int"
    )
    assert all(p.is_meta for p in m.parameters())


def test_two_components_from_their_own_files_and_a_third_from_its_tensors(tmp_path):
    # A pipeline of two transformers from two files (one sharded) and a third component with real CPU tensors:
    # every output bit-identical to the references, weights after disable the files' and the module's own.
    torch.manual_seed(1)
    refs = {"transformer": reference(), "transformer_2": diffusers.FluxTransformer2DModel(**CONFIG).to(BF16).eval()}
    save_file({k: v.contiguous() for k, v in weights(refs["transformer"]).items()}, str(tmp_path / "t1.safetensors"))
    (tmp_path / "t2").mkdir()
    save_sharded(weights(refs["transformer_2"]), tmp_path / "t2", 7)
    torch.manual_seed(2)
    third = diffusers.FluxTransformer2DModel(**CONFIG).to(BF16).eval()
    twin = copy.deepcopy(third)
    pipe = {"transformer": on_meta(), "transformer_2": on_meta(), "transformer_3": third}
    files = {"transformer": tmp_path / "t1.safetensors", "transformer_2": tmp_path / "t2"}
    cfg = json.loads(json.dumps(LAYER))
    x = inputs()
    with wf.enable(pipe, cfg, device="sim", checkpoint=files) as h:
        for _ in range(2):
            for name, ref in [*refs.items(), ("transformer_3", twin)]:
                assert torch.equal(forward(pipe[name], x), forward(ref, x)), name
        assert h.stats()["plan_host"]["master_bytes"] == h.stats()["master_host_bytes"]
    for name, ref in [*refs.items(), ("transformer_3", twin)]:
        got, want = weights(pipe[name]), weights(ref)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


def test_a_meta_tensor_no_checkpoint_fills_is_refused_before_anything_changes(tmp_path):
    save_file({k: v.contiguous() for k, v in weights(reference()).items()}, str(tmp_path / "t.safetensors"))
    pipe = {"transformer": on_meta(), "transformer_2": on_meta()}
    with pytest.raises(wf.PipelineError) as e:
        wf.enable(pipe, LAYER, device="sim", checkpoint={"transformer": tmp_path / "t.safetensors"})
    assert re.fullmatch(
        r"tensor 'transformer_2\.[\w.]+' is on the meta device, but no checkpoint fills its component; give its "
        r"component a file in checkpoint= \(\{component: path\}\), or build it with its weights", str(e.value))
    assert all(p.is_meta for m in pipe.values() for p in m.parameters())


@pytest.mark.parametrize("host_masters", ["auto", "mapped", "pinned"])
def test_blocks_are_served_from_the_checkpoint_file_itself(tmp_path, host_masters):
    # Heads of 128: every block tensor is a multiple of 256 bytes, so every section lies in the file as packed.
    config = dict(CONFIG, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**config).to(BF16).eval()
    x = inputs()
    expected = forward(ref, x)
    state = weights(ref)
    block_bytes = sum(v.numel() * v.element_size() for k, v in state.items() if "blocks." in k)
    path = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with torch.device("meta"):
        m = diffusers.FluxTransformer2DModel(**config).to(BF16).eval()
    cfg = json.loads(json.dumps(LAYER))
    cfg["diffusion_offload_config"]["host_masters"] = host_masters
    with wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path) as h:
        s = h.stats()
        served = (block_bytes, 0) if host_masters == "pinned" else (0, block_bytes)
        assert (s["master_host_bytes"], s["mapped_host_bytes"]) == served
        assert s["host_bytes"] == served[0]
        for _ in range(2):
            assert torch.equal(forward(m, x), expected)
        # Streamed weights served from the file are read-only; pinned masters take a write, and so does every
        # weight of the fixed placement (it leaves the file for a buffer of its own). disable gives back the written
        # bytes, never the file's.
        key, fixed = "transformer_blocks.1.attn.to_q.weight", "x_embedder.weight"
        new = {key: state[key] + 1}
        h.retune(prefetch_depth=1)  # the stacks of a checkpoint's blocks (in file order) are rebuilt alike
        assert torch.equal(forward(m, x), expected)
        if host_masters == "pinned":
            m.load_state_dict(new, strict=False)
            assert torch.equal(m.state_dict()[key], new[key])
            assert torch.equal(h.state_dict("transformer")[key], new[key])
        else:
            with pytest.raises(wf.OffloadError) as e:
                m.load_state_dict(new, strict=False)
            assert str(e.value) == (
                f"'transformer.{key}' is streamed read-only from its checkpoint file (host_masters = \"auto\" or "
                '"mapped" served its block from the file, or host_budget left the block to the disk tier); to write '
                'weights while enabled, enable with host_masters = "pinned" and a host_budget that holds every '
                "block, or disable first")
            assert torch.equal(forward(m, x), expected)
            new = {}
        new[fixed] = state[fixed] * 2
        m.load_state_dict({fixed: new[fixed]}, strict=False)
        assert torch.equal(m.state_dict()[fixed], new[fixed])
        ref.load_state_dict(new, strict=False)
        assert torch.equal(forward(m, x), forward(ref, x))
    for k, v in state.items():
        assert torch.equal(m.state_dict()[k], new.get(k, v)), k


def test_a_model_in_memory_keeps_a_write_after_disable(tmp_path):
    # The model holds its weights and names its own file: enable serves its blocks from pinned masters filled from
    # the file; a write into one is what disable gives back, in this session and after enabling again.
    ref = reference()
    state = weights(ref)
    path = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    m = copy.deepcopy(ref)
    cfg = json.loads(json.dumps(LAYER))
    cfg["diffusion_offload_config"]["host_masters"] = "pinned"
    key, fixed = "single_transformer_blocks.2.proj_out.weight", "proj_out.weight"
    new = {key: state[key] * 2, fixed: state[fixed] - 1}
    with wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path):
        m.load_state_dict(new, strict=False)
    for k, v in state.items():
        assert torch.equal(m.state_dict()[k], new.get(k, v)), k
    # The module now differs from the file: serving the file's bytes would drop the edit, so enable refuses.
    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path)
    assert str(e.value) == (
        f"tensor 'transformer.{key}' (and 1 more) holds values other than checkpoint {path}: checkpoint= serves the "
        "file's bytes, so the module's (an edit, a fused LoRA) would be lost; enable without checkpoint= (the "
        "module's own tensors become the host masters), or save the module (save_pretrained) and name that file")
    for k, v in state.items():
        assert torch.equal(m.state_dict()[k], new.get(k, v)), k
    with wf.enable({"transformer": m}, cfg, device="sim"):
        pass
    for k, v in state.items():
        assert torch.equal(m.state_dict()[k], new.get(k, v)), k


RSS_PROBE = """
import json, sys, warnings
import diffusers, torch
import weightferry as wf
warnings.simplefilter("ignore")
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
with torch.device("meta"):
    m = diffusers.FluxTransformer2DModel(**json.loads(sys.argv[1])).to(torch.bfloat16)
base = rss()
cfg = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "host_masters": sys.argv[2]}}
h = wf.enable({"transformer": m}, cfg, device="sim", checkpoint=sys.argv[3])
print(json.dumps({"grew": rss() - base, "masters": h.stats()["master_host_bytes"]}))
"""


@pytest.mark.parametrize("host_masters", ["auto", "pinned"])
def test_blocks_served_from_the_file_cost_the_process_no_copy(tmp_path, host_masters):
    # 141 MB of bf16 weights, every block section aligned; each probe in a fresh process, so its RSS is its own.
    import subprocess
    import sys

    config = dict(CONFIG, num_layers=4, num_single_layers=8, attention_head_dim=128, num_attention_heads=4,
                  joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(16, 56, 56))
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in diffusers.FluxTransformer2DModel(**config).to(BF16).state_dict().items()}
    weight_bytes = sum(v.numel() * v.element_size() for v in state.values())
    path = tmp_path / "transformer.safetensors"
    save_file(state, str(path))
    del state
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, json.dumps(config), host_masters, str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if host_masters == "auto":
        # Only the simulated device's memory (its slots and the fixed placement) and torch's bookkeeping grow.
        assert r["masters"] == 0 and r["grew"] < 0.3 * weight_bytes, (r, weight_bytes)
    else:
        assert r["masters"] > 0.95 * weight_bytes and r["grew"] > 0.9 * weight_bytes, (r, weight_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host_masters", ["auto", "mapped", "pinned"])
def test_on_cuda_blocks_copy_from_the_registered_file(tmp_path, host_masters):
    # The CUDA path of mapped masters: the file's mapping is registered read-only with the driver and the blocks are
    # copied from it; the outputs equal the same module resident on the GPU, bit for bit.
    config = dict(CONFIG, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**config).to(BF16).eval()
    state = weights(ref)
    path = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    cuda = torch.device("cuda", 0)
    x = {k: v.to(cuda) for k, v in inputs().items()}
    expected = forward(ref.to(cuda), x).cpu()
    with torch.device("meta"):
        m = diffusers.FluxTransformer2DModel(**config).to(BF16).eval()
    cfg = json.loads(json.dumps(LAYER))
    cfg["diffusion_offload_config"]["host_masters"] = host_masters
    with wf.enable({"transformer": m}, cfg, device="cuda", checkpoint=path) as h:
        s = h.stats()
        assert (s["mapped_host_bytes"] > 0) == (host_masters != "pinned"), s
        for _ in range(3):
            assert torch.equal(forward(m, x).cpu(), expected)
    for k, v in state.items():
        assert torch.equal(m.state_dict()[k].cpu(), v), k


WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
           text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
           eps=1e-6, rope_max_seq_len=32)


def params_on_meta(cls, **config):
    """``cls(**config)`` with its parameters on ``meta`` and its buffers real (what accelerate's
    ``init_empty_weights`` builds)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, None if param is None else torch.nn.Parameter(param.to("meta"), param.requires_grad))

    torch.nn.Module.register_parameter = on_meta
    try:
        return cls(**config).to(BF16).eval()
    finally:
        torch.nn.Module.register_parameter = register


def test_non_persistent_buffers_come_from_the_module_not_the_file(tmp_path):
    # Wan's rotary tables are non-persistent buffers: computed when the module is built, in no checkpoint.
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**WAN).to(BF16).eval()
    assert set(dict(ref.named_buffers())) - set(ref.state_dict()) == {"rope.freqs_cos", "rope.freqs_sin"}
    path = tmp_path / "wan.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    g = torch.Generator().manual_seed(5)
    x = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g).to(BF16), timestep=torch.tensor([500]),
             encoder_hidden_states=torch.randn(1, 7, 16, generator=g).to(BF16))
    expected = forward(ref, x)
    # Buffers on meta too: refused before anything moved, naming the buffer and the fix.
    with torch.device("meta"):
        m = diffusers.WanTransformer3DModel(**WAN).to(BF16).eval()
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=path)
    assert str(e.value) == (
        "buffer 'transformer.rope.freqs_cos' is on the meta device, but no checkpoint holds it (a non-persistent "
        "buffer, computed when the module is built); build the module with only its parameters on meta "
        "(accelerate.init_empty_weights(), which keeps buffers real) and enable it with checkpoint= again"
    )
    assert all(t.device.type == "meta" for t in [*m.parameters(), *m.buffers()])
    assert not any(mod._forward_pre_hooks for mod in m.modules())
    # Parameters alone on meta: the file fills them, the module's own rotary tables are kept.
    m = params_on_meta(diffusers.WanTransformer3DModel, **WAN)
    tables = {k: v.clone() for k, v in m.named_buffers()}
    with wf.enable({"transformer": m}, LAYER, device="sim", checkpoint=path) as h:
        assert h.stats()["enabled"]
        for _ in range(2):
            assert torch.equal(forward(m, x), expected)
    for k, v in ref.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    for k, v in m.named_buffers():
        assert torch.equal(v, tables[k]), k
