"""A static schedule (``layer_options.<component>.static_slots``) on ``device="sim"``: every streamed block lands in
the same device slot on every pass, so each of its tensors is bound to one place only (the ground for binding them
once and capturing the forward in a graph). A tiny Flux streams its 4 double and 6 single blocks as one stack of 10:
at depth 2 the ring takes 3 slots, which do not divide 10, and blocks move between slots from pass to pass; with
``static_slots`` it takes 5 and never moves a block. Outputs are bit-identical to the resident model either way."""

import collections
import copy
import json

import pytest
import torch
import zoo
from test_diffusers import flux

import weightferry as wf
from weightferry import _hooks

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")


def config(static):
    dit = {"prefetch_depth": 2}
    if static:
        dit["static_slots"] = True
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "layer_options": {"dit": dit}}}


def places(monkeypatch, model, x, cfg, passes=4):
    """Per streamed block, the (buffer, offset) places it landed at over ``passes`` forwards; the plan's stack row;
    whether every output equalled the resident model's; how many distinct data pointers each streamed parameter
    had during its block's forwards."""
    landed = collections.defaultdict(set)
    pointers = collections.defaultdict(set)
    original = _hooks.Hooks._place

    def spy(self, path, offsets, buffer, base, traced):
        landed[path].add((buffer, base))
        return original(self, path, offsets, buffer, base, traced)

    def watch(module, args, output):
        for name, p in module.named_parameters():
            pointers[(id(module), name)].add(p.data_ptr())

    monkeypatch.setattr(_hooks.Hooks, "_place", spy)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    hooks = [b.register_forward_hook(watch) for b in blocks]
    resident = copy.deepcopy(model)
    with torch.no_grad():
        want = resident(**x, return_dict=False)[0]
    with wf.enable({"transformer": model}, cfg, device="sim") as h:
        (stack,) = [s for c in json.loads(h._session.plan_json())["components"] for s in c.get("stacks", [])]
        same = True
        for _ in range(passes):
            with torch.no_grad():
                same &= torch.equal(model(**x, return_dict=False)[0], want)
        assert h._session.hazard_violations() == []
    for hook in hooks:
        hook.remove()
    return {path: p for path, p in landed.items() if path in h._storages.streamed_by}, stack, same, pointers


def test_a_static_schedule_binds_every_streamed_tensor_to_one_slot_on_every_pass(monkeypatch):
    model, x, _ = flux()
    model = type(model)(**{**model.config, "num_layers": 4, "num_single_layers": 6})
    moved, stack, same, _ = places(monkeypatch, model, x, config(static=False))
    assert same and (stack["slots"], stack["streaming"]) == (3, 10) and "static_slots" not in stack
    assert sum(len(p) > 1 for p in moved.values()) > len(moved) // 2, "3 slots for 10 blocks: blocks move"

    fixed, stack, same, pointers = places(monkeypatch, model, x, config(static=True))
    assert same and (stack["slots"], stack["streaming"], stack["static_slots"]) == (5, 10, True)
    assert len(fixed) == len(moved) == 10 and all(len(p) == 1 for p in fixed.values())
    assert len({next(iter(p))[0] for p in fixed.values()}) == 5, "the five slot buffers, each block in its own"
    assert all(len(p) == 1 and 0 not in p for p in pointers.values()), "bound at the block's place every time"


def test_the_plan_says_the_schedule_is_static_and_counts_its_slots():
    model, _, _ = flux()
    report = wf.plan({"transformer": model}, config(static=True))
    (stack,) = [s for c in report["components"] for s in c.get("stacks", [])]
    # 2 double + 3 single blocks: depth 2 needs 3 slots, and 5 is the smallest count from 3 up dividing 5.
    assert (stack["streaming"], stack["slots"], stack["static_slots"]) == (5, 5, True)
    assert "(depth 2, 5 slots, static)" in report["components"][0]["action"]


@pytest.mark.parametrize("case", zoo.DITS, ids=[c.name for c in zoo.DITS])
def test_every_zoo_transformer_runs_a_static_schedule_bit_identical(case):
    """``static_slots`` on every diffusers transformer of the zoo (classes no issue names): its blocks bound at their
    places for each forward (plain parameters only), two forwards equal to the resident model's, the order check
    clean, the weights given back bit-identical."""
    m, x = case.build(), case.inputs()
    want = case.run(m, x)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cfg = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                        "layer_options": {"dit": {"prefetch_depth": 1, "static_slots": True}}}}
    stacks = [s for c in wf.plan({"transformer": m}, cfg)["components"] for s in c.get("stacks", [])]
    assert stacks and all(s["static_slots"] for s in stacks), "the plan shows the static schedule"
    with wf.enable({"transformer": m}, cfg, device="sim") as h:
        assert h._hooks.static is not None and h._hooks.static.places
        for _ in range(2):
            assert torch.equal(case.run(m, x), want)
        assert h._session.hazard_violations() == []
    after = m.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
