"""``torch.compile(fullgraph=True)`` of a streamed transformer on ``device="sim"``: with a static schedule
(``static_slots``) every streamed block's tensors are bound at its slot for each forward of the transformer and its
hooks trace as the custom operators ``weightferry::enter`` / ``weightferry::leave``, so the whole transformer
compiles into one graph with no graph break at its blocks, and the compiled forward (``backend="eager"`` and
``"aot_eager"``, AOT autograd's functionalization included) streams every block and gives exactly the resident
compiled model's output, pass after pass (a tiny Flux, also with two dtypes in every block, and a tiny Wan); also
under a device budget, after a weight write, after a retune and after a compiled forward that raised inside a block.
The simulated device's hazard detector finds no violation in the compiled schedule and names its broken variant.
Without ``static_slots`` the graph breaks at the blocks, and ``fullgraph=True`` refuses."""

import copy
import re

import pytest
import torch
import torch._dynamo
from test_diffusers import flux, wan
from torch._dynamo.utils import counters

import weightferry as wf
from weightferry._binders import is_placeholder

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")


def config(static=True, depth=2):
    dit = {"prefetch_depth": depth}
    if static:
        dit["static_slots"] = True
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "layer_options": {"dit": dit}}}


def model_and_inputs(dtypes, single=6):
    """A tiny Flux of 4 double and ``single`` single blocks (10 streamed; at depth 2 a static ring of 5 slots; the
    inductor tests take 2 single blocks, 6 streamed in a ring of 3, to compile in less time). ``"mixed"``: bf16, with
    every block's ``norm_q`` in float32, so each block holds two dtypes in its slot. ``"wan"``: a tiny Wan 2.1
    transformer (4 blocks) instead."""
    if dtypes == "wan":
        model, x, _ = wan()
        return model.eval(), x
    model, x, _ = flux()
    model = type(model)(**{**model.config, "num_layers": 4, "num_single_layers": single}).eval()
    if dtypes == "mixed":
        model = model.to(torch.bfloat16)
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.attn.norm_q.float()
        x = {k: v if k in ("img_ids", "txt_ids") else v.to(torch.bfloat16) for k, v in x.items()}
    return model, x


def run(fn, x):
    with torch.no_grad():
        return fn(**x, return_dict=False)[0]


def loads(h):
    return sum(s["loads"] for s in h.stats()["stacks"])


# Dynamo alone (``eager``) on one model; ``aot_eager`` (dynamo, then AOTAutograd's functionalization of the traced
# operators, what inductor sees) on each: the graph-break count is dynamo's in both.
@pytest.mark.parametrize(("backend", "dtypes"), [("eager", "wan"), ("aot_eager", "float32"), ("aot_eager", "mixed"),
                                                 ("aot_eager", "wan")])
def test_fullgraph_compile_streams_every_block_with_no_graph_break(backend, dtypes):
    model, x = model_and_inputs(dtypes, single=2)  # Flux: 6 streamed blocks, a ring of 3 turning twice a pass
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch._dynamo.reset()
    want = run(torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True), x)
    # Wan's 4 blocks at depth 2 would take 4 static slots (the smallest divisor from 3): nothing would stream.
    with wf.enable({"transformer": model}, config(depth=1 if dtypes == "wan" else 2), device="sim") as h:
        explained = torch._dynamo.explain(model)(**x, return_dict=False)
        assert (explained.graph_break_count, explained.graph_count) == (0, 1)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        blocks = len(h._storages.streamed_by)
        for _ in range(3):
            start = loads(h)
            assert torch.equal(run(compiled, x), want)
            assert loads(h) - start >= blocks - 2, "every streamed block but the prefetched ones loaded in the pass"
        assert h._session.hazard_violations() == []
        # Between forwards a statically bound tensor is an empty placeholder again, never a view of a slot that may
        # hold another block's bytes (its component's forward binds it at its place).
        name = next(k for k in before if k.endswith(("blocks.3.attn1.to_q.weight", "blocks.3.attn.to_q.weight")))
        assert is_placeholder(model.get_parameter(name))
        assert torch.equal(h.state_dict("transformer")[name], before[name])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_without_a_static_schedule_each_streamed_block_is_one_graph_break():
    model, x = model_and_inputs("float32")
    with wf.enable({"transformer": model}, config(static=False), device="sim"):
        explained = torch._dynamo.explain(model)(**x, return_dict=False)
        # The hooks are compiler-disabled: the graph breaks at the blocks (the blocks of a kind share one frame).
        assert explained.graph_break_count >= 2 and explained.graph_count >= 3
        torch._dynamo.reset()
        # fullgraph=True stops at the first hook, and torch's message says why and names the fix.
        with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
            run(torch.compile(model, backend="eager", fullgraph=True), x)
        assert re.search(r"weightferry streams block 'transformer\.\w+\.0' and rebinds its tensors in this hook",
                         str(caught.value)), str(caught.value)
        assert "compile without fullgraph=True" in str(caught.value)
        assert '"static_slots": True in its layer_options' in str(caught.value)


