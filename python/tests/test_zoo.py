"""Sanity of the model zoo (``zoo.py``): each tiny diffusers transformer and transformers text encoder builds in
float32, forwards on the CPU, gives ``torch.equal`` outputs twice and from a ``copy.deepcopy``, and its class
declares ``_repeated_blocks`` or ``_no_split_modules`` exactly when its case says so (``metadata``)."""

import copy

import pytest
import torch
import zoo


@pytest.mark.parametrize("case", zoo.CASES, ids=[c.name for c in zoo.CASES])
def test_a_zoo_model_builds_forwards_deterministically_and_declares_its_blocks(case):
    m = case.build()
    assert type(m).__name__ == case.name and not m.training
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert all(t.device.type == "cpu" for t in m.state_dict().values())
    y = case.run(m, case.inputs())
    assert torch.is_tensor(y) and y.dtype == torch.float32 and y.numel() > 0 and torch.isfinite(y).all()
    assert torch.equal(case.run(m, case.inputs()), y)
    assert torch.equal(case.run(copy.deepcopy(m), case.inputs()), y)
    cls = type(m)
    declares = bool(getattr(cls, "_repeated_blocks", None)) or bool(getattr(cls, "_no_split_modules", None))
    assert declares == case.metadata
