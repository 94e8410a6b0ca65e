"""Quantized models offloaded on ``device="sim"`` (CI): tiny diffusers Flux and Wan transformers loaded from GGUF
files through diffusers' GGUF quantizer (``GGUFParameter``: a tensor subclass over its own quantized bytes, with its
``quant_type`` as a Python attribute) and quantized by torchao (``Int8Tensor`` and ``Float8Tensor``: wrapper
subclasses streamed by their parts). Outputs bit-identical to the same quantized model resident, the bytes streamed
per pass equal to the stored (quantized) bytes of the streamed blocks, every parameter (object, class, attributes
and the bytes of each part) bit-identical after disable and after a failure at every allocation and copy of enable,
``state_dict`` while offloaded equal to the resident one; tensor subclasses weightferry cannot stream are refused
naming the tensor before anything changes. Diffusers' layerwise casting (fp8 storage, each layer cast to bf16 for its
forward) streams the fp8 bytes and computes as it does resident."""

import copy
import json
import math
import os
import types

import pytest
import torch
from quantized import (
    bnb8_model,
    bnb_model,
    gguf_model,
    gguf_parameters,
    layerwise_cast_model,
    parts,
    signature,
    state_tensors,
    torchao_model,
    weights,
)
from test_diffusers import layer
from test_enable import enable_through_binding_failures, enable_through_sim_faults

import weightferry as wf
from weightferry._binders import is_placeholder

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gguf"))


