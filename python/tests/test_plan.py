"""``weightferry.plan``: exact figures for tiny pipelines, equality with ``weightferry plan --json`` on
``describe()``'s output, tied weights, declarations against the fallback scan, typed errors with the CLI's text,
and that planning touches nothing."""

import json
import warnings

import pytest
import torch
from tiny import TinyBlock, TinyDiT, TinyDualDiT, TinyPipeline, TinyTextEncoder, TinyVAE, UndeclaredPipeline

import weightferry as wf

ALL = ["dit", "text_encoder", "vae"]
LAYER = {"diffusion_offload_config": {"mode": "layer", "components": ALL}}
LAYER_DEPTH1 = {"diffusion_offload_config": {"mode": "layer", "components": ALL,
                                             "layer_options": {"dit": {"prefetch_depth": 1}}}}
MODEL = {"diffusion_offload_config": {"mode": "module", "components": ALL}}


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def cli_plan(cli, tmp_path, pipeline, config):
    """``weightferry plan --json`` on ``describe(pipeline)`` and ``config`` written to files, and
    ``weightferry.plan`` on the same (with the file's name as the report's ``pipeline``)."""
    pfile = write(tmp_path, "pipeline.json", json.dumps(wf.describe(pipeline)))
    cfile = write(tmp_path, "config.json", json.dumps(config))
    return cli.plan(pfile, cfile), wf.plan(pipeline, config, name=pfile)


def stack(component):
    (s,) = component["stacks"]
    return s


@pytest.mark.parametrize("n", [2, 4, 7])
@pytest.mark.parametrize("config", [LAYER, LAYER_DEPTH1], ids=["depth2", "depth1"])
def test_layerwise_figures_match_the_cli(cli, tmp_path, n, config):
    expected, got = cli_plan(cli, tmp_path, TinyPipeline(n), config)
    assert got == expected
    depth = config["diffusion_offload_config"].get("layer_options", {}).get("dit", {}).get("prefetch_depth", 2)
    assert got["strategy"] == "layer"
    assert got["skip_reason"] is None
    dit, enc, vae = got["components"]
    assert (dit["path"], dit["kind"], enc["path"], enc["kind"], vae["path"], vae["kind"]) == (
        "transformer", "dit", "text_encoder", "text_encoder", "vae", "vae")
    dit_slots = min(depth + 1, n)
    assert stack(dit) == {
        "name": "transformer[blocks]", "blocks": n, "resident": 0, "streaming": n, "bytes": n * TinyBlock.DEVICE,
        "resident_bytes": 0, "max_streaming_block_bytes": TinyBlock.DEVICE, "prefetch_depth": depth,
        "slots": dit_slots, "slot_bytes": dit_slots * TinyBlock.DEVICE,
        # Every streamed block once a forward when the ring holds fewer slots than blocks, none when each has one.
        "pass_h2d_bytes": n * TinyBlock.DEVICE if dit_slots < n else 0,
    }
    assert stack(enc) == {
        "name": "text_encoder[layers]", "blocks": 3, "resident": 0, "streaming": 3, "bytes": 3 * TinyBlock.DEVICE,
        "resident_bytes": 0, "max_streaming_block_bytes": TinyBlock.DEVICE, "prefetch_depth": 2, "slots": 3,
        "slot_bytes": 3 * TinyBlock.DEVICE, "pass_h2d_bytes": 0,
    }
    # A component's `bytes` are its distinct storages' (host) bytes; stacks and the budget count device bytes.
    assert dit["bytes"] == TinyDiT.NON_BLOCK + n * TinyBlock.RAW
    assert enc["bytes"] == TinyTextEncoder.EMBED + 3 * TinyBlock.RAW
    assert (vae["on_demand"], vae["bytes"], vae["stacks"]) == (True, TinyVAE.RAW, [])
    always = TinyDiT.NON_BLOCK + TinyTextEncoder.EMBED
    slots = (dit_slots + 3) * TinyBlock.DEVICE
    assert got["budget"] == {"budget": None, "always_resident_bytes": always, "resident_head_bytes": 0,
                             "slot_bytes": slots, "on_demand_peak_bytes": TinyVAE.DEVICE, "planner_chose": False}
    assert got["device_weight_bytes"] == always + slots + TinyVAE.DEVICE
    assert got["pass_h2d_bytes"] == stack(dit)["pass_h2d_bytes"]
    # The tied head is counted once.
    raw = TinyDiT.NON_BLOCK + n * TinyBlock.RAW + TinyTextEncoder.EMBED + 3 * TinyBlock.RAW + TinyVAE.RAW
    assert got["total_weight_bytes"] == raw
    assert got["warnings"] == []


