"""Tiny whole diffusers pipelines for the tests: built from configurations with random weights (seeded) and
word-level tokenizers built here (no download), every module in bf16 and in eval mode, each run end to end on the CPU
in well under a second: ``sd3_pipeline`` (StableDiffusion3Pipeline: three text encoders), ``wan22_pipeline``
(WanPipeline with two transformers, both used in one run), ``ltx_pipeline`` (LTXPipeline), ``qwen_image_pipeline``
(QwenImagePipeline, its Qwen2.5-VL text encoder run on text only) and ``hunyuan_video_pipeline`` (HunyuanVideoPipeline:
Llama and CLIP text encoders). Each ``run_<name>(pipe)`` runs its pipeline with a fixed generator and returns the
output tensor (``output_type="pt"``, bf16); the run is deterministic, so two runs, or a run of a deep copy, are
``torch.equal``. Flux's tiny pipeline is ``flux_pipeline`` in test_diffusers.py.

diffusers warns, when a transformer is cast with ``.to(torch.bfloat16)``, of modules that should be kept in float32
(Wan's norms, rope, time embedder): the tests cast everything, as ``flux_pipeline`` does; the runs stay finite."""

import diffusers
import torch
import transformers

BF16 = torch.bfloat16

WORDS = ["a", "photo", "of", "cat", "dog", "on", "the", "moon", "video", "walking"]
PROMPT = "a photo of a cat on the moon"
SPECIAL = ["<pad>", "<unk>", "</s>", "<s>"]
CHAT = ["<|im_start|>", "<|im_end|>", "\n"]


def tokenizer(max_len, bos=False, chat=False):
    """A word-level tokenizer built here (no download): the words of the prompts, ``</s>`` (id 2) as the end token;
    with ``bos`` also ``<s>`` (id 3) as the start token, as CLIP tokenizers have. Unknown words (a template's) map to
    ``<unk>`` (id 1); nothing is added to the encoded text. With ``chat``, ``<|im_start|>``, ``<|im_end|>`` and the
    newline are tokens of their own, so that Qwen-Image's prompt template is, like with Qwen's tokenizer, 34 tokens
    before the prompt (the number the pipeline drops)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + CHAT)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if chat:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, normalized=False) for t in CHAT])
    extra = {"bos_token": "<s>"} if bos else {}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>", model_max_length=max_len, **extra
    )


VOCAB = len(SPECIAL) + len(WORDS) + len(CHAT)


def _t5(cls=transformers.T5EncoderModel, config=transformers.T5Config):
    return cls(config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    ))


def _clip_with_projection():
    return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        bos_token_id=3, eos_token_id=2, pad_token_id=0, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=VOCAB, projection_dim=32, hidden_act="gelu",
    ))


def _bf16(pipe, *modules):
    for m in modules:
        m.to(BF16).eval()
    return pipe


def sd3_pipeline():
    """A tiny StableDiffusion3Pipeline, near diffusers' own test shapes (SD3 transformer of two joint blocks, two CLIP
    encoders with projection whose pooled outputs concatenate to the transformer's pooled projection, a T5 encoder),
    a one-level VAE (32×32 latents of 4 channels, 16×16 tokens of patch 2), local tokenizers (CLIP's padded to 77)."""
    torch.manual_seed(0)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    )
    clip = _clip_with_projection()
    clip_2 = _clip_with_projection()
    t5 = _t5()
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer, text_encoder=clip,
        tokenizer=tokenizer(77, bos=True), text_encoder_2=clip_2, tokenizer_2=tokenizer(77, bos=True),
        text_encoder_3=t5, tokenizer_3=tokenizer(16),
    )
    return _bf16(pipe, transformer, clip, clip_2, t5, vae)


def run_sd3(pipe):
    """Two steps at 32×32 with classifier-free guidance (the empty negative prompt through all three encoders)."""
    return pipe(prompt=PROMPT, num_inference_steps=2, height=32, width=32, guidance_scale=5.0, max_sequence_length=16,
                output_type="pt", generator=torch.Generator().manual_seed(0)).images


# Two steps of the flow-matching scheduler (shift 1) are at timesteps 1000 and 1: Wan 2.2's boundary, 0.875 × 1000
# train timesteps, puts the first on `transformer` (high noise, t >= 875) and the second on `transformer_2` (low noise);
# with 3 or 4 steps too both run (1000, 500.5, 1 / 1000, 667, 334, 1).
WAN22_BOUNDARY_RATIO = 0.875


def _wan_transformer():
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def wan22_pipeline():
    """A tiny Wan 2.2 WanPipeline (text to video): two transformers of two blocks each (``transformer`` for high
    noise, ``transformer_2`` for low noise, split by ``boundary_ratio``), a UMT5 encoder, a Wan VAE of diffusers' test
    shapes (8× spatial, 4× temporal: 5 frames of 32×32 are latents of 2 frames of 4×4; its decode runs the decoder
    once per latent frame, with a feature cache), a local tokenizer."""
    torch.manual_seed(0)
    transformer = _wan_transformer()
    transformer_2 = _wan_transformer()
    umt5 = _t5(transformers.UMT5EncoderModel, transformers.UMT5Config)
    vae = diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
    )
    pipe = diffusers.WanPipeline(
        tokenizer=tokenizer(16), text_encoder=umt5, vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        transformer=transformer, transformer_2=transformer_2, boundary_ratio=WAN22_BOUNDARY_RATIO,
    )
    return _bf16(pipe, transformer, transformer_2, umt5, vae)


