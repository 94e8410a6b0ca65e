//! Built-in pipeline descriptions of real model families, and tiny variants with the same topology.
//!
//! [`preset`] returns a [`PipelineDesc`] by name; [`PRESET_NAMES`] lists the names. Each big preset has a tiny twin
//! (`flux-tiny`, `wan-tiny`, `qwen-tiny`) with exactly the same modules, block counts, tensor names, ranks, kinds,
//! dtypes, ties and declarations, only with small hidden sizes (a few MB in all), so tests exercise the real
//! topology cheaply.
//!
//! Every pipeline has three components at the root: `transformer` (the DiT), `text_encoder` (a stack of blocks) and
//! `vae` (small, with the pipeline-managed lifecycle, listed in `on_demand_component_paths`). Component
//! declarations are `dit = ["transformer"]`, `encoders = ["text_encoder"]`, `vaes = ["vae"]`; the offload plan
//! declares the DiT's block lists, the encoder's block list and `resident_dit_paths = ["transformer"]`.
//!
//! # Tensor conventions
//!
//! - A `Linear` child holds `weight` `[out, in]` (row-major, contiguous) and usually `bias` `[out]`; it computes
//!   `y = x · weightᵀ + bias` for `x` of shape `[tokens, in]`.
//! - The one exception to contiguity: every DiT's `proj_out.weight` is logically `[out, in]` but stored in-major,
//!   with strides `[1, out]` (element `(o, i)` sits at `o + i · out`).
//! - Norms (`RMSNorm`, `LayerNorm`, `GroupNorm`) hold `weight` `[dim]` (and `bias` `[dim]` for affine LayerNorm and
//!   GroupNorm). Convolutions hold `weight` `[out, in, kh, kw]` (`[out, in, kt, kh, kw]` for Wan's patch embedding)
//!   and `bias` `[out]`. Modulation tables are parameters of rank 3.
//! - Ties: the Flux DiT's `proj_alias.weight` is the same storage as `single_transformer_blocks.0.linear2.weight`
//!   (a non-block attribute aliasing a block weight). The T5 / UMT5 encoders' `encoder.embed_tokens.weight` is the
//!   same storage as `shared.weight`.
//!
//! # Per-block layout (what feeds what)
//!
//! Notation: `h` hidden size, `d` head dimension, `f` MLP hidden size, `x` image tokens `[n, h]`, `c` text tokens
//! `[m, h]`, `v` the conditioning vector `[h]` (time, guidance and pooled text embeddings, summed, after SiLU).
//!
//! **Double-stream block** (Flux `transformer_blocks.i`, class `FluxTransformerBlock`; Qwen-Image
//! `transformer_blocks.i`, class `QwenImageTransformerBlock`). For each stream `s` in `img` (input `x`) and `txt`
//! (input `c`):
//! 1. `s_mod.lin`: `v` `[h]` → `[6h]` = shift₁, scale₁, gate₁, shift₂, scale₂, gate₂.
//! 2. `s_attn.qkv`: modulated `[·, h]` → `[·, 3h]`, split into q, k, v of `h = heads · d` each;
//!    `s_attn.norm_q` / `s_attn.norm_k` (`[d]`) RMS-normalise each head of q and k.
//! 3. Joint attention over the concatenated `txt` and `img` tokens; each stream takes back its own rows (`[·, h]`).
//! 4. `s_attn.proj`: `[·, h]` → `[·, h]`, gated by gate₁ and added to the stream.
//! 5. `s_mlp.fc1`: `[·, h]` → `[·, f]`, GELU, `s_mlp.fc2`: `[·, f]` → `[·, h]`, gated by gate₂ and added.
//!
//! **Single-stream block** (Flux `single_transformer_blocks.i`, class `FluxSingleTransformerBlock`), input
//! `y = [txt; img]` `[m + n, h]`:
//! 1. `modulation.lin`: `v` → `[3h]` = shift, scale, gate.
//! 2. `linear1`: modulated `[·, h]` → `[·, 3h + f]`, split into q, k, v (`h` each) and an MLP hidden `[·, f]`;
//!    `norm_q` / `norm_k` (`[d]`) normalise q and k per head.
//! 3. Attention gives `[·, h]`; GELU of the MLP hidden gives `[·, f]`; they are concatenated to `[·, h + f]`.
//! 4. `linear2`: `[·, h + f]` → `[·, h]`, gated and added to `y`.
//!
//! **Wan block** (`blocks.i`, class `WanTransformerBlock`), input `x` `[n, h]`, text context `c` `[m, h]`, time
//! projection `t` `[6h]` from `condition_embedder.time_proj`:
//! 1. `scale_shift_table` `[1, 6, h]` (f32) plus `t` = shift/scale/gate for attention and for the FFN.
//! 2. `attn1` (self-attention): `to_q`, `to_k`, `to_v` `[h]` → `[h]`, `norm_q` / `norm_k` RMS-normalise q and k
//!    over all of `h`; attention; `to_out` `[h]` → `[h]`, gated, added.
//! 3. `norm2` (affine LayerNorm over `h`), then `attn2` (cross-attention): `to_q` from `x`, `to_k` / `to_v` from
//!    `c`, `norm_q` / `norm_k`, attention, `to_out`, added.
//! 4. `ffn.fc1` `[h]` → `[f]`, GELU (tanh), `ffn.fc2` `[f]` → `[h]`, gated, added.
//!
//! **T5 / UMT5 encoder block** (`text_encoder.encoder.block.i`, class `T5Block` / `UMT5Block`), hidden `e`, inner
//! attention width `a = heads · d`, feed-forward `g`:
//! 1. `layer.0.layer_norm` (RMS over `e`), `layer.0.SelfAttention.q`, `.k`, `.v`: `[e]` → `[a]` (no bias);
//!    attention with the relative position bias `SelfAttention.relative_attention_bias.weight` `[buckets, heads]`
//!    (T5: block 0 only, shared by all blocks; UMT5: every block has its own); `.o`: `[a]` → `[e]`, added.
//! 2. `layer.1.layer_norm`, `layer.1.DenseReluDense.wi_0` and `.wi_1`: `[e]` → `[g]`; gated GELU
//!    (`gelu(wi_0 x) · wi_1 x`); `.wo`: `[g]` → `[e]`, added.
//!
//! **Qwen text-encoder layer** (`text_encoder.model.layers.i`, class `Qwen2_5_VLDecoderLayer`), hidden `e`,
//! key/value width `kv`, MLP `g`: `input_layernorm` (RMS); `self_attn.q_proj` `[e]` → `[e]`, `k_proj` / `v_proj`
//! `[e]` → `[kv]` (all with bias, grouped-query attention); `o_proj` `[e]` → `[e]` (no bias), added;
//! `post_attention_layernorm`; `mlp.gate_proj` and `mlp.up_proj` `[e]` → `[g]`, SiLU-gated; `mlp.down_proj`
//! `[g]` → `[e]`, added.
//!
//! **VAE** (`vae`, lifecycle-managed): `encoder.conv_in`, then `encoder.down.i.conv_j` (3×3 convolutions, the
//! first of each level changing the channel count), `encoder.mid.conv_j`, `encoder.norm_out`, `encoder.conv_out`
//! (to `2z` latent channels); `decoder.conv_in` (from `z`), `decoder.mid.conv_j`, `decoder.up.i.conv_j` (widest
//! level first), `decoder.norm_out`, `decoder.conv_out` (to 3 channels). `latents_mean` / `latents_std` are
//! persistent f32 buffers of `[z]`.
//!
//! # Sizes (bf16 unless noted)
//!
//! | preset | DiT | DiT parameters | text encoder |
//! | --- | --- | --- | --- |
//! | `flux-dev` | 19 double + 38 single blocks, `h` 3072, `f` 12288, `d` 128 | ≈ 11.9 B (≈ 23.8 GB) | T5-XXL-like, 24 blocks, `e` 4096, `g` 10240 |
//! | `wan-14b` | 40 blocks, `h` 5120, `f` 13824, 40 heads | ≈ 14.3 B (≈ 28.6 GB, modulation in f32) | UMT5-XXL-like, 24 blocks |
//! | `qwen-image` | 60 double-stream blocks, `h` 3072, `f` 12288 | ≈ 20.4 B (≈ 40.9 GB) | 28 layers, `e` 3584, `g` 18944 |
//!
//! The VAEs hold about 77 M parameters. The tiny variants use `h` 32, `d` 16, `f` 128 and text encoders of width 32.

