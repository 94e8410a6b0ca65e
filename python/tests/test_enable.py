"""``weightferry.enable`` on the simulated device: offloaded forwards bit-identical to the same modules before
enable (layerwise at prefetch depths 1-3, resident layers, model-level; on-demand VAE), every tensor bit-identical
after disable with tied weights and views of one storage sharing it again, typed errors before anything moves
(bad config, a tensor off the CPU, CUDA not built yet), a second enable refused, a forward that raises still
releasing its block, and a failure injected at every session call and at every tensor binding leaving the modules
exactly as they were."""

import json
import warnings

import pytest
import torch
import torch.nn as nn
from tiny import BF16, OffloadPlan, TinyBlock, TinyDiT, TinyPipeline, TinyTextEncoder, TinyVAE

import weightferry as wf
import weightferry._enable as wf_enable
from weightferry._binders import CudaBinder, is_placeholder
from weightferry._clock import HookClock
from weightferry._enable import Seams
from weightferry._storages import View, set_data

ALL = ["dit", "text_encoder", "vae"]


def layer(depth, **dit):
    return {"diffusion_offload_config": {"mode": "layer", "components": ALL, "layer_options": {
        "dit": {"prefetch_depth": depth, **dit}, "text_encoder": {"prefetch_depth": depth}}}}


MODEL = {"diffusion_offload_config": {"mode": "module", "components": ALL}}


class Block(TinyBlock):
    def forward(self, h):
        return h + self.norm(self.fc(h))


class DiT(TinyDiT):
    def __init__(self, n):
        super().__init__(n)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.rope.normal_()

    def forward(self, x):
        h = self.x_embedder(x)
        for b in self.blocks:
            h = b(h)
        return self.proj_out(h) * self.rope[0, 0].to(BF16)


class Encoder(TinyTextEncoder):
    def __init__(self):
        super().__init__(3, tied=True)
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, ids):
        h = self.embed(ids)
        for layer_ in self.layers:
            h = layer_(h)
        return self.head(h)


class VAE(TinyVAE):
    def forward(self, x):
        return self.dec(self.enc(x))


class Pipe(TinyPipeline):
    _offload_plan = OffloadPlan(encoder_block_attrs={"text_encoder": ["layers"]}, on_demand_component_paths=("vae",),
                                resident_dit_paths=("transformer",))

    def __init__(self, n=4):
        super().__init__(n)
        self.transformer = DiT(n)
        self.text_encoder = Encoder()
        self.vae = VAE()


def pipe(n=4):
    torch.manual_seed(1)
    return Pipe(n)


def run(p, steps=2):
    """Text encoder, ``steps`` DiT steps, VAE: every output."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 5), generator=g)
    x = torch.randn(2, 5, 16, generator=g).to(BF16)
    img = torch.randn(1, 3, 6, 6, generator=g).to(BF16)
    with torch.no_grad():
        out = [p.text_encoder(ids)]
        for _ in range(steps):
            out.append(p.transformer(x))
        out.append(p.vae(img))
    return out


def tensors(p):
    """``{path: tensor}`` of every parameter and buffer (tied ones under each name)."""
    out = {}
    for cname in ("transformer", "text_encoder", "vae"):
        for mname, m in getattr(p, cname).named_modules(prefix=cname, remove_duplicate=False):
            for tname, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    out[f"{mname}.{tname}"] = t
    return out


def snapshot(p):
    """Each tensor's object, bytes, dtype, shape, strides, storage offset and requires_grad; which tensors share a
    storage; every module's torch hook counts."""
    ts = tensors(p)
    state = {k: (id(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad,
                 t.detach().contiguous().view(torch.uint8).flatten().tolist()) for k, t in ts.items()}
    groups = {}
    for k, t in ts.items():
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(k)
    hooks = {}
    for cname in ("transformer", "text_encoder", "vae"):
        for mname, m in getattr(p, cname).named_modules(prefix=cname):
            hooks[mname] = (len(m._forward_pre_hooks), len(m._forward_hooks))
    return state, sorted(sorted(g) for g in groups.values()), hooks


def assert_outputs_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e)


