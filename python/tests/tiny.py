"""Tiny torch pipelines for the tests: a DiT with N blocks, a text encoder with a tied head, a VAE with a
lifecycle. Every size is chosen so the expected plan figures can be written down by hand (``align`` is the
device layout's 256-byte alignment of each storage)."""

import dataclasses

import torch
import torch.nn as nn

BF16 = torch.bfloat16
D = 64


def align(n):
    """Bytes a storage of ``n`` bytes takes on the device (each storage is aligned to 256 bytes)."""
    return -(-n // 256) * 256


class TinyBlock(nn.Module):
    """fc.weight 64x64 bf16 (8192 B), norm.weight and norm.bias 64 bf16 (128 B each)."""

    RAW = 8192 + 128 + 128
    DEVICE = 8192 + align(128) + align(128)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D, bias=False, dtype=BF16)
        self.norm = nn.LayerNorm(D, dtype=BF16)


class TinyDiT(nn.Module):
    """x_embedder (2048 B), ``blocks``, proj_out (2048 B), a non-persistent f32 rope buffer (2048 B)."""

    _layerwise_offload_blocks_attrs = ["blocks"]
    NON_BLOCK = 3 * 2048

    def __init__(self, n):
        super().__init__()
        self.x_embedder = nn.Linear(16, D, bias=False, dtype=BF16)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(n))
        self.proj_out = nn.Linear(D, 16, bias=False, dtype=BF16)
        self.register_buffer("rope", torch.zeros(64, 8), persistent=False)


class TinyDualDiT(TinyDiT):
    """A DiT with two block lists, ``blocks`` then ``single_blocks`` (as Flux)."""

    _layerwise_offload_blocks_attrs = ["blocks", "single_blocks"]

    def __init__(self, n, single):
        super().__init__(n)
        self.single_blocks = nn.ModuleList(TinyBlock() for _ in range(single))


class TinyTextEncoder(nn.Module):
    """embed 128x64 bf16 (16384 B), ``layers``, and a head whose weight is the embedding's (tied: one storage)."""

    EMBED = 128 * D * 2

    def __init__(self, n=3, tied=True):
        super().__init__()
        self.embed = nn.Embedding(128, D, dtype=BF16)
        self.layers = nn.ModuleList(TinyBlock() for _ in range(n))
        self.head = nn.Linear(D, 128, bias=False, dtype=BF16)
        if tied:
            self.head.weight = self.embed.weight


class TinyVAE(nn.Module):
    """Two bf16 convolutions (432 + 16 and 432 + 6 bytes) and the pipeline-managed lifecycle."""

    RAW = 432 + 16 + 432 + 6
    DEVICE = align(432) + align(16) + align(432) + align(6)

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, dtype=BF16)
        self.dec = nn.Conv2d(8, 3, 3, dtype=BF16)

    def load_to_device(self, device):
        self.to(device)

    def offload_to_cpu(self):
        self.to("cpu")


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """The shape of vLLM-Omni's ``OffloadPlan`` declaration."""

    block_attrs: dict = dataclasses.field(default_factory=dict)
    encoder_block_attrs: dict = dataclasses.field(default_factory=dict)
    on_demand_component_paths: tuple = ()
    resident_dit_paths: tuple = ()


class TinyPipeline:
    """A diffusers-like pipeline with declarations; non-module attributes (scheduler, tokenizer) are ignored."""

    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]
    _offload_plan = OffloadPlan(encoder_block_attrs={"text_encoder": ["layers"]}, on_demand_component_paths=("vae",))

    def __init__(self, n=4, encoder_layers=3, tied=True):
        self.transformer = TinyDiT(n)
        self.text_encoder = TinyTextEncoder(encoder_layers, tied=tied)
        self.vae = TinyVAE()
        self.scheduler = object()
        self.tokenizer = None


class UndeclaredPipeline:
    """The same components and no declarations: the deprecated fallback scan finds them by name."""

    def __init__(self, n=4):
        self.transformer = TinyDiT(n)
        self.text_encoder = TinyTextEncoder()
        self.vae = TinyVAE()
