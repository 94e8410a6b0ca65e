#!/usr/bin/env python3
"""Where ``weightferry.enable``'s time and host memory go, on one full-size diffusers transformer (random bf16
weights) per process:

    python3 benches/torch/enable_profile.py --model sd35 [--layers N] [--trim] [--budget P]
    python3 benches/torch/enable_profile.py --model sd35 --pin

Prints host RSS by kind (anonymous, file, shared: pinned memory counts as shared) as multiples of the weight bytes
after building the model, after the hand-over (every tensor's bytes given to the session, torch's copy released)
and after enable, with the time of each part, and one JSON line. ``--pin`` instead times one copy of every weight
into freshly pinned host memory (torch's ``pin_memory``, each copy held so each is a fresh allocation): the
baseline of the enable-time target. ``--trim`` calls glibc's ``malloc_trim`` after enable and measures again
(memory the C heap kept). ``--layers`` shrinks the model (tensor sizes stay the real ones). ``--budget P`` enables
under a device budget of P% of the weights. Models: ``sd35`` (SD3.5-Large), ``auraflow`` (AuraFlow v0.3), ``flux``
(FLUX.1-dev). Without a GPU it runs on the simulated device (whose device memory is host memory: RSS then counts it).
"""

import argparse
import ctypes
import json
import os
import time
import warnings

import torch

CONFIGS = {
    "sd35": ("SD3Transformer2DModel", "num_layers", dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
        joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192, qk_norm="rms_norm")),
    "auraflow": ("AuraFlowTransformer2DModel", "num_single_dit_layers", dict(
        sample_size=64, patch_size=2, in_channels=4, num_mmdit_layers=4, num_single_dit_layers=32,
        attention_head_dim=256, num_attention_heads=12, joint_attention_dim=2048, caption_projection_dim=3072,
        out_channels=4, pos_embed_max_size=9216)),
    "flux": ("FluxTransformer2DModel", "num_single_layers", dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))),
}
KINDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def rss():
    """The process's memory counters of ``KINDS``, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in KINDS:
                out[key] = int(line.split()[1]) * 1024
    return out


def build(name, layers):
    """The model built on ``meta``, then each parameter given uninitialised CPU memory filled from one pattern."""
    import diffusers

    nn = torch.nn
    cls, knob, cfg = CONFIGS[name]
    cfg = dict(cfg, **({knob: layers} if layers is not None else {}))
    register = nn.Module.register_parameter

    def on_meta(self, pname, p):
        register(self, pname, p)
        if p is not None:
            self._parameters[pname] = nn.Parameter(p.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta
    try:
        model = getattr(diffusers, cls)(**cfg).to(torch.bfloat16).eval()
    finally:
        nn.Module.register_parameter = register
    pattern = (torch.rand(64 << 20, generator=torch.Generator().manual_seed(0)) * 0.04 - 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for mod in model.modules():
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                flat = torch.empty(p.shape, dtype=p.dtype).view(-1)
                for start in range(0, flat.numel(), pattern.numel()):
                    end = min(flat.numel(), start + pattern.numel())
                    flat[start:end].copy_(pattern[: end - start])
                mod._parameters[pname] = nn.Parameter(flat.view(p.shape), requires_grad=False)
    return model


def enable_timed(model, res, base, budget, weight_bytes):
    """Enables ``model``, timing and measuring the hand-over apart from the rest."""
    import weightferry as wf
    import weightferry._storages as storages

    hand_over = storages.StorageMap.hand_over

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        hand_over(self, *args, **kwargs)
        res["hand_over_s"] = time.perf_counter() - t0
        res["after_hand_over"] = {k: v - base[k] for k, v in rss().items()}
        res["hand_over_end"] = time.perf_counter()

    storages.StorageMap.hand_over = timed
    cfg = {"mode": "layer", "components": ["dit"]}
    if budget:
        cfg["device_budget"] = weight_bytes * budget // 100
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        device = "cuda" if torch.cuda.is_available() else "sim"
        handle = wf.enable({"transformer": model}, {"diffusion_offload_config": cfg}, device=device)
    t1 = time.perf_counter()
    res["enable_s"] = t1 - t0
    res["after_hand_over_s"] = t1 - res.pop("hand_over_end")
    res["after_enable"] = {k: v - base[k] for k, v in rss().items()}
    return handle


def report(res, weight_bytes):
    def ratios(d):
        return " ".join(f"{k}={v / weight_bytes:.3f}" for k, v in d.items())

    print(json.dumps(res))
    print(f"{res['model']}: {weight_bytes / 1e9:.2f} GB in {res['tensors']} tensors")
    print(f"  built:     {ratios(res['built'])}")
    if "pin_copy_s" in res:
        print(f"  one copy into pinned memory: {res['pin_copy_s']:.2f} s")
        return
    print(f"  hand-over: {ratios(res['after_hand_over'])}  {res['hand_over_s']:.2f} s")
    print(f"  enable:    {ratios(res['after_enable'])}  {res['enable_s']:.2f} s in all, "
          f"{res['after_hand_over_s']:.2f} s after the hand-over")
    if "after_trim" in res:
        print(f"  trimmed:   {ratios(res['after_trim'])}")
    print(f"  host masters {res['master_host_bytes'] / weight_bytes:.3f}, "
          f"fixed placement {res['fixed_device_bytes'] / weight_bytes:.3f} of the weights")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sd35", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, help="the model's repeated blocks (default: the real count)")
    ap.add_argument("--budget", type=int, default=0, help="device budget in %% of the weights (default: none)")
    ap.add_argument("--trim", action="store_true", help="measure again after glibc's malloc_trim")
    ap.add_argument("--pin", action="store_true", help="time one copy into pinned memory instead of enabling")
    a = ap.parse_args()
    base = rss()
    model = build(a.model, a.layers)
    params = list(model.parameters())
    weight_bytes = sum(t.numel() * t.element_size() for t in params + list(model.buffers()))
    res = {"model": a.model, "weight_bytes": weight_bytes, "tensors": len(params)}
    res["built"] = {k: v - base[k] for k, v in rss().items()}
    if a.pin:
        t0 = time.perf_counter()
        held = [p.detach().pin_memory() for p in params]
        res["pin_copy_s"] = time.perf_counter() - t0
        del held
    else:
        del params
        handle = enable_timed(model, res, base, a.budget, weight_bytes)
        if a.trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            res["after_trim"] = {k: v - base[k] for k, v in rss().items()}
        stats = handle.stats()
        res["master_host_bytes"] = stats.get("master_host_bytes", 0)
        res["fixed_device_bytes"] = stats.get("fixed_device_bytes", 0)
    report(res, weight_bytes)
    os._exit(0)  # no teardown of the model and the masters to wait for


if __name__ == "__main__":
    main()