CONFIGS = [layer(1), layer(2), layer(3), layer(2, resident_layers=1), MODEL]
IDS = ["depth1", "depth2", "depth3", "resident1", "model"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_offloaded_forward_is_bit_identical_and_disable_restores_every_tensor(config):
    p = pipe()
    expected = run(p)
    before = snapshot(p)
    # A reference of our own keeps torch's original storage alive, so its address cannot be reused by chance.
    original = p.text_encoder.embed.weight.detach()
    handle = wf.enable(p, config, device="sim")
    assert handle.enabled
    # Streamed tensors hold no host copy between forwards; inside its block's forward a weight is bound.
    fc = p.transformer.blocks[1].fc
    assert is_placeholder(fc.weight) and fc.weight.shape == (64, 64)
    seen = []
    user_hook = fc.register_forward_pre_hook(lambda m, a: seen.append(tuple(m.weight.shape)))
    # Every tensor now holds device bytes (or nothing): it no longer views torch's own host copy.
    assert p.text_encoder.embed.weight.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    del original
    assert p.text_encoder.head.weight is p.text_encoder.embed.weight
    assert_outputs_equal(run(p), expected)
    assert seen == [(64, 64), (64, 64)]
    user_hook.remove()
    assert_outputs_equal(run(p), expected)
    assert handle._session.hazard_violations() == []
    stats = handle.stats()
    assert stats["enabled"] is True
    assert stats["strategy"] == wf.plan(p, config)["strategy"]
    assert sum(s["loads"] for s in stats["stacks"]) > 0
    handle.disable()
    assert not handle.enabled
    after = snapshot(p)
    assert after[0] == before[0] and after[2] == before[2]
    assert after[1] == before[1]
    # The tied head shares the embedding's storage again.
    head, embed = p.text_encoder.head.weight, p.text_encoder.embed.weight
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    assert_outputs_equal(run(p), expected)
    handle.disable()  # idempotent


def test_the_handle_is_a_context_manager_and_a_pipeline_can_be_enabled_again():
    p = pipe(3)
    expected = run(p)
    with wf.enable(p, layer(1), device="sim") as h:
        assert_outputs_equal(run(p), expected)
        with pytest.raises(wf.OffloadError) as e:
            wf.enable(p, layer(2), device="sim")
        assert str(e.value) == (
            "pipeline Pipe is already enabled by weightferry (one of its tensors is offloaded); call disable() on "
            "its handle first"
        )
        assert_outputs_equal(run(p), expected)
    assert not h.enabled
    with wf.enable(p, MODEL, device="sim"):
        assert_outputs_equal(run(p), expected)
    assert_outputs_equal(run(p), expected)


def test_a_bad_config_raises_config_error_and_nothing_changed():
    p = pipe()
    before = snapshot(p)
    bad = {"diffusion_offload_config": {"mode": "layer", "mdoe": "layer"}}
    with pytest.raises(wf.ConfigError) as e:
        wf.enable(p, bad, device="sim")
    with pytest.raises(wf.ConfigError) as plan_error:
        wf.plan(p, bad)
    assert str(e.value) == str(plan_error.value)
    assert snapshot(p) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: test_cuda.py covers it")
def test_cuda_without_a_gpu_is_refused():
    p = pipe()
    before = snapshot(p)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(wf.DeviceError) as e:
            wf.enable(p, layer(2), device=device)
        assert str(e.value) == (
            f'device "{device}": torch sees no CUDA device (torch.cuda.is_available() is False); use device="sim" '
            "(the simulated device) on a machine without a GPU"
        )
        assert isinstance(e.value, wf.Error)
    assert snapshot(p) == before


def test_unknown_devices_are_refused():
    p = pipe()
    before = snapshot(p)
    for device in ("tpu", "cuda:", "cuda:x", "CUDA", "cuda:-1"):
        with pytest.raises(wf.DeviceError) as e:
            wf.enable(p, layer(2), device=device)
        assert str(e.value) == f'unknown device "{device}"; use "cuda", "cuda:N" or "sim" (the simulated device)'
    assert snapshot(p) == before


class FailingSession:
    """Delegates to the real session and raises at its ``fail_at``-th method call."""

    def __init__(self, fail_at, *args, **kwargs):
        self._s = wf_enable._core.Session(*args, **kwargs)
        self._left = fail_at
        self.calls = 0

    def __getattr__(self, name):
        method = getattr(self._s, name)

        def call(*a):
            self.calls += 1
            self._left -= 1
            if self._left == 0:
                raise wf.OffloadError(f"injected failure in {name}")
            return method(*a)

        return call


def enable_through_sim_faults(enable, fault, check):
    """Calls ``enable(seams)`` with the simulated device's ``fault`` armed at its n-th call, n = 0, 1, ... until an
    enable gets through, running ``check(n)`` after each failed one; returns ``(handle, n)``."""
    n = 0
    while True:
        try:
            return enable(Seams(sim_faults={fault: n})), n
        except wf.OffloadError:
            check(n)
            n += 1


def enable_through_binding_failures(enable, check):
    """Calls ``enable(seams)`` with its n-th binding of a tensor failing, n = 1, 2, ... until an enable gets through,
    running ``check(n)`` after each failed one; returns ``(handle, n)``. Later bindings (the forwards') never fail."""
    count = [0, 0]

    def failing(view, tensor):
        count[0] += 1
        if count[0] == count[1]:
            raise RuntimeError(f"injected binding failure at {view.path}")
        set_data(view, tensor)

    n = 1
    while True:
        count[:] = [0, n]
        try:
            h = enable(Seams(bind=failing))
        except RuntimeError as e:
            assert "injected binding failure" in str(e)
            check(n)
            n += 1
            continue
        count[1] = -1
        return h, n


@pytest.mark.parametrize("config", [layer(2), MODEL], ids=["layer", "model"])
def test_a_failure_at_every_session_call_of_enable_leaves_the_modules_as_they_were(config):
    p = pipe(3)
    expected = run(p)
    before = snapshot(p)
    made = []

    def factory(*args, **kwargs):
        made.append(FailingSession(at, *args, **kwargs))
        return made[-1]

    at = 1
    while True:
        try:
            h = wf.enable(p, config, device="sim", _seams=Seams(session=factory))
        except wf.OffloadError as e:
            assert str(e).startswith("injected failure in "), e
            assert snapshot(p) == before, f"failure at call {at}"
            at += 1
            continue
        break
    # The enable that got through made `at - 1` calls, each of which failed once in an earlier attempt.
    assert made[-1].calls == at - 1 > 10
    made[-1]._left = 0  # disarmed
    assert_outputs_equal(run(p), expected)
    h.disable()
    assert snapshot(p) == before


def test_a_failure_at_every_binding_of_enable_leaves_the_modules_as_they_were():
    p = pipe(3)
    expected = run(p)
    before = snapshot(p)

    def check(n):
        assert snapshot(p) == before, f"failure at binding {n}"
        assert_outputs_equal(run(p), expected)

    h, n = enable_through_binding_failures(lambda seams: wf.enable(p, layer(2), device="sim", _seams=seams), check)
    # Every binding of enable failed once: each tensor object is bound twice (its host copy released, then bound to
    # the device), so the first run without a failure was the one after 2 x (tensor objects) failures.
    assert n == 2 * len({id(t) for t in tensors(p).values()}) + 1, n
    assert_outputs_equal(run(p), expected)
    h.disable()
    assert snapshot(p) == before


def test_a_config_that_disables_offload_touches_nothing():
    p = pipe()
    before = snapshot(p)
    with pytest.warns(wf.WeightferryWarning, match="weightferry offloads nothing: the config disables offload"):
        h = wf.enable(p, {}, device="sim")
    assert not h.enabled
    assert h.stats()["strategy"] == "none"
    assert snapshot(p) == before
    h.disable()
    assert snapshot(p) == before


@pytest.mark.parametrize("config", [layer(1), MODEL], ids=["layer", "model"])
def test_views_of_one_storage_share_it_again_after_disable(config):
    p = pipe(2)
    flat = torch.randn(432 + 216 + 5).to(BF16)  # two views and an unused tail: one storage of 653 elements
    p.vae.enc.weight = nn.Parameter(flat[:216].view(8, 3, 3, 3))
    p.vae.dec.weight = nn.Parameter(flat[216:432].view(3, 8, 3, 3))
    expected = run(p)
    before = snapshot(p)
    with wf.enable(p, config, device="sim"):
        assert_outputs_equal(run(p), expected)
    assert snapshot(p) == before
    enc, dec = p.vae.enc.weight, p.vae.dec.weight
    assert enc.untyped_storage().data_ptr() == dec.untyped_storage().data_ptr()
    assert (enc.storage_offset(), dec.storage_offset(), enc.untyped_storage().nbytes()) == (0, 216, 653 * 2)


def test_a_tensor_off_the_cpu_is_a_pipeline_error_and_nothing_changed():
    p = pipe(2)
    p.vae.dec.bias = nn.Parameter(torch.zeros(3, dtype=BF16, device="meta"))
    before = [(k, id(t), t.device) for k, t in tensors(p).items()]
    with pytest.raises(wf.PipelineError) as e:
        wf.enable(p, layer(2), device="sim")
    assert str(e.value) == (
        "tensor 'vae.dec.bias' is on meta; weightferry offloads a pipeline whose weights are on the CPU (move it "
        "there with .to('cpu') before enable; a module the config does not offload, such as a VAE left out of its "
        "components, is put on the device by enable with every tensor no block holds)"
    )
    assert [(k, id(t), t.device) for k, t in tensors(p).items()] == before
    assert all(len(m._forward_pre_hooks) == 0 for m in p.transformer.modules())


class Wrapped(torch.Tensor):
    """A tensor subclass over its own bytes with a Python attribute (diffusers' ``GGUFParameter`` is one)."""


def test_unsupported_layouts_are_pipeline_errors_and_nothing_changed():
    p = pipe(2)
    before = snapshot(p)
    p.vae.register_buffer("table", torch.eye(3).to_sparse())
    with pytest.raises(wf.PipelineError) as e:
        wf.enable(p, layer(2), device="sim")
    assert str(e.value) == (
        "tensor 'vae.table' has layout torch.sparse_coo; weightferry offloads dense (strided) tensors only: make it "
        "dense (.to_dense()) or leave its module out of the offloaded components"
    )
    del p.vae.table
    assert snapshot(p) == before
    assert all(len(m._forward_pre_hooks) == 0 for m in p.transformer.modules())


def test_a_tensor_subclass_over_its_own_bytes_streams_and_keeps_its_class_and_attributes():
    p = pipe(3)
    fc = p.transformer.blocks[1].fc
    w = torch.randn(64, 64).to(BF16).as_subclass(Wrapped)
    w.note = "kept"
    fc._parameters["weight"] = w
    expected = run(p)
    data = w.detach().as_subclass(torch.Tensor).clone()
    with wf.enable(p, layer(2), device="sim"):
        assert_outputs_equal(run(p), expected)
        assert fc.weight is w and type(w) is Wrapped
    assert fc.weight is w and type(w) is Wrapped and w.note == "kept"
    assert torch.equal(w.as_subclass(torch.Tensor), data)


def test_a_forward_that_raises_still_releases_its_block(monkeypatch):
    p = pipe(3)
    expected = run(p)
    block = p.transformer.blocks[1]
    with wf.enable(p, layer(2), device="sim") as h:
        monkeypatch.setattr(block, "forward", lambda h_: (_ for _ in ()).throw(ValueError("boom")))
        with pytest.raises(ValueError, match="boom"):
            run(p)
        assert is_placeholder(block.fc.weight)  # the post-hook ran (always_call) and released it
        monkeypatch.undo()
        assert_outputs_equal(run(p), expected)
        assert h.stats()["enabled"] is True
    assert_outputs_equal(run(p), expected)


def test_the_native_session_raises_typed_errors_never_a_panic():
    import json

    p = pipe(2)
    s = wf._core.Session(json.dumps(wf.describe(p)), json.dumps(layer(1)), wf._core.SessionOptions(name="p"))
    storages = s.storages()
    sid, size, unit = storages[0]
    with pytest.raises(wf.OffloadError) as e:
        s.write_storage(sid, b"\0" * (size + 1))
    assert str(e.value) == f"storage {sid} holds {size} bytes, but {size + 1} bytes were given for it"
    with pytest.raises(wf.OffloadError) as e:
        s.enable()
    assert str(e.value) == f"storage {sid} was never written; write every storage's bytes before enable"
    with pytest.raises(wf.OffloadError) as e:
        s.read_device(12345, 0, 1)
    assert str(e.value) == "invalid device buffer handle 12345"
    with pytest.raises(wf.OffloadError) as e:
        s.locate(sid)
    assert str(e.value) == f"storage {sid} is not on the device: offload is not enabled"
    assert s.pre_forward("transformer.blocks.0") is None  # no hooks yet
    assert issubclass(wf.OffloadError, wf.Error) and issubclass(wf.DeviceError, wf.Error)


def test_a_dict_and_a_root_module_pipeline_bind_by_their_paths():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 16).to(BF16)
    dit_only = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                             "layer_options": {"dit": {"prefetch_depth": 1}}}}
    root = nn.Module()
    root.scale = nn.Parameter(torch.randn(4).to(BF16))
    root.transformer = DiT(3)
    for p in ({"transformer": DiT(3)}, root):
        dit = p["transformer"] if isinstance(p, dict) else p.transformer
        with torch.no_grad():
            expected = dit(x)
        before = {k: v.clone() for k, v in dit.state_dict(keep_vars=False).items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # its class declares its block lists: found without a warning
            h = wf.enable(p, dit_only, device="sim")
        with h, torch.no_grad():
            assert is_placeholder(dit.blocks[2].fc.weight)
            assert torch.equal(dit(x), expected)
        after = dit.state_dict()
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert root.scale.numel() == 4


def test_stats_total_the_stacks_and_time_the_hooks():
    p = pipe()
    with wf.enable(p, layer(2), device="sim") as h:
        assert h.stats()["hooks"] == {"calls": 0, "p50_us": None, "p99_us": None, "max_us": None, "total_ms": 0.0}
        run(p, steps=3)
        s = h.stats()
        assert s["bytes_streamed"] == sum(st["h2d_bytes"] for st in s["stacks"]) > 0
        assert s["device_bytes"] == s["fixed_device_bytes"] + sum(st["device_bytes"] for st in s["stacks"])
        assert s["host_bytes"] == s["master_host_bytes"] > 0
        assert s["stalls"] == sum(st["sync_fetches"] for st in s["stacks"])
        assert all(st["record_waits"] <= st["loads"] for st in s["stacks"])
        # One pre and one post sample per hooked module call: the encoder's 3 layers once, the DiT's 4 blocks 3
        # times (the VAE is on demand: its hook runs once per call too).
        hooked = len(h._session.hooked_modules())
        hooks = s["hooks"]
        assert hooks["calls"] == 2 * (3 + 3 * 4 + (hooked - 7))
        assert 0 < hooks["p50_us"] <= hooks["p99_us"] <= hooks["max_us"] <= hooks["total_ms"] * 1e3


def test_the_hook_clock_keeps_a_fixed_ring():
    clock = HookClock()
    for ns in range(10_000):
        clock.record(ns)
    assert clock.calls == 10_000 and len(clock.ring) == clock.SAMPLES == 4096
    s = clock.summary()
    # The ring holds the last 4096 samples (5904..9999): their median and 99th percentile.
    assert (s["p50_us"], s["p99_us"], s["max_us"]) == (7952 / 1e3, 9959 / 1e3, 9999 / 1e3)
    assert s["total_ms"] == sum(range(10_000)) / 1e6


def test_an_auto_budget_is_planned_from_the_device_at_enable():
    p = pipe()
    expected = run(p)
    before = snapshot(p)
    auto = {"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "device_budget": "auto"}}
    with pytest.raises(wf.PlanError) as e:
        wf.plan(p, auto)
    assert str(e.value) == (
        'the config cannot be applied to Pipe: diffusion_offload_config.device_budget = "auto" is resolved from the '
        "device's free memory when offload is enabled on a device (weightferry.enable in Python); to plan or run it "
        'here, give a size such as "24GiB"'
    )
    assert snapshot(p) == before
    # The simulated device's capacity is 64 GiB: the budget is that less a tenth (the headroom, at least 2 GiB).
    with wf.enable(p, auto, device="sim") as h:
        report = json.loads(h._session.plan_json())
        assert report["budget"]["budget"] == (64 << 30) - (64 << 30) // 10
        assert_outputs_equal(run(p), expected)
    assert snapshot(p) == before


def dit_stack(plan):
    (c,) = [c for c in plan["components"] if c["kind"] == "dit"]
    (s,) = c["stacks"]
    return s


def test_retune_changes_depth_and_budget_keeping_the_masters():
    p = pipe(6)
    expected = run(p)
    before = snapshot(p)
    with wf.enable(p, layer(1), device="sim") as h:
        assert_outputs_equal(run(p), expected)
        masters = h.stats()["master_host_bytes"]
        deeper = h.retune(prefetch_depth=3)
        assert dit_stack(deeper)["prefetch_depth"] == 3
        assert_outputs_equal(run(p), expected)
        # A budget with room for what depth 3 needs and one more block: the planner keeps one of the six resident.
        block = dit_stack(deeper)["max_streaming_block_bytes"]
        stack = dit_stack(h.retune(device_budget=deeper["device_weight_bytes"] + block))
        assert (stack["resident"], stack["streaming"]) == (1, 5)
        assert_outputs_equal(run(p), expected)
        h.retune(layer(2))
        assert_outputs_equal(run(p), expected)
        assert h.stats()["master_host_bytes"] == masters
        assert h._session.hazard_violations() == []
        # What is offloaded cannot change: refused, and the pipeline still runs as it was.
        with pytest.raises(wf.OffloadError) as e:
            h.retune({"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}})
        assert "retune can change prefetch depths, resident layers and the device budget, not which components" in (
            str(e.value))
        with pytest.raises(wf.ConfigError):
            h.retune(prefetch_depth=0)
        assert_outputs_equal(run(p), expected)
    assert snapshot(p) == before
    with pytest.raises(wf.OffloadError) as e:
        h.retune(prefetch_depth=2)
    assert str(e.value) == "retune needs an enabled handle; this one is disabled or offloads nothing"


def test_retune_changes_resident_layers():
    p = pipe(6)
    expected = run(p)
    with wf.enable(p, layer(1, resident_layers=1), device="sim") as h:
        assert dit_stack(h.retune(resident_layers=3))["resident"] == 3
        assert_outputs_equal(run(p), expected)
        # Without resident layers the strategy itself would change (distributed_layer -> layer): refused, saying so.
        with pytest.raises(wf.OffloadError) as e:
            h.retune(resident_layers=0)
        assert str(e.value) == (
            "retune cannot switch from the distributed_layer strategy to layer (the new config's keys select it: "
            "resident layers under layer_options select the distributed layerwise strategy); disable and enable "
            "with the new config instead"
        )
        assert_outputs_equal(run(p), expected)


@pytest.mark.parametrize("fault", ["oom_at_alloc", "fail_host_alloc", "fail_h2d_copy"])
@pytest.mark.parametrize("config", [layer(2), MODEL], ids=["layer", "model"])
def test_a_failure_at_every_allocation_and_copy_of_enable_leaves_the_modules_as_they_were(fault, config):
    p = pipe(3)
    expected = run(p)
    before = snapshot(p)

    def check(n):
        assert snapshot(p) == before, f"{fault} at call {n}"

    h, n = enable_through_sim_faults(lambda seams: wf.enable(p, config, device="sim", _seams=seams), fault, check)
    # The first count past every such call of enable: enable succeeds (a later copy may still fail in a forward,
    # which is not enable's business). A host allocation of disable itself may now fail: disable says so, keeps
    # every weight, and a second call finishes.
    try:
        h.disable()
    except wf.OffloadError as e:
        assert fault == "fail_host_alloc" and "call disable again" in str(e), e
        h.disable()
    assert snapshot(p) == before
    # Model-level enable copies nothing (components move at their phases): no copy of enable to fail there.
    assert n > 0 or (fault == "fail_h2d_copy" and config is MODEL), "the fault never fired during enable"
    with wf.enable(p, config, device="sim"):
        assert_outputs_equal(run(p), expected)
    assert snapshot(p) == before


def test_the_cuda_binder_moves_a_tensor_between_slots_from_views_made_once():
    # The CUDA binder's rebinding on CPU storages (its `storage` pointed at two CPU buffers standing in for two
    # slots): applying a rebinding makes the parameter object (kept, with its requires_grad) view its bytes in that
    # slot, and a rebinding made once is applied again later without being rebuilt.
    binder = CudaBinder(None, torch.device("cpu"))
    slots = {b: torch.arange(256, dtype=torch.uint8).add_(b).untyped_storage() for b in (1, 2)}
    binder.storage = slots.__getitem__
    p = nn.Parameter(torch.zeros(2, 3, dtype=BF16))
    tied = p.detach().view(6)  # another tensor object over the same storage
    views = [View(p, "m.weight"), View(tied, "m.tied", like=tied)]
    at = {b: binder.rebinding([(views, b, 64)]) for b in (1, 2)}
    for b in (1, 2, 1):
        binder.apply(at[b])
        want = torch.empty(0, dtype=BF16).set_(slots[b], 32, (2, 3), (3, 1))
        assert torch.equal(p.detach(), want) and p.requires_grad and isinstance(p, nn.Parameter)
        assert p.data_ptr() == tied.data_ptr() == want.data_ptr()
        assert tied.shape == (6,)
    with pytest.raises(wf.OffloadError, match=r"^internal error: tensor 'm\.weight' would start at byte 65 "):
        binder.rebinding([(views, 1, 65)])