def run_wan22(pipe):
    """Two steps (one per transformer) of 5 frames at 32×32 with classifier-free guidance; the video as a tensor
    (batch, frames, channels, height, width)."""
    return pipe(prompt="a video of a cat walking", num_inference_steps=2, height=32, width=32, num_frames=5,
                guidance_scale=4.0, guidance_scale_2=3.0, max_sequence_length=16, output_type="pt",
                generator=torch.Generator().manual_seed(0)).frames


def ltx_pipeline():
    """A tiny LTXPipeline (text to video): diffusers' own test shapes (LTX transformer of two blocks, a T5 encoder, an
    LTX VAE of four levels of 8 channels, 4× spatial and 4× temporal: 9 frames of 32×32 are latents of 3 frames of
    8×8), a local tokenizer."""
    torch.manual_seed(0)
    transformer = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=32,
    )
    t5 = _t5()
    vae = diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1, 1, 1, 1), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    pipe = diffusers.LTXPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=t5, tokenizer=tokenizer(16),
        transformer=transformer,
    )
    return _bf16(pipe, transformer, t5, vae)


def run_ltx(pipe):
    """Two steps of 9 frames at 32×32 with classifier-free guidance; the video as a tensor (batch, frames, channels,
    height, width)."""
    return pipe(prompt="a video of a cat walking", num_inference_steps=2, height=32, width=32, num_frames=9,
                guidance_scale=3.0, max_sequence_length=16, output_type="pt",
                generator=torch.Generator().manual_seed(0)).frames


def qwen_image_pipeline():
    """A tiny QwenImagePipeline: diffusers' own test shapes (Qwen-Image transformer of two blocks, a Qwen2.5-VL text
    encoder of two layers with a two-block vision tower, a Qwen-Image VAE, narrower than the tests' (base_dim 8, not
    24): 4× spatial, 32×32 images are latents of 4 channels, 8×8), a local tokenizer that knows the chat template's
    markers. The encoder's vocabulary is the tokenizer's (the vision tokens' ids lie beyond it: text only)."""
    torch.manual_seed(0)
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    qwen = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": VOCAB, "bos_token_id": 3, "eos_token_id": 2, "pad_token_id": 0,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        image_token_id=VOCAB + 3, video_token_id=VOCAB + 4, vision_start_token_id=VOCAB + 1,
        vision_end_token_id=VOCAB + 2,
    ))
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=qwen,
        tokenizer=tokenizer(64, chat=True), transformer=transformer,
    )
    return _bf16(pipe, transformer, qwen, vae)


def run_qwen_image(pipe):
    """Two steps at 32×32 with true classifier-free guidance (a negative prompt: the encoder runs twice)."""
    return pipe(prompt=PROMPT, negative_prompt="a dog", true_cfg_scale=4.0, num_inference_steps=2, height=32,
                width=32, max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0)).images


def hunyuan_video_pipeline():
    """A tiny HunyuanVideoPipeline: near diffusers' own test shapes (HunyuanVideo transformer of two dual-stream and
    two single-stream blocks and one token-refiner block, guidance-distilled; a Llama text encoder, a CLIP text
    encoder for the pooled projection; a HunyuanVideo VAE of four levels of 8 channels, 8× spatial and 4× temporal: 5
    frames of 32×32 are latents of 2 frames of 4×4), local tokenizers. The Llama encoder has three layers: the pipeline
    takes the hidden states before the last two (which run all the same)."""
    torch.manual_seed(0)
    transformer = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2, num_single_layers=2,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    )
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        bos_token_id=3, eos_token_id=2, pad_token_id=0, hidden_size=16, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=3, vocab_size=VOCAB, hidden_act="gelu",
    ))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        bos_token_id=3, eos_token_id=2, pad_token_id=0, hidden_size=8, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=VOCAB, hidden_act="gelu", projection_dim=32,
    ))
    vae = diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True,
    )
    pipe = diffusers.HunyuanVideoPipeline(
        text_encoder=llama, tokenizer=tokenizer(256), transformer=transformer, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder_2=clip, tokenizer_2=tokenizer(77, bos=True),
    )
    return _bf16(pipe, transformer, llama, clip, vae)


def hunyuan_prompt_template(tok):
    """HunyuanVideo's prompt template, its ``crop_start`` (95 with Llama's tokenizer) counted with ``tok``."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    template = DEFAULT_PROMPT_TEMPLATE["template"]
    return {"template": template, "crop_start": len(tok(template.split("{}")[0]).input_ids)}


def run_hunyuan_video(pipe):
    """Two steps of 5 frames at 32×32 (embedded guidance, one transformer call a step); the video as a tensor (batch,
    frames, channels, height, width)."""
    return pipe(prompt="a video of a cat walking", num_inference_steps=2, height=32, width=32, num_frames=5,
                guidance_scale=6.0, max_sequence_length=16, prompt_template=hunyuan_prompt_template(pipe.tokenizer),
                output_type="pt", generator=torch.Generator().manual_seed(0)).frames
