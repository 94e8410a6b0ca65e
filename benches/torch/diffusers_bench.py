#!/usr/bin/env python3
"""A full-size diffusers transformer (random bf16 weights) stepped resident, offloaded by weightferry and offloaded
by diffusers' group offloading, on one GPU, each variant in its own process (so its peak host RSS is its own).

    python3 benches/torch/diffusers_bench.py [--model flux-dev] [--variants resident,wf_d1,...] [--steps 5]

``--overlap SECONDS`` runs the variants' processes at once (compiling a full-size transformer takes minutes) and
times each alone in its turn once all are warm (``turns.py``): step times and the H2D probe are measured with nothing
else on the GPU; enable and pin times are not (they ran beside the other builds), nor is the compile time.

Variants: ``resident`` (the model on the GPU: the compute term of the bound, and the reference output); ``wf_dK``
(weightferry, every block streamed at prefetch depth K); ``wf_sdK`` (the same with a static schedule,
``static_slots``); any variant with ``_c``, ``_ma`` or ``_ro`` appended (``resident_c``, ``wf_sd2_ro``): compiled by
inductor, ``torch.compile(fullgraph=True)`` in mode ``default``, ``max-autotune-no-cudagraphs`` or ``reduce-overhead``
(CUDA graphs), or ``_rc``: diffusers' regional compilation (``compile_repeated_blocks(fullgraph=True)``, each block
class compiled once), compared with the resident model compiled alike and bounded by its step (inductor in its
deterministic mode, ``TORCHINDUCTOR_DETERMINISTIC=1``, unless the environment sets it: else the kernels it picks by
timing them differ from process to process, and so do the bf16 outputs); ``edges_<suffix>``: the resident model with
every block framed by two do-nothing custom operators declared as weightferry's compiled hooks are (what the block
edges alone change in inductor's kernels; the last lines compare every pair of the variants' outputs); ``_cg``
(``resident_cg``, ``wf_sd2_cg``): not compiled, the forward captured whole in one CUDA graph after the warm-up
steps (weightferry's copies inside it), each timed step a replay; ``_cgc``: compiled as ``_c``, then captured as
``_cg`` (inductor's kernels in a graph ``torch.cuda.graph`` records; compared with ``resident_c``); ``wf_bP``
(weightferry under a device budget of P% of the weight bytes, the planner keeping blocks resident; ``wf_b400`` keeps
every block resident through the hooks: what the hooks add to a step); ``group`` / ``group_record`` (diffusers
``apply_group_offloading``: block level, one block per group, ``use_stream=True``, without / with
``record_stream``). The default runs resident, wf_d1, wf_d2, wf_d4, wf_b25, wf_b50, wf_b75, group, group_record.
Each prints one JSON line; the parent prints a table last: step time, the ratio to the bound
``max(resident step, streamed bytes per step / pinned H2D)`` (both measured in this call), host RSS after enable
(``RSS GB``, and ``RSS×`` as a multiple of the weight bytes) and its peak (``peakRSS``, ``peak×``; both counted from
the process's RSS before the model is built, so the build's transient memory is in the peak), device memory in
use (``total - free`` from the driver: torch's pool and weightferry's buffers), the time to enable
(``enable s``: ``wf_*`` ``enable``, ``group`` applying group offloading, ``resident`` moving the model) beside its
floor ``pin s`` and their ratio ``en/pin``, and whether the output equals the resident output bit for bit.
``pin s`` (``pin_copy_s``, ``wf_*`` and ``group`` on a GPU, else ``-``) is measured in the variant's process just
before enable: every weight copied once into freshly allocated pinned host memory (buffers of 256 MiB, each freed,
and torch's pinned cache emptied, once full: not timed, so enable finds the host as the build left it and the peak
rises by one buffer at most). For the ``wf_*`` variants a second table sets the host memory the plan predicted
before anything was allocated (``pred GB``: the masters plus the file-served bytes, ``Handle.stats()["plan_host"]``)
beside the RSS after enable and its peak (``RSS/pred``, ``peak/pred``); for the checkpoint variants (the model on
``meta``, so the process holds no weights before enable) also what enable added to the process as ``enable`` found
it, CUDA context and inputs included (``added/pred``, ``peak added/pred``).

Checkpoint variants ``ck_<masters>_<dK|bP>[_h<H>]`` (``masters``: ``mapped`` or ``pinned``, the ``host_masters`` key;
``_h<H>``: a ``host_budget`` of H% of the weights, so the blocks beyond it are read from the file on every pass by
the disk tier, reported in a last table against the bound max(resident step, H2D bytes / pinned rate, disk bytes /
the file's ``O_DIRECT`` read rate measured in the same call); ``group_disk`` is diffusers' group offloading with
``offload_to_disk_path``, its disk offload) load
the transformer from a safetensors file of its full size, written once per call into ``--out`` from the same
random weights (so their output is compared with the resident one too): the module is built with its parameters
on ``meta`` and ``weightferry.enable(..., checkpoint=PATH)`` binds it, so the weights never pass through torch.
They report the time from the start of ``enable`` to the end of the first step, host RSS split into anonymous
memory (what the process owns; pinned masters count in neither) and file pages (the mapping), the bytes served
from the file and the pinned master bytes, beside the time to read the file once (page cache as the write left
it; ``--cold`` drops it first).

``--lora R`` adds two LoRA adapters of rank R (random, seeded) on the attention and feed-forward projections before
the model is offloaded, both active (weights 1.0 and 0.5), so every variant steps with them (bit-exact against the
resident model with the same adapters); after the steps it times switching (``set_adapters``), loading a third
adapter (``add_adapter``; diffusers' group offloading is removed and applied again, as its LoRA loaders do) and
unloading it (``delete_adapters``), and for weightferry fusing and unfusing both inside ``Handle.editing()``.

Models (full-size configs of the checkpoints' config.json; parameters counted on ``meta``): ``flux-dev``
(11.9 B, 1024²), ``qwen-image`` (20.4 B, 1024²), ``wan-14b`` (Wan 2.1 T2V 14B: 14.3 B, 480p x 81 frames), and models
no preset tunes: ``sd35-large`` (8.06 B, 1024², 333 text tokens), ``auraflow`` (v0.3: 6.86 B, 1024²), ``ltx-video``
(0.9: 1.92 B, 121 frames at 512x768, RoPE scaled as LTXPipeline at 25 fps), ``hunyuan-video`` (12.8 B, 33 frames
at 480x848, guidance 6 x 1000), and ``wan22-pair``: Wan 2.2 A14B's ``transformer`` and ``transformer_2``, two
transformers of the Wan 14B config (28.6 B together). A pipeline's steps switch from one to the other at the
boundary; here one step runs each once on the same inputs, so both stream in every step, and the output compared
bit for bit is the two outputs stacked. ``resident`` moves both, weightferry enables
``{"transformer": ..., "transformer_2": ...}`` with ``components: ["dit"]`` (both keys are discovered as DiTs and
stream), group offloading is applied to each, the weight bytes count both; ``--lora`` and the ``ck_`` variants
(``checkpoint=`` fills one component) take a model of one transformer.
``--quant`` quantizes the model in every variant before it is placed: ``fp8-layerwise`` (diffusers' layerwise
casting, weights stored in float8_e4m3fn and each layer cast to bf16 for its forward), ``torchao-int8`` /
``torchao-fp8`` (torchao int8 / float8 weight-only, each linear layer quantized on the GPU and brought back),
``gguf-q8_0`` / ``gguf-q4_0`` (each linear layer quantized by the ``gguf`` package into diffusers' ``GGUFLinear``, as
its GGUF quantizer loads a file; without the ``kernels`` package it dequantizes in torch each forward), ``bnb-nf4``
/ ``bnb-int8`` (each linear layer a bitsandbytes ``Linear4bit`` (NF4) / ``Linear8bitLt``, quantized on the GPU and
brought back, as diffusers' ``BitsAndBytesConfig`` builds them); weight bytes, ``GB/step`` and the bound then count
the stored (quantized) bytes, a 4-bit weight's ``quant_state`` tensors included.
``--tiny`` runs a tiny configuration (on the CPU and the simulated device when there is no GPU) to check the script:
narrow, but with enough blocks that the budgets from 25% up leave room for a ring.

Weights: one seeded random bf16 pattern of 64 Mi values, tiled over every tensor (deterministic, cheap to build,
finite); the pair's ``transformer_2`` gets the pattern rotated by 1 000 003 values, so the two differ. Inputs: the
model's real shapes at the chosen resolution. Needs torch, diffusers and weightferry.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import timeline
import turns


def flux_inputs(torch, c, g, tokens):
    n, t = tokens
    bf = torch.bfloat16
    x = dict(
        hidden_states=torch.randn(1, n, c["in_channels"], generator=g).to(bf),
        encoder_hidden_states=torch.randn(1, t, c["joint_attention_dim"], generator=g).to(bf),
        pooled_projections=torch.randn(1, c["pooled_projection_dim"], generator=g).to(bf),
        timestep=torch.tensor([0.5]).to(bf),
        img_ids=torch.randn(n, 3, generator=g),
        txt_ids=torch.randn(t, 3, generator=g),
    )
    if c.get("guidance_embeds"):
        x["guidance"] = torch.tensor([3.5]).to(bf)
    return x


def qwen_inputs(torch, c, g, tokens):
    (h, w), t = tokens
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, h * w, c["in_channels"], generator=g).to(bf),
        encoder_hidden_states=torch.randn(1, t, c["joint_attention_dim"], generator=g).to(bf),
        encoder_hidden_states_mask=torch.ones(1, t, dtype=torch.long),
        timestep=torch.tensor([0.5]).to(bf),
        img_shapes=[(1, h, w)],
    )


def wan_inputs(torch, c, g, tokens):
    (f, h, w), t = tokens
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, c["in_channels"], f, h, w, generator=g).to(bf),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, t, c["text_dim"], generator=g).to(bf),
    )


def sd3_inputs(torch, c, g, tokens):
    side, t = tokens
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, c["in_channels"], side, side, generator=g).to(bf),
        encoder_hidden_states=torch.randn(1, t, c["joint_attention_dim"], generator=g).to(bf),
        pooled_projections=torch.randn(1, c["pooled_projection_dim"], generator=g).to(bf),
        timestep=torch.tensor([500.0]).to(bf),
    )


def auraflow_inputs(torch, c, g, tokens):
    side, t = tokens
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, c["in_channels"], side, side, generator=g).to(bf),
        encoder_hidden_states=torch.randn(1, t, c["joint_attention_dim"], generator=g).to(bf),
        timestep=torch.tensor([0.5]).to(bf),
    )


def ltx_inputs(torch, c, g, tokens):
    (f, h, w), t = tokens
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, f * h * w, c["in_channels"], generator=g).to(bf),
        encoder_hidden_states=torch.randn(1, t, c["caption_channels"], generator=g).to(bf),
        timestep=torch.tensor([500]),
        encoder_attention_mask=torch.ones(1, t, dtype=torch.long),
        # as LTXPipeline at its default 25 fps: (VAE temporal compression / fps, spatial, spatial)
        num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32),
    )


def hunyuan_video_inputs(torch, c, g, tokens):
    (f, h, w), t = tokens
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, c["in_channels"], f, h, w, generator=g).to(bf),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, t, c["text_embed_dim"], generator=g).to(bf),
        encoder_attention_mask=torch.ones(1, t, dtype=torch.long),
        pooled_projections=torch.randn(1, c["pooled_projection_dim"], generator=g).to(bf),
        guidance=torch.tensor([6000.0]).to(bf),
    )


# Wan 2.1 T2V 14B's config; Wan 2.2 A14B's two transformers have it too.
WAN_14B = dict(
    cls="WanTransformer3DModel",
    config=dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    tiny=dict(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4, text_dim=32,
              freq_dim=32, ffn_dim=128, num_layers=14, rope_max_seq_len=32),
    inputs=wan_inputs, tokens=((21, 60, 104), 512), tiny_tokens=((2, 8, 8), 7),
)

MODELS = {
    # FLUX.1-dev's transformer: 19 double-stream + 38 single-stream blocks, 1024x1024 (4096 image tokens), 512 text.
    "flux-dev": dict(
        cls="FluxTransformer2DModel",
        config=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                    axes_dims_rope=(16, 56, 56)),
        tiny=dict(num_layers=2, num_single_layers=24, attention_head_dim=32, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 12, 12), in_channels=8),
        inputs=flux_inputs, tokens=(4096, 512), tiny_tokens=(16, 7),
    ),
    # The same at 512x512 (1024 image tokens): issue 29's launch-bound size.
    "flux-dev-512": dict(
        cls="FluxTransformer2DModel",
        config=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                    axes_dims_rope=(16, 56, 56)),
        tiny=dict(num_layers=2, num_single_layers=24, attention_head_dim=32, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 12, 12), in_channels=8),
        inputs=flux_inputs, tokens=(1024, 512), tiny_tokens=(16, 7),
    ),
    # Qwen-Image's transformer: 60 blocks, 1024x1024 (64x64 latent patches = 4096 image tokens), 512 text tokens.
    "qwen-image": dict(
        cls="QwenImageTransformer2DModel",
        config=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)),
        tiny=dict(num_layers=10, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                  axes_dims_rope=(8, 12, 12), in_channels=16, out_channels=4),
        inputs=qwen_inputs, tokens=((64, 64), 512), tiny_tokens=((4, 4), 7),
    ),
    # Wan 2.1 T2V 14B's transformer: 40 blocks, 480p x 81 frames (21 x 60 x 104 latents, 32 760 tokens), 512 text.
    "wan-14b": WAN_14B,
    # Wan 2.1 T2V 1.3B's transformer: 30 blocks, 480p x 81 frames (a small, launch-bound model; issue 29).
    "wan-1.3b": dict(WAN_14B, config=dict(WAN_14B["config"], num_attention_heads=12, ffn_dim=8960, num_layers=30)),
    # Wan 2.2 A14B's pair: two transformers of Wan 14B's config (high and low noise), each run once per step (see
    # `pair`), the second's weights from the pattern rotated (see `build`); 480p x 81 frames.
    "wan22-pair": dict(WAN_14B, pair=True),
    # Models no preset tunes (issue 26). SD3.5-Large's transformer: 38 joint blocks, 1024² (128² latents of 16
    # channels, 4096 tokens), 333 text tokens (77 CLIP + 256 T5).
    "sd35-large": dict(
        cls="SD3Transformer2DModel",
        config=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"),
        tiny=dict(sample_size=8, num_layers=10, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                  caption_projection_dim=64, pooled_projection_dim=16, in_channels=4, out_channels=4,
                  pos_embed_max_size=16),
        inputs=sd3_inputs, tokens=(128, 333), tiny_tokens=(8, 7),
    ),
    # AuraFlow v0.3: 4 joint + 32 single blocks, 1024² (128² latents, 4096 tokens), 256 text tokens.
    "auraflow": dict(
        cls="AuraFlowTransformer2DModel",
        config=dict(sample_size=64, patch_size=2, in_channels=4, num_mmdit_layers=4, num_single_dit_layers=32,
                    attention_head_dim=256, num_attention_heads=12, joint_attention_dim=2048,
                    caption_projection_dim=3072, out_channels=4, pos_embed_max_size=9216),
        tiny=dict(sample_size=8, num_mmdit_layers=2, num_single_dit_layers=16, attention_head_dim=32,
                  num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=64, pos_embed_max_size=64),
        inputs=auraflow_inputs, tokens=(128, 256), tiny_tokens=(8, 7),
    ),
    # LTX-Video 0.9 (2B): 28 blocks, 121 frames at 512x768 (16 x 16 x 24 latents, 6144 tokens), 128 text tokens.
    "ltx-video": dict(
        cls="LTXVideoTransformer3DModel",
        config=dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                    attention_head_dim=64, cross_attention_dim=2048, num_layers=28, caption_channels=4096,
                    qk_norm="rms_norm_across_heads"),
        tiny=dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32, cross_attention_dim=64,
                  num_layers=14, caption_channels=32),
        inputs=ltx_inputs, tokens=((16, 16, 24), 128), tiny_tokens=((2, 4, 4), 7),
    ),
    # HunyuanVideo (13B): 20 double + 40 single blocks and a 2-block token refiner, 33 frames at 480x848
    # (9 x 60 x 106 latents, 14 310 tokens of patch 2), 256 text tokens.
    "hunyuan-video": dict(
        cls="HunyuanVideoTransformer3DModel",
        config=dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                    qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                    rope_theta=256.0, rope_axes_dim=(16, 56, 56)),
        tiny=dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2,
                  num_single_layers=24, num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=16,
                  rope_axes_dim=(8, 12, 12)),
        inputs=hunyuan_video_inputs, tokens=((9, 60, 106), 256), tiny_tokens=((1, 4, 4), 7),
    ),
}


def model_config(spec, tiny):
    return {**spec["config"], **(spec["tiny"] if tiny else {})}


def rss(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def thread_cpu():
    """Each thread's CPU seconds so far (user + system), by ``thread-id name``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[f"{tid} {name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(before, after, wall):
    """The threads busy more than 5% of ``wall`` seconds between two :func:`thread_cpu` readings, busiest first:
    ``[name, share of wall]``."""
    busy = [(k, (v - before.get(k, 0.0)) / wall) for k, v in after.items()]
    return [[k, round(share, 3)] for k, share in sorted(busy, key=lambda b: -b[1]) if share > 0.05]