use super::builder::{ModuleBuilder, PipelineBuilder, TensorSpec};
use super::{DType, OffloadPlanDecl, PipelineDesc};
use std::collections::BTreeMap;

/// Names accepted by [`preset`].
pub const PRESET_NAMES: &[&str] = &["flux-dev", "flux-tiny", "wan-14b", "wan-tiny", "qwen-image", "qwen-tiny"];

/// The built-in pipeline `name` (one of [`PRESET_NAMES`]), or `None` for an unknown name.
pub fn preset(name: &str) -> Option<PipelineDesc> {
    let builder = match name {
        "flux-dev" => flux(&FluxDims::DEV),
        "flux-tiny" => flux(&FluxDims::TINY),
        "wan-14b" => wan(&WanDims::BIG),
        "wan-tiny" => wan(&WanDims::TINY),
        "qwen-image" => qwen(&QwenDims::BIG),
        "qwen-tiny" => qwen(&QwenDims::TINY),
        _ => return None,
    };
    builder.build().ok()
}

const BF16: DType = DType::Bf16;
const F32: DType = DType::F32;

/// Widths of a T5 / UMT5 encoder.
struct T5Dims {
    vocab: u64,
    d_model: u64,
    inner: u64,
    ff: u64,
    heads: u64,
    buckets: u64,
    layers: usize,
}

