"""The DiT of a weightferry pipeline description (the `weightferry-pipeline/1` JSON format, see
docs/pipeline-format.md), as the GPU reference engine runs it. Pure Python (no torch): `peer_bench.py` builds its
PyTorch model from it and `check_shapes.py` compares its byte totals with `weightferry plan --json`.

What one DiT step computes in our engine (harness/engine/program.rs, harness/engine/cuda.rs), reproduced here:
- the DiT component runs as a list of kernels: the component's own tensors; then its children in declaration order:
  every block of a block list (`repeat`, or a ModuleList/Sequential with children 0..n-1) is one kernel over all the
  block's tensors; a child that holds a block list deeper down is entered and walked the same way; any other child
  is one kernel over its whole subtree. Tensors tied to a block's storage are computed inside that block only.
- in a kernel, every bf16 tensor of rank >= 2 viewed as [out, in] (out = shape[0], in = numel / out; contiguous,
  or a 2-D tensor stored transposed), with out and in <= 32768, is one GEMM over `tokens` rows:
  input [tokens, in] (the previous product of the kernel if at least `in` wide, else the activation x if at least
  `in` wide, else zeros) times W^T -> [tokens, out]; a product exactly `width` wide is added back into x (x += 0.05 y).
- a block kernel then runs the attention proxy: S = x x^T / width and O = S x / tokens, 1024 rows at a time
  (4 * tokens^2 * width flops), and x += 0.05 O.
- other tensors (norm scales, f32 modulation tables, rope buffers) are not read.
`width` is the most common `in` among the DiT's GEMM weights (ties: the wider).
"""

import json
import os
from collections import Counter

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f8e4m3": 1, "f8e5m2": 1, "i64": 8, "i32": 4, "i8": 1, "u8": 1}
MAX_GEMM_DIM = 32768
ATTN_CHUNK = 1024
RESIDUAL = 0.05
DEVICE_ALIGN = 256
HERE = os.path.dirname(os.path.abspath(__file__))


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def contiguous_strides(shape):
    out, acc = [0] * len(shape), 1
    for i in reversed(range(len(shape))):
        out[i] = acc
        acc *= max(shape[i], 1)
    return out


class Tensor:
    """One tensor of a module: its storage is its own unless `tied_to` names another tensor's."""

    def __init__(self, name, d):
        self.name = name
        self.dtype = d["dtype"]
        self.shape = [int(x) for x in d["shape"]]
        self.strides = [int(x) for x in d.get("strides", contiguous_strides(self.shape))]
        self.kind = d.get("kind", "parameter")
        self.tied_to = d.get("tied_to")
        if d.get("storage") is not None or int(d.get("storage_offset", 0)) != 0:
            raise NotImplementedError(f"tensor {name}: named storages / storage offsets are not supported in a DiT")
        self.numel = numel(self.shape)
        transposed = len(self.shape) == 2 and self.strides == [1, self.shape[0]]
        if self.strides != contiguous_strides(self.shape) and not transposed:
            raise NotImplementedError(f"tensor {name}: strides {self.strides} (only contiguous or 2-D transposed)")
        self.bytes = self.numel * DTYPE_BYTES[self.dtype]

    @property
    def transposed(self):
        return self.strides != contiguous_strides(self.shape)

    def gemm_view(self):
        """(out, in) when the engine multiplies by this tensor, else None (cuda.rs `gemm_view`)."""
        if self.dtype != "bf16" or len(self.shape) < 2:
            return None
        out = self.shape[0]
        inn = self.numel // max(out, 1)
        if out > MAX_GEMM_DIM or inn > MAX_GEMM_DIM or out == 0 or inn == 0:
            return None
        return out, inn


class Module:
    def __init__(self, name, cls, tensors, children, block_list=False):
        self.name = name
        self.cls = cls
        self.tensors = tensors  # [Tensor]
        self.children = children  # [(name, Module)]
        self.block_list = block_list

    def tensors_recursive(self):
        out = list(self.tensors)
        for _, c in self.children:
            out += c.tensors_recursive()
        return out

    def contains_block_list(self):
        return any((c.block_list and c.children) or c.contains_block_list() for _, c in self.children)


def parse_module(name, d):
    tensors = [Tensor(n, t) for n, t in d.get("tensors", {}).items()]
    children = []
    for cname, c in d.get("children", {}).items():
        if "repeat" in c:
            lead = c.get("children", {})
            blocks = [(str(i), parse_module(str(i), lead[str(i)] if str(i) in lead else c["block"]))
                      for i in range(int(c["repeat"]))]
            children.append((cname, Module(cname, c.get("class", "ModuleList"), [], blocks, block_list=True)))
        else:
            m = parse_module(cname, c)
            if m.cls in ("ModuleList", "Sequential") and m.children and not m.tensors and all(
                    n == str(i) for i, (n, _) in enumerate(m.children)):
                m.block_list = True
            children.append((cname, m))
    return Module(name, d.get("class", "Module"), tensors, children)


