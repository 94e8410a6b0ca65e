"""Tiny quantized diffusers transformers for the tests, made the way users get them: a GGUF file written with the
``gguf`` package (tensor names as the diffusers model names them, so diffusers' single-file loader maps none) and
loaded through diffusers' GGUF quantizer (``from_single_file`` with a ``GGUFQuantizationConfig``), or the bf16 model
quantized in place by torchao's ``quantize_`` (what diffusers' ``TorchAoConfig`` runs)."""

import os

import diffusers
import gguf
import numpy as np
import torch
from test_diffusers import flux

BF16 = torch.bfloat16


def wan():
    """A tiny Wan transformer whose projections are 32 or 64 wide, so GGUF's 32-value blocks quantize them."""
    torch.manual_seed(0)
    m = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=4, rope_max_seq_len=32,
    )
    g = torch.Generator().manual_seed(3)
    x = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
    )
    return m, x, 4


MODELS = {"flux": flux, "wan": wan}


def gguf_file(model, path, qtype):
    """Writes ``model``'s state dict to the GGUF file ``path``: each matrix whose rows are whole blocks of ``qtype``
    (a ``gguf.GGMLQuantizationType`` name) quantized to it, every other tensor as F32."""
    q = gguf.GGMLQuantizationType[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[q]
    w = gguf.GGUFWriter(path, "tiny")
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if t.ndim == 2 and a.shape[1] % block == 0:
            data = gguf.quants.quantize(a, q)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q)
        else:
            w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_model(name, qtype, folder):
    """``(model, inputs)``: the tiny model ``name`` of test_diffusers written as ``qtype`` into ``folder`` (once) and
    loaded back by diffusers' GGUF quantizer (bf16 compute); each call loads a new model object."""
    path = os.path.join(folder, f"{name}-{qtype}.gguf")
    model, x, _ = MODELS[name]()
    if not os.path.exists(path):
        model.save_config(os.path.join(folder, name))
        gguf_file(model.to(BF16), path, qtype)
    loaded = type(model).from_single_file(
        path, config=os.path.join(folder, name), torch_dtype=BF16,
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=BF16),
    )
    return loaded, {k: v.to(BF16) if v.is_floating_point() else v for k, v in x.items()}


def torchao_model(name, config):
    """``(model, inputs)``: the tiny model ``name`` in bf16 quantized by ``torchao.quantization.quantize_`` with the
    config class named ``config`` (e.g. ``Int8WeightOnlyConfig``); each call builds a new model object."""
    import torchao.quantization as ao

    model, x, _ = MODELS[name]()
    model = model.to(BF16)
    ao.quantize_(model, getattr(ao, config)())
    return model, {k: v.to(BF16) if v.is_floating_point() else v for k, v in x.items()}


GPU_ONLY_AO = {
    # torchao's int4 weight-only needs CUDA's tile packing on this torchao (its plain packing needs `mslk`), and
    # float8 dynamic activations need compute capability 8.9 or later: quantized on the GPU, then kept on the CPU.
    "Int4WeightOnlyConfig": {"group_size": 32, "int4_packing_format": "tile_packed_to_4d"},
    "Float8DynamicActivationFloat8WeightConfig": {},
}


def torchao_gpu_model(name, config):
    """``(model, inputs)``: the tiny model ``name`` in bf16 quantized on CUDA device 0 by torchao with the config class
    named ``config`` (one of :data:`GPU_ONLY_AO`, formats without a CPU build), then moved back to the CPU."""
    import torchao.quantization as ao

    model, x, _ = MODELS[name]()
    model = model.to(device="cuda", dtype=BF16)
    ao.quantize_(model, getattr(ao, config)(**GPU_ONLY_AO[config]))
    return model.cpu(), {k: v.to(BF16) if v.is_floating_point() else v for k, v in x.items()}


def layerwise_cast_model(name):
    """``(model, inputs)``: the tiny model ``name`` in bf16 with diffusers' layerwise casting (weights stored in
    float8_e4m3fn, each layer cast to bf16 for its forward); each call builds a new model object."""
    model, x, _ = MODELS[name]()
    model = model.to(BF16)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=BF16)
    return model, {k: v.to(BF16) if v.is_floating_point() else v for k, v in x.items()}


