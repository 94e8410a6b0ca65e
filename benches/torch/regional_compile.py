#!/usr/bin/env python3
"""Compile time of diffusers' regional compilation (``compile_repeated_blocks(fullgraph=True)``, inductor) of a tiny
Flux on the simulated device, resident or streamed with a static schedule: the graphs torch.compile made, the first
call (the compile) and the second. Run each variant in its own process.

    python3 benches/torch/regional_compile.py --variant resident|weightferry [--singles 16] [--device sim|cuda]
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "tests"))
from test_static_compile import config, model_and_inputs, run

import weightferry as wf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["resident", "weightferry"], required=True)
    p.add_argument("--singles", type=int, default=16, help="single-stream blocks (4 double blocks besides)")
    p.add_argument("--device", default="sim", help="sim (CPU) or cuda")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    model, x = model_and_inputs("float32")
    model = type(model)(**{**model.config, "num_single_layers": a.singles}).eval()
    on = "cpu" if a.device == "sim" else a.device
    x = {k: v.to(on) for k, v in x.items()}
    torch._dynamo.reset()
    counters.clear()
    handle = None
    if a.variant == "weightferry":
        handle = wf.enable({"transformer": model}, config(), device=a.device)
    else:
        model.to(on)
    model.compile_repeated_blocks(fullgraph=True)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        run(model, x)
        if on != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"{a.variant} blocks {4 + a.singles}: graphs {counters['stats']['unique_graphs']}, "
          f"first call {times[0]:.1f} s, second {times[1] * 1e3:.0f} ms")
    if handle is not None:
        handle.disable()


if __name__ == "__main__":
    main()