def build(torch, name, tiny=False):
    """The model with random weights, built without initialising them (:func:`build_on_meta`), then its parameters
    get uninitialised CPU memory filled from one seeded pattern (a pair's second transformer from the pattern rotated
    by a prime number of values, so the two differ)."""
    model, spec = build_on_meta(torch, name, tiny)
    g = torch.Generator().manual_seed(0)
    pattern = (torch.rand(64 << 20, generator=g) * 0.04 - 0.02).to(torch.bfloat16)
    for i, part in enumerate(parts(model, spec).values()):
        fill(torch, part, pattern.roll(i * 1_000_003) if i else pattern)
    return model, spec


def fill(torch, model, pattern):
    """Gives each parameter of ``model`` CPU memory holding ``pattern``, tiled."""
    with torch.no_grad():
        for m in model.modules():
            for pname, p in list(m._parameters.items()):
                if p is None:
                    continue
                t = torch.empty(p.shape, dtype=p.dtype)
                flat = t.view(-1)
                for start in range(0, flat.numel(), pattern.numel()):
                    end = min(flat.numel(), start + pattern.numel())
                    flat[start:end].copy_(pattern[: end - start])
                m._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)


def parts(model, spec):
    """The transformers of the model by pipeline attribute: what weightferry enables as one pipeline and diffusers'
    group offloading is applied to, one by one."""
    return model.parts() if spec.get("pair") else {"transformer": model}