def block_bytes(model, align=1):
    """Stored bytes of every tensor in the model's block lists, each rounded up to ``align`` (a fully streamed pass
    copies them at the device's 256-byte alignment)."""
    return sum(-(-p.untyped_storage().nbytes() // align) * align for attr in BLOCK_LISTS if hasattr(model, attr)
               for t in getattr(model, attr).state_dict().values() for _, p in parts(t))


def budget(model):
    """A device budget of the smallest ring plus half the streamed blocks, so the planner keeps some resident."""
    pipeline = {"transformer": model}
    smallest = wf.plan(pipeline, layer(1))
    (stack,) = smallest["components"][0]["stacks"]
    total = smallest["device_weight_bytes"] + stack["bytes"] // 2
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": total}}


def stream_twice(model, twin, x, depth):
    """Enables ``model`` on sim (layerwise at prefetch ``depth``, or under :func:`budget` for 0) and runs two passes,
    each bit-identical to ``twin`` resident; returns ``(handle, bytes the second pass streamed, the output)``."""
    with torch.no_grad():
        expected = twin(**x)[0]
    cfg = layer(depth) if depth else budget(model)
    h = wf.enable({"transformer": model}, cfg, device="sim")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
        streamed = h.stats()["bytes_streamed"]
        assert torch.equal(model(**x)[0], expected)
    return h, h.stats()["bytes_streamed"] - streamed, expected


CASES = [("flux", "Q8_0"), ("flux", "Q4_0"), ("wan", "Q8_0"), ("wan", "Q5_0")]


@pytest.mark.parametrize("depth", [1, 2, 0], ids=["depth1", "depth2", "budget"])
@pytest.mark.parametrize("name,qtype", CASES, ids=[f"{n}-{q}" for n, q in CASES])
def test_a_gguf_model_streams_its_quantized_bytes_bit_identical_to_resident(folder, name, qtype, depth):
    model, x = gguf_model(name, qtype, folder)
    twin, _ = gguf_model(name, qtype, folder)
    assert len(gguf_parameters(model)) > 4
    before = weights(model)
    h, per_pass, expected = stream_twice(model, twin, x, depth)
    if depth:
        # Every block streams once a pass: exactly the stored bytes (each storage at the device alignment), GGUF
        # weights as their quantized bytes.
        assert per_pass == block_bytes(twin, align=256)
        # What the same blocks hold in bf16 (a GGUF weight's values: its quant_shape).
        bf16 = sum(2 * math.prod(getattr(t, "quant_shape", t.shape)) for attr in BLOCK_LISTS
                   if hasattr(twin, attr) for t in getattr(twin, attr).parameters())
        assert block_bytes(twin) < (0.6 if qtype == "Q8_0" else 0.45) * bf16, (block_bytes(twin), bf16)
    else:
        # Some blocks stay resident (and the streamed ones may stay in their slots between passes).
        assert h.stats()["stacks"][0]["resident"] > 0
        assert per_pass < block_bytes(twin, align=256)
    h.disable()
    assert weights(model) == before
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


FAULT_MODELS = {
    "gguf": lambda folder: gguf_model("flux", "Q8_0", folder),
    "torchao": lambda folder: torchao_model("flux", "Int8WeightOnlyConfig"),
    "bnb": lambda folder: bnb_model("flux", nested=True),
}


@pytest.mark.parametrize("fault", ["oom_at_alloc", "fail_host_alloc", "fail_h2d_copy"])
@pytest.mark.parametrize("kind", sorted(FAULT_MODELS))
def test_a_failure_at_every_allocation_and_copy_of_enable_leaves_a_quantized_model_as_it_was(folder, kind, fault):
    model, x = FAULT_MODELS[kind](folder)
    before = weights(model)
    with torch.no_grad():
        expected = model(**x)[0]

    def check(n):
        assert weights(model) == before, f"{fault} at call {n}"

    def enable(seams):
        return wf.enable({"transformer": model}, layer(2), device="sim", _seams=seams)

    h, n = enable_through_sim_faults(enable, fault, check)
    try:
        h.disable()
    except wf.OffloadError:  # a host allocation of disable itself failed: a second call finishes
        h.disable()
    assert n > 0 and weights(model) == before
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


class Scaled(torch.Tensor):
    """A tensor subclass over its own bytes whose scale is a tensor in its Python state (as bitsandbytes keeps a
    4-bit weight's ``quant_state``)."""


class Shell(torch.Tensor):
    """A wrapper tensor subclass (no storage of its own) that does not name its parts."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def test_tensor_subclasses_weightferry_cannot_stream_are_refused_before_anything_changes(folder):
    model, _ = gguf_model("flux", "Q8_0", folder)
    before = weights(model)
    lin = model.transformer_blocks[0].attn.to_q
    weight = lin.weight
    scaled = torch.zeros(32, 32, dtype=torch.bfloat16).as_subclass(Scaled)
    scaled.state = types.SimpleNamespace(scales=[torch.ones(32)])
    lin._parameters["weight"] = scaled
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": model}, layer(2), device="sim")
    assert str(e.value) == (
        "tensor 'transformer.transformer_blocks.0.attn.to_q.weight' is a test_quantized.Scaled whose attribute "
        "'state.scales' holds a list of tensors, which weightferry cannot bind in place beside its data: leave its "
        "module out of the offloaded components"
    )
    scaled.state = types.SimpleNamespace(scale=torch.ones(32).as_subclass(Scaled))
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": model}, layer(2), device="sim")
    assert str(e.value) == (
        "tensor 'transformer.transformer_blocks.0.attn.to_q.weight' is a test_quantized.Scaled whose attribute "
        "'state.scale' holds a Scaled, a tensor subclass, which weightferry cannot bind in place beside its data: "
        "leave its module out of the offloaded components"
    )
    lin._parameters["weight"] = Shell(torch.zeros(32, 32))
    with pytest.raises(wf.PipelineError) as e:
        wf.plan({"transformer": model}, layer(2))
    assert str(e.value) == (
        "tensor 'transformer.transformer_blocks.0.attn.to_q.weight' is a test_quantized.Shell, a torch.Tensor "
        "subclass without storage of its own that does not describe its parts (__tensor_flatten__); weightferry "
        "cannot stream it: leave its module out of the offloaded components"
    )
    lin._parameters["weight"] = weight
    assert weights(model) == before
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())


def test_a_gguf_model_s_state_dict_while_offloaded_is_the_resident_one(folder):
    model, x = gguf_model("flux", "Q8_0", folder)
    twin, _ = gguf_model("flux", "Q8_0", folder)
    expected = state_of(twin.state_dict())
    with wf.enable({"transformer": model}, layer(2), device="sim") as h:
        with torch.no_grad():
            model(**x)
        assert state_of(model.state_dict()) == expected
        assert state_of({f"transformer.{k}": v for k, v in model.state_dict().items()}) == state_of(h.state_dict())


def state_of(sd):
    """Each entry's :func:`quantized.signature` (class, attributes, the bytes of its parts)."""
    return {k: signature(t) for k, t in sd.items()}


AO = [("flux", "Int8WeightOnlyConfig"), ("flux", "Float8WeightOnlyConfig"), ("wan", "Int8WeightOnlyConfig"),
      ("flux", "Int8DynamicActivationInt8WeightConfig")]


@pytest.mark.parametrize("depth", [1, 2, 0], ids=["depth1", "depth2", "budget"])
@pytest.mark.parametrize("name,config", AO, ids=[f"{n}-{c[:-6]}" for n, c in AO])
def test_a_torchao_model_streams_its_parts_bit_identical_to_resident(name, config, depth):
    model, x = torchao_model(name, config)
    twin = copy.deepcopy(model)
    wrapped = {n: t for n, t in model.named_parameters() if len(parts(t)) > 1}
    assert len(wrapped) > 4
    before = weights(model)
    with torch.no_grad():
        expected = twin(**x)[0]
    h = wf.enable({"transformer": model}, layer(depth) if depth else budget(model), device="sim")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
        streamed = h.stats()["bytes_streamed"]
        assert torch.equal(model(**x)[0], expected)
    per_pass = h.stats()["bytes_streamed"] - streamed
    if depth:
        assert per_pass == block_bytes(twin, align=256)
        # Between forwards a streamed weight's parts hold nothing (no copy of its bytes stays behind).
        streamed_weights = [t for n, t in wrapped.items() if n.split(".")[0] in BLOCK_LISTS]
        assert streamed_weights and all(is_placeholder(p) for t in streamed_weights for _, p in parts(t))
    else:
        assert h.stats()["stacks"][0]["resident"] > 0
        assert per_pass < block_bytes(twin, align=256)
    assert state_of(model.state_dict()) == state_of(twin.state_dict())
    h.disable()
    assert weights(model) == before
    assert all(model.get_parameter(n) is t for n, t in wrapped.items())
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


def test_load_state_dict_into_a_torchao_weight_while_offloaded_is_refused_and_nothing_changes():
    model, x = torchao_model("flux", "Int8WeightOnlyConfig")
    sd = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        expected = model(**x)[0]
    with wf.enable({"transformer": model}, layer(2), device="sim") as h:
        before = state_of(h.state_dict())
        with pytest.raises(wf.OffloadError) as e:
            model.load_state_dict(sd)
        assert str(e.value) == (
            "'transformer' is offloaded by weightferry: its weight 'time_text_embed.timestep_embedder.linear_1.weight' "
            "is a Int8Tensor, a tensor subclass weightferry streams by its parts, which load_state_dict cannot write "
            "while offloaded; disable, load, and enable again (nothing was loaded)"
        )
        assert state_of(h.state_dict()) == before
        with torch.no_grad():
            assert torch.equal(model(**x)[0], expected)


@pytest.mark.parametrize("depth", [1, 2, 0], ids=["depth1", "depth2", "budget"])
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_layerwise_casting_streams_the_stored_fp8_bytes_and_computes_as_resident(name, depth):
    model, x = layerwise_cast_model(name)
    twin, _ = layerwise_cast_model(name)  # diffusers' casting hooks do not survive a deepcopy
    before = weights(model)
    fp8 = {n for n, t in model.named_parameters() if t.dtype == torch.float8_e4m3fn}
    assert len(fp8) > 4
    with torch.no_grad():
        expected = twin(**x)[0]
    h = wf.enable({"transformer": model}, layer(depth) if depth else budget(model), device="sim")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
        streamed = h.stats()["bytes_streamed"]
        assert torch.equal(model(**x)[0], expected)
    per_pass = h.stats()["bytes_streamed"] - streamed
    if depth:
        assert per_pass == block_bytes(twin, align=256)
    # Between forwards every weight is in its stored dtype again (the casts of the forward are given back).
    assert {n for n, t in model.named_parameters() if t.dtype == torch.float8_e4m3fn} == fp8
    with pytest.raises(wf.OffloadError) as e:
        model.to(torch.float16)  # outside a forward: still refused
    assert str(e.value).startswith("'transformer' is offloaded by weightferry: converting it")
    h.disable()
    assert weights(model) == before
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


def test_a_cast_inside_a_forward_that_moves_a_layer_off_its_device_is_refused():
    model, x = layerwise_cast_model("flux")
    with torch.no_grad():
        expected = model(**x)[0]
    layer0 = model.transformer_blocks[0].attn.to_q
    layer0.register_forward_pre_hook(lambda m, a: m.to("meta"))
    with wf.enable({"transformer": model}, layer(2), device="sim"):
        with pytest.raises(wf.OffloadError) as e, torch.no_grad():
            model(**x)
        assert str(e.value) == (
            "'transformer.transformer_blocks.0.attn.to_q' is offloaded by weightferry: inside a forward only a change "
            "of dtype on the device is allowed (diffusers' layerwise casting); moving it to another device would move "
            "the device views it holds, not its weights"
        )
        layer0._forward_pre_hooks.clear()
        with torch.no_grad():
            assert torch.equal(model(**x)[0], expected)


@pytest.mark.parametrize("kind", ["gguf", "layerwise", "bnb"])
def test_quantized_models_compose_with_retune_compile_and_editing(folder, kind):
    def build():
        if kind == "bnb":
            return bnb_model("flux", nested=True)
        return gguf_model("flux", "Q8_0", folder) if kind == "gguf" else layerwise_cast_model("flux")

    model, x = build()
    twin, _ = build()
    before = weights(model)
    with torch.no_grad():
        expected = twin(**x)[0]
    h = wf.enable({"transformer": model}, layer(1), device="sim")
    h.retune(prefetch_depth=3)
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
        assert torch.equal(torch.compile(model, backend="eager")(**x)[0], expected)
    with h.editing():
        pass
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
    h.disable()
    for t in model.parameters():
        t.__dict__.pop("_dynamo_static_input_type", None)  # what torch.compile marks on parameters
    assert weights(model) == before


REGIONAL_MODELS = {
    "torchao-int8": lambda folder: torchao_model("flux", "Int8WeightOnlyConfig"),
    "torchao-float8": lambda folder: torchao_model("wan", "Float8WeightOnlyConfig"),
    "gguf": lambda folder: gguf_model("wan", "Q8_0", folder),
    "bnb": lambda folder: bnb_model("flux", nested=True),
}


@pytest.mark.parametrize("kind", sorted(REGIONAL_MODELS))
def test_an_offloaded_quantized_model_compiled_block_by_block_runs_bit_identical_to_resident(folder, kind):
    # diffusers' regional compilation (each repeated block's call compiled, hooks included): the way to compile an
    # offloaded torchao model, whose whole-model compile dynamo refuses after any graph break (docs/python.md)
    model, x = REGIONAL_MODELS[kind](folder)
    twin, _ = REGIONAL_MODELS[kind](folder)
    before = weights(model)
    with torch.no_grad():
        expected = twin(**x)[0]
    h = wf.enable({"transformer": model}, layer(2), device="sim")
    torch._dynamo.reset()
    model.compile_repeated_blocks(backend="eager")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**x)[0], expected)
    assert h.stats()["bytes_streamed"] > 0
    h.disable()
    for t in model.parameters():
        t.__dict__.pop("_dynamo_static_input_type", None)
    assert weights(model) == before