/// Widths of the VAE.
struct VaeDims {
    channels: [u64; 4],
    z: u64,
}

const VAE_BIG: VaeDims = VaeDims { channels: [128, 256, 512, 512], z: 16 };
const VAE_TINY: VaeDims = VaeDims { channels: [4, 8, 8, 8], z: 4 };

/// Widths shared by the double-stream blocks of Flux and Qwen-Image.
struct StreamDims {
    hidden: u64,
    head_dim: u64,
    mlp: u64,
}

struct FluxDims {
    stream: StreamDims,
    in_channels: u64,
    time_dim: u64,
    pooled_dim: u64,
    rope_len: u64,
    t5: T5Dims,
    vae: VaeDims,
}

impl FluxDims {
    const DEV: FluxDims = FluxDims {
        stream: StreamDims { hidden: 3072, head_dim: 128, mlp: 12288 },
        in_channels: 64,
        time_dim: 256,
        pooled_dim: 768,
        rope_len: 4096,
        t5: T5Dims { vocab: 32128, d_model: 4096, inner: 4096, ff: 10240, heads: 64, buckets: 32, layers: 24 },
        vae: VAE_BIG,
    };
    const TINY: FluxDims = FluxDims {
        stream: StreamDims { hidden: 32, head_dim: 16, mlp: 128 },
        in_channels: 16,
        time_dim: 16,
        pooled_dim: 16,
        rope_len: 64,
        t5: T5Dims { vocab: 256, d_model: 32, inner: 32, ff: 128, heads: 2, buckets: 32, layers: 24 },
        vae: VAE_TINY,
    };
}

struct WanDims {
    hidden: u64,
    ffn: u64,
    in_channels: u64,
    freq_dim: u64,
    out_dim: u64,
    rope_len: u64,
    rope_dim: u64,
    layers: usize,
    t5: T5Dims,
    vae: VaeDims,
}