@pytest.mark.parametrize("dtypes", ["float32", "mixed"])
def test_regional_compilation_with_fullgraph_compiles_each_block_class_once_and_is_exact(dtypes):
    # diffusers' compile_repeated_blocks(fullgraph=True) compiles each block's call: traced alone, a block's hooks
    # name it by a tensor, so every block of a class shares its compiled code, as the resident model's blocks do.
    # The count of compiled graphs must not grow with the number of blocks (it did: one version per block, past
    # torch.compile's default limit of 8, which weightferry still raises by its static blocks while enabled).
    graphs = []
    for singles in (6, 10):
        model, x = model_and_inputs(dtypes)
        model = type(model)(**{**model.config, "num_single_layers": singles}).eval().to(next(model.parameters()).dtype)
        if dtypes == "mixed":
            for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
                block.attn.norm_q.float()
        twin = copy.deepcopy(model)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.reset()
        twin.compile_repeated_blocks(fullgraph=True, backend="eager")
        want = run(twin, x)
        torch._dynamo.reset()
        counters.clear()
        with wf.enable({"transformer": model}, config(), device="sim") as h:
            blocks = len(h._hooks.static.places)
            assert blocks == 4 + singles and torch._dynamo.config.recompile_limit == limit + blocks
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
            for _ in range(2):
                assert torch.equal(run(model, x), want)
            assert h._session.hazard_violations() == []
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch._dynamo.config.recompile_limit == limit
        torch._dynamo.reset()
    assert graphs[0] == graphs[1], graphs


def compile_as(how, backend):
    """``model`` compiled whole (``torch.compile(fullgraph=True)``) or block by block (diffusers'
    ``compile_repeated_blocks(fullgraph=True)``, in place)."""
    def compile_model(model):
        if how == "whole":
            return torch.compile(model, backend=backend, fullgraph=True)
        model.compile_repeated_blocks(fullgraph=True, backend=backend)
        return model
    return compile_model


@pytest.mark.parametrize("how", ["whole", "regional"])
@pytest.mark.parametrize("backend", ["aot_eager"])  # dynamo's guards and recompiles, and the functionalized operators
def test_a_write_and_a_retune_keep_the_compiled_forward_exact(backend, how):
    # The resident copy is compiled while the model is enabled: torch.compile guards on hooks then, so the copy's
    # code (no hooks) never runs for the offloaded model. Regional: the blocks' shared code reads their weights by
    # name, and those names are made again with the places.
    model, x = model_and_inputs("float32")
    resident = copy.deepcopy(model)
    key = "single_transformer_blocks.4.proj_out.weight"
    new = {key: resident.state_dict()[key] * 2}
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        compiled = compile_as(how, backend)(model)
        run(compiled, x)
        model.load_state_dict(new, strict=False)  # the stacks are rebuilt: every block bound at its new slot
        resident.load_state_dict(new, strict=False)
        torch._dynamo.reset()
        want = run(compile_as(how, backend)(resident), x)
        assert torch.equal(run(compiled, x), want)
        h.retune(prefetch_depth=1)  # 2 static slots now
        assert torch.equal(run(compiled, x), want)
        assert torch.equal(run(compiled, x), want)
        assert h._session.hazard_violations() == []
    assert torch.equal(model.state_dict()[key], new[key])
    assert torch._dynamo.config.skip_nnmodule_hook_guards is True, "torch's setting is back after disable"