def test_model_level_figures_match_the_cli(cli, tmp_path):
    expected, got = cli_plan(cli, tmp_path, TinyPipeline(4), MODEL)
    assert got == expected
    assert got["strategy"] == "model"
    assert [c["selected"] for c in got["components"]] == [True, True, True]
    largest = max(TinyDiT.NON_BLOCK + 4 * TinyBlock.DEVICE, TinyTextEncoder.EMBED + 3 * TinyBlock.DEVICE)
    assert got["budget"]["on_demand_peak_bytes"] == largest
    assert got["device_weight_bytes"] == largest


def test_a_toml_config_file_gives_the_same_plan(cli, tmp_path):
    pipe = TinyPipeline(3)
    toml = '[diffusion_offload_config]\nmode = "layer"\ncomponents = ["dit", "text_encoder", "vae"]\n'
    cfile = write(tmp_path, "c.toml", toml)
    pfile = write(tmp_path, "p.json", json.dumps(wf.describe(pipe)))
    assert wf.plan(pipe, cfile, name=pfile) == cli.plan(pfile, cfile)
    assert wf.plan(pipe, str(cfile)) == wf.plan(pipe, LAYER)
    assert wf.check_config(cfile) == "layer"


def test_tied_weights_are_counted_once():
    tied = wf.plan(TinyPipeline(4), LAYER)
    untied = wf.plan(TinyPipeline(4, tied=False), LAYER)
    assert untied["total_weight_bytes"] - tied["total_weight_bytes"] == TinyTextEncoder.EMBED
    assert untied["budget"]["always_resident_bytes"] - tied["budget"]["always_resident_bytes"] == TinyTextEncoder.EMBED


def test_declarations_take_precedence_over_the_fallback_scan():
    class Declared(UndeclaredPipeline):
        _dit_modules = ["backbone"]

    p = Declared()
    p.backbone = TinyDiT(5)  # `transformer` (a fallback name) stays, and must not be taken as the DiT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = wf.plan(p, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
    assert [(c["path"], c["kind"]) for c in report["components"]] == [("backbone", "dit")]
    assert stack(report["components"][0])["blocks"] == 5
    assert report["warnings"] == []