BINDING_MODELS = {
    "torchao": lambda: torchao_model("flux", "Float8WeightOnlyConfig"),
    "bnb": lambda: bnb_model("flux", nested=True),
}


@pytest.mark.parametrize("kind", sorted(BINDING_MODELS))
def test_a_failure_at_every_binding_of_enable_leaves_a_quantized_model_as_it_was(kind):
    model, x = BINDING_MODELS[kind]()
    before = weights(model)
    with torch.no_grad():
        expected = model(**x)[0]

    def check(n):
        assert weights(model) == before, f"failure at binding {n}"

    def enable(seams):
        return wf.enable({"transformer": model}, layer(2), device="sim", _seams=seams)

    h, n = enable_through_binding_failures(enable, check)
    # Past every part of a subclass (a wrapper's, or the quant_state tensors of a 4-bit weight) at least once.
    subclasses = [t for t in model.parameters() if type(t) is not torch.nn.Parameter]
    assert n > sum(len(parts(t)) + len(state_tensors(t)) for t in subclasses)
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
    h.disable()
    assert weights(model) == before


def test_the_plan_counts_stored_bytes_so_a_budget_keeps_more_quantized_blocks_resident(folder):
    from test_diffusers import flux

    plain, _, _ = flux()
    plain = plain.to(torch.bfloat16)
    quantized, _ = gguf_model("flux", "Q4_0", folder)
    stacks = [wf.plan({"transformer": m}, layer(1))["components"][0]["stacks"][0] for m in (plain, quantized)]
    assert [s["bytes"] for s in stacks] == [block_bytes(plain, align=256), block_bytes(quantized, align=256)]
    # One budget: room for the bf16 ring and one more bf16 block.
    smallest = wf.plan({"transformer": plain}, layer(1))["device_weight_bytes"]
    one_block = stacks[0]["max_streaming_block_bytes"]
    cfg = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": smallest + one_block}}
    resident = [wf.plan({"transformer": m}, cfg)["components"][0]["stacks"][0]["resident"] for m in (plain, quantized)]
    assert resident[0] >= 1 and resident[1] >= 2 * resident[0], resident


