"""Writes into an offloaded pipeline's weights go through weightferry's copy (issue: weights behave). Each case runs
on a tiny diffusers Flux transformer offloaded on ``device="sim"`` beside a deepcopy twin that is not offloaded and
receives the same operation: the offloaded module's outputs, its ``state_dict`` while enabled and its parameters
after ``disable`` equal the twin's bit for bit, or the operation raises a typed error with weights and outputs
unchanged."""

import copy

import pytest
import torch
from test_diffusers import BF16, bf16_inputs, flux, forward, layer

import weightferry as wf

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")

CONFIGS = {
    "depth2": layer(2),
    "resident1": layer(1, resident_layers=1),
    "depth1": layer(1),
}


def model():
    m, x, _ = flux()
    return m.to(BF16).eval(), bf16_inputs(x)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def shifted(m, keys=None, by=0.25):
    return {k: (v.float() + by).to(v.dtype) for k, v in m.state_dict().items() if keys is None or k in keys}


@pytest.mark.parametrize("cfg", CONFIGS)
def test_a_full_strict_load_while_offloaded_equals_the_same_load_on_the_resident_twin(cfg):
    m, x = model()
    twin = copy.deepcopy(m)
    new = shifted(m)
    with wf.enable({"transformer": m}, CONFIGS[cfg]):
        forward(m, x)  # slots hold the old bytes, and the next pass's first blocks are prefetched
        got = m.load_state_dict(new)
        want = twin.load_state_dict(new)
        assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys) == ([], [])
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)
    assert torch.equal(forward(m, x), forward(twin, x))


def test_partial_loads_of_streamed_fixed_and_foreign_keys_report_what_torch_reports():
    m, x = model()
    twin = copy.deepcopy(m)
    keys = {"transformer_blocks.1.attn.to_q.weight", "single_transformer_blocks.2.proj_out.bias", "x_embedder.weight"}
    new = shifted(m, keys)
    new["not.a.weight"] = torch.zeros(3)
    with wf.enable({"transformer": m}, layer(2)):
        forward(m, x)
        got = m.load_state_dict(new, strict=False)
        want = twin.load_state_dict(new, strict=False)
        assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)
        assert got.unexpected_keys == ["not.a.weight"] and len(got.missing_keys) > 100
        assert torch.equal(forward(m, x), forward(twin, x))
        # From a block: the keys are the block's own.
        block = shifted(twin.transformer_blocks[0], {"ff.net.2.weight"}, by=-0.5)
        got = m.transformer_blocks[0].load_state_dict(block, strict=False)
        assert got == twin.transformer_blocks[0].load_state_dict(block, strict=False)
        # float32 values into the bf16 weights convert as torch's copy_ converts.
        wide = {"norm_out.linear.weight": torch.randn(twin.norm_out.linear.weight.shape)}
        m.load_state_dict(wide, strict=False)
        twin.load_state_dict(wide, strict=False)
        assert torch.equal(forward(m, x), forward(twin, x))
        same_weights(m, twin)
    same_weights(m, twin)


def test_a_strict_load_missing_keys_raises_torch_s_error_after_loading_what_it_has():
    m, x = model()
    twin = copy.deepcopy(m)
    new = shifted(m, {"transformer_blocks.0.attn.to_k.weight"})
    with wf.enable({"transformer": m}, layer(2)):
        with pytest.raises(RuntimeError) as got:
            m.load_state_dict(new)
        with pytest.raises(RuntimeError) as want:
            twin.load_state_dict(new)
        assert str(got.value) == str(want.value) and "Missing key(s)" in str(got.value)
        assert torch.equal(forward(m, x), forward(twin, x))
    same_weights(m, twin)


def test_a_size_mismatch_or_assign_is_refused_before_anything_loads():
    m, x = model()
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    new = shifted(m)
    new["transformer_blocks.1.attn.to_q.weight"] = torch.zeros(3, 3, dtype=BF16)
    with wf.enable({"transformer": m}, layer(2)):
        before = forward(m, x)
        with pytest.raises(wf.OffloadError) as e:
            m.load_state_dict(new)
        assert str(e.value) == (
            "load_state_dict: size mismatch for 'transformer.transformer_blocks.1.attn.to_q.weight': the new value "
            "has shape [3, 3], the weight [32, 32] (nothing was written)"
        )
        with pytest.raises(wf.OffloadError) as e:
            m.load_state_dict(shifted(m), assign=True)
        assert "load_state_dict(assign=True)" in str(e.value) and str(e.value).endswith("(nothing was loaded)")
        assert torch.equal(forward(m, x), before)
        assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())
    assert all(torch.equal(m.state_dict()[k], v) for k, v in expected.items())
