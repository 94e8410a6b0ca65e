"""The schedule a captured CUDA graph replays (``weightferry._replay``), checked over repeated replays with the order
checker, and the broken variants it catches (issue 29, Deliver 4); and a whole capture on the simulated device
(``weightferry._capture.simulated_capture``): the schedule recorded from a forward's hooks, eager or compiled, replayed
against the simulated device's memory around forwards of the model, exact, and leaving the session's own schedule
true (an eager forward after replays, and replays after it, exact), with the broken wrap caught by the bytes."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_static_compile import config, loads, model_and_inputs, run

import weightferry as wf
from weightferry import _capture
from weightferry._replay import Copy, Fork, Join, Op, Ready, ReplayPlan, Use, hazards


def _stack(n: int, slots: int, resident: int = 0) -> tuple[list[str], dict[str, int]]:
    """``n`` blocks, the first ``resident`` each in a place of its own (100 + i), the rest streamed through ``slots``
    places in the static order (streamed block k in place k mod slots)."""
    order = [f"b{i}" for i in range(n)]
    place = {b: (100 + i if i < resident else (i - resident) % slots) for i, b in enumerate(order)}
    return order, place


def _boundary(order: list[str], place: dict[str, int], depth: int) -> dict[int, str]:
    """What the session's static schedule holds at a pass boundary: each place its last block of the pass, then the
    next pass's first ``depth`` streamed blocks prefetched over them (the wrap)."""
    held: dict[int, str] = {}
    for b in order:
        held[place[b]] = b
    streamed = [b for b in order if list(place.values()).count(place[b]) > 1]
    for b in streamed[:depth]:
        held[place[b]] = b
    return held


def _pass(plan: ReplayPlan, calls: list[str]) -> list[Op]:
    ops = plan.start()
    for b in calls:
        ops += plan.enter(b)
        ops += plan.leave(b)
    return ops + plan.finish()


SHAPES = [(4, 2, 0, 1), (6, 3, 0, 2), (6, 2, 0, 1), (8, 4, 2, 3), (57, 3, 0, 2), (5, 5, 0, 4)]


@pytest.mark.parametrize("n,slots,resident,depth", SHAPES)
def test_a_replayed_pass_is_race_free_and_gives_the_places_back(n: int, slots: int, resident: int, depth: int) -> None:
    order, place = _stack(n, slots, resident)
    held = _boundary(order, place, depth)
    ops = _pass(ReplayPlan(order, place, held), order)
    assert hazards(ops, held, replays=4) == []
    assert isinstance(ops[0], Fork) and isinstance(ops[-1], Join)
    uses = [op.block for op in ops if isinstance(op, Use)]
    assert uses == order
    # A block is copied once per pass, unless it is held at the start and alone in its place (a resident block, or
    # a slot of its own): a held block sharing its place is overwritten during the pass and given back by the wrap.
    copied = [op.block for op in ops if isinstance(op, Copy)]
    for b in order:
        alone = list(place.values()).count(place[b]) == 1
        assert copied.count(b) == (0 if held.get(place[b]) == b and alone else 1), b


@pytest.mark.parametrize("n,slots,depth", [(4, 2, 1), (6, 3, 2), (57, 3, 2)])
def test_copies_run_ahead_of_the_blocks_that_read_them(n: int, slots: int, depth: int) -> None:
    """In a steady pass no block waits for a copy issued when it opened: each is prefetched while an earlier block
    runs (the copies overlap compute, as the session's own schedule does)."""
    order, place = _stack(n, slots)
    held = _boundary(order, place, depth)
    plan = ReplayPlan(order, place, held)
    plan.start()
    for b in order:
        issued_at_open = [op for op in plan.enter(b) if isinstance(op, Copy) and op.block == b]
        assert issued_at_open == [], f"{b} was fetched when it opened"
        plan.leave(b)