def load_document(preset_or_path):
    """A pipeline JSON document: a file path, or a preset name exported to benches/peers/pipelines/."""
    path = preset_or_path
    if not path.endswith(".json"):
        path = os.path.join(HERE, "pipelines", preset_or_path + ".json")
    with open(path) as f:
        return json.load(f)


class DitSpec:
    """The DiT component of a pipeline document, with its byte accounting and the engine's GEMM rules."""

    def __init__(self, doc):
        comps = doc.get("components") or {}
        dits = comps.get("dit") or []
        if len(dits) != 1:
            raise ValueError(f"expected one DiT component, got {dits}")
        self.path = dits[0]
        node = doc["modules"]
        parts = self.path.split(".")
        d = node[parts[0]]
        for p in parts[1:]:
            d = d["children"][p]
        self.root = parse_module(parts[-1], d)
        ts = self.root.tensors_recursive()
        for t in ts:
            if t.tied_to is not None:
                rel = t.tied_to[len(self.path) + 1:] if t.tied_to.startswith(self.path + ".") else None
                if rel is None or not self._is_block_path(rel):
                    raise NotImplementedError(f"tie {t.name} -> {t.tied_to}: only ties to a block weight are supported")
        gemms = [t.gemm_view() for t in ts]
        counts = Counter(g[1] for g in gemms if g)
        self.width = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else 64
        own = [g for t, g in zip(ts, gemms) if g and t.tied_to is None]
        self.max_out = max([g[0] for g in own] + [self.width])
        self.max_in = max([g[1] for g in own] + [self.width])

    def _is_block_path(self, rel):
        m = self.root
        parts = rel.split(".")
        for p in parts[:-1]:
            c = dict(m.children).get(p)
            if c is None:
                return False
            if m.block_list:
                return True
            m = c
        return False

    def block_lists(self):
        """[(dotted path under the DiT, [block Module])] in execution order."""
        out = []

        def walk(m, prefix):
            for n, c in m.children:
                p = f"{prefix}.{n}" if prefix else n
                if c.block_list and c.children:
                    out.append((p, [b for _, b in c.children]))
                elif c.contains_block_list():
                    walk(c, p)

        walk(self.root, "")
        return out

    @staticmethod
    def module_bytes(m, aligned=False):
        """Bytes of the module's own storages; `aligned`: each rounded up to 256 B, as the plan packs them."""
        a = DEVICE_ALIGN
        return sum(-(-t.bytes // a) * a if aligned else t.bytes for t in m.tensors_recursive() if t.tied_to is None)

    def total_bytes(self):
        return self.module_bytes(self.root)

    def block_bytes(self, aligned=False):
        """{block-list path: [bytes of each block]}."""
        return {p: [self.module_bytes(b, aligned) for b in bs] for p, bs in self.block_lists()}

    def gemm_flops(self, tokens):
        """Flops of one DiT step as our engine computes it: weight GEMMs + attention proxy."""
        fl = 0
        for t in self.root.tensors_recursive():
            g = t.gemm_view()
            if g and t.tied_to is None:
                fl += 2 * tokens * g[0] * g[1]
        blocks = sum(len(bs) for _, bs in self.block_lists())
        return fl + blocks * 4 * tokens * tokens * self.width

    def summary(self):
        bb = self.block_bytes()
        allb = [b for v in bb.values() for b in v]
        alla = [b for v in self.block_bytes(aligned=True).values() for b in v]
        return {
            "dit_path": self.path,
            "dit_bytes": self.total_bytes(),
            "block_bytes_total": sum(allb),
            "blocks": len(allb),
            "max_block_bytes": max(allb) if allb else 0,
            "nonblock_bytes": self.total_bytes() - sum(allb),
            "block_device_bytes_total": sum(alla),
            "max_block_device_bytes": max(alla) if alla else 0,
            "block_lists": {p: {"blocks": len(v), "bytes_per_block": sorted(set(v))} for p, v in bb.items()},
            "width": self.width,
        }


# Default tokens of a preset (harness/engine/cuda.rs `default_tokens`): (DiT tokens, encoder tokens).
def default_tokens(preset):
    if preset in ("flux-dev", "qwen-image"):
        return 4096 + 512
    if preset == "wan-14b":
        return 30 * 52 * 21
    return 256


def compare_with_plan(summary, plan):
    """Rows (quantity, ours from `weightferry plan --json`, this spec, equal?) for the DiT component."""
    comp = next((c for c in plan["components"] if c.get("kind") == "dit"), None)
    if comp is None:
        return [("dit component", "missing", "", False)]
    rows = [("DiT bytes", comp["bytes"], summary["dit_bytes"])]
    stacks = comp.get("stacks") or []
    rows.append(("blocks", sum(s["blocks"] for s in stacks), summary["blocks"]))
    # The plan packs each storage at a 256-byte boundary: its stack sizes are the aligned sums.
    rows.append(("block bytes (256-aligned)", sum(s["bytes"] for s in stacks), summary["block_device_bytes_total"]))
    if stacks:
        rows.append(("max block (aligned)", max(s["max_streaming_block_bytes"] for s in stacks),
                     summary["max_block_device_bytes"]))
    return [(q, a, b, a == b) for q, a, b in rows]