impl WanDims {
    const BIG: WanDims = WanDims {
        hidden: 5120,
        ffn: 13824,
        in_channels: 16,
        freq_dim: 256,
        out_dim: 64,
        rope_len: 1024,
        rope_dim: 64,
        layers: 40,
        t5: T5Dims { vocab: 256_384, d_model: 4096, inner: 4096, ff: 10240, heads: 64, buckets: 32, layers: 24 },
        vae: VAE_BIG,
    };
    const TINY: WanDims = WanDims {
        hidden: 32,
        ffn: 128,
        in_channels: 4,
        freq_dim: 16,
        out_dim: 16,
        rope_len: 64,
        rope_dim: 8,
        layers: 40,
        t5: T5Dims { vocab: 256, d_model: 32, inner: 32, ff: 128, heads: 2, buckets: 32, layers: 24 },
        vae: VAE_TINY,
    };
}

struct QwenDims {
    stream: StreamDims,
    blocks: usize,
    in_channels: u64,
    time_dim: u64,
    rope_len: u64,
    vocab: u64,
    text_hidden: u64,
    text_kv: u64,
    text_ff: u64,
    text_head_dim: u64,
    text_layers: usize,
    vae: VaeDims,
}

impl QwenDims {
    const BIG: QwenDims = QwenDims {
        stream: StreamDims { hidden: 3072, head_dim: 128, mlp: 12288 },
        blocks: 60,
        in_channels: 64,
        time_dim: 256,
        rope_len: 4096,
        vocab: 152_064,
        text_hidden: 3584,
        text_kv: 512,
        text_ff: 18944,
        text_head_dim: 128,
        text_layers: 28,
        vae: VAE_BIG,
    };
    const TINY: QwenDims = QwenDims {
        stream: StreamDims { hidden: 32, head_dim: 16, mlp: 128 },
        blocks: 60,
        in_channels: 16,
        time_dim: 16,
        rope_len: 64,
        vocab: 256,
        text_hidden: 32,
        text_kv: 16,
        text_ff: 128,
        text_head_dim: 16,
        text_layers: 28,
        vae: VAE_TINY,
    };
}

fn plan(dit_blocks: &[&str], encoder_blocks: &str) -> OffloadPlanDecl {
    let mut block_attrs = BTreeMap::new();
    block_attrs.insert("transformer".to_string(), dit_blocks.iter().map(|s| s.to_string()).collect());
    let mut encoder_block_attrs = BTreeMap::new();
    encoder_block_attrs.insert("text_encoder".to_string(), vec![encoder_blocks.to_string()]);
    OffloadPlanDecl {
        block_attrs,
        encoder_block_attrs,
        on_demand_component_paths: vec!["vae".to_string()],
        resident_dit_paths: vec!["transformer".to_string()],
        ..OffloadPlanDecl::default()
    }
}

/// Declares the three components.
fn with_components(b: PipelineBuilder) -> PipelineBuilder {
    b.dit("transformer").encoder("text_encoder").vae("vae")
}

/// `proj_out`: logical `[out, in]`, stored in-major (transposed strides), with a bias.
fn transposed_linear(m: &mut ModuleBuilder<'_>, name: &str, in_features: u64, out_features: u64) {
    m.module(name, "Linear", |l| {
        l.tensor("weight", TensorSpec::new(BF16, &[out_features, in_features]).transposed());
        l.param("bias", BF16, &[out_features]);
    });
}

/// One stream of a double-stream block (`img` or `txt`).
fn stream(b: &mut ModuleBuilder<'_>, s: &str, d: &StreamDims) {
    let h = d.hidden;
    b.linear(&format!("{s}_mod.lin"), BF16, h, 6 * h, true);
    b.module(&format!("{s}_attn"), "Attention", |a| {
        a.linear("qkv", BF16, h, 3 * h, true);
        a.norm("norm_q", "RMSNorm", BF16, d.head_dim, false);
        a.norm("norm_k", "RMSNorm", BF16, d.head_dim, false);
        a.linear("proj", BF16, h, h, true);
    });
    b.module(&format!("{s}_mlp"), "FeedForward", |f| {
        f.linear("fc1", BF16, h, d.mlp, true);
        f.linear("fc2", BF16, d.mlp, h, true);
    });
}