class Counting(torch.Tensor):
    """A storage-backed tensor subclass that counts the calls of its ``__torch_function__``."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_binding_swaps_a_subclass_s_bytes_without_its_torch_function_and_moves_a_wrapper_only_with_its_parts(
    monkeypatch,
):
    from weightferry import _storages
    from weightferry._composites import Composite

    t = torch.zeros(4, 8, dtype=torch.uint8).as_subclass(Counting)
    t.quant_type = 8
    data = torch.arange(32, dtype=torch.uint8).reshape(4, 8)
    view = _storages.View(t, "w")
    before = Counting.calls
    _storages.set_data(view, data)
    assert Counting.calls == before  # torch's own assignment: the class computes nothing for a binding
    assert type(t) is Counting and t.quant_type == 8 and t.data_ptr() == data.data_ptr()

    model, _ = torchao_model("flux", "Int8WeightOnlyConfig")
    name, w = next((n, p) for n, p in model.named_parameters() if len(parts(p)) > 1)
    c = Composite(w, name, (model, name))
    settled = []
    monkeypatch.setattr(_storages, "settle", settled.append)
    for holder, attr, path in c.leaves():
        part = getattr(holder, attr)
        _storages.set_data(_storages.View(part, path, owner=c), part.clone())
    assert settled == []  # no part changed device: the wrapper is where its parts are, nothing to re-point


def stored_bytes(model, align):
    """Bytes of every parameter in the model's block lists and of the tensors its Python state holds (a 4-bit
    weight's ``quant_state``), each its own storage rounded up to ``align``."""
    tensors = [t for attr in BLOCK_LISTS if hasattr(model, attr) for t in getattr(model, attr).parameters()]
    tensors += [s for t in tensors for _, s in state_tensors(t)]
    return sum(-(-t.untyped_storage().nbytes() // align) * align for t in tensors)


BNB = [("flux", True, 1), ("flux", True, 2), ("flux", True, 0), ("flux", False, 2), ("wan", False, 2), ("wan", True, 0)]


@pytest.mark.parametrize("name,nested,depth", BNB, ids=[f"{n}-{'nested' if d else 'nf4'}-{k or 'budget'}"
                                                        for n, d, k in BNB])
def test_a_bitsandbytes_4bit_model_streams_its_weights_and_quant_state_bit_identical_to_resident(name, nested, depth):
    model, x = bnb_model(name, nested)
    twin, _ = bnb_model(name, nested)
    four = {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    quant_states = {n: p.quant_state for n, p in four.items()}
    before = weights(model)
    h, per_pass, expected = stream_twice(model, twin, x, depth)
    if depth:
        # The packed 4-bit bytes and their quant_state tensors (absmax, code; nested: offset and state2's) stream.
        assert per_pass == stored_bytes(twin, align=256)
        # The same blocks in bf16 (a 4-bit weight's values: its quant_state's shape).
        bf16 = sum(2 * math.prod(p.quant_state.shape if hasattr(p, "quant_state") else p.shape)
                   for attr in BLOCK_LISTS if hasattr(twin, attr) for p in getattr(twin, attr).parameters())
        assert stored_bytes(twin, align=1) < 0.5 * bf16, (stored_bytes(twin, align=1), bf16)  # tiny: code, absmax weigh
        # Between forwards a streamed weight's quant_state tensors hold nothing (no host copy of its scales).
        streamed4 = [p for n, p in four.items() if n.split(".")[0] in BLOCK_LISTS]
        assert streamed4 and all(is_placeholder(s) for p in streamed4 for _, s in state_tensors(p))
    else:
        assert h.stats()["stacks"][0]["resident"] > 0
        assert per_pass < stored_bytes(twin, align=256)
    # bitsandbytes writes the quant_state entries (weight.absmax, weight.quant_map, ...) from the live tensors,
    # lent their true bytes while it does (given back after), with keep_vars too.
    assert state_of(model.state_dict()) == state_of(twin.state_dict())
    kept = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
    assert state_of(kept) == state_of({k: v.detach() for k, v in twin.state_dict(keep_vars=True).items()})
    if depth:
        assert all(is_placeholder(s) for p in streamed4 for _, s in state_tensors(p))
    h.disable()
    assert weights(model) == before
    assert all(model.get_parameter(n) is p and p.quant_state is quant_states[n] for n, p in four.items())
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)


def test_load_state_dict_into_a_bitsandbytes_4bit_weight_while_offloaded_is_refused_and_nothing_changes():
    model, x = bnb_model("flux", nested=True)
    sd = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        expected = model(**x)[0]
    with wf.enable({"transformer": model}, layer(2), device="sim"):
        before = weights(model)
        with pytest.raises(wf.OffloadError) as e:
            model.load_state_dict(sd)
        assert str(e.value) == (
            "'transformer' is offloaded by weightferry: its weight 'time_text_embed.timestep_embedder.linear_1.weight' "
            "is a Params4bit, a tensor subclass weightferry streams by its parts, which load_state_dict cannot write "
            "while offloaded; disable, load, and enable again (nothing was loaded)"
        )
        assert weights(model) == before
        with torch.no_grad():
            assert torch.equal(model(**x)[0], expected)


MODULE_MODELS = {
    "gguf": lambda folder: gguf_model("flux", "Q4_0", folder),
    "torchao": lambda folder: torchao_model("flux", "Int8WeightOnlyConfig"),
    "bnb": lambda folder: bnb_model("flux", nested=False),
}


@pytest.mark.parametrize("kind", sorted(MODULE_MODELS))
def test_module_level_offload_swaps_quantized_models_as_stored(folder, kind):
    # Two quantized models swapped whole (model-level offload swaps a DiT against an encoder stage).
    model, x = MODULE_MODELS[kind](folder)
    encoder, _ = MODULE_MODELS[kind](folder)
    twin, _ = MODULE_MODELS[kind](folder)
    before = (weights(model), weights(encoder))
    with torch.no_grad():
        expected = twin(**x)[0]
    cfg = {"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}
    pipeline = {"transformer": model, "text_encoder": encoder}
    with wf.enable(pipeline, cfg, device="sim", dit=["transformer"], encoders=["text_encoder"]) as h:
        with torch.no_grad():
            for m in (encoder, model, encoder, model):
                assert torch.equal(m(**x)[0], expected)
        assert state_of(model.state_dict()) == state_of(twin.state_dict())
        # Each swap-in copies a model's stored bytes: its parameters, their parts and their state's tensors (at
        # least the bytes they view; at most their storages, each at the device alignment).
        tensors = [q for t in twin.parameters() for _, q in parts(t) + state_tensors(t)]
        viewed = sum(q.numel() * q.element_size() for q in tensors)
        stored = sum(-(-q.untyped_storage().nbytes() // 256) * 256 for q in tensors)
        assert 4 * viewed <= h.stats()["bytes_streamed"] <= 4 * stored, (h.stats()["bytes_streamed"], viewed, stored)
    assert (weights(model), weights(encoder)) == before


def test_a_bitsandbytes_8bit_model_streams_bit_identical_and_one_run_before_enable_is_refused():
    # Int8Params: int8 bytes, with CB (a second view of them) and SCB (the row scales) in its attributes.
    # Linear8bitLt's first forward moves CB and SCB into the module's `state` (the same tensor objects, which
    # weightferry binds in place), and each forward puts state.CB back into the weight.
    model, x = bnb8_model("flux")
    twin, _ = bnb8_model("flux")
    with torch.no_grad():
        expected = twin(**x)[0]
    h = wf.enable({"transformer": model}, layer(2), device="sim")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
        assert torch.equal(model(**x)[0], expected)
    assert state_of(model.state_dict()) == state_of(twin.state_dict())
    h.disable()
    assert weights(model) == weights(twin)
    # Run once resident, the module holds state.CB, a tensor over its weight's bytes that is neither a parameter nor
    # a buffer: weightferry could not move it, so enable refuses before anything changes.
    before = weights(twin)
    with pytest.raises(wf.PipelineError) as e:
        wf.enable({"transformer": twin}, layer(2), device="sim")
    assert str(e.value) == (
        "module 'transformer.time_text_embed.timestep_embedder.linear_1' (Linear8bitLt) holds in its attribute "
        "'state.CB' a tensor over the bytes of its weight 'transformer.time_text_embed.timestep_embedder.linear_1."
        "weight', outside its parameters and buffers: weightferry moves the weight's bytes and cannot move that "
        "tensor; build the module anew without running it before enable, or leave it out of the offloaded components"
    )
    assert weights(twin) == before
    assert all(len(m._forward_pre_hooks) == 0 for m in twin.modules())
    with torch.no_grad():
        assert torch.equal(twin(**x)[0], expected)


def test_weightferry_inspect_reads_a_gguf_file_as_the_gguf_package_does_and_enable_refuses_another_quantization(
        folder, cli):
    # The file diffusers' GGUF quantizer loads (tensors named as the diffusers model names them), read by the CLI's
    # checkpoint reader (header checked, tensors mapped as stored: quantized ones as their bytes) and by gguf's own.
    import gguf
    from quantized import gguf_file
    from test_diffusers import flux

    path = os.path.join(folder, "inspect-Q4_0.gguf")
    gguf_file(flux()[0].to(torch.bfloat16), path, "Q4_0")
    out = cli.run("inspect", "--json", path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    tensors = gguf.GGUFReader(path).tensors
    by_dtype = {}
    for t in tensors:
        dtype = "f32" if t.tensor_type == gguf.GGMLQuantizationType.F32 else "u8"
        n, size = by_dtype.get(dtype, (0, 0))
        by_dtype[dtype] = (n + 1, size + int(t.n_bytes))
    assert got["tensors"] == len(tensors) and got["tensor_bytes"] == sum(int(t.n_bytes) for t in tensors)
    assert {k: (v["tensors"], v["bytes"]) for k, v in got["dtypes"].items()} == by_dtype
    # Every block of both block lists found by name, as from a safetensors file.
    assert [(b["attr"], b["blocks"]) for b in got["block_lists"]] == [
        ("transformer_blocks", 2), ("single_transformer_blocks", 3)]
    # The CLI's engine runs the file resident and offloaded over its mapped bytes (quantized ones as stored).
    run = cli.run("run", "--checkpoint", path)
    assert run.returncode == 0, run.stderr
    assert "outputs match: yes" in run.stdout and "weights match: yes" in run.stdout

    # checkpoint= binds a GGUF file by name (test_gguf_checkpoint.py); one of another quantization than the model's
    # (Q4_0 bytes for Q8_0 ones) is refused, naming the first tensor that differs, before anything changes.
    model, _ = gguf_model("flux", "Q8_0", folder)
    before = weights(model)
    with pytest.raises(wf.CheckpointError) as e:
        wf.enable({"transformer": model}, layer(2), device="sim", checkpoint=path)
    assert str(e.value) == (
        f"{path}: tensor `time_text_embed.timestep_embedder.linear_1.weight`: the checkpoint has u8 [32, 144], the "
        "description u8 [32, 272]"
    )
    assert weights(model) == before and all(len(m._forward_pre_hooks) == 0 for m in model.modules())