def test_any_call_order_is_race_free() -> None:
    """Blocks called out of the stack's order (an eager forward that skips or reorders blocks) are copied when they
    open, still ordered behind the last use of what they overwrite."""
    order, place = _stack(6, 2)
    held = _boundary(order, place, 1)
    for calls in (order[::-1], ["b0", "b2", "b4", "b1", "b3", "b5"], ["b3", "b3", "b0"], []):
        ops = _pass(ReplayPlan(order, place, held), calls)
        assert hazards(ops, held, replays=3) == [], calls


def test_an_empty_start_is_race_free() -> None:
    """Places the session left empty (nothing held) are filled by the graph and left filled: later replays find the
    blocks there."""
    order, place = _stack(6, 3)
    ops = _pass(ReplayPlan(order, place, {}), order)
    assert hazards(ops, {}, replays=3) == []


@pytest.mark.parametrize("fault,hazard", [("skip_last_use_wait", "overwrite-before-last-use"),
                                          ("skip_ready_wait", "read-before-ready")])
@pytest.mark.parametrize("n,slots,depth", [(4, 2, 1), (6, 3, 2), (8, 2, 1)])
def test_broken_waits_are_caught(n: int, slots: int, depth: int, fault: str, hazard: str) -> None:
    """Without the wait for the last use of what a copy overwrites, or without the wait for a block's own copy."""
    order, place = _stack(n, slots)
    held = _boundary(order, place, depth)
    found = hazards(_pass(ReplayPlan(order, place, held, fault=fault), order), held)
    assert found and all(hazard in h for h in found), found


def test_broken_without_the_wrap_is_caught() -> None:
    """A graph that does not give the places back leaves the session's bookkeeping wrong, and its next replay reads
    the wrong bytes."""
    order, place = _stack(4, 2)
    held = _boundary(order, place, 1)
    found = hazards(_pass(ReplayPlan(order, place, held, fault="skip_wrap"), order), held)
    assert any("replay-changed-places" in h for h in found), found
    assert any("read-wrong-block" in h for h in found), found


def test_the_checker_flags_hand_written_races() -> None:
    """The checker itself: a read with no wait for its copy, a copy with no wait for the read it overwrites."""
    held = {0: "a"}
    read_early = [Fork(), Copy("b", 0, 1, ()), Use("b", 0, 2), Copy("a", 0, 3, (2,)), Join()]
    assert hazards(read_early, held, replays=1) == ["replay 0: read-before-ready: b against the copy of b"]
    overwrite = [Fork(), Use("a", 0, 1), Copy("b", 0, 2, ()), Ready("b", 2), Use("b", 0, 3), Copy("a", 0, 4, (3,))]
    found = hazards([*overwrite, Join()], held, replays=1)
    assert found == ["replay 0: overwrite-before-last-use: b over a"]
    ordered = [Fork(), Use("a", 0, 1), Copy("b", 0, 2, (1,)), Ready("b", 2), Use("b", 0, 3), Copy("a", 0, 4, (3,))]
    assert hazards([*ordered, Join()], held, replays=3) == []


def test_an_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        ReplayPlan(["a"], {"a": 0}, {}, fault="nope")


