#!/usr/bin/env python3
"""What one binding of a tensor costs on the host, by the kind of tensor a quantized model holds: a plain
``Parameter``, diffusers' ``GGUFParameter`` (a subclass over its own bytes with a Python ``__torch_function__``) and a
torchao ``Int8Tensor``'s inner tensor. Each is bound ``--n`` times, alternating between two tensors of its shape, by
``t.data = x`` (a subclass's ``__torch_function__`` runs on each) and by weightferry's ``_storages.assign`` (torch's
own assignment, what the hooks do since issue 27), in one process, best of ``--repeat`` runs; prints microseconds per
binding.

    python3 benches/torch/bind_cost.py [--n 20000] [--repeat 5]

Needs torch, diffusers and weightferry (torchao for its row). CPU only: the cost measured is the host's, the same
whatever device the bytes are on."""

import argparse
import time


def per_binding(bind, t, sources, n, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(n):
            bind(t, sources[i & 1])
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def tensors():
    """``{kind: (tensor object, [two sources of its shape])}``."""
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter

    out = {"Parameter": (torch.nn.Parameter(torch.zeros(64, 64), requires_grad=False),
                         [torch.zeros(64, 64) for _ in range(2)])}
    out["GGUFParameter"] = (GGUFParameter(torch.zeros(64, 68, dtype=torch.uint8), quant_type=8),
                            [torch.zeros(64, 68, dtype=torch.uint8) for _ in range(2)])
    try:
        import torchao.quantization as ao

        lin = torch.nn.Linear(64, 64).to(torch.bfloat16)
        ao.quantize_(lin, ao.Int8WeightOnlyConfig())
        q = lin.weight.qdata
        out["Int8Tensor.qdata"] = (q, [q.clone() for _ in range(2)])
    except ImportError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from weightferry._storages import assign

    def data_attr(t, x):
        t.data = x

    print(f"{'tensor':<20}{'t.data = x  us':>16}{'assign  us':>12}{'ratio':>8}")
    for kind, (t, sources) in tensors().items():
        a = per_binding(data_attr, t, sources, args.n, args.repeat)
        b = per_binding(assign, t, sources, args.n, args.repeat)
        print(f"{kind:<20}{a:>16.3f}{b:>12.3f}{a / b:>8.1f}")


if __name__ == "__main__":
    main()
