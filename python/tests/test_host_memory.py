"""Host memory predicted and bounded, on ``device="sim"``: the host masters ``weightferry.plan()`` predicts (its
``host`` section) are exactly the bytes ``enable`` then holds (``stats()["master_host_bytes"]``), for layerwise and
module-level plans, budgets, encoders and quantized weights; with a checkpoint, the session's prediction splits them
into masters and file-served (mapped) bytes exactly as enable does. ``host_budget`` refuses, before anything
changes, a plan whose masters do not fit, naming the key; ``plan()`` warns about it first."""

import copy
import json

import diffusers
import pytest
import torch
from quantized import gguf_model, torchao_model
from safetensors.torch import save_file
from test_checkpoint import CONFIG, LAYER, forward, inputs
from test_checkpoint import weights as file_weights
from test_diffusers import flux, flux_pipeline, layer

import weightferry as wf

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")


def dit_budget(model, fraction):
    """A layer config whose device budget keeps about ``fraction`` of the streamed blocks resident."""
    (stack,) = wf.plan({"transformer": model}, layer(1))["components"][0]["stacks"]
    fixed = wf.plan({"transformer": model}, layer(1))["device_weight_bytes"]
    return {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                         "device_budget": fixed + int(stack["bytes"] * fraction)}}


def with_key(cfg, **keys):
    cfg = copy.deepcopy(cfg)
    cfg["diffusion_offload_config"].update(keys)
    return cfg


CASES = {
    "flux depth 1": lambda f: ({"transformer": flux()[0]}, layer(1)),
    "flux depth 3 pageable": lambda f: ({"transformer": flux()[0]}, with_key(layer(3), pin_memory=False)),
    "flux budget": lambda f: (lambda m: ({"transformer": m}, dit_budget(m, 0.5)))(flux()[0]),
    "pipeline layer": lambda f: (flux_pipeline(), {"diffusion_offload_config": {
        "mode": "layer", "components": ["dit", "text_encoder"]}}),
    "pipeline module": lambda f: (flux_pipeline(), {"diffusion_offload_config": {
        "mode": "module", "components": ["dit", "text_encoder"]}}),
    "gguf": lambda f: ({"transformer": gguf_model("wan", "Q8_0", f)[0]}, layer(2)),
    "torchao": lambda f: ({"transformer": torchao_model("flux", "Int8WeightOnlyConfig")[0]}, layer(2)),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_predicts_the_host_masters_enable_holds_to_the_byte(folder, case):
    pipe, cfg = CASES[case](folder)
    predicted = wf.plan(pipe, cfg)["host"]
    assert predicted["master_bytes"] > 0
    assert (predicted["mapped_bytes"], predicted["sharded_bytes"], predicted["budget"]) == (0, 0, None)
    assert predicted["pinned"] == cfg["diffusion_offload_config"].get("pin_memory", True)
    with wf.enable(pipe, cfg, device="sim") as h:
        s = h.stats()
        assert s["master_host_bytes"] == predicted["master_bytes"]
        assert s["plan_host"] == predicted


PASSES = {
    "depth 1": layer(1),
    "depth 2 resident 1": layer(2, resident_layers=1),
    "depth 4 (a slot per block)": layer(4),
    "static depth 1": layer(1, static_slots=True),
    "static depth 2": with_key(layer(2, static_slots=True), pin_memory=False),
    "budget 30%": None,
}


@pytest.mark.parametrize("case", sorted(PASSES))
def test_the_plan_predicts_the_bytes_each_forward_copies_once_the_ring_is_warm(case):
    m, x, _ = flux()
    cfg = PASSES[case] or dit_budget(m, 0.3)
    plan = wf.plan({"transformer": m}, cfg)
    (stack,) = plan["components"][0]["stacks"]
    assert plan["pass_h2d_bytes"] == stack["pass_h2d_bytes"]
    with wf.enable({"transformer": m}, cfg, device="sim") as h:
        seen = []
        for _ in range(4):
            m(**x)
            seen.append(h.stats()["bytes_streamed"])
    per_pass = {b - a for a, b in zip(seen[1:], seen[2:])}
    assert per_pass == {plan["pass_h2d_bytes"]}, (seen, plan["pass_h2d_bytes"])
    # Every streamed block once a pass, or none when each keeps a slot of its own.
    assert (plan["pass_h2d_bytes"] > 0) == (stack["slots"] < stack["streaming"])


def checkpoint(tmp_path, head_dim, **blocks):
    """A tiny Flux's weights in a safetensors file, the same module on ``meta``, and the reference. Heads of 128:
    every block tensor is a multiple of 256 bytes, so every section lies in the file as packed; heads of 16: the
    64-byte biases break that, so only some sections do. ``blocks``: other block counts (``num_layers``, ...)."""
    config = dict(CONFIG, attention_head_dim=head_dim, axes_dims_rope=(16, 56, 56) if head_dim == 128 else (4, 6, 6),
                  **blocks)
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16).eval()
    path = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in file_weights(ref).items()}, str(path))
    with torch.device("meta"):
        m = diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16).eval()
    return ref, m, path