def write_checkpoint(torch, model, path):
    """Writes the model's state dict as one safetensors file, tensor by tensor (no second copy in memory); names in
    sorted order, as the safetensors library orders tensors of one dtype."""
    state = model.state_dict()
    names = sorted(state)
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
    header, at = {}, 0
    for n in names:
        t = state[n]
        size = t.numel() * t.element_size()
        header[n] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for n in names:
            f.write(state[n].detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)
    return at


def read_once(path, chunk=64 << 20):
    """Seconds to read the file once, sequentially."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def read_direct(path, chunk=64 << 20):
    """Seconds to read the file once with ``O_DIRECT`` (around the page cache, as the disk tier reads), sequentially
    into one page-aligned buffer; ``None`` where the filesystem refuses ``O_DIRECT``."""
    import mmap

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    buf = mmap.mmap(-1, chunk)  # anonymous mappings are page-aligned
    t0 = time.perf_counter()
    try:
        offset = 0
        while True:
            n = os.preadv(fd, [buf], offset)
            offset += n
            if n < chunk:
                break
    finally:
        os.close(fd)
        buf.close()
    return time.perf_counter() - t0


def drop_caches():
    """Writes the page cache back and drops it (needs root), so the next read of a file comes from disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def build_on_meta(torch, name, tiny=False):
    """The model with its parameters on ``meta`` (as accelerate's ``init_empty_weights`` does); buffers and plain
    tensor attributes such as rotary tables stay real, since no checkpoint holds them."""
    import diffusers

    nn = torch.nn
    spec = MODELS[name]
    register = nn.Module.register_parameter

    def on_meta(self, pname, param):
        register(self, pname, param)
        if param is not None:
            self._parameters[pname] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        make = getattr(diffusers, spec["cls"])
        model = make(**model_config(spec, tiny))
        if spec.get("pair"):
            model = pair(torch)(model, make(**model_config(spec, tiny)))
    finally:
        nn.Module.register_parameter = register
    return model.to(torch.bfloat16).eval(), spec


def pair(torch):
    """A module of two transformers (Wan 2.2's ``transformer`` and ``transformer_2``) whose forward runs each once
    on the same inputs, their outputs stacked: a step of the pair streams both."""

    class Pair(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.transformer, self.transformer_2 = a, b

        def parts(self):
            return {"transformer": self.transformer, "transformer_2": self.transformer_2}

        def forward(self, return_dict=False, **x):
            outs = [m(**x, return_dict=False)[0] for m in self.parts().values()]
            return (torch.stack(outs),)

    return Pair


def inputs(torch, spec, dev, tiny=False):
    g = torch.Generator().manual_seed(1)
    x = spec["inputs"](torch, model_config(spec, tiny), g, spec["tiny_tokens" if tiny else "tokens"])
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in x.items()}