fn double_stream_block(b: &mut ModuleBuilder<'_>, d: &StreamDims) {
    stream(b, "img", d);
    stream(b, "txt", d);
}

/// A timestep-style MLP embedder: `linear_1` `in → h`, `linear_2` `h → h`.
fn embedder(m: &mut ModuleBuilder<'_>, name: &str, class: &str, in_features: u64, h: u64) {
    m.module(name, class, |e| {
        e.linear("linear_1", BF16, in_features, h, true);
        e.linear("linear_2", BF16, h, h, true);
    });
}

fn t5_encoder(m: &mut ModuleBuilder<'_>, d: &T5Dims, umt5: bool) {
    let block_class = if umt5 { "UMT5Block" } else { "T5Block" };
    m.module("shared", "Embedding", |e| {
        e.param("weight", BF16, &[d.vocab, d.d_model]);
    });
    m.module("encoder", if umt5 { "UMT5Stack" } else { "T5Stack" }, |enc| {
        enc.module("embed_tokens", "Embedding", |_| {});
    });
    m.tie("encoder.embed_tokens.weight", "shared.weight");
    m.block_list("encoder.block", d.layers, block_class, |blk, i| {
        blk.module("layer", "ModuleList", |layer| {
            layer.module("0", "T5LayerSelfAttention", |sa| {
                sa.module("SelfAttention", "T5Attention", |att| {
                    att.linear("q", BF16, d.d_model, d.inner, false);
                    att.linear("k", BF16, d.d_model, d.inner, false);
                    att.linear("v", BF16, d.d_model, d.inner, false);
                    att.linear("o", BF16, d.inner, d.d_model, false);
                    if umt5 || i == 0 {
                        att.module("relative_attention_bias", "Embedding", |e| {
                            e.param("weight", BF16, &[d.buckets, d.heads]);
                        });
                    }
                });
                sa.norm("layer_norm", "T5LayerNorm", BF16, d.d_model, false);
            });
            layer.module("1", "T5LayerFF", |ff| {
                ff.module("DenseReluDense", "T5DenseGatedActDense", |dd| {
                    dd.linear("wi_0", BF16, d.d_model, d.ff, false);
                    dd.linear("wi_1", BF16, d.d_model, d.ff, false);
                    dd.linear("wo", BF16, d.ff, d.d_model, false);
                });
                ff.norm("layer_norm", "T5LayerNorm", BF16, d.d_model, false);
            });
        });
    });
    m.norm("encoder.final_layer_norm", "T5LayerNorm", BF16, d.d_model, false);
}

fn conv(m: &mut ModuleBuilder<'_>, name: &str, out_ch: u64, in_ch: u64) {
    m.module(name, "Conv2d", |c| {
        c.param("weight", BF16, &[out_ch, in_ch, 3, 3]);
        c.param("bias", BF16, &[out_ch]);
    });
}

/// A level of `convs` 3×3 convolutions, the first changing `in_ch` to `out_ch`.
fn conv_level(m: &mut ModuleBuilder<'_>, convs: usize, in_ch: u64, out_ch: u64) {
    for j in 0..convs {
        let input = if j == 0 { in_ch } else { out_ch };
        conv(m, &format!("conv_{j}"), out_ch, input);
    }
}

fn vae(m: &mut ModuleBuilder<'_>, d: &VaeDims) {
    let [c0, c1, c2, c3] = d.channels;
    let levels = [c0, c1, c2, c3];
    m.has_lifecycle(true);
    m.buffer("latents_mean", F32, &[d.z], true);
    m.buffer("latents_std", F32, &[d.z], true);
    m.module("encoder", "Encoder", |e| {
        conv(e, "conv_in", c0, 3);
        e.block_list("down", 4, "DownEncoderBlock", |l, i| {
            let input = if i == 0 { c0 } else { levels[i - 1] };
            conv_level(l, 4, input, levels[i]);
        });
        e.module("mid", "MidBlock", |mid| conv_level(mid, 4, c3, c3));
        e.norm("norm_out", "GroupNorm", BF16, c3, true);
        conv(e, "conv_out", 2 * d.z, c3);
    });
    m.module("decoder", "Decoder", |dec| {
        conv(dec, "conv_in", c3, d.z);
        dec.module("mid", "MidBlock", |mid| conv_level(mid, 6, c3, c3));
        dec.block_list("up", 4, "UpDecoderBlock", |l, i| {
            let input = if i == 0 { c3 } else { levels[4 - i] };
            conv_level(l, 6, input, levels[3 - i]);
        });
        dec.norm("norm_out", "GroupNorm", BF16, c0, true);
        conv(dec, "conv_out", 3, c0);
    });
}