SERVED = {("auto", 16): (True, False), ("auto", 128): (False, True), ("mapped", 128): (False, True),
          ("pinned", 128): (True, False)}


@pytest.mark.parametrize("host_masters, head_dim", sorted(SERVED))
def test_with_a_checkpoint_the_session_predicts_which_blocks_its_file_serves(tmp_path, host_masters, head_dim):
    _, m, path = checkpoint(tmp_path, head_dim)
    with wf.enable({"transformer": m}, with_key(LAYER, host_masters=host_masters), device="sim",
                   checkpoint=path) as h:
        s = h.stats()
        assert (s["plan_host"]["master_bytes"], s["plan_host"]["mapped_bytes"]) == (
            s["master_host_bytes"], s["mapped_host_bytes"])
        assert (s["master_host_bytes"] > 0, s["mapped_host_bytes"] > 0) == SERVED[host_masters, head_dim]


def test_a_host_budget_below_the_masters_is_refused_before_anything_changes():
    model, x, _ = flux()
    twin = copy.deepcopy(model)
    pipe = {"transformer": model}
    need = wf.plan(pipe, layer(1))["host"]["master_bytes"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    over = with_key(layer(1), host_budget=need - 1)
    report = wf.plan(pipe, over)
    assert report["host"]["budget"] == need - 1
    message = (
        f"host_budget: the host masters of the offloaded weights need {human(need)}, over the budget of "
        f"{human(need - 1)}; raise host_budget, offload fewer components, or bind the weights from a checkpoint "
        "(its file then serves the blocks beyond the budget, read from disk on every pass)"
    )
    assert report["warnings"][-1] == f"enable will refuse this plan: {message}"
    with pytest.raises(wf.PlanError) as e:
        wf.enable(pipe, over, device="sim")
    assert str(e.value) == f"the config cannot be applied to dict: {message}"
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The budget at the masters' exact size fits, and the model runs as its twin.
    with wf.enable(pipe, with_key(layer(1), host_budget=f"{need}B"), device="sim") as h:
        assert h.stats()["plan_host"]["budget"] == need
        with torch.no_grad():
            assert torch.equal(model(**x)[0], twin(**x)[0])


def human(b):
    """weightferry's human byte count (``human_bytes``): two decimals of the largest binary unit, exact bytes after."""
    units, v, u = ["B", "KiB", "MiB", "GiB", "TiB"], float(b), 0
    while v >= 1024 and u + 1 < len(units):
        v, u = v / 1024, u + 1
    return f"{b} B" if b < 1024 else f"{v:.2f} {units[u]} ({b} B)"


@pytest.mark.parametrize("value, why", [
    (0, "0 bytes leaves no room for weights; give a positive size, or remove the key for no limit"),
    ("lots", '"lots" is not a byte size; expected a positive integer number of bytes'),
    (True, "expected a positive integer number of bytes"),
])
def test_a_bad_host_budget_names_the_key(value, why):
    with pytest.raises(wf.ConfigError) as e:
        wf.plan({"transformer": flux()[0]}, with_key(layer(1), host_budget=value))
    assert "diffusion_offload_config.host_budget" in str(e.value)
    assert why in str(e.value)


def test_a_checkpoint_s_file_served_blocks_do_not_count_against_the_host_budget(tmp_path):
    ref, m, path = checkpoint(tmp_path, 128)
    # Pinned masters do not fit a budget of one byte: refused, and the module stays on meta.
    cfg = with_key(LAYER, host_masters="pinned", host_budget=1)
    with pytest.raises(wf.PlanError, match=r"^the config cannot be applied to dict: host_budget: the host masters"):
        wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path)
    assert all(p.device.type == "meta" for p in m.parameters())
    # Served from the file, every master of this checkpoint's blocks takes no host bytes: the budget holds.
    x = inputs()
    with wf.enable({"transformer": m}, with_key(cfg, host_masters="mapped"), device="sim", checkpoint=path) as h:
        assert (h.stats()["master_host_bytes"], h.stats()["plan_host"]["budget"]) == (0, 1)
        assert torch.equal(forward(m, x), forward(ref, x))


def test_plan_json_shows_the_host_side():
    report = wf.plan({"transformer": flux()[0]}, with_key(layer(1), host_budget="1GiB"))
    assert json.loads(json.dumps(report["host"]))["budget"] == 1 << 30


def test_an_automatic_host_budget_is_resolved_when_the_session_opens():
    model, x, _ = flux()
    cfg = with_key(layer(1), host_budget="auto")
    report = wf.plan({"transformer": model}, cfg)
    assert report["host"]["budget"] is None
    assert "host_budget = \"auto\": resolved when a session opens" in " ".join(report["notes"])
    with wf.enable({"transformer": model}, cfg, device="sim") as h:
        host = h.stats()["plan_host"]
        # A number now, which the masters fit (enable checked them against it).
        assert isinstance(host["budget"], int) and host["budget"] >= host["master_bytes"] > 0
        with torch.no_grad():
            model(**x)
