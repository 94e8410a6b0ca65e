"""A zoo of tiny, randomly initialised real models for the offloading tests: ``DITS``, diffusers transformers
(denoisers of image, video and audio pipelines, among them those with nested or several block lists: HunyuanVideo's
token refiner, AuraFlow's joint and single blocks, Lumina2's context and noise refiners, HiDream's double and single
blocks, WanVACE's ``vace_blocks``...), and ``ENCODERS``, transformers text encoders (T5, UMT5, CLIP, Llama, Qwen2/3,
Gemma2/3, Mistral, BERT...). Each :class:`Case` builds its model seeded, float32, in eval mode, on the CPU, and makes a
fresh dict of seeded CPU inputs; :meth:`Case.run` returns the main output tensor. Every case is deterministic (two
forwards, or a forward of a ``copy.deepcopy``, give ``torch.equal`` outputs) and takes well under a second on a CPU.

The configurations follow diffusers' own model tests (``tests/models/transformers``), with at least two blocks in
each block list where that is cheap."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import diffusers
import torch
import transformers


def _first(out: Any) -> torch.Tensor:
    """The main output of a forward called with ``return_dict=False``: the first element of the (nested) tuples or
    lists (a tensor returned alone is itself)."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    assert torch.is_tensor(out), type(out)
    return out


@dataclasses.dataclass
class Case:
    """One model: ``build`` (seeded, float32, eval) and ``inputs`` (a fresh dict of seeded CPU inputs each call).
    ``metadata`` says whether the model's class declares ``_repeated_blocks`` or ``_no_split_modules``; ``kwargs``
    are keyword arguments of every forward (``return_dict=False`` for diffusers), ``output`` picks the main tensor
    from what the forward returns."""

    name: str
    kind: str  # "dit" or "encoder"
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], dict]
    output: Callable[[Any], torch.Tensor] = _first
    kwargs: dict = dataclasses.field(default_factory=dict)
    metadata: bool = True

    def run(self, m: torch.nn.Module, x: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.output(m(**x, **self.kwargs))

    def __repr__(self) -> str:
        return f"Case({self.name})"


class _Rand:
    """Seeded random inputs: ``r(1, 4, 8)`` normal floats, ``r.ints(hi, 1, 7)`` integers, ``r.uniform(1)``."""

    def __init__(self, seed: int = 3):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)

    def ints(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g)

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g)


