"""The disk tier's memory, measured in a process of its own (``disk_probe.py``) on ``device="sim"``: a Flux
transformer of about 210 MB bound from its checkpoint with a ``host_budget`` of a quarter or half of its masters.
The process RSS after two forward passes stays within the plan's predicted host bytes plus the simulated device's
bytes (the sim keeps device memory in the process) plus the fixed overhead of the same run with every master held
(measured here, so the bound does not depend on this machine's torch); and the blocks read from disk bypass the
page cache where the filesystem allows ``O_DIRECT`` (``mincore`` over the file after the passes: the cached bytes
are at most the file less the bytes the disk tier read)."""

import json
import os
import subprocess
import sys

import diffusers
import pytest
import torch
from disk_probe import cached_bytes, evict
from safetensors.torch import save_file
from test_checkpoint import CONFIG

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and mincore (Linux)")

# 24 single blocks of about 8 MB: large against the allocator's noise, small enough for CI.
MODEL = dict(CONFIG, attention_head_dim=128, num_attention_heads=4, axes_dims_rope=(16, 56, 56), num_layers=1,
             num_single_layers=24, joint_attention_dim=64, pooled_projection_dim=32, in_channels=16)
# Beyond the overhead measured with every master held: the sim's staging buffers are not aligned for O_DIRECT, so the
# file keeps one bounce buffer of a staging window (a GPU's pinned ones are, and need none), and 2 % of the weights
# for the allocator.
NOISE = 0.02
# Pages the kernel may read ahead of the buffered reads of the masters next to the disk units.
READAHEAD = 2 << 20


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**MODEL).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("disk_memory") / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    return str(path), sum(v.numel() * v.element_size() for v in ref.state_dict().values())


def probe(path, budget):
    """One run of ``disk_probe.py`` with the file evicted from the page cache first. glibc's mmap threshold is fixed
    so that large temporaries go back to the system when freed (its default threshold grows with them and keeps
    them in the heap, which would count them as held)."""
    evict(path)
    evicted = cached_bytes(path) == 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    here = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, os.path.join(here, "disk_probe.py"), json.dumps(MODEL), path, str(budget)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), evicted=evicted)


@pytest.fixture(scope="module")
def held_all(weights_file):
    """The run with every master held: its RSS over the prediction is the fixed overhead."""
    run = probe(weights_file[0], "none")
    s = run["stats"]
    assert s["disk_bytes"] == 0 and s["host_bytes"] == s["plan_host"]["master_bytes"]
    return run, run["after"] - run["before"] - (s["host_bytes"] + s["device_bytes"])


def direct_io(path):
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_rss_stays_within_the_predicted_host_bytes_and_disk_reads_bypass_the_page_cache(
        weights_file, held_all, fraction):
    path, weights = weights_file
    full, overhead = held_all
    budget = int(full["stats"]["host_bytes"] * fraction)
    run = probe(path, budget)
    s = run["stats"]
    host = s["host_bytes"]
    assert s["disk_bytes"] > 0 and host == s["plan_host"]["master_bytes"] + s["plan_host"]["staging_bytes"]
    assert host <= budget
    grew = run["after"] - run["before"]
    bounce = s["staging_host_bytes"] // 2
    bound = host + s["device_bytes"] + overhead + bounce + NOISE * weights
    assert grew <= bound, (grew, host, s["device_bytes"], overhead)
    # The bound is below what holding every master would take: the test fails if the disk tier held them.
    assert bound < full["stats"]["host_bytes"] + s["device_bytes"] + overhead
    # Where the filesystem refuses O_DIRECT (the reads fall back to buffered ones) or the kernel kept the file's
    # pages despite POSIX_FADV_DONTNEED, the page cache says nothing about the reads.
    if direct_io(path) and run["evicted"]:
        size = os.path.getsize(path)
        assert run["cached"] <= size - s["disk_bytes"] + READAHEAD, (run["cached"], size, s["disk_bytes"])
