"""One run of the disk tier measured from inside its own process, for ``test_disk_memory.py``: builds a Flux
transformer on ``meta`` (the config in the first argument, JSON), binds it from the checkpoint (second argument) with
pinned masters and the ``host_budget`` in the third (``none``: no budget), runs two forward passes and prints, as one
JSON line, the process RSS before ``enable`` and after the passes, the session's ``stats()`` (its predictions
included) and how many bytes of the checkpoint file the page cache holds at that point (``mincore``)."""

import ctypes
import json
import mmap
import os
import sys

import diffusers
import torch

import weightferry as wf


def rss():
    """The process's resident set, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def cached_bytes(path):
    """Bytes of ``path`` in the page cache (``mincore`` over a fresh mapping, which itself reads nothing)."""
    libc, size = _libc(), os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        ok = libc.mincore(addr, size, vec)
        libc.munmap(addr, size)
        if ok != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
    finally:
        os.close(fd)


def evict(path):
    """Drops ``path``'s clean pages from the page cache (after writing back any dirty ones)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def inputs(config):
    g = torch.Generator().manual_seed(3)
    text, pooled = config["joint_attention_dim"], config["pooled_projection_dim"]
    x = dict(hidden_states=torch.randn(1, 16, config["in_channels"], generator=g),
             encoder_hidden_states=torch.randn(1, 7, text, generator=g),
             pooled_projections=torch.randn(1, pooled, generator=g), timestep=torch.tensor([0.5]),
             img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.randn(7, 3, generator=g))
    return {k: v.to(torch.bfloat16) if k not in ("img_ids", "txt_ids") else v for k, v in x.items()}


def main(config, path, budget):
    import warnings

    warnings.simplefilter("ignore")
    with torch.device("meta"):
        m = diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16).eval()
    x = inputs(config)
    keys = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"prefetch_depth": 2}},
            "host_masters": "pinned"}
    if budget != "none":
        keys["host_budget"] = int(budget)
    before = rss()
    h = wf.enable({"transformer": m}, {"diffusion_offload_config": keys}, device="sim", checkpoint=path)
    with torch.no_grad():
        for _ in range(2):
            m(**x, return_dict=False)
    out = dict(before=before, after=rss(), cached=cached_bytes(path), stats=h.stats())
    out["stats"].pop("stacks")
    print(json.dumps(out))
    h.disable()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