fn flux(d: &FluxDims) -> PipelineBuilder {
    let s = &d.stream;
    let h = s.hidden;
    let b = PipelineBuilder::new("FluxPipeline")
        .module("transformer", "FluxTransformer2DModel", |m| {
            m.module("pos_embed", "FluxPosEmbed", |p| {
                p.buffer("freqs", F32, &[d.rope_len, s.head_dim / 2], false);
            });
            m.linear("x_embedder", BF16, d.in_channels, h, true);
            m.module("time_text_embed", "CombinedTimestepGuidanceTextProjEmbeddings", |t| {
                embedder(t, "timestep_embedder", "TimestepEmbedding", d.time_dim, h);
                embedder(t, "guidance_embedder", "TimestepEmbedding", d.time_dim, h);
                embedder(t, "text_embedder", "PixArtAlphaTextProjection", d.pooled_dim, h);
            });
            m.linear("context_embedder", BF16, d.t5.d_model, h, true);
            m.block_list("transformer_blocks", 19, "FluxTransformerBlock", |blk, _| double_stream_block(blk, s));
            m.block_list("single_transformer_blocks", 38, "FluxSingleTransformerBlock", |blk, _| {
                blk.linear("modulation.lin", BF16, h, 3 * h, true);
                blk.linear("linear1", BF16, h, 3 * h + s.mlp, true);
                blk.norm("norm_q", "RMSNorm", BF16, s.head_dim, false);
                blk.norm("norm_k", "RMSNorm", BF16, s.head_dim, false);
                blk.linear("linear2", BF16, h + s.mlp, h, true);
            });
            m.linear("norm_out.linear", BF16, h, 2 * h, true);
            transposed_linear(m, "proj_out", h, d.in_channels);
            m.tie("proj_alias.weight", "single_transformer_blocks.0.linear2.weight");
        })
        .module("text_encoder", "T5EncoderModel", |m| t5_encoder(m, &d.t5, false))
        .module("vae", "AutoencoderKL", |m| vae(m, &d.vae))
        .offload_plan(plan(&["transformer_blocks", "single_transformer_blocks"], "encoder.block"))
        .class_block_attrs("FluxTransformer2DModel", &["transformer_blocks", "single_transformer_blocks"]);
    with_components(b)
}

