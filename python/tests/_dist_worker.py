"""One rank of ``test_distributed.py``: a tiny Flux transformer (the same seeded weights on every rank) enabled with
its blocks gathered across the ranks on ``device="sim"``, run twice against its resident output, disabled, its
weights compared; prints one ``RESULT`` JSON line. ``WF_TEST_FAULT=R:N`` makes rank R's AllGather call N fail."""

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import forward, inputs, reference, weights  # noqa: E402

import weightferry as wf  # noqa: E402

warnings.simplefilter("ignore")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
fault = os.environ.get("WF_TEST_FAULT")
if fault and rank == int(fault.split(":")[0]):
    wf._enable._SIM_FAULTS = {"fail_all_gather": int(fault.split(":")[1])}
config = {"data_parallel_size": int(os.environ.get("WF_TEST_GROUP", world)),
          "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                       "layer_options": {"dit": {"weight_transfer": "allgather"}}}}
m = reference()
x = inputs()
expected = forward(m, x)
before = weights(m)
res = {"rank": rank}
h = None
try:
    h = wf.enable({"transformer": m}, config)
    res["group"] = h.stats()["group"]
    res["exact"] = [bool(torch.equal(forward(m, x), expected)) for _ in range(2)]
    h.disable()
    res["weights"] = all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
except wf.Error as e:
    res["error"] = f"{type(e).__name__}: {e}"
    if h is not None:
        try:
            h.disable()
            res["disable"] = "ok"
        except wf.Error as e2:
            res["disable"] = f"{type(e2).__name__}: {e2}"
print("RESULT " + json.dumps(res), flush=True)