def test_an_edit_outside_editing_is_refused_and_put_back_before_the_compiled_forward():
    # A statically bound tensor views its slot between forwards: an in-place edit there is found (its version
    # counter moved) before the next forward, compiled or not, put back, and named.
    model, x = model_and_inputs("float32")
    torch._dynamo.reset()
    want = run(copy.deepcopy(model), x)
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert torch.equal(run(compiled, x), want)
        with torch.no_grad():
            model.transformer_blocks[2].attn.to_k.weight.mul_(2)
        with pytest.raises(wf.OffloadError, match=r"^'transformer\.transformer_blocks\.2\.attn\.to_k\.weight' changed "
                           r"while offloaded, outside Handle\.editing\(\)"):
            run(compiled, x)
        assert torch.equal(run(compiled, x), want)
        assert h._session.hazard_violations() == []


def test_the_hazard_detector_sees_a_compiled_forward_that_reads_a_slot_early(monkeypatch):
    # The broken variant of the compiled schedule: each block's enter also reads the next block's slot, whose copy
    # was issued (prefetched) but not waited for. The simulated device's hazard detector, which finds no violation
    # in the right schedule (above), names it.
    from weightferry import _static

    model, x = model_and_inputs("float32")
    original = _static.StaticPlaces.landed

    def early(self, path, buffer, base):
        original(self, path, buffer, base)
        paths = list(self.places)
        following = paths[(paths.index(path) + 1) % len(paths)]
        original(self, following, *self.places[following])

    with wf.enable({"transformer": model}, config(), device="sim") as h:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        run(compiled, x)
        assert h._session.hazard_violations() == []
        monkeypatch.setattr(_static.StaticPlaces, "landed", early)
        run(compiled, x)
        violations = h._session.hazard_violations()
        assert violations and all("ReadBeforeReady" in v for v in violations), violations


def test_a_static_ring_under_a_device_budget_compiles_with_no_graph_break():
    # The budget planner sizes the static ring by its own slot count (a divisor of the streamed blocks it leaves):
    # the plan fits the budget, and the compiled forward is exact.
    model, x = model_and_inputs("float32")
    budget = 700_000  # under the 827,392 bytes of the 5-slot ring with every block streamed
    cfg = config()
    cfg["diffusion_offload_config"]["device_budget"] = budget
    report = wf.plan({"transformer": model}, cfg)
    (stack,) = [s for c in report["components"] for s in c.get("stacks", [])]
    assert report["device_weight_bytes"] <= budget and stack["static_slots"]
    assert stack["streaming"] % stack["slots"] == 0 and 0 < stack["resident"] < 10, stack
    torch._dynamo.reset()
    want = run(torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True), x)
    with wf.enable({"transformer": model}, cfg, device="sim") as h:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for _ in range(2):
            assert torch.equal(run(compiled, x), want)
        assert h._session.hazard_violations() == []


def test_a_compiled_forward_that_raises_inside_a_block_leaves_the_next_one_exact(monkeypatch):
    # The compiled code raises after block 2 opened and before it closed (here: in the operator that closes it):
    # the transformer's own forward hook closes it, every tensor is a placeholder again, and the next forwards,
    # compiled or eager, are exact.
    from weightferry import _hooks

    model, x = model_and_inputs("float32")
    torch._dynamo.reset()
    want = run(torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True), x)
    original = _hooks.Hooks.traced_leave
    fail = [False]

    def leave(self, unit):
        if fail[0] and unit == 2:
            raise RuntimeError("injected")
        return original(self, unit)

    monkeypatch.setattr(_hooks.Hooks, "traced_leave", leave)
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert torch.equal(run(compiled, x), want)
        fail[0] = True
        with pytest.raises(RuntimeError, match="injected"):
            run(compiled, x)
        fail[0] = False
        assert not h._hooks.busy()
        assert all(is_placeholder(p) for n, p in model.named_parameters() if "blocks." in n)
        for _ in range(2):
            assert torch.equal(run(compiled, x), want)
        assert torch.equal(run(model, x), want)
        assert h._session.hazard_violations() == []


def compiled_outputs(model, x, dtypes, passes=2):
    """The outputs of ``passes`` forwards of ``model`` streamed with a static schedule and compiled by inductor."""
    outs = []
    with wf.enable({"transformer": model}, config(depth=1 if dtypes == "wan" else 2), device="sim") as h:
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(passes):
            start = loads(h)
            outs.append(run(compiled, x))
            assert loads(h) - start >= 2
        assert h._session.hazard_violations() == []
        torch._dynamo.reset()
    return outs