def _captured(h, fn, x):
    with _capture.simulated_capture(h._hooks) as cap:
        run(fn, x)
    return cap


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
@pytest.mark.parametrize("dtypes", ["float32", "mixed", "wan"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_simulated_capture_replays_exactly_and_leaves_the_session_true(dtypes, compiled):
    model, x = model_and_inputs(dtypes)
    x2 = {k: (v * 0.5 if k in ("hidden_states", "encoder_hidden_states") else v) for k, v in x.items()}
    resident = copy.deepcopy(model)
    want, want2 = run(resident, x), run(resident, x2)
    with wf.enable({"transformer": model}, config(depth=1 if dtypes == "wan" else 2), device="sim") as h:
        torch._dynamo.reset()
        fn = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
        assert torch.equal(run(fn, x), want)
        streamed = h.stats()["bytes_streamed"]
        assert torch.equal(run(fn, x2), want2)
        per_pass = h.stats()["bytes_streamed"] - streamed
        cap = _captured(h, fn, x)
        start = loads(h)
        for _ in range(3):
            assert torch.equal(cap.replay(h._hooks, lambda: run(fn, x)), want)
        assert loads(h) == start, "replays run without the session's scheduler"
        assert h.stats()["captured_bytes_per_replay"] == per_pass, "a replay copies what an eager pass does"
        assert torch.equal(cap.replay(h._hooks, lambda: run(fn, x2)), want2)
        assert torch.equal(run(fn, x), want), "an eager forward after replays: the session's places are true"
        assert torch.equal(cap.replay(h._hooks, lambda: run(fn, x2)), want2), "a replay after an eager forward"
        assert h._session.hazard_violations() == []
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
def test_a_simulated_capture_without_the_wrap_is_caught_by_the_bytes(monkeypatch):
    """The broken variant: a graph that does not give the places back. Its replays and the eager forward after
    them read blocks of the previous pass where the session expects the next pass's first ones."""
    model, x = model_and_inputs("float32")
    want = run(copy.deepcopy(model), x)
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        run(model, x)
        monkeypatch.setattr(_capture, "ReplayPlan", functools.partial(ReplayPlan, fault="skip_wrap"))
        cap = _captured(h, model, x)
        outs = [cap.replay(h._hooks, lambda: run(model, x)) for _ in range(2)] + [run(model, x)]
        assert not all(torch.equal(out, want) for out in outs)


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
def test_a_replay_of_another_forward_is_refused_by_name():
    model, x = model_and_inputs("float32")
    want = run(copy.deepcopy(model), x)
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        run(model, x)
        cap = _captured(h, model, x)
        blocks = model.transformer_blocks
        model.transformer_blocks = torch.nn.ModuleList(list(blocks)[1:])  # a forward that skips block 0
        with pytest.raises(wf.OffloadError, match=r"reached enter 'transformer.transformer_blocks.1' where the "
                           r"captured forward reached enter 'transformer.transformer_blocks.0'"):
            cap.replay(h._hooks, lambda: run(model, x))
        model.transformer_blocks = blocks
        assert not h._hooks.busy()
        assert torch.equal(cap.replay(h._hooks, lambda: run(model, x)), want), "the graph still replays"


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
@pytest.mark.parametrize("dtypes", ["float32", "wan"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_capture_that_starts_at_the_first_block_finishes_at_the_last_and_replays_exactly(dtypes, compiled):
    # Inductor's CUDA graph trees capture inside the compiled call, after the component's hooks ran, and end the
    # capture when the call returns: the captured schedule starts at the first static block and finishes (the wrap,
    # the join) when the last block of every stack closes, before the component's forward ends.
    model, x = model_and_inputs(dtypes)
    want = run(copy.deepcopy(model), x)
    with wf.enable({"transformer": model}, config(depth=1 if dtypes == "wan" else 2), device="sim") as h:
        torch._dynamo.reset()
        fn = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
        streamed = h.stats()["bytes_streamed"]
        assert torch.equal(run(fn, x), want)
        per_pass = h.stats()["bytes_streamed"] - streamed
        at_end = []
        idle = h._hooks.idle_static
        h._hooks.idle_static = lambda: (at_end.append((h._hooks.capture, h._hooks.captured)), idle())[1]
        with _capture.simulated_capture(h._hooks, inside=True) as cap:
            run(fn, x)
        del h._hooks.idle_static
        assert at_end == [(None, True)], "finished at the last block's close, inside the capture"
        assert cap.graph is not None and cap.graph._segments[0][:2] == ("start", "")
        start = loads(h)
        for _ in range(2):
            assert torch.equal(cap.replay(h._hooks, lambda: run(fn, x)), want)
        assert loads(h) == start
        assert h.stats()["captured_bytes_per_replay"] == per_pass
        assert torch.equal(run(fn, x), want), "an eager forward after replays"
        assert h._session.hazard_violations() == []
        torch._dynamo.reset()


def test_a_whole_trace_calls_the_operators_cuda_graphs_may_record_and_a_broken_one_those_they_leave_out():
    # torch.compile(fullgraph=True): no graph break can split the forward's blocks over two CUDA graphs, so the
    # operators are the untagged pair inductor's CUDA graph trees record (mode="reduce-overhead" captures the copies
    # inside one graph); without fullgraph the pair tagged cudagraph_unsafe, which runs between the graphs. Six
    # streamed blocks (a ring of 3, so each slot turns twice a pass): each traced four ways.
    model, x = model_and_inputs("float32", single=2)
    want = run(copy.deepcopy(model), x)
    seen: dict[object, list[str]] = {}

    def backend(full):
        def compile_graph(gm, example):
            seen.setdefault(full, []).extend(str(n.target) for n in gm.graph.nodes if "weightferry" in str(n.target))
            return gm.forward
        return compile_graph

    with wf.enable({"transformer": model}, config(), device="sim"):
        for full in (True, False):
            torch._dynamo.reset()
            assert torch.equal(run(torch.compile(model, fullgraph=full, backend=backend(full)), x), want)
        torch._dynamo.reset()
        # Regional compilation (diffusers' compile_repeated_blocks): each block's call traced alone, fullgraph or
        # not, holds one block's share of the forward's schedule, so its graphs call a pair kept out of CUDA graphs
        # (the one naming the block by a tensor, so the blocks of a class share their code).
        for full in (True, False):
            key = ("regional", full)
            for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
                block.compile(fullgraph=full, backend=backend(key))
            assert torch.equal(run(model, x), want)
            torch._dynamo.reset()
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert sorted(set(seen[True])) == ["weightferry.enter_in_graph", "weightferry.leave_in_graph"]
    assert sorted(set(seen[False])) == ["weightferry.enter", "weightferry.leave"]
    for key in (("regional", True), ("regional", False)):
        assert sorted(set(seen[key])) == ["weightferry.enter_block", "weightferry.leave_block"], key
    assert len(seen[True]) == len(seen[False]) == 2 * blocks
    for op in ("enter", "leave", "enter_block", "leave_block"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.weightferry, op).default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.weightferry.enter_in_graph.default.tags


@pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")
@pytest.mark.parametrize("inside", [False, True], ids=["around", "inside"])
def test_a_capture_per_input_shape_each_replays_exactly_in_any_order(inside):
    # A changed input shape is a new capture (torch.cuda.graph again, or the next recording of CUDA graph trees): the
    # blocks stay at their places, so the graphs of both shapes copy into the same places and either may replay after
    # the other, or after an eager forward.
    model, x = model_and_inputs("float32")
    small = {**x, "hidden_states": x["hidden_states"][:, :8], "img_ids": x["img_ids"][:8]}
    resident = copy.deepcopy(model)
    want, want_small = run(resident, x), run(resident, small)
    assert want.shape != want_small.shape
    with wf.enable({"transformer": model}, config(), device="sim") as h:
        assert torch.equal(run(model, x), want)
        graphs = []
        for inputs in (x, small):
            with _capture.simulated_capture(h._hooks, inside=inside) as cap:
                run(model, inputs)
            graphs.append(cap)
        start = loads(h)
        for cap, inputs, expected in [(graphs[1], small, want_small), (graphs[0], x, want), (graphs[1], small,
                                      want_small), (graphs[0], x, want)]:
            assert torch.equal(cap.replay(h._hooks, lambda inputs=inputs: run(model, inputs)), expected)
        assert loads(h) == start
        assert torch.equal(run(model, small), want_small), "an eager forward after replays"
        assert torch.equal(graphs[0].replay(h._hooks, lambda: run(model, x)), want), "a replay after it"
        assert h._session.hazard_violations() == []