def h2d_bandwidth(torch, size=256 << 20, copies=16):
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(copies):
        dev.copy_(host, non_blocking=True)
    e.record()
    torch.cuda.synchronize()
    return size * copies / (s.elapsed_time(e) / 1e3)


LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"]


def lora_config(rank, seed):
    import torch
    from peft import LoraConfig

    torch.manual_seed(seed)
    return LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=LORA_TARGETS)


def add_adapters(model, rank):
    """Two adapters of ``rank``, both active; returns their bytes."""
    model.add_adapter(lora_config(rank, 1), "a")
    model.add_adapter(lora_config(rank, 2), "b")
    model.set_adapters(["a", "b"], [1.0, 0.5])
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)


def lora_timings(torch, model, rank, handle, group, sync):
    """Seconds to switch, load and unload an adapter (and, offloaded by weightferry, to fuse and unfuse)."""
    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def reapply():
        if group:
            from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading

            _maybe_remove_and_reapply_group_offloading(model)

    out = {"switch_s": timed(lambda: model.set_adapters(["b"], [1.0]))}
    model.set_adapters(["a", "b"], [1.0, 0.5])
    out["load_s"] = timed(lambda: (model.add_adapter(lora_config(rank, 3), "c"), reapply()))
    out["unload_s"] = timed(lambda: model.delete_adapters("c"))  # diffusers re-applies group offloading itself
    if handle is not None:
        def fuse():
            with handle.editing():
                model.fuse_lora(adapter_names=["a", "b"])

        def unfuse():
            with handle.editing():
                model.unfuse_lora()

        out["fuse_s"] = timed(fuse)
        out["unfuse_s"] = timed(unfuse)
    return out


def plain_parts(t):
    """The plain tensors a weight is stored as: itself, a torchao tensor's inner tensors (``__tensor_flatten__``),
    or itself and the tensors its Python state holds (bitsandbytes' ``quant_state``: absmax, code, ...)."""
    if hasattr(type(t), "__tensor_flatten__") and not hasattr(t, "quant_type"):
        names, _ = t.__tensor_flatten__()
        return [p for n in names for p in plain_parts(getattr(t, n))]
    return [t, *state_tensors(t)]


def state_tensors(obj, seen=None):
    """The tensors in ``obj``'s attributes and, nested, in plain objects there (not modules)."""
    import torch

    seen = seen if seen is not None else {id(obj)}
    out = []
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
        elif hasattr(v, "__dict__") and not isinstance(v, (type, torch.nn.Module, torch.Tensor)) and id(v) not in seen:
            seen.add(id(v))
            out.extend(state_tensors(v, seen))
    return out


def stored_bytes(tensors):
    """Bytes the tensors are stored in (a quantized weight's quantized bytes and scales), each viewed byte range once
    (bitsandbytes' ``Int8Params.CB`` is a second view of the weight's bytes)."""
    return sum(n for _, _, n in unique_views(tensors))


def unique_views(tensors):
    """``(tensor, (storage, offset, bytes), bytes)`` of every plain part of ``tensors``, one per viewed byte range."""
    seen, out = set(), []
    for t in tensors:
        for p in plain_parts(t):
            n = p.numel() * p.element_size()
            key = (p.untyped_storage().data_ptr(), p.storage_offset(), n) if n else ("empty", id(p), 0)
            if key not in seen:
                seen.add(key)
                out.append((p, key, n))
    return out


def quantize(torch, model, kind, dev):
    """Quantizes ``model`` in place as ``--quant`` says: ``fp8-layerwise`` (diffusers' layerwise casting: fp8 storage,
    bf16 compute), ``torchao-int8`` / ``torchao-fp8`` (torchao int8 / float8 weight-only, quantized on ``dev`` one
    linear layer at a time and brought back to the CPU)."""
    if kind == "fp8-layerwise":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        return
    if kind.startswith("gguf-"):
        return quantize_gguf(torch, model, kind[5:].upper())
    if kind.startswith("bnb-"):
        return quantize_bnb(torch, model, kind, dev)
    import torchao.quantization as ao

    config = ao.Int8WeightOnlyConfig() if kind == "torchao-int8" else ao.Float8WeightOnlyConfig()
    for m in quantizable(torch, model).values():
        ao.quantize_(m, config, device=dev)
        m.to("cpu")
    torch.cuda.empty_cache() if dev.type == "cuda" else None


