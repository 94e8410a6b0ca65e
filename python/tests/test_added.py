"""Adapters added to an offloaded model after ``enable`` (``_added``): counted in ``stats()``, held beside the plan
by a byte-count ``device_budget`` in ``retune()`` and after an ``editing()`` block that added them; outputs equal
the twin's throughout, and the weights come back bit-identical."""

import copy
import json
import warnings

import pytest
import torch
from test_diffusers import forward
from test_writes import lora, model, same_weights

import weightferry as wf


def budget_config(budget):
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": budget}}


def lora_bytes(m):
    return sum(t.numel() * t.element_size() for n, t in m.named_parameters() if ".lora_" in n)


def stack(plan):
    return plan["components"][0]["stacks"][0]


def full_budget(m):
    """One byte less than every weight on the device: the planner keeps some blocks resident and streams the rest."""
    p = wf.plan({"transformer": m}, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
    return p["budget"]["always_resident_bytes"] + stack(p)["bytes"] - 1


def offloaded_with_a_twin():
    """``(model, inputs, its twin not offloaded, a budget that streams some blocks)``."""
    m, x = model()
    return m, x, copy.deepcopy(m), full_budget(m)


def ours(caught):
    """The messages of weightferry's warnings among ``caught``."""
    return [str(w.message) for w in caught if issubclass(w.category, wf.WeightferryWarning)]


def test_a_retune_plans_the_budget_beside_adapters_added_after_enable():
    m, x, twin, budget = offloaded_with_a_twin()
    with wf.enable({"transformer": m}, budget_config(budget), device="sim") as h:
        before = json.loads(h._session.plan_json())
        assert h.stats()["added_device_bytes"] == 0
        for mod in (m, twin):
            mod.add_adapter(lora(rank=16, seed=1), "late")
        added = lora_bytes(m)
        assert h.stats()["added_device_bytes"] == added > 0
        assert before["device_weight_bytes"] + added > budget, "the test's adapter must overflow the old plan"
        assert torch.equal(forward(m, x), forward(twin, x))
        plan = h.retune()
        assert plan["device_weight_bytes"] + added <= budget
        assert stack(plan)["resident"] < stack(before)["resident"]
        assert f"device_budget {budget} bytes less {added} bytes of tensors added" in " ".join(plan["notes"])
        assert torch.equal(forward(m, x), forward(twin, x))
        # A budget the adapters fill alone: refused, naming both numbers, and the plan stays.
        with pytest.raises(wf.PlanError) as e:
            h.retune(device_budget=added)
        assert str(e.value) == (
            f"the config cannot be applied to dict: diffusion_offload_config.device_budget: {added} bytes are all "
            f"taken by the {added} bytes of tensors added to the pipeline after enable (adapter layers); raise "
            "device_budget, or remove adapters"
        )
        assert json.loads(h._session.plan_json()) == plan
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_an_editing_block_that_adds_an_adapter_retunes_to_fit_it_or_warns():
    m, x, twin, budget = offloaded_with_a_twin()
    with wf.enable({"transformer": m}, budget_config(budget), device="sim") as h:
        resident = stack(json.loads(h._session.plan_json()))["resident"]
        with h.editing():
            m.add_adapter(lora(rank=16, seed=1), "late")
        twin.add_adapter(lora(rank=16, seed=1), "late")
        plan = json.loads(h._session.plan_json())
        assert plan["device_weight_bytes"] + lora_bytes(m) <= budget and stack(plan)["resident"] < resident
        assert torch.equal(forward(m, x), forward(twin, x))
        # An adapter no plan fits beside: the load stands, the plan stays, and a warning names the fix.
        with pytest.warns(wf.WeightferryWarning) as caught, h.editing():
            m.add_adapter(lora(rank=256, seed=2), "huge")
        twin.add_adapter(lora(rank=256, seed=2), "huge")
        assert len(ours(caught)) == 1
        message = ours(caught)[0]
        assert message.startswith(f"the {lora_bytes(m)} bytes of tensors added to the offloaded modules after enable")
        assert "raise device_budget or remove adapters, then call retune()" in message
        assert json.loads(h._session.plan_json()) == plan
        assert torch.equal(forward(m, x), forward(twin, x))
    # Without a budget nothing is planned beside them: no retune, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", wf.WeightferryWarning)
        with wf.enable({"transformer": m}, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}},
                       device="sim") as h:
            plan = json.loads(h._session.plan_json())
            with h.editing():
                m.add_adapter(lora(seed=3), "third")
            twin.add_adapter(lora(seed=3), "third")
            assert json.loads(h._session.plan_json()) == plan
            assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_an_adapter_added_outside_editing_warns_once_at_the_next_forward_until_a_retune():
    m, x, twin, budget = offloaded_with_a_twin()
    registered = torch.nn.modules.module._global_parameter_registration_hooks
    hooks = len(registered)
    with wf.enable({"transformer": m}, budget_config(budget), device="sim") as h:
        assert len(registered) == hooks + 1
        for mod in (m, twin):
            mod.add_adapter(lora(rank=16, seed=1), "late")
        with pytest.warns(wf.WeightferryWarning) as caught:
            assert torch.equal(forward(m, x), forward(twin, x))
        said = ours(caught)
        assert len(said) == 1 and said[0].startswith(f"the {lora_bytes(m)} bytes of tensors added to the offloaded")
        assert said[0].endswith("call handle.retune() to plan the weights beside them (more blocks stream)")
        with warnings.catch_warnings():
            warnings.simplefilter("error", wf.WeightferryWarning)
            assert torch.equal(forward(m, x), forward(twin, x))  # counted once: no second warning
            h.retune()
            m.set_adapters("late", 0.5)  # registers nothing new
            twin.set_adapters("late", 0.5)
            assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)
    assert len(registered) == hooks  # disable took torch's global registration hooks away with the rest
