"""Writes a Flux-dev-shaped safetensors checkpoint with fewer blocks (``--double``/``--single``; the full model's
layer sizes, random bf16 weights) for ``weightferry run --checkpoint PATH --platform cuda``: the reference engine over
real checkpoint bytes on a GPU in a few seconds. Usage: python3 benches/gpu/ref_checkpoint.py PATH [--double N]
[--single N]."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch"))
import diffusers_bench as bench  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("path")
ap.add_argument("--double", type=int, default=4)
ap.add_argument("--single", type=int, default=8)
a = ap.parse_args()
import torch  # noqa: E402

spec = bench.MODELS["flux-dev"]
spec["config"] = dict(spec["config"], num_layers=a.double, num_single_layers=a.single)
model, _ = bench.build(torch, "flux-dev")
print(f"{bench.write_checkpoint(torch, model, a.path) / 1e9:.2f} GB written to {a.path}")