def quantizable(torch, model):
    """The linear layers a diffusers quantizer converts: every one outside the modules the model keeps in float32
    (its ``_keep_in_fp32_modules``, e.g. Wan's time embedder, whose input is cast to its weight's dtype)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(k in n.split(".") for k in keep)}


def quantize_bnb(torch, model, kind, dev):
    """Every quantizable linear layer made a bitsandbytes ``Linear4bit`` (``bnb-nf4``: NF4, bf16 compute, scales not
    quantized again, as diffusers' ``BitsAndBytesConfig(load_in_4bit=True)`` defaults) or ``Linear8bitLt``
    (``bnb-int8``: ``load_in_8bit``), quantized on ``dev`` by bitsandbytes and brought back to the CPU."""
    import bitsandbytes as bnb

    for name, c in quantizable(torch, model).items():
        parent, _, child = name.rpartition(".")
        if kind == "bnb-nf4":
            new = bnb.nn.Linear4bit(c.in_features, c.out_features, bias=c.bias is not None,
                                    compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=False)
            new.weight = bnb.nn.Params4bit(c.weight.data, requires_grad=False, quant_type="nf4",
                                           compress_statistics=False)
        else:
            new = bnb.nn.Linear8bitLt(c.in_features, c.out_features, bias=c.bias is not None, has_fp16_weights=False)
            new.weight = bnb.nn.Int8Params(c.weight.data, requires_grad=False, has_fp16_weights=False)
        new.bias = c.bias
        setattr(model.get_submodule(parent) if parent else model, child, new.to(dev).to("cpu"))
    torch.cuda.empty_cache() if dev.type == "cuda" else None


def quantize_gguf(torch, model, qtype):
    """Every linear layer whose rows are whole blocks of the GGUF type ``qtype`` (``Q8_0``, ``Q4_0``, ...) quantized
    with the ``gguf`` package (on all cores) into diffusers' ``GGUFLinear`` / ``GGUFParameter``, as diffusers' GGUF
    quantizer loads a GGUF file (bf16 compute)."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear

    q = gguf.GGMLQuantizationType[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[q]
    layers = {n: m for n, m in quantizable(torch, model).items() if m.in_features % block == 0}

    def one(item):
        name, m = item
        data = gguf.quants.quantize(m.weight.detach().float().numpy(), q)
        return name, GGUFParameter(torch.from_numpy(data), quant_type=q)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        weights = {f"{n}.weight": p for n, p in pool.map(one, layers.items())}
    biases = {n: m.bias for n, m in layers.items()}
    _replace_with_gguf_linear(model, torch.bfloat16, weights)
    for name, bias in biases.items():
        m = model.get_submodule(name)
        m.weight = weights[f"{name}.weight"]
        m.bias = bias


def pin_copy(torch, model, chunk=256 << 20):
    """Seconds to copy every weight of ``model`` once into freshly allocated pinned host memory: the floor under
    enable's time (a host master per weight, filled once). Buffers of ``chunk`` bytes (tensors split across them),
    each freed and torch's pinned cache emptied once it is full, so none is reused and host memory rises by one buffer
    at most (pinned pages count in the RSS peak); the frees are not timed."""
    flats = [p.detach().reshape(-1).view(torch.uint8)
             for p, _, n in unique_views(list(model.parameters()) + list(model.buffers())) if n]
    total = sum(f.numel() for f in flats)
    timed, done, i, at = 0.0, 0, 0, 0
    while done < total:
        t0 = time.perf_counter()
        buf = torch.empty(min(chunk, total - done), dtype=torch.uint8, pin_memory=True)
        filled = 0
        while filled < buf.numel():
            n = min(buf.numel() - filled, flats[i].numel() - at)
            buf[filled:filled + n].copy_(flats[i][at:at + n])
            filled, at = filled + n, at + n
            if at == flats[i].numel():
                i, at = i + 1, 0
        timed += time.perf_counter() - t0
        done += filled
        del buf
        torch._C._host_emptyCache()
    return timed


# A compiled variant's suffix and its torch.compile mode (inductor, fullgraph=True); ``_cg``: not compiled, the
# forward captured in one CUDA graph (torch.cuda.graph) after the warm-up steps, each timed step a replay.
# ``_cgc``: compiled as ``_c``, then captured as ``_cg`` (inductor's kernels in a graph torch.cuda.graph records).
# (``_cgc`` before ``_c``: a suffix is the first key the name ends with.)
COMPILE_MODES = {"_cgc": "default", "_c": "default", "_ma": "max-autotune-no-cudagraphs", "_ro": "reduce-overhead",
                 "_cg": None, "_rc": "regional"}
CAPTURED = ("_cg", "_cgc")


def compile_suffix(v):
    """The compile suffix of variant ``v`` (a key of ``COMPILE_MODES``), or ``""`` for an eager variant."""
    return next((k for k in COMPILE_MODES if v.endswith(k)), "")


def variant_base(v):
    """A variant's name without its compile suffix (see :func:`compiled`)."""
    suffix = compile_suffix(v)
    return v[: -len(suffix)] if suffix else v


def compiled(torch, args, model):
    """``<variant>_c`` / ``_ma`` / ``_ro``: the model compiled by inductor (``torch.compile(fullgraph=True)``, mode
    ``default`` / ``max-autotune-no-cudagraphs`` / ``reduce-overhead``) after it was placed; ``_rc``: its repeated
    blocks compiled in place (``compile_repeated_blocks(fullgraph=True)``); its first warm-up step compiles
    (``first_warmup_s``)."""
    mode = COMPILE_MODES.get(compile_suffix(args.variant))
    if args.no_cudagraph_trees:
        import torch._inductor.config

        torch._inductor.config.triton.cudagraph_trees = False
    if mode == "regional":  # diffusers' regional compilation: each repeated block's call, in place
        model.compile_repeated_blocks(fullgraph=True)
        return model
    return torch.compile(model, fullgraph=True, mode=mode) if mode else model


def offload(torch, args, model, spec, weight_bytes, dev, cpu):
    """Puts the model where the variant wants it: on the device (``resident``), enabled by weightferry (returns the
    handle) or under diffusers' group offloading."""
    v, ck = variant_base(args.variant), args.variant.startswith("ck_")
    if v == "resident":
        model.to(dev)
    elif v == "edges":  # resident, each repeated block framed by two custom operators as weightferry's compiled hooks
        model.to(dev)
        block_edges(torch, model)
    elif v.startswith("wf_") or ck:
        import warnings

        import weightferry as wf

        dcfg = {"mode": "layer", "components": ["dit"]}
        knobs = v.split("_")
        if ck and knobs[-1].startswith("h"):  # ck_<masters>_<dK|bP>_h<P>: a host budget of P% of the weights
            on_meta = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
            dcfg["host_budget"] = on_meta * int(knobs.pop()[1:]) // 100
        knob = knobs[-1]
        if knob.startswith("sd"):  # a static schedule (static_slots) at depth K: what torch.compile traces whole
            dcfg["layer_options"] = {"dit": {"prefetch_depth": int(knob[2:]), "static_slots": True}}
        elif knob.startswith("d"):
            dcfg["layer_options"] = {"dit": {"prefetch_depth": int(knob[1:])}}
        elif knob.startswith("b"):
            dcfg["device_budget"] = weight_bytes * int(knob[1:]) // 100
        extra = {}
        if ck:
            dcfg["host_masters"] = v.split("_")[1]
            extra["checkpoint"] = os.path.join(args.out, "checkpoint.safetensors")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return wf.enable(parts(model, spec), {"diffusion_offload_config": dcfg},
                             device="sim" if cpu else "cuda", **extra)
    elif v.startswith("group"):
        from diffusers.hooks import apply_group_offloading

        # group_disk: diffusers' disk offload (each group's weights saved under --out and read back per forward).
        disk = {"offload_to_disk_path": os.path.join(args.out, "group_disk")} if v == "group_disk" else {}
        for part in parts(model, spec).values():
            apply_group_offloading(part, onload_device=dev, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=not cpu,
                                   record_stream=v == "group_record" and not cpu,  # cpu: no stream to record on
                                   **disk)
    else:
        raise SystemExit(f"unknown variant {v}")
    return None


def block_edges(torch, model):
    """``edges``: every block of ``model`` (weightferry's own discovery: the lists of the classes diffusers'
    ``_repeated_blocks`` and ``_no_split_modules`` name) framed by two custom operators that do nothing, declared as
    weightferry's compiled hooks are (one declaring the block's weights mutated before it, one taking its output
    tensors after it): the resident model compiled with the edges a streamed compiled forward has, to tell what the
    edges change in inductor's kernels from what streaming changes."""
    from weightferry._discover import metadata_block_lists
    from weightferry._traced import output_tensors

    @torch.library.custom_op("wfbench::enter", mutates_args=("order", "weights"))
    def enter(order: torch.Tensor, weights: list[torch.Tensor]) -> None:
        pass

    @torch.library.custom_op("wfbench::leave", mutates_args=("order",))
    def leave(order: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        pass

    order = torch.zeros(1, device=next(model.parameters()).device)
    lists = metadata_block_lists(model)
    assert lists, f"{type(model).__name__} declares no block class (_repeated_blocks, _no_split_modules)"
    for block in [b for path in lists for b in model.get_submodule(path)]:
        weights = list(block.parameters())
        block.register_forward_pre_hook(lambda m, a, weights=weights: enter(order, weights))
        block.register_forward_hook(lambda m, a, out: leave(order, output_tensors(out)))


def step(torch, args, model, x, res, handle, t0, sync, cpu):
    """Warm-up and timed steps (and, for a checkpoint variant, the first step's time since ``t0``); returns the last
    output and the handle's stats before the timed steps."""
    before = handle.stats() if handle else None
    out = None
    inner = model
    if compile_suffix(args.variant) == "_ro":

        def model(**kw):  # each call a new step of the CUDA graph trees (the last output is read only at the end)
            torch.compiler.cudagraph_mark_step_begin()
            return inner(**kw)

    with torch.no_grad():
        if args.variant.startswith("ck_"):
            out = model(**x, return_dict=False)[0]
            sync()
            res["first_step_s"] = time.perf_counter() - t0
        for i in range(args.warmup):
            w0 = time.perf_counter()
            out = model(**x, return_dict=False)[0]
            if not i:
                sync()
                res["first_warmup_s"] = time.perf_counter() - w0
        sync()
        if compile_suffix(args.variant) in CAPTURED:
            model = captured(torch, inner, x, args.refill)
        turns.wait_for_turn(args.variant)  # --overlap: the GPU is this variant's alone from here
        if handle:
            before = handle.stats()
        threads, wall0 = thread_cpu(), time.perf_counter()
        if cpu:
            start = time.perf_counter()
        else:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
            marks[0].record()
        for i in range(args.steps):
            out = model(**x, return_dict=False)[0]
            if not cpu:
                marks[i + 1].record()  # each step's own time too (steps_s): a slow first step after an idle GPU
        if cpu:
            res["step_s"] = (time.perf_counter() - start) / args.steps
        else:
            sync()
            res["step_s"] = marks[0].elapsed_time(marks[-1]) / 1e3 / args.steps
            res["steps_s"] = [round(a.elapsed_time(b) / 1e3, 4) for a, b in zip(marks, marks[1:])]
        # the host threads busy during the timed steps (a thread spinning beside the copies shows here)
        res["busy_threads"] = busy_threads(threads, thread_cpu(), time.perf_counter() - wall0)
        if args.profile and not cpu:  # --profile: one more step on a device timeline (timeline.py)
            path = os.path.join(args.out, f"timeline-{args.variant}.json.gz")
            last = []  # the profiled step's output is the one compared (a CUDA graph tree overwrote the earlier one)
            res["profile"] = timeline.profile_step(torch, lambda: last.append(model(**x, return_dict=False)[0]), path)
            out = last[0]
            res["numa"] = timeline.numa_layout()
            if handle is not None and handle._session.static_stacks():
                res["master_GBps"] = timeline.master_rates(torch, handle)
            if handle is not None and len(res["numa"]["nodes"]) > 1:
                res["master_nodes"] = timeline.master_nodes(handle)
    return out, before


def captured(torch, model, x, refill=False):
    """``_cg``: the forward captured in one CUDA graph (weightferry's copies inside it for a ``wf_sd*`` variant); the
    returned callable replays it and returns the graph's output. ``refill`` (``"copy"`` / ``"kernel"``): each replay
    first writes every input tensor into the one the graph captured, from a copy of it (what a pipeline's step with
    new latents does), by ``copy_`` or by kernels."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(**x, return_dict=False)
    fresh = {k: v.clone() for k, v in x.items() if torch.is_tensor(v)} if refill else {}

    def replay(**kw):
        for k, v in fresh.items():
            if refill == "kernel":  # written by kernels, no copy-engine operation before the graph
                x[k].mul_(0).add_(v)
            else:
                x[k].copy_(v)
        graph.replay()
        return out

    return replay


def wf_results(res, handle, before, steps):
    """What weightferry's stats say about the timed steps: bytes streamed, device bytes, masters, hooks."""
    after = handle.stats()
    streamed = sum(a["h2d_bytes"] for a in after["stacks"]) - sum(b["h2d_bytes"] for b in before["stacks"])
    # replays of a captured forward copy outside the session's scheduler: its stats count what one replay copies
    res["streamed_per_step"] = after.get("captured_bytes_per_replay", 0) if after.get("captured") else streamed / steps
    res["wf_device_bytes"] = after.get("fixed_device_bytes", 0) + sum(a.get("device_bytes", 0) for a in after["stacks"])
    keys = ("master_host_bytes", "mapped_host_bytes", "disk_bytes", "staging_host_bytes", "pinned")
    res["wf_stats"] = {k: after[k] for k in keys if k in after}
    hook_ms = after["hooks"]["total_ms"] - before["hooks"]["total_ms"]
    res["hooks"] = dict(after["hooks"], per_step_ms=hook_ms / steps,
                        record_waits=sum(a.get("record_waits", 0) for a in after["stacks"]),
                        sync_fetches=sum(a.get("sync_fetches", 0) for a in after["stacks"]))
    res["hook_share"] = hook_ms / 1e3 / steps / res["step_s"]


def variant(args):
    import torch

    res = {"variant": args.variant, "model": args.model, "quant": args.quant}
    base = rss()
    v, ck = variant_base(args.variant), args.variant.startswith("ck_")
    model, spec = (build_on_meta if ck else build)(torch, args.model, args.tiny)
    cpu = args.tiny and not torch.cuda.is_available()  # the script's own check on a machine without a GPU
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if args.quant != "none":
        quantize(torch, model, args.quant, dev)
    weight_bytes = stored_bytes(list(model.parameters()) + list(model.buffers()))
    if args.lora:
        res["adapter_bytes"] = add_adapters(model, args.lora)
        res["lora_rank"] = args.lora
        model.requires_grad_(False)
    res["weight_bytes"] = weight_bytes
    res["rss_built"] = rss() - base
    x = inputs(torch, spec, dev, args.tiny)
    # the pinned-copy floor for enable (a checkpoint variant's weights are on meta: the file's read-once is its floor)
    res["pin_copy_s"] = pin_copy(torch, model) if v.startswith(("wf_", "group")) and not cpu else None

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    sync()
    # The process as enable finds it (torch's CUDA context, the inputs, the model as built): what enable adds is
    # measured from here, for the host table's observed-against-predicted columns.
    res["rss_before_enable"] = rss() - base
    t0 = time.perf_counter()
    handle = offload(torch, args, model, spec, weight_bytes, dev, cpu)
    sync()
    res["enable_s"] = time.perf_counter() - t0
    res["rss_after_enable"] = rss() - base
    model = compiled(torch, args, model)
    res["rss_anon_after_enable"] = rss("RssAnon")
    res["rss_file_after_enable"] = rss("RssFile")
    if handle is not None and hasattr(handle, "stats"):
        res["plan_host"] = handle.stats()["plan_host"]  # what the plan predicted, before anything was allocated
    out, before = step(torch, args, model, x, res, handle, t0, sync, cpu)
    free, total = (0, 0) if cpu else torch.cuda.mem_get_info()
    res["device_used"] = total - free
    res["peak_rss"] = rss("VmHWM") - base
    # A compiled variant is compared with the resident model compiled alike (inductor's kernels are not eager's); a
    # captured one (``_cg``) with the resident model captured, else eager (a graph replays the eager kernels).
    torch.save(out.cpu(), output_path(args.out, args.variant))  # every variant's (pairs() compares them all)
    out_path = output_path(args.out, f"resident{compile_suffix(args.variant)}")
    if v != "resident" and compile_suffix(args.variant) in CAPTURED and not os.path.exists(out_path):
        out_path = output_path(args.out, "resident" if compile_suffix(args.variant) == "_cg" else "resident_c")
    if v == "resident":
        res["bit_exact"] = True
    elif os.path.exists(out_path):
        want = torch.load(out_path)
        res["bit_exact"] = bool(torch.equal(out.cpu(), want))
        res["max_abs_diff"] = (out.cpu().float() - want.float()).abs().max().item()
    if handle:
        wf_results(res, handle, before, args.steps)
    elif v.startswith("group"):
        res["streamed_per_step"] = stored_bytes(t for n, t in model.named_parameters() if "blocks." in n)
    else:
        res["streamed_per_step"] = 0
    if args.lora:
        res["lora"] = lora_timings(torch, model, args.lora, handle, v.startswith("group"), sync)
    res["h2d_Bps"] = 1e9 if cpu else h2d_bandwidth(torch)  # cpu: a placeholder, the check runs the code only
    turns.end_turn(args.variant)
    print("RESULT " + json.dumps(res), flush=True)
    os._exit(0)  # the process ends here: no teardown of 24 GB of tensors and masters to wait for


def output_path(out, variant):
    """Where a variant's process saves its output under ``--out``."""
    return os.path.join(out, f"out-{variant}.pt")


def pairs(out, variants):
    """Every pair of the variants' saved outputs: equal or not, and their largest difference (a compiled variant
    against the resident model compiled alike is in the table; this says how every other pair compares)."""
    import torch

    outs = {v: torch.load(output_path(out, v)) for v in variants if os.path.exists(output_path(out, v))}
    if len(outs) >= 2:
        print("\noutputs, every pair: equal, largest difference")
        for i, a in enumerate(outs):
            for b in list(outs)[i + 1:]:
                diff = (outs[a].float() - outs[b].float()).abs().max().item()
                print(f"{a:<14}{b:<14}{torch.equal(outs[a], outs[b])!s:>6}  {diff:.6g}")


def table(results):
    res = {r["variant"]: r for r in results}
    resident = res.get("resident", {}).get("step_s")
    print(f"\n{'variant':<14}{'step s':>9}{'bound s':>9}{'ratio':>8}{'GB/step':>9}{'H2D GB/s':>10}"
          f"{'RSS GB':>8}{'RSS×':>7}{'peakRSS':>9}{'peak×':>7}{'dev GB':>8}{'enable s':>9}{'pin s':>8}"
          f"{'en/pin':>8}  bit-exact")
    for r in results:
        h2d = r["h2d_Bps"]
        # A compiled variant's compute term is the resident model compiled alike.
        suffix = compile_suffix(r["variant"])
        compute = res.get(f"resident{suffix}", {}).get("step_s") or resident
        bound = max(compute or 0, r["streamed_per_step"] / h2d)
        ratio = r["step_s"] / bound if bound else float("nan")
        wb = r["weight_bytes"]
        pin = r.get("pin_copy_s")
        pin_s, per_pin = ("-", "-") if pin is None else (f"{pin:.1f}", f"{r['enable_s'] / pin:.2f}")
        print(f"{r['variant']:<14}{r['step_s']:>9.4f}{bound:>9.4f}{ratio:>8.3f}{r['streamed_per_step'] / 1e9:>9.2f}"
              f"{h2d / 1e9:>10.1f}{r['rss_after_enable'] / 1e9:>8.1f}{r['rss_after_enable'] / wb:>7.2f}"
              f"{r['peak_rss'] / 1e9:>9.1f}{r['peak_rss'] / wb:>7.2f}{r['device_used'] / 1e9:>8.1f}"
              f"{r['enable_s']:>9.1f}{pin_s:>8}{per_pin:>8}  {r.get('bit_exact')}")
    for r in results:
        if "hook_share" in r:
            h = r["hooks"]
            print(f"{r['variant']}: hooks {h['per_step_ms']:.3f} ms per step = "
                  f"{100 * r['hook_share']:.3f}% of the step "
                  f"(p50 {h['p50_us']:.1f} us, p99 {h['p99_us']:.1f} us, {h['calls']} calls; host waits for the copy "
                  f"actor {h['record_waits']}, sync fetches {h['sync_fetches']})")
    for r in results:
        if compile_suffix(r["variant"]):
            print(f"{r['variant']}: first warm-up step (compiling) {r['first_warmup_s']:.1f} s")
        if not r.get("bit_exact", True) and "max_abs_diff" in r:
            print(f"{r['variant']}: largest difference from resident{compile_suffix(r['variant'])} "
                  f"{r['max_abs_diff']:.3g}")
    predicted = [r for r in results if "plan_host" in r]
    if predicted:
        print(f"\n{'host':<14}{'pred GB':>9}{'RSS GB':>8}{'RSS/pred':>9}{'peak/pred':>10}{'added/pred':>11}"
              f"{'peak added/pred':>16}")
        for r in predicted:
            p = sum(r["plan_host"].get(k, 0) for k in ("master_bytes", "mapped_bytes", "staging_bytes"))
            # A model bound from its file (built on meta) holds no weights before enable: what enable added to the
            # process (its CUDA context and inputs already there) is weightferry's own, against the prediction.
            added = "-"
            peak_added = "-"
            if "first_step_s" in r and "rss_before_enable" in r:
                added = f"{(r['rss_after_enable'] - r['rss_before_enable']) / max(p, 1):.3f}"
                peak_added = f"{(r['peak_rss'] - r['rss_before_enable']) / max(p, 1):.3f}"
            print(f"{r['variant']:<14}{p / 1e9:>9.2f}{r['rss_after_enable'] / 1e9:>8.2f}"
                  f"{r['rss_after_enable'] / max(p, 1):>9.3f}{r['peak_rss'] / max(p, 1):>10.3f}{added:>11}"
                  f"{peak_added:>16}")
    cks = [r for r in results if "first_step_s" in r]
    if cks:
        print(f"\n{'checkpoint':<16}{'start→1st step s':>17}{'read once s':>12}{'anon GB':>9}{'file GB':>9}"
              f"{'pinned GB':>10}{'mapped GB':>10}{'step s':>9}")
        for r in cks:
            st = r["wf_stats"]
            print(f"{r['variant']:<16}{r['first_step_s']:>17.2f}{r.get('read_once_s', float('nan')):>12.2f}"
                  f"{r['rss_anon_after_enable'] / 1e9:>9.2f}{r['rss_file_after_enable'] / 1e9:>9.2f}"
                  f"{st.get('master_host_bytes', 0) / 1e9:>10.2f}{st.get('mapped_host_bytes', 0) / 1e9:>10.2f}"
                  f"{r['step_s']:>9.4f}")
    disks = [r for r in cks if r["wf_stats"].get("disk_bytes")]
    if disks:
        # The disk tier's bound: the largest of the resident step, the host-to-device bytes over the pinned rate and
        # the disk bytes over the O_DIRECT read rate of the file (both measured in this call).
        print(f"\n{'disk tier':<16}{'budget GB':>10}{'disk GB':>9}{'read GB/s':>10}{'bound s':>9}{'step s':>9}"
              f"{'ratio':>7}{'RSS GB':>8}{'pred GB':>8}")
        for r in disks:
            st, host = r["wf_stats"], r["plan_host"]
            rate = r["file_bytes"] / r["read_direct_s"] if r.get("read_direct_s") else float("nan")
            bound = max(resident or 0, r["streamed_per_step"] / r["h2d_Bps"], st["disk_bytes"] / rate)
            pred = host["master_bytes"] + host["staging_bytes"]
            print(f"{r['variant']:<16}{(host['budget'] or 0) / 1e9:>10.2f}{st['disk_bytes'] / 1e9:>9.2f}"
                  f"{rate / 1e9:>10.2f}{bound:>9.4f}{r['step_s']:>9.4f}{r['step_s'] / bound:>7.3f}"
                  f"{r['rss_after_enable'] / 1e9:>8.2f}{pred / 1e9:>8.2f}")
    loras = [r for r in results if "lora" in r]
    if loras:
        print(f"\n{'LoRA':<14}{'switch ms':>10}{'load s':>8}{'unload s':>9}{'fuse s':>8}{'unfuse s':>9}")
        for r in loras:
            t = r["lora"]
            print(f"{r['variant']:<14}{t['switch_s'] * 1e3:>10.2f}{t['load_s']:>8.3f}{t['unload_s']:>9.3f}"
                  f"{t.get('fuse_s', float('nan')):>8.2f}{t.get('unfuse_s', float('nan')):>9.2f}")
        print(f"adapters: {loras[0]['adapter_bytes'] / 1e9:.3f} GB (two, rank {loras[0]['lora_rank']})")
    if results:
        quant = f", {results[0]['quant']}" if results[0].get("quant", "none") != "none" else ""
        print(f"weights: {results[0]['weight_bytes'] / 1e9:.2f} GB stored ({results[0]['model']}{quant})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="flux-dev", choices=sorted(MODELS))
    ap.add_argument("--variants", default="resident,wf_d1,wf_d2,wf_d4,wf_b25,wf_b50,wf_b75,group,group_record")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lora", type=int, default=0, help="rank of two LoRA adapters added before offloading (0: none)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quant", default="none",
                    choices=["none", "fp8-layerwise", "torchao-int8", "torchao-fp8", "gguf-q8_0", "gguf-q4_0",
                             "bnb-nf4", "bnb-int8"],
                    help="quantize the model in every variant: diffusers' layerwise casting (fp8 storage), torchao "
                         "int8 / float8 weight-only, GGUF Q8_0 / Q4_0 (diffusers' GGUFLinear), or bitsandbytes NF4 / "
                         "int8 (Linear4bit / Linear8bitLt)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny configuration of the model (on the CPU and the simulated device without a GPU): "
                         "checks the script, measures nothing")
    ap.add_argument("--out", default="/tmp/wf-diffusers-bench")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache (root: /proc/sys/vm/drop_caches) before reading the checkpoint once and "
                         "before each checkpoint variant, so start-up is measured from disk")
    ap.add_argument("--overlap", type=float, default=0, metavar="SECONDS",
                    help="run the variants' processes at once, each timed alone in its turn once all are warm "
                         "(benches/torch/turns.py); a process not warm SECONDS after the start is killed")
    ap.add_argument("--stagger", type=float, default=20, help="with --overlap: seconds between the processes' starts")
    ap.add_argument("--hold", metavar="PATH",
                    help="with --overlap: the first turn waits until the file PATH is gone (other GPU work beside)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, one more step on a device timeline (benches/torch/timeline.py): "
                         "its Chrome trace under --out, and per stream the busy time and largest gaps in the result")
    ap.add_argument("--no-cudagraph-trees", action="store_true",
                    help="the _ro variants record with inductor's plain CUDA graphs, not CUDA graph trees "
                         "(torch._inductor.config.triton.cudagraph_trees = False): does the tree machinery cost a "
                         "copy-bound model its copy rate")
    ap.add_argument("--refill", choices=("copy", "kernel"),
                    help="the _cg / _cgc variants copy every input into the captured ones before each replay, as a "
                         "pipeline's step does (the work inductor's CUDA graphs do before theirs): with copy_, or "
                         "written by kernels (mul_(0).add_())")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return variant(args)
    variants = args.variants.split(",")
    if args.overlap and (args.cold or args.lora):
        raise SystemExit("--overlap times the steps alone, not what runs beside them: --cold and --lora run one "
                         "variant at a time")
    if MODELS[args.model].get("pair") and (args.lora or any(v.startswith("ck_") for v in variants)):
        raise SystemExit(f"{args.model} has two transformers: --lora and the ck_ variants (checkpoint= fills one "
                         "component) take a model of one")
    os.makedirs(args.out, exist_ok=True)
    if any(compile_suffix(v) not in ("", "_cg") for v in variants):
        # Inductor picks some kernels' configurations by timing them, a choice that moves bf16 roundings and differs
        # from process to process (SD3.5-Large: the resident model compiled in two processes differed by 0.0156):
        # without its deterministic mode no compiled variant could be compared bit for bit with another process.
        os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
        print("TORCHINDUCTOR_DETERMINISTIC=" + os.environ["TORCHINDUCTOR_DETERMINISTIC"], flush=True)
    results = []
    read_s = direct_s = size = None
    if any(v.startswith("ck_") for v in variants):
        import torch

        t0 = time.time()
        path = os.path.join(args.out, "checkpoint.safetensors")
        model, _ = build(torch, args.model, args.tiny)
        size = write_checkpoint(torch, model, path)
        del model
        if args.cold:
            drop_caches()
        read_s = read_once(path)
        direct_s = read_direct(path)
        print(f"checkpoint: {size / 1e9:.2f} GB written in {time.time() - t0:.0f} s; read once in {read_s:.2f} s, "
              f"with O_DIRECT in {direct_s if direct_s is None else round(direct_s, 2)} s", flush=True)

    def command(v):
        cmd = [sys.executable, __file__, "--model", args.model, "--variant", v, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--out", args.out, "--lora", str(args.lora), "--quant", args.quant]
        cmd += ["--profile"] if args.profile else []
        cmd += ["--no-cudagraph-trees"] if args.no_cudagraph_trees else []
        cmd += ["--refill", args.refill] if args.refill else []
        return [*cmd, "--tiny"] if args.tiny else cmd

    def report(v, returncode, stdout, stderr, seconds):
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if returncode or not lines:
            print(f"{v}: failed (exit {returncode}) after {seconds:.0f} s\n{stderr[-3000:]}", flush=True)
            return
        r = json.loads(lines[-1][7:])
        if v.startswith("ck_"):
            r["read_once_s"] = read_s
            r["read_direct_s"], r["file_bytes"] = direct_s, size
        print(f"{v}: {seconds:.0f} s  " + json.dumps(r), flush=True)
        results.append(r)

    if args.overlap:
        turns.run_overlapped({v: command(v) for v in variants}, args.overlap, report, stagger_s=args.stagger,
                              hold=args.hold)
    for v in variants if not args.overlap else []:
        if args.cold and v.startswith("ck_"):
            drop_caches()
        t0 = time.time()
        p = subprocess.run(command(v), capture_output=True, text=True)
        report(v, p.returncode, p.stdout, p.stderr, time.time() - t0)
    table(results)
    pairs(args.out, [r["variant"] for r in results])


if __name__ == "__main__":
    main()
