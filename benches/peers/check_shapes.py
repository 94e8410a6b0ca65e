#!/usr/bin/env python3
"""Checks benches/peers/pipelines/*.json against the binary: for each preset, the DiT byte totals that
pipeline_spec.py derives from the exported file must equal what `weightferry plan --preset P --json` reports, and
`weightferry plan --pipeline <file> --json` must report the same as the preset itself (the export round-trips).

    python3 benches/peers/check_shapes.py [--weightferry target/release/weightferry] [PRESET ...]

No torch needed. Exit status 1 on any mismatch.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_spec as ps


def find_binary(explicit=None):
    for b in [explicit, ".devbin/weightferry", "target/release/weightferry", "target/debug/weightferry"]:
        if b and os.path.exists(b):
            return b
    return None


def plan_json(binary, *args):
    out = subprocess.run([binary, "plan", *args, "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def check(binary, preset, out=sys.stdout):
    """Prints the comparison for one preset; returns True when everything matches."""
    doc = ps.load_document(preset)
    s = ps.DitSpec(doc).summary()
    ok = True
    ours = plan_json(binary, "--preset", preset)
    rt = plan_json(binary, "--pipeline", os.path.join(ps.HERE, "pipelines", preset + ".json"))
    ours_dit = [c for c in ours["components"] if c["kind"] == "dit"]
    rt_dit = [c for c in rt["components"] if c["kind"] == "dit"]
    same = ours_dit == rt_dit and ours["total_weight_bytes"] == rt["total_weight_bytes"]
    ok &= same
    print(f"{preset}: width {s['width']}, block lists "
          + ", ".join(f"{p}: {v['blocks']} x {v['bytes_per_block']} B" for p, v in s["block_lists"].items()), file=out)
    print(f"  plan --pipeline {preset}.json == plan --preset {preset}: {'yes' if same else 'NO'}", file=out)
    for q, a, b, eq in ps.compare_with_plan(s, ours):
        ok &= eq
        print(f"  {q:26s} weightferry plan {a:>14}  peer spec {b:>14}  {'ok' if eq else 'MISMATCH'}", file=out)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weightferry", help="binary (default: .devbin/weightferry or target/release/weightferry)")
    ap.add_argument("presets", nargs="*",
                    default=["flux-dev", "wan-14b", "qwen-image", "flux-tiny", "wan-tiny", "qwen-tiny"])
    a = ap.parse_args()
    binary = find_binary(a.weightferry)
    if binary is None:
        sys.exit("no weightferry binary: build it (cargo build --release) or pass --weightferry")
    ok = all([check(binary, p) for p in a.presets])  # noqa: C419 (every preset is checked, even after a mismatch)
    print("all match" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
