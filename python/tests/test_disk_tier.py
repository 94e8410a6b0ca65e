"""The disk tier on ``device="sim"``: with weights bound from a checkpoint and a ``host_budget`` below their masters,
the blocks beyond the budget are read from the file on every pass (through a reader actor and a ring of staging
buffers) instead of holding a master. At several budgets the outputs equal the model's own, the bytes ``enable``
holds are the ones the plan predicted (masters + staging within the budget), ``state_dict`` and ``disable`` give
the true weights; a budget nothing fits is refused before anything changes, and a file truncated or rewritten in
place under a run is a typed error naming it."""

import copy
import json
import os

import pytest
import torch
from test_checkpoint import LAYER, forward, inputs
from test_host_memory import checkpoint as host_checkpoint
from test_host_memory import with_key

import weightferry as wf
from weightferry import _enable as wf_enable
from weightferry._enable import Seams

pytestmark = pytest.mark.filterwarnings("ignore::weightferry.WeightferryWarning")


def checkpoint(tmp_path, head_dim):
    """``test_host_memory.checkpoint`` with one double and twelve single blocks (many small units: budgets down to
    half the masters fit the staging buffers)."""
    return host_checkpoint(tmp_path, head_dim, num_layers=1, num_single_layers=12)


def masters_of(m, path):
    """The master bytes of the model bound from ``path`` with pinned masters and no budget."""
    with wf.enable({"transformer": m}, with_key(LAYER, host_masters="pinned"), device="sim", checkpoint=path) as h:
        return h.stats()["master_host_bytes"]