@pytest.mark.parametrize("dtypes", ["float32", "wan"])
def test_inductor_matches_the_resident_model_compiled_whole_bit_for_bit(dtypes):
    # Inductor (the default backend; on the CPU here): in float32 the streamed compiled forward equals the resident
    # model compiled whole, bit for bit, pass after pass.
    model, x = model_and_inputs(dtypes, single=2)
    torch._dynamo.reset()
    want = run(torch.compile(copy.deepcopy(model), fullgraph=True), x)
    for out in compiled_outputs(model, x, dtypes):
        assert torch.equal(out, want)


_edges = None


def block_edges(model):
    """A copy of ``model`` whose every block is framed by two custom operators declared as weightferry's are (see
    ``weightferry._traced``: one declaring the block's weights mutated before it, one taking its outputs after it,
    both tagged ``cudagraph_unsafe``) that do nothing: the resident model compiled with the same edges at its blocks,
    against which a streamed compiled forward differs only if streaming changed a byte."""
    global _edges
    if _edges is None:
        unsafe = (torch.Tag.cudagraph_unsafe,)

        @torch.library.custom_op("wftest::enter", mutates_args=("order", "weights"), tags=unsafe)
        def enter(order: torch.Tensor, weights: list[torch.Tensor]) -> None:
            pass

        @torch.library.custom_op("wftest::leave", mutates_args=("order",), tags=unsafe)
        def leave(order: torch.Tensor, outputs: list[torch.Tensor]) -> None:
            pass

        _edges = (enter, leave)
    enter, leave = _edges
    model = copy.deepcopy(model)
    order = torch.zeros(1, device=next(model.parameters()).device)
    from weightferry._traced import output_tensors

    flux = hasattr(model, "single_transformer_blocks")
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks] if flux else [*model.blocks]
    for block in blocks:
        weights = list(block.parameters())
        block.register_forward_pre_hook(lambda m, a, weights=weights: enter(order, weights))
        block.register_forward_hook(lambda m, a, out: leave(order, output_tensors(out)))
    return model


def test_inductor_in_bf16_matches_the_resident_model_compiled_with_the_same_block_edges():
    # bf16 with a float32 tensor in every block: the streamed compiled forward equals the resident model compiled
    # with the same operators at its blocks' edges, bit for bit (``leave`` takes the outputs: see weightferry._traced);
    # from the resident model compiled whole it is one bf16 rounding step (inductor no longer fuses across the edges).
    model, x = model_and_inputs("mixed", single=2)
    torch._dynamo.reset()
    whole = run(torch.compile(copy.deepcopy(model), fullgraph=True), x)
    torch._dynamo.reset()
    want = run(torch.compile(block_edges(model), fullgraph=True), x)
    for out in compiled_outputs(model, x, "mixed"):
        assert torch.equal(out, want)
        torch.testing.assert_close(out, whole, rtol=0, atol=2**-7)


@pytest.mark.parametrize("dtypes", ["float32", "wan"])
def test_a_leave_that_waits_for_no_output_reads_poisoned_places(monkeypatch, dtypes):
    # The broken variant: ``leave`` handed a tensor unrelated to the block's outputs, so nothing orders the block's
    # reads before it and inductor moves some past it. The sim poisons a block's place when it closes (a slot the
    # copy stream would refill on a GPU), so those reads give NaN, not the right bytes by luck.
    from weightferry import _hooks

    model, x = model_and_inputs(dtypes)
    monkeypatch.setattr(_hooks, "output_tensors", lambda output: [torch.ones(1)])
    (out,) = compiled_outputs(model, x, dtypes, passes=1)
    assert out.isnan().any()


def test_a_static_block_that_returns_no_tensor_is_refused_while_compiling():
    # ``leave`` waits for the block's output tensors; a block that returns none cannot be ordered, and is refused
    # while torch.compile traces (dynamo carries the refusal out in its own exception, the message kept).
    from weightferry import _hooks

    model, x = model_and_inputs("float32")
    want = run(model, x)
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        real = _hooks.output_tensors
        try:
            _hooks.output_tensors = lambda output: []
            refused = r"static block 'transformer\.transformer_blocks\.0' returned no tensor"
            with pytest.raises(torch._dynamo.exc.Unsupported, match=refused):
                run(compiled, x)
        finally:
            _hooks.output_tensors = real
        assert not h._hooks.busy()
        torch._dynamo.reset()
        assert torch.equal(run(model, x), want), "the eager forward after the refusal is exact"
