#!/usr/bin/env python3
"""Tests of the peer benchmark's pure parts (always) and of the PyTorch model on the CPU (when torch is installed).

    python3 benches/peers/test_peers.py
"""
import importlib.util
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_spec as ps
import table

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def spec(p):
    return ps.DitSpec(ps.load_document(p))


class SpecTests(unittest.TestCase):
    def test_real_presets_bytes(self):
        # The DiT sizes of src/pipeline/presets.rs (also checked against the binary by check_shapes.py).
        self.assertEqual(spec("flux-dev").total_bytes(), 23_803_865_216)
        self.assertEqual(spec("wan-14b").total_bytes(), 28_579_723_392)
        self.assertEqual(spec("qwen-image").total_bytes(), 40_861_850_752)

    def test_block_structure(self):
        s = spec("flux-dev").summary()
        self.assertEqual(s["blocks"], 57)
        self.assertEqual(s["block_lists"]["transformer_blocks"], {"blocks": 19, "bytes_per_block": [679_662_592]})
        self.assertEqual(s["block_lists"]["single_transformer_blocks"]["blocks"], 38)
        self.assertEqual(spec("wan-14b").summary()["block_lists"]["blocks"]["blocks"], 40)
        self.assertEqual(spec("qwen-image").summary()["blocks"], 60)

    def test_widths(self):
        self.assertEqual(spec("flux-dev").width, 3072)
        self.assertEqual(spec("wan-14b").width, 5120)
        self.assertEqual(spec("qwen-image").width, 3072)

    def test_tie_is_not_counted_twice(self):
        s = spec("flux-dev")
        tied = [t for t in s.root.tensors_recursive() if t.tied_to]
        self.assertEqual(len(tied), 1)
        self.assertEqual(s.total_bytes(), sum(t.bytes for t in s.root.tensors_recursive() if not t.tied_to))

    def test_flops(self):
        s = spec("wan-14b")
        t = ps.default_tokens("wan-14b")
        self.assertEqual(t, 32760)
        attn = 40 * 4 * t * t * 5120
        self.assertGreater(s.gemm_flops(t), attn)

    def test_compare_with_plan(self):
        s = spec("flux-tiny").summary()
        plan = {"components": [{"kind": "dit", "bytes": s["dit_bytes"], "stacks": [
            {"blocks": s["blocks"], "bytes": s["block_device_bytes_total"],
             "max_streaming_block_bytes": s["max_block_device_bytes"]}]}]}
        self.assertTrue(all(r[3] for r in ps.compare_with_plan(s, plan)))
        plan["components"][0]["bytes"] += 1
        self.assertFalse(all(r[3] for r in ps.compare_with_plan(s, plan)))


class TableTests(unittest.TestCase):
    def test_render(self):
        dit = spec("flux-dev").total_bytes()
        other = 9_679_948_742
        ours = {"device": "X", "rows": [
            {"preset": "flux-dev", "config": "depth=1", "step_s": 0.5, "bound_s": 0.48, "ratio": 0.5 / 0.48,
             "streamed_bytes_per_step": 23_674_566_656, "peak_weight_bytes": other + 2_000_000_000,
             "outputs_match": True}],
            "h2d_bytes_per_s": [["flux-dev", 5e10]], "compute_s": [["flux-dev", 0.2]],
            "host_memory": [["flux-dev", dit + other, 23_674_566_656, dit + other + 1_000_000_000]],
            "tokens": [["flux-dev", 4608, 512]]}
        peers = {"torch": "t", "diffusers": "0.42.1", "accelerate": "1.15.0", "presets": [
            {"preset": "flux-dev", "tokens": 4608, "spec": spec("flux-dev").summary(), "compute_s": 0.2,
             "rows": [{"variant": "group_stream", "step_s": 0.6, "bound_s": 0.47, "ratio": 0.6 / 0.47,
                       "streamed_bytes": dit, "peak_device_weight_bytes": 1.5e9, "peak_host_rss": 2 * dit,
                       "h2d_bytes_per_s": 5.1e10, "output_matches_resident": True},
                      {"variant": "sequential", "error": "skipped: 3 s left before the deadline"}]}]}
        text = table.render([ours], [peers])
        rows = [ln for ln in text.splitlines() if ln.startswith("| flux-dev")]
        self.assertEqual(len(rows), 3)
        cells = [c.strip() for c in rows[0].split("|")]
        self.assertEqual(cells[2], "weightferry")
        self.assertEqual(cells[8], "2.00")  # DiT weights on device: the other components subtracted
        self.assertEqual(cells[10], "1.04 (masters 0.995)")  # (RSS - other components) / DiT
        cells = [c.strip() for c in rows[1].split("|")]
        self.assertEqual((cells[2], cells[6], cells[10]), ("diffusers", "1.277", "2.00 (after passes n/a)"))
        self.assertIn("not run: skipped", rows[2])


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class ModelTests(unittest.TestCase):
    def test_tiny_model_matches_spec(self):
        import peer_bench
        import torch
        for p in ["flux-tiny", "wan-tiny", "qwen-tiny"]:
            s = spec(p)
            cpu = torch.device("cpu")
            model, ws = peer_bench.build_model(s, 16, cpu, cpu, 0, "proxy")
            self.assertEqual(peer_bench.tensor_bytes(model, "off"), s.total_bytes(), p)
            with torch.no_grad():
                model(ws.x)
            n_gemm = sum(1 for t in s.root.tensors_recursive() if t.gemm_view() and not t.tied_to)
            self.assertEqual(ws.gemms, n_gemm, p)
            self.assertEqual(ws.attns, s.summary()["blocks"], p)
            self.assertTrue(torch.isfinite(ws.x.float()).all(), p)
            # Block lists are ModuleLists of the right length (what group offloading groups).
            for path, blocks in s.block_lists():
                m = model
                for part in path.split("."):
                    m = getattr(m, part)
                self.assertIsInstance(m, torch.nn.ModuleList)
                self.assertEqual(len(m), len(blocks))

    def test_cpu_run_end_to_end(self):
        import subprocess
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "p.json")
            here = os.path.dirname(os.path.abspath(__file__))
            r = subprocess.run([sys.executable, os.path.join(here, "peer_bench.py"), "--device", "cpu", "--preset",
                                "qwen-tiny", "--tokens", "32", "--steps", "1", "--warmup", "1",
                                "--variants", "resident,group_nostream", "--json", out],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            with open(out) as f:
                rep = json.load(f)
            rows = rep["presets"][0]["rows"]
            self.assertEqual([x["variant"] for x in rows], ["resident", "group_nostream"])
            self.assertTrue(rows[1]["output_matches_resident"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