def test_the_fallback_scan_warns_and_finds_components_by_name():
    with pytest.warns(wf.WeightferryWarning) as record:
        report = wf.plan(UndeclaredPipeline(4), {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
    # The DiT declares its block lists; the text encoder and the VAE have no metadata: taken by name, with a warning.
    assert [str(w.message).split(" (")[0] for w in record] == ["'text_encoder'", "'vae'"]
    assert report["warnings"] == []
    assert [(c["path"], c["kind"], c["selected"]) for c in report["components"]] == [
        ("transformer", "dit", True), ("text_encoder", "text_encoder", False), ("vae", "vae", False)]
    assert stack(report["components"][0])["blocks"] == 4


def test_plan_block_attrs_win_over_the_class_declaration():
    class Planned(TinyPipeline):
        _offload_plan = {"block_attrs": {"transformer": ["single_blocks"]}}

    p = Planned()
    p.transformer = TinyDualDiT(4, 6)
    report = wf.plan(p, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
    assert stack(report["components"][0])["name"] == "transformer[single_blocks]"
    assert stack(report["components"][0])["blocks"] == 6
    # Without the plan the class's `_layerwise_offload_blocks_attrs` (both lists) is used.
    plain = TinyPipeline()
    plain.transformer = TinyDualDiT(4, 6)
    report = wf.plan(plain, {"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
    assert [(s["name"], s["blocks"]) for s in report["components"][0]["stacks"]] == [
        ("transformer[blocks+single_blocks]", 10)]


def test_a_bad_config_key_raises_config_error_with_the_cli_message(cli, tmp_path):
    bad = {"diffusion_offload_config": {"mode": "layer", "mdoe": "layer"}}
    pfile = write(tmp_path, "p.json", json.dumps(wf.describe(TinyPipeline())))
    expected = cli.plan_error(pfile, write(tmp_path, "bad.json", json.dumps(bad)))
    assert expected.startswith("invalid config: diffusion_offload_config.mdoe: ")
    with pytest.raises(wf.ConfigError) as e:
        wf.plan(TinyPipeline(), bad)
    assert str(e.value) == expected
    with pytest.raises(wf.ConfigError) as e:
        wf.check_config(bad)
    assert str(e.value) == expected
    # A file is read as the CLI reads it: a syntax error is keyed by its path.
    broken = write(tmp_path, "broken.toml", "[diffusion_offload_config\n")
    with pytest.raises(wf.ConfigError) as e:
        wf.plan(TinyPipeline(), broken)
    assert str(e.value) == cli.plan_error(pfile, broken)
    assert str(e.value).startswith(f"invalid config: {broken}: ")


def test_a_config_of_the_wrong_type_is_a_config_error():
    with pytest.raises(wf.ConfigError) as e:
        wf.plan(TinyPipeline(), 3)
    assert str(e.value) == (
        "invalid config: <root>: expected a dict in the config file's vocabulary or a path to a .json or .toml "
        "file, got int"
    )


def test_a_config_the_pipeline_cannot_serve_raises_the_cli_error_in_python_words(cli, tmp_path):
    class NoEncoderPlan(TinyPipeline):
        _offload_plan = None

    p = NoEncoderPlan()
    p.text_encoder.stack = p.text_encoder.layers  # no block list of a conventional name, and no metadata
    del p.text_encoder.layers
    config = {"diffusion_offload_config": {"mode": "layer", "components": ["text_encoder"]}}
    pfile = write(tmp_path, "p.json", json.dumps(wf.describe(p)))
    expected = cli.plan_error(pfile, write(tmp_path, "c.json", json.dumps(config)))
    with pytest.raises(wf.PlanError) as e:
        wf.plan(p, config, name=pfile)
    assert expected == (
        f"the config cannot be applied to {pfile}: Selected text encoder 'text_encoder' requires a model-declared "
        "streamable (offload_plan.encoder_block_attrs) or on-demand (offload_plan.on_demand_component_paths) plan"
    )
    # The same error in a Python caller's words: the keyword that declares it, not the description file's key.
    assert str(e.value) == (
        f"the config cannot be applied to {pfile}: Selected text encoder 'text_encoder' has no block list to stream; "
        "pass blocks={\"text_encoder\": [...]} to enable (or plan) naming its block lists (nn.ModuleList)"
    )


def test_a_bad_dtype_raises_pipeline_error():
    p = TinyPipeline()
    p.vae.dec.bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(wf.PipelineError) as e:
        wf.plan(p, LAYER)
    assert str(e.value).startswith("tensor 'vae.dec.bias' has dtype torch.complex64, which weightferry does not")


def test_a_panic_is_a_weightferry_error_not_a_panic_exception():
    with pytest.raises(wf.Error) as e:
        wf._core._panic_for_test("boom")
    assert type(e.value) is wf.Error
    assert str(e.value) == "internal error in weightferry._core._panic_for_test: boom; this is a bug, please report it"


def snapshot(pipeline):
    """Everything plan() must leave alone: every tensor's data pointer, device, dtype, version counter,
    requires_grad and bytes, every module's attributes and hooks."""
    out = {}
    for cname in ("transformer", "text_encoder", "vae"):
        for mname, m in getattr(pipeline, cname).named_modules(prefix=cname, remove_duplicate=False):
            hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._state_dict_hooks)
            out[mname] = (sorted(vars(m)), [len(h) for h in hooks], str(m.training))
            for tname, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    data = t.detach().contiguous().view(torch.uint8).flatten().tolist()
                    out[f"{mname}.{tname}"] = (t.data_ptr(), str(t.device), t.dtype, t._version, t.requires_grad, data)
    return out


def test_plan_touches_nothing():
    p = TinyPipeline(4)
    before = snapshot(p)
    attrs = sorted(vars(p))
    for config in (LAYER, LAYER_DEPTH1, MODEL):
        wf.plan(p, config)
    wf.describe(p)
    assert snapshot(p) == before
    assert sorted(vars(p)) == attrs
    assert all(t.device.type == "cpu" for t in p.transformer.parameters())