def _finite(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` with every value of its floating parameters that is NaN, infinite or beyond 1e6 in magnitude set to 0: some
    classes leave a parameter uninitialised (LuminaNext's ``pad_token`` is ``torch.empty``), holding whatever the
    allocator held: a NaN, which no comparison equals, or a huge value that overflows in the forward (no
    initialisation gives such values; the small garbage stays: each test compares a model with itself)."""
    with torch.no_grad():
        for t in m.parameters():
            if t.is_floating_point():
                t.masked_fill_(~torch.isfinite(t) | (t.abs() > 1e6), 0.0)
    return m


def _builder(cls: type, **config: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _finite(cls(**config).float().eval())

    build.__qualname__ = f"build_{cls.__name__}"
    return build


def _dit(cls_name: str, config: dict, inputs: Callable[[_Rand], dict], **case: Any) -> Case:
    cls = getattr(diffusers, cls_name)

    def make_inputs() -> dict:
        return inputs(_Rand())

    return Case(cls_name, "dit", _builder(cls, **config), make_inputs, kwargs={"return_dict": False}, **case)


# --------------------------------------------------------------------------------------------------- image models


def _flux_like(r: _Rand, channels: int = 4, text: int = 32, img: int = 16, txt: int = 7) -> dict:
    return dict(hidden_states=r(1, img, channels), encoder_hidden_states=r(1, txt, text),
                img_ids=r(img, 3), txt_ids=r(txt, 3), timestep=torch.tensor([0.5]))


FLUX = _dit(
    "FluxTransformer2DModel",
    dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
         joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 4, 8)),
    lambda r: dict(_flux_like(r), pooled_projections=r(1, 16)),
)

FLUX2 = _dit(
    "Flux2Transformer2DModel",
    dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
         joint_attention_dim=32, timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4)),
    lambda r: dict(
        hidden_states=r(1, 16, 4), encoder_hidden_states=r(1, 7, 32),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), torch.zeros(1),
                                           indexing="ij"), -1).reshape(1, 16, 4).long(),
        txt_ids=torch.stack([torch.zeros(7), torch.zeros(7), torch.zeros(7), torch.arange(7.0)], -1)[None].long(),
        timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
    ),
)

CHROMA = _dit(
    "ChromaTransformer2DModel",
    dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
         joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_num_channels=8, approximator_hidden_dim=16,
         approximator_layers=1),
    _flux_like,
)

OVIS = _dit(
    "OvisImageTransformer2DModel",
    dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
         num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8)),
    _flux_like,
)

LONGCAT_IMAGE = _dit(
    "LongCatImageTransformer2DModel",
    dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
         joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
    lambda r: dict(_flux_like(r), guidance=torch.tensor([3.5])),
)

BRIA_FIBO = _dit(
    "BriaFiboTransformer2DModel",
    dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
         joint_attention_dim=64, text_encoder_dim=32, pooled_projection_dim=None, axes_dims_rope=(0, 4, 4)),
    lambda r: dict(_flux_like(r, channels=16, text=64, txt=8), timestep=torch.tensor([1.0]),
                   text_encoder_layers=[r(1, 8, 32) for _ in range(4)]),
)

SD3 = _dit(
    "SD3Transformer2DModel",
    dict(sample_size=8, patch_size=1, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
         caption_projection_dim=16, joint_attention_dim=32, pooled_projection_dim=16, out_channels=4,
         pos_embed_max_size=16),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 7, 32), pooled_projections=r(1, 16),
                   timestep=torch.tensor([500])),
)

AURAFLOW = _dit(
    "AuraFlowTransformer2DModel",
    dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
         attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=32,
         out_channels=4, pos_embed_max_size=64),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 7, 32), timestep=torch.tensor([500])),
)

QWEN_IMAGE = _dit(
    "QwenImageTransformer2DModel",
    dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
         joint_attention_dim=16, axes_dims_rope=(2, 2, 4)),
    lambda r: dict(hidden_states=r(1, 16, 16), encoder_hidden_states=r(1, 7, 16),
                   encoder_hidden_states_mask=torch.ones(1, 7), timestep=torch.tensor([0.5]), img_shapes=[(1, 4, 4)]),
)

PIXART = _dit(
    "PixArtTransformer2DModel",
    dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=4, num_attention_heads=2, in_channels=4,
         cross_attention_dim=8, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
         num_embeds_ada_norm=8, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
         use_additional_conditions=False, caption_channels=None),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 7, 8), timestep=torch.tensor([500]),
                   added_cond_kwargs={"aspect_ratio": None, "resolution": None}),
)

DIT = _dit(  # its forward runs transformer_blocks[0].norm1.emb before any block (a call from outside a block)
    "DiTTransformer2DModel",
    dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2, sample_size=8,
         patch_size=2, num_embeds_ada_norm=10, norm_num_groups=1),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), timestep=torch.tensor([3]), class_labels=torch.tensor([1])),
    metadata=False,
)

SANA = _dit(
    "SanaTransformer2DModel",
    dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
         num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
         sample_size=8),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 7, 8), timestep=torch.tensor([500])),
)

LUMINA2 = _dit(
    "Lumina2Transformer2DModel",
    dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=2,
         num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
         scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=16),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([0.5]),
                   encoder_attention_mask=torch.ones(1, 7, dtype=torch.bool)),
)


def _lumina_next_inputs(r: _Rand) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    return dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([0.5]),
                encoder_mask=torch.ones(1, 7), image_rotary_emb=get_2d_rotary_pos_embed_lumina(8, 16, 16),
                cross_attention_kwargs={})


LUMINA_NEXT = _dit(
    "LuminaNextDiT2DModel",
    dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_attention_heads=3,
         num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, learn_sigma=False, qk_norm=True,
         cross_attention_dim=16, scaling_factor=1.0),
    _lumina_next_inputs,
    metadata=False,
)

HIDREAM = _dit(
    "HiDreamImageTransformer2DModel",
    dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
         num_attention_heads=2, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
         num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(16, 16), llama_layers=(0, 1, 2, 3),
         force_inference_output=True),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states_t5=r(1, 6, 8),
                   encoder_hidden_states_llama3=r(4, 1, 6, 4), pooled_embeds=r(1, 8), timesteps=torch.tensor([500])),
)


def _cogview_inputs(r: _Rand) -> dict:
    return dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 8, 8), timestep=torch.tensor([500]),
                original_size=torch.tensor([[64, 64]]), target_size=torch.tensor([[64, 64]]),
                crop_coords=torch.tensor([[0, 0]]))


COGVIEW4 = _dit(
    "CogView4Transformer2DModel",
    dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4, out_channels=4,
         text_embed_dim=8, time_embed_dim=8, condition_dim=4),
    _cogview_inputs,
)

COGVIEW3PLUS = _dit(
    "CogView3PlusTransformer2DModel",
    dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2, out_channels=4,
         text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=8, sample_size=8),
    _cogview_inputs,
)


def _hunyuan_dit_inputs(r: _Rand) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    return dict(
        hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 4, 8), text_embedding_mask=torch.ones(1, 4),
        encoder_hidden_states_t5=r(1, 4, 8), text_embedding_mask_t5=torch.ones(1, 4), timestep=torch.tensor([500.0]),
        image_meta_size=torch.tensor([[64.0, 64.0, 64.0, 64.0, 0.0, 0.0]]), style=torch.zeros(1, dtype=torch.long),
        image_rotary_emb=get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4), output_type="pt"),
    )


HUNYUAN_DIT = _dit(
    "HunyuanDiT2DModel",
    # An even number of blocks: the first half-minus-one push long skips that the last half-minus-one pop.
    dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
         cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16, text_len=4,
         text_len_t5=4, activation_fn="gelu-approximate"),
    _hunyuan_dit_inputs,
    metadata=False,
)

OMNIGEN = _dit(
    "OmniGenTransformer2DModel",
    dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=2,
         pad_token_id=0, vocab_size=64, in_channels=4, time_step_dim=4,
         rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]}),
    lambda r: dict(
        # 24 text tokens, the first 16 replaced by the 16 patches of the input image; + 1 time token + 16 patches.
        hidden_states=r(1, 4, 8, 8), timestep=torch.tensor([0.5]), input_ids=r.ints(10, 1, 24),
        input_img_latents=[r(1, 4, 8, 8)], input_image_sizes={0: [[0, 16]]},
        attention_mask=torch.ones(1, 41, 41), position_ids=torch.arange(41)[None],
    ),
)

ZIMAGE = _dit(
    "ZImageTransformer2DModel",
    dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=2, n_refiner_layers=2,
         n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
         axes_dims=[8, 4, 4], axes_lens=[64, 32, 32]),
    lambda r: dict(x=[r(16, 1, 8, 8)], cap_feats=[r(7, 16)], t=torch.tensor([0.5])),
)

HUNYUAN_IMAGE = _dit(
    "HunyuanImageTransformer2DModel",
    dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
         num_single_layers=2, num_refiner_layers=2, patch_size=(1, 1), guidance_embeds=False, text_embed_dim=16,
         text_embed_2_dim=16, rope_axes_dim=(4, 4)),
    lambda r: dict(hidden_states=r(1, 4, 8, 8), timestep=torch.tensor([500.0]), encoder_hidden_states=r(1, 7, 16),
                   encoder_attention_mask=torch.ones(1, 7), encoder_hidden_states_2=r(1, 5, 16),
                   encoder_attention_mask_2=torch.ones(1, 5)),
)

# --------------------------------------------------------------------------------------------------- video models

_HUNYUAN_VIDEO = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
                      num_single_layers=2, num_refiner_layers=2, patch_size=1, patch_size_t=1, guidance_embeds=True,
                      text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))


def _hunyuan_video_inputs(r: _Rand, frames: int = 1, side: int = 8) -> dict:
    return dict(hidden_states=r(1, 4, frames, side, side), timestep=torch.tensor([500.0]),
                encoder_hidden_states=r(1, 7, 16), pooled_projections=r(1, 8), encoder_attention_mask=torch.ones(1, 7),
                guidance=torch.tensor([3500.0]))


HUNYUAN_VIDEO = _dit("HunyuanVideoTransformer3DModel", dict(_HUNYUAN_VIDEO, image_condition_type=None),
                     _hunyuan_video_inputs)

HUNYUAN_FRAMEPACK = _dit(
    "HunyuanVideoFramepackTransformer3DModel",
    dict(_HUNYUAN_VIDEO, patch_size=2, image_condition_type=None, has_image_proj=True, image_proj_dim=16,
         has_clean_x_embedder=True),
    lambda r: dict(
        _hunyuan_video_inputs(r, frames=3, side=4), image_embeds=r(1, 5, 16), indices_latents=torch.ones(3),
        latents_clean=r(1, 4, 2, 4, 4), indices_latents_clean=torch.ones(2), latents_history_2x=r(1, 4, 2, 4, 4),
        indices_latents_history_2x=torch.ones(2), latents_history_4x=r(1, 4, 8, 4, 4),
        indices_latents_history_4x=torch.ones(8),
    ),
)

HUNYUAN_VIDEO15 = _dit(
    "HunyuanVideo15Transformer3DModel",
    dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
         num_refiner_layers=2, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8,
         image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v"),
    lambda r: dict(hidden_states=r(1, 4, 1, 8, 8), timestep=torch.tensor([500.0]), encoder_hidden_states=r(1, 6, 16),
                   encoder_hidden_states_2=r(1, 4, 8), encoder_attention_mask=torch.ones(1, 6),
                   encoder_attention_mask_2=torch.ones(1, 4), image_embeds=torch.zeros(1, 3, 12)),
)

_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32)


def _wan_inputs(r: _Rand, channels: int = 4) -> dict:
    return dict(hidden_states=r(1, channels, 2, 8, 8), timestep=torch.tensor([500]),
                encoder_hidden_states=r(1, 7, 16))


WAN = _dit("WanTransformer3DModel", _WAN, _wan_inputs)

WAN_VACE = _dit(
    "WanVACETransformer3DModel",
    dict(_WAN, num_layers=4, vace_layers=[0, 2], vace_in_channels=12),
    lambda r: dict(_wan_inputs(r), control_hidden_states=r(1, 12, 2, 8, 8)),
)

SKYREELS_V2 = _dit("SkyReelsV2Transformer3DModel", _WAN, _wan_inputs)

CHRONO_EDIT = _dit("ChronoEditTransformer3DModel", dict(_WAN, rope_temporal_skip_len=8), _wan_inputs)

LTX = _dit(
    "LTXVideoTransformer3DModel",
    dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
         num_layers=3, qk_norm="rms_norm_across_heads", caption_channels=16),
    lambda r: dict(hidden_states=r(1, 2 * 4 * 4, 4), encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([500]),
                   encoder_attention_mask=torch.ones(1, 7, dtype=torch.bool), num_frames=2, height=4, width=4),
)

LTX2 = _dit(
    "LTX2VideoTransformer3DModel",
    dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
         cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
         audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
         caption_channels=16, rope_double_precision=False),
    lambda r: dict(hidden_states=r(1, 2 * 4 * 4, 4), audio_hidden_states=r(1, 5, 4), encoder_hidden_states=r(1, 7, 16),
                   audio_encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([500.0]),
                   encoder_attention_mask=torch.ones(1, 7, dtype=torch.bool), num_frames=2, height=4, width=4,
                   audio_num_frames=5, fps=25.0),
)

COGVIDEOX = _dit(
    "CogVideoXTransformer3DModel",
    dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
         text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
         patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=8),
    lambda r: dict(hidden_states=r(1, 1, 4, 8, 8), encoder_hidden_states=r(1, 8, 8), timestep=torch.tensor([500])),
)

CONSISID = _dit(
    "ConsisIDTransformer3DModel",
    dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
         text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
         temporal_compression_ratio=4, max_text_seq_length=8, cross_attn_interval=1, is_kps=False,
         is_train_face=True, cross_attn_dim_head=1, cross_attn_num_heads=1, LFE_id_dim=2, LFE_vit_dim=2,
         LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=10,
         LFE_ff_mult=1, LFE_num_scale=1),
    lambda r: dict(hidden_states=r(1, 1, 4, 8, 8), encoder_hidden_states=r(1, 8, 8), timestep=torch.tensor([500]),
                   id_vit_hidden=[r(1, 2, 2)], id_cond=r(1, 2)),
    metadata=False,
)

MOCHI = _dit(
    "MochiTransformer3DModel",
    dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=3, pooled_projection_dim=16,
         in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
         activation_fn="swiglu", max_sequence_length=16),
    lambda r: dict(hidden_states=r(1, 4, 2, 8, 8), encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([500]),
                   encoder_attention_mask=torch.ones(1, 7, dtype=torch.bool)),
)

ALLEGRO = _dit(
    "AllegroTransformer3DModel",
    dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
         cross_attention_dim=16, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8),
    lambda r: dict(hidden_states=r(1, 4, 2, 8, 8), encoder_hidden_states=r(1, 7, 8), timestep=torch.tensor([500])),
    metadata=False,
)

LATTE = _dit(
    "LatteTransformer3DModel",
    dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=4, num_attention_heads=2, caption_channels=8,
         in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
         num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
         video_length=2),
    lambda r: dict(hidden_states=r(1, 4, 2, 8, 8), encoder_hidden_states=r(1, 7, 8), timestep=torch.tensor([500]),
                   enable_temporal_attentions=True),
    metadata=False,
)

COSMOS = _dit(
    "CosmosTransformer3DModel",
    # concat_padding_mask=False: the padding mask is resized with torchvision, which the tests do not install.
    dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=3, mlp_ratio=2,
         text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 16, 16), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0),
         concat_padding_mask=False, extra_pos_embed_type="learnable"),
    lambda r: dict(hidden_states=r(1, 4, 1, 8, 8), timestep=torch.tensor([500]), encoder_hidden_states=r(1, 7, 16),
                   attention_mask=torch.ones(1, 7), fps=30),
)

EASYANIMATE = _dit(
    "EasyAnimateTransformer3DModel",
    dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2, num_layers=2, out_channels=4,
         patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16, time_embed_dim=8,
         time_position_encoding_type="3d_rope", timestep_activation_fn="silu"),
    lambda r: dict(hidden_states=r(1, 4, 2, 8, 8), timestep=torch.tensor([500]), encoder_hidden_states=r(1, 7, 16)),
)

SANA_VIDEO = _dit(
    "SanaVideoTransformer3DModel",
    dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
         num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16,
         mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8, patch_size=(1, 2, 2),
         norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    lambda r: dict(hidden_states=r(1, 4, 2, 8, 8), encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([500])),
)


def _kandinsky5_inputs(r: _Rand) -> dict:
    return dict(hidden_states=r(1, 2, 8, 8, 16), encoder_hidden_states=r(1, 7, 16), timestep=torch.tensor([500.0]),
                pooled_projections=r(1, 8), visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
                text_rope_pos=torch.arange(7))


KANDINSKY5 = _dit(
    "Kandinsky5Transformer3DModel",
    dict(in_visual_dim=16, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=16, patch_size=(1, 2, 2),
         model_dim=16, ff_dim=32, num_text_blocks=2, num_visual_blocks=2, axes_dims=(1, 1, 2), visual_cond=False,
         attention_type="regular"),
    _kandinsky5_inputs,
)

# --------------------------------------------------------------------------------------------------- audio models


def _stable_audio_inputs(r: _Rand) -> dict:
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    return dict(hidden_states=r(1, 3, 8), timestep=torch.tensor([0.5]), encoder_hidden_states=r(1, 5, 4),
                global_hidden_states=r(1, 1, 8),
                rotary_embedding=get_1d_rotary_pos_embed(2, 8 + 1, use_real=True, repeat_interleave_real=False))


STABLE_AUDIO = _dit(
    "StableAudioDiTModel",
    dict(sample_size=8, in_channels=3, num_layers=2, attention_head_dim=4, num_key_value_attention_heads=2,
         out_channels=3, cross_attention_dim=4, time_proj_dim=8, global_states_input_dim=8,
         cross_attention_input_dim=4),
    _stable_audio_inputs,
    metadata=False,
)

STABLE_AUDIO3 = _dit(
    "StableAudio3DiTModel",
    dict(io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4, cond_token_dim=16, global_cond_dim=12,
         local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2, num_memory_tokens=3,
         use_differential_attention=False),
    lambda r: dict(hidden_states=r(1, 8, 16), timestep=torch.tensor([0.5]), encoder_hidden_states=r(1, 4, 16),
                   global_hidden_states=r(1, 12)),
)

DITS: list[Case] = [
    FLUX, FLUX2, CHROMA, OVIS, LONGCAT_IMAGE, BRIA_FIBO, SD3, AURAFLOW, QWEN_IMAGE, PIXART, DIT, SANA, LUMINA2,
    LUMINA_NEXT, HIDREAM, COGVIEW4, COGVIEW3PLUS, HUNYUAN_DIT, OMNIGEN, ZIMAGE, HUNYUAN_IMAGE,
    HUNYUAN_VIDEO, HUNYUAN_FRAMEPACK, HUNYUAN_VIDEO15, WAN, WAN_VACE, SKYREELS_V2, CHRONO_EDIT, LTX, LTX2, COGVIDEOX,
    CONSISID, MOCHI, ALLEGRO, LATTE, COSMOS, EASYANIMATE, SANA_VIDEO, KANDINSKY5,
    STABLE_AUDIO, STABLE_AUDIO3,
]

# --------------------------------------------------------------------------------------------------- text encoders

VOCAB = 64


def _encoder(name: str, cls_name: str, config_cls_name: str, config: dict, mask: bool = True,
             output: Callable[[Any], torch.Tensor] | None = None, metadata: bool = True) -> Case:
    cls = getattr(transformers, cls_name)
    config_cls = getattr(transformers, config_cls_name)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _finite(cls(config_cls(**config)).float().eval())

    build.__qualname__ = f"build_{cls_name}"

    def inputs() -> dict:
        r = _Rand()
        ids = r.ints(VOCAB, 1, 7)
        return dict(input_ids=ids, attention_mask=torch.ones(1, 7, dtype=torch.long)) if mask else dict(input_ids=ids)

    return Case(name, "encoder", build, inputs, output=output or (lambda out: out.last_hidden_state),
                metadata=metadata)


# Decoder-only models (Llama & co.): hidden 32, 2 layers, 4 heads of 8 (2 key-value heads), vocab 64.
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
_T5 = dict(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
           relative_attention_max_distance=16)
_CLIP = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=16, projection_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ENCODERS: list[Case] = [
    _encoder("T5EncoderModel", "T5EncoderModel", "T5Config", _T5),
    _encoder("UMT5EncoderModel", "UMT5EncoderModel", "UMT5Config", _T5),
    _encoder("CLIPTextModel", "CLIPTextModel", "CLIPTextConfig", _CLIP),
    _encoder("CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "CLIPTextConfig", _CLIP,
             output=lambda out: out.text_embeds),
    _encoder("LlamaModel", "LlamaModel", "LlamaConfig", _DECODER),
    _encoder("MistralModel", "MistralModel", "MistralConfig", dict(_DECODER, sliding_window=None)),
    _encoder("Qwen2Model", "Qwen2Model", "Qwen2Config", _DECODER),
    _encoder("Qwen3Model", "Qwen3Model", "Qwen3Config", _DECODER),
    _encoder("Gemma2Model", "Gemma2Model", "Gemma2Config", dict(_DECODER, sliding_window=4)),
    _encoder("Gemma3TextModel", "Gemma3TextModel", "Gemma3TextConfig", dict(_DECODER, sliding_window=4)),
    _encoder("GlmModel", "GlmModel", "GlmConfig", _DECODER),
    # The language models of Qwen-Image's and others' vision-language encoders (multimodal rope: 3 sections).
    _encoder("Qwen2_5_VLTextModel", "Qwen2_5_VLTextModel", "Qwen2_5_VLTextConfig",
             dict(_DECODER, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4})),
    _encoder("Qwen3VLTextModel", "Qwen3VLTextModel", "Qwen3VLTextConfig",
             dict(_DECODER, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4})),
    _encoder("BertModel", "BertModel", "BertConfig",
             dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=16, type_vocab_size=2, pad_token_id=0)),
]

CASES: list[Case] = DITS + ENCODERS
assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