def bnb_model(name, nested=False):
    """``(model, inputs)``: the tiny model ``name`` in bf16 with every linear layer outside its
    ``_keep_in_fp32_modules`` made a bitsandbytes ``Linear4bit`` (NF4, bf16 compute; ``nested``: the scales quantized
    again, ``bnb_4bit_use_double_quant``) over the same weights, quantized by bitsandbytes' CPU build as ``.to()``
    quantizes them (what diffusers' ``BitsAndBytesConfig(load_in_4bit=True)`` builds, on a GPU only)."""
    import bitsandbytes as bnb

    def four_bit(c):
        new = bnb.nn.Linear4bit(c.in_features, c.out_features, bias=c.bias is not None, compute_dtype=BF16,
                                quant_type="nf4", compress_statistics=nested)
        new.weight = bnb.nn.Params4bit(c.weight.data, requires_grad=False, quant_type="nf4",
                                       compress_statistics=nested)
        return new

    return _linears_replaced(name, four_bit)


def bnb8_model(name):
    """``(model, inputs)``: the tiny model ``name`` in bf16 with every linear layer outside its
    ``_keep_in_fp32_modules`` a bitsandbytes ``Linear8bitLt`` (int8 weights, ``has_fp16_weights=False``: what
    ``BitsAndBytesConfig(load_in_8bit=True)`` builds) over the same weights, quantized by ``.to()`` on the CPU."""
    import bitsandbytes as bnb

    def eight_bit(c):
        new = bnb.nn.Linear8bitLt(c.in_features, c.out_features, bias=c.bias is not None, has_fp16_weights=False)
        new.weight = bnb.nn.Int8Params(c.weight.data, requires_grad=False, has_fp16_weights=False)
        return new

    return _linears_replaced(name, eight_bit)


def _linears_replaced(name, make):
    """``(model, inputs)``: the tiny model ``name`` in bf16 with each ``nn.Linear`` outside the model's
    ``_keep_in_fp32_modules`` replaced by ``make(linear)`` (given the linear's bias, then quantized by ``.to()``)."""
    model, x, _ = MODELS[name]()
    model = model.to(BF16)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for path, m in list(model.named_modules()):
        for child, c in list(m.named_children()):
            if type(c) is not torch.nn.Linear or any(k in f"{path}.{child}".split(".") for k in keep):
                continue
            new = make(c)
            new.bias = c.bias
            setattr(m, child, new.to("cpu"))
    return model, {k: v.to(BF16) if v.is_floating_point() else v for k, v in x.items()}


def state_tensors(t, prefix=""):
    """``[(name, tensor)]`` of the tensors in ``t``'s Python attributes and, nested, in plain objects there
    (bitsandbytes' ``quant_state`` and its ``state2``); none for a wrapper subclass (its attributes are its parts)."""
    if isinstance(t, torch.Tensor) and len(parts(t)) > 1:
        return []
    out = []
    for k, v in sorted(vars(t).items()):
        if isinstance(v, torch.Tensor):
            out.append((prefix + k, v))
        elif hasattr(v, "__dict__") and not isinstance(v, (type, torch.nn.Module)):
            out.extend(state_tensors(v, f"{prefix}{k}."))
    return out


def parts(t):
    """A tensor's plain parts as ``[(name, tensor)]``: itself, or for a wrapper subclass that names its parts
    (``__tensor_flatten__``) each inner tensor, nested ones flattened again."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return [("", t)]
    names, _ = t.__tensor_flatten__()
    return [(f"{n}.{sub}" if sub else n, inner) for n in names for sub, inner in parts(getattr(t, n))]


def gguf_parameters(model):
    """``{name: parameter}`` of ``model``'s GGUF-quantized parameters."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return {n: p for n, p in model.named_parameters() if isinstance(p, GGUFParameter)}


def weights(model):
    """Every parameter and buffer's class, dtype, shape, Python attributes (``quant_type``) and bytes."""
    return {name: signature(t) for name, t in list(model.named_parameters()) + list(model.named_buffers())}


def signature(t):
    """A tensor's class, dtype, shape, device, Python attributes (``quant_type``, a flatten context's; objects there
    by identity) and the bytes of each of its parts and of the tensors its attributes hold (``quant_state``'s)."""
    attrs = {k: v for k, v in vars(t).items() if not isinstance(v, torch.Tensor)}
    data = []
    for name, p in parts(t) + state_tensors(t, "state:"):
        with torch._C.DisableTorchFunctionSubclass():  # GGUFParameter wraps every result otherwise
            raw = np.asarray(p.detach().contiguous().reshape(-1).view(torch.uint8)).tobytes()
        data.append((name, p.dtype, tuple(p.shape), raw))
    return (type(t).__name__, t.dtype, tuple(t.shape), str(t.device), sorted(attrs.items(), key=str), data)