@pytest.mark.parametrize("fraction", [0.5, 0.7, 0.9])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_blocks_beyond_the_host_budget_are_read_from_disk_bit_exact(tmp_path, fraction, head_dim):
    ref, m, path = checkpoint(tmp_path, head_dim)
    x = inputs()
    want = forward(ref, x)
    budget = int(masters_of(m, path) * fraction)
    cfg = with_key(LAYER, host_masters="pinned", host_budget=budget)
    with wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path) as h:
        for _ in range(3):
            assert torch.equal(forward(m, x), want)
        s = h.stats()
        host = s["plan_host"]
        assert s["disk_bytes"] > 0 and s["disk_bytes"] == host["disk_bytes"]
        assert (s["master_host_bytes"], s["staging_host_bytes"]) == (host["master_bytes"], host["staging_bytes"])
        assert 0 < s["master_host_bytes"] + s["staging_host_bytes"] <= budget
        # Every pass reads the disk units again: their bytes are copied to the device each time.
        assert sum(st["h2d_bytes"] for st in s["stacks"]) >= 3 * s["disk_bytes"]
        got = m.state_dict()
        assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
        # A retune rebuilds the stacks over the same readers.
        h.retune(prefetch_depth=1)
        assert torch.equal(forward(m, x), want)
        assert h.stats()["disk_bytes"] == host["disk_bytes"]
        assert h._session.hazard_violations() == []
    assert all(torch.equal(m.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert torch.equal(forward(m, x), want)


def test_a_budget_the_staging_ring_cannot_fit_is_refused_before_anything_changes(tmp_path):
    _, m, path = checkpoint(tmp_path, 128)
    cfg = with_key(LAYER, host_masters="pinned", host_budget=4096)
    with pytest.raises(wf.PlanError) as e:
        wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path)
    # Bound from a checkpoint already: the message does not suggest binding one.
    assert str(e.value).endswith(
        "with the disk tier's staging buffers, over the budget of 4.00 KiB (4096 B); raise host_budget or offload "
        "fewer components (the disk tier reads only the parts of blocks whose tensors the checkpoint holds as the "
        "module does, and needs two staging buffers of the largest block)")
    assert all(p.device.type == "meta" for p in m.parameters())


def test_a_model_without_a_checkpoint_has_no_disk_tier_and_is_refused():
    from test_diffusers import flux, layer

    model = flux()[0]
    twin = copy.deepcopy(model)
    need = wf.plan({"transformer": model}, layer(1))["host"]["master_bytes"]
    with pytest.raises(wf.PlanError, match="bind the weights from a checkpoint"):
        wf.enable({"transformer": model}, with_key(layer(1), host_budget=need // 2), device="sim")
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in model.state_dict().items())


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def rewrite(path):
    """Zeroes the file's second half in place, the length unchanged (its modification time set 10 s on, as a
    rewrite seconds into a run has it on a filesystem with coarse timestamps)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(size - size // 2))
    later = os.path.getmtime(path) + 10
    os.utime(path, (later, later))


@pytest.mark.parametrize(("change", "said"), [(truncate, "truncated from"), (rewrite, "rewritten in place")])
def test_a_file_truncated_or_rewritten_under_a_run_is_a_typed_error_naming_it(tmp_path, change, said):
    ref, m, path = checkpoint(tmp_path, 128)
    x = inputs()
    budget = masters_of(m, path) * 7 // 10
    cfg = with_key(LAYER, host_masters="pinned", host_budget=budget)
    h = wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path)
    assert torch.equal(forward(m, x), forward(ref, x))
    change(path)
    with pytest.raises(wf.Error) as e:
        forward(m, x)
    assert f"{path}: the checkpoint was {said}" in str(e.value) and "while weightferry used it" in str(e.value)
    assert type(e.value).__module__.startswith("weightferry")
    # The weights the file held are gone: disable says so (a typed error), never gives other weights back.
    with pytest.raises(wf.Error, match=f"the checkpoint was {said}"):
        h.disable()
    del h


class BufferedSession:
    """The real session, whose report says the disk tier reads ``files`` through the page cache (as it does where the
    filesystem refuses ``O_DIRECT``; every filesystem of the test machines allows it)."""

    def __init__(self, files, *args, **kwargs):
        self._s = wf_enable._core.Session(*args, **kwargs)
        self._files = files

    def __getattr__(self, name):
        return getattr(self._s, name)

    def report(self):
        report = json.loads(self._s.report())
        assert report["buffered_files"] == []  # this machine's filesystem reads around the cache
        return json.dumps({**report, "buffered_files": self._files})


def test_a_file_read_through_the_page_cache_is_a_warning_at_enable(tmp_path):
    ref, m, path = checkpoint(tmp_path, 16)
    budget = masters_of(m, path) * 7 // 10
    cfg = with_key(LAYER, host_masters="pinned", host_budget=budget)

    def session(*args, **kwargs):
        return BufferedSession([str(path)], *args, **kwargs)

    with pytest.warns(wf.WeightferryWarning) as caught:
        h = wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path, _seams=Seams(session=session))
    said = [w for w in caught if "O_DIRECT" in str(w.message)]
    assert [str(w.message) for w in said] == [
        f"{path}: the filesystem refuses O_DIRECT, so the disk tier reads this checkpoint through the page cache, "
        "whose pages the kernel keeps beyond host_budget; keep it on a local disk (ext4, xfs) to read around the cache"
    ]
    assert said[0].filename == __file__  # attributed to the caller of enable
    x = inputs()
    assert torch.equal(forward(m, x), forward(ref, x))
    h.disable()


def test_after_a_failed_read_forwards_keep_failing_until_a_retune_and_disable_gives_the_weights_back(tmp_path):
    """A read that fails (here the file is cut short, then restored with its bytes and time stamps, as after a
    transient fault) fails its forward; the stack keeps that load's error, so every later forward raises it too,
    never an output from missing bytes, until ``retune`` rebuilds the stacks (its message says so); ``disable``
    then gives the module the file's weights, bit for bit, and a new ``enable`` runs exact again."""
    ref, m, path = checkpoint(tmp_path, 128)
    x = inputs()
    want = forward(ref, x)
    cfg = with_key(LAYER, host_masters="pinned", host_budget=masters_of(m, path) * 7 // 10)
    h = wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path)
    assert torch.equal(forward(m, x), want)
    stat, data = os.stat(path), path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(len(data) // 2)
    with pytest.raises(wf.Error) as first:
        forward(m, x)
    assert str(first.value).endswith(
        "; the block stack keeps this error until it is rebuilt: once the cause is gone (a file restored, memory "
        "freed) call retune(), which rebuilds the stacks and keeps the host masters, or disable()"
    )
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    for _ in range(2):
        with pytest.raises(wf.Error) as again:
            forward(m, x)
        assert str(again.value).split(": ", 1)[1] == str(first.value).split(": ", 1)[1]
    # The cause gone, a retune rebuilds the stacks: exact again, the masters kept.
    h.retune()
    assert torch.equal(forward(m, x), want)
    h.disable()
    got = m.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    with wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path):
        assert torch.equal(forward(m, x), want)


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_plan_with_the_checkpoint_predicts_the_disk_tier_enable_then_holds(tmp_path, fraction):
    _, m, path = checkpoint(tmp_path, 128)
    cfg = with_key(LAYER, host_masters="pinned", host_budget=int(masters_of(m, path) * fraction))
    before = {k: (v.device, v.shape) for k, v in m.state_dict().items()}
    predicted = wf.plan({"transformer": m}, cfg, checkpoint=path)["host"]
    assert {k: (v.device, v.shape) for k, v in m.state_dict().items()} == before  # still on meta, nothing read
    assert predicted["disk_bytes"] > 0 and predicted["staging_bytes"] > 0
    with wf.enable({"transformer": m}, cfg, device="sim", checkpoint=path) as h:
        s = h.stats()
        assert s["plan_host"] == predicted
        assert (s["master_host_bytes"], s["disk_bytes"], s["staging_host_bytes"]) == (
            predicted["master_bytes"], predicted["disk_bytes"], predicted["staging_bytes"])
    # Without the checkpoint the plan cannot know what the file serves: it counts every block as a master.
    assert wf.plan({"transformer": m}, cfg)["host"]["disk_bytes"] == 0


def test_plan_with_a_checkpoint_refuses_a_distributed_config(tmp_path):
    _, m, path = checkpoint(tmp_path, 128)
    cfg = {"data_parallel_size": 2, "diffusion_offload_config": {
        "mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}}
    with pytest.raises(wf.PlanError, match=r"plan\(checkpoint=\.\.\.\) predicts one process's host memory"):
        wf.plan({"transformer": m}, cfg, checkpoint=path)