fn wan(d: &WanDims) -> PipelineBuilder {
    let h = d.hidden;
    let attention = |a: &mut ModuleBuilder<'_>| {
        for p in ["to_q", "to_k", "to_v"] {
            a.linear(p, BF16, h, h, true);
        }
        a.norm("norm_q", "RMSNorm", BF16, h, false);
        a.norm("norm_k", "RMSNorm", BF16, h, false);
        a.linear("to_out", BF16, h, h, true);
    };
    let b = PipelineBuilder::new("WanPipeline")
        .module("transformer", "WanTransformer3DModel", |m| {
            m.buffer("rope.freqs", F32, &[d.rope_len, d.rope_dim], false);
            m.module("patch_embedding", "Conv3d", |c| {
                c.param("weight", BF16, &[h, d.in_channels, 1, 2, 2]);
                c.param("bias", BF16, &[h]);
            });
            m.module("condition_embedder", "WanTimeTextImageEmbedding", |c| {
                embedder(c, "time_embedder", "TimestepEmbedding", d.freq_dim, h);
                c.linear("time_proj", BF16, h, 6 * h, true);
                embedder(c, "text_embedder", "PixArtAlphaTextProjection", d.t5.d_model, h);
            });
            m.block_list("blocks", d.layers, "WanTransformerBlock", |blk, _| {
                blk.param("scale_shift_table", F32, &[1, 6, h]);
                blk.module("attn1", "WanAttention", attention);
                blk.norm("norm2", "LayerNorm", BF16, h, true);
                blk.module("attn2", "WanAttention", attention);
                blk.module("ffn", "FeedForward", |f| {
                    f.linear("fc1", BF16, h, d.ffn, true);
                    f.linear("fc2", BF16, d.ffn, h, true);
                });
            });
            m.param("scale_shift_table", F32, &[1, 2, h]);
            transposed_linear(m, "proj_out", h, d.out_dim);
        })
        .module("text_encoder", "UMT5EncoderModel", |m| t5_encoder(m, &d.t5, true))
        .module("vae", "AutoencoderKLWan", |m| vae(m, &d.vae))
        .offload_plan(plan(&["blocks"], "encoder.block"))
        .class_block_attrs("WanTransformer3DModel", &["blocks"]);
    with_components(b)
}

fn qwen(d: &QwenDims) -> PipelineBuilder {
    let s = &d.stream;
    let h = s.hidden;
    let e = d.text_hidden;
    let b = PipelineBuilder::new("QwenImagePipeline")
        .module("transformer", "QwenImageTransformer2DModel", |m| {
            m.buffer("pos_embed.pos_freqs", F32, &[d.rope_len, s.head_dim / 2], false);
            m.module("time_text_embed", "QwenTimestepProjEmbeddings", |t| {
                embedder(t, "timestep_embedder", "TimestepEmbedding", d.time_dim, h);
            });
            m.norm("txt_norm", "RMSNorm", BF16, e, false);
            m.linear("img_in", BF16, d.in_channels, h, true);
            m.linear("txt_in", BF16, e, h, true);
            m.block_list("transformer_blocks", d.blocks, "QwenImageTransformerBlock", |blk, _| {
                double_stream_block(blk, s)
            });
            m.linear("norm_out.linear", BF16, h, 2 * h, true);
            transposed_linear(m, "proj_out", h, d.in_channels);
        })
        .module("text_encoder", "Qwen2_5_VLForConditionalGeneration", |m| {
            m.module("model", "Qwen2_5_VLModel", |model| {
                model.module("embed_tokens", "Embedding", |emb| {
                    emb.param("weight", BF16, &[d.vocab, e]);
                });
                model.block_list("layers", d.text_layers, "Qwen2_5_VLDecoderLayer", |l, _| {
                    l.norm("input_layernorm", "Qwen2RMSNorm", BF16, e, false);
                    l.module("self_attn", "Qwen2_5_VLAttention", |a| {
                        a.linear("q_proj", BF16, e, e, true);
                        a.linear("k_proj", BF16, e, d.text_kv, true);
                        a.linear("v_proj", BF16, e, d.text_kv, true);
                        a.linear("o_proj", BF16, e, e, false);
                    });
                    l.norm("post_attention_layernorm", "Qwen2RMSNorm", BF16, e, false);
                    l.module("mlp", "Qwen2MLP", |mlp| {
                        mlp.linear("gate_proj", BF16, e, d.text_ff, false);
                        mlp.linear("up_proj", BF16, e, d.text_ff, false);
                        mlp.linear("down_proj", BF16, d.text_ff, e, false);
                    });
                });
                model.norm("norm", "Qwen2RMSNorm", BF16, e, false);
                model.buffer("rotary_emb.inv_freq", F32, &[d.text_head_dim / 2], false);
            });
        })
        .module("vae", "AutoencoderKLQwenImage", |m| vae(m, &d.vae))
        .offload_plan(plan(&["transformer_blocks"], "model.layers"))
        .class_block_attrs("QwenImageTransformer2DModel", &["transformer_blocks"]);
    with_components(b)
}
