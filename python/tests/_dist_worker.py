"""One rank of ``test_distributed.py``: a tiny Flux transformer (the same seeded weights on every rank) enabled with
its blocks gathered across the ranks on ``device="sim"``, run twice against its resident output, disabled, its
weights compared; prints one ``RESULT`` JSON line. ``WF_TEST_FAULT=R:N`` makes rank R's AllGather call N fail;
``WF_TEST_TORCH_PG=1`` starts a torch.distributed (gloo) process group first; ``WF_TEST_TWICE=1`` enables twice;
``WF_TEST_DEVICE=cuda`` runs on GPU ``LOCAL_RANK`` (NCCL AllGathers); ``WF_TEST_CHECKPOINT=PATH`` binds a meta module
from that safetensors file instead."""

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import forward, inputs, on_meta, reference, weights

import weightferry as wf
from weightferry._enable import Seams

warnings.simplefilter("ignore")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if os.environ.get("WF_TEST_TORCH_PG"):
    # A process group of torch's own holds MASTER_PORT: weightferry must meet on another port, found in its store.
    torch.distributed.init_process_group("gloo")
fault = os.environ.get("WF_TEST_FAULT")
seams = Seams()
if fault and rank == int(fault.split(":")[0]):
    seams = Seams(sim_faults={"fail_all_gather": int(fault.split(":")[1])})
config = {"data_parallel_size": int(os.environ.get("WF_TEST_GROUP", world)),
          "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                                       "layer_options": {"dit": {"weight_transfer": "allgather"}}}}
device = os.environ.get("WF_TEST_DEVICE", "sim")
m = reference()
x = inputs()
if device == "sim":
    expected = forward(m, x)
else:
    import copy

    # One GPU per rank (LOCAL_RANK), torch's current device; the reference runs resident on it.
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    x = {k: v.cuda() for k, v in x.items()}
    expected = forward(copy.deepcopy(m).cuda(), x)
before = weights(m)
extra = {}
if os.environ.get("WF_TEST_CHECKPOINT"):
    # Every rank binds a meta module from the same file and reads only its own shards of it.
    m = on_meta()
    extra["checkpoint"] = os.environ["WF_TEST_CHECKPOINT"]
res = {"rank": rank}
h = None
try:
    h = wf.enable({"transformer": m}, config, device="sim" if device == "sim" else "cuda", _seams=seams, **extra)
    res["group"] = h.stats()["group"]
    res["exact"] = [bool(torch.equal(forward(m, x), expected)) for _ in range(2)]
    h.disable()
    res["weights"] = all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    if os.environ.get("WF_TEST_TWICE"):
        with wf.enable({"transformer": m}, config, device="sim" if device == "sim" else "cuda", _seams=seams):
            res["exact"].append(bool(torch.equal(forward(m, x), expected)))
        res["weights"] &= all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
except wf.Error as e:
    res["error"] = f"{type(e).__name__}: {e}"
    if h is not None:
        try:
            h.disable()
            res["disable"] = "ok"
        except wf.Error as e2:
            res["disable"] = f"{type(e2).__name__}: {e2}"
print("RESULT " + json.dumps(res), flush=True)
