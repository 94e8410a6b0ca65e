#!/usr/bin/env python3
"""Merges `weightferry bench --json` reports and `peer_bench.py --json` reports into one markdown table.

    python3 benches/peers/table.py --ours ours-flux-dev.json --ours ours-wan-14b.json --peers peers-flux-dev.json ...

Per preset: one header line (tokens, DiT bytes of both models, pinned H2D bandwidth and compute time each system
measured), then one row per configuration of each system. Columns:
- step s: one DiT step / pass; bound s: max(that system's compute time, streamed bytes per step / the H2D bandwidth
  measured in the same run); ratio: step / bound (1.000 = at the physical bound).
- GB/step: bytes streamed host -> device per step.
- peak dev GB: DiT weights on the device at the peak. Ours: the bench's peak weight memory minus the bytes of the
  pipeline's other components (text encoder, VAE), which our bench keeps resident on the device; peers: the peak of
  torch.cuda.max_memory_allocated minus the activations and workspace allocated before any weight.
- peak host GB: peak RSS (VmHWM) of the process. Ours: one `weightferry bench` process per preset (its host model
  holds every component of the pipeline); peers: one process per variant (torch + CUDA context included; `base`
  in the JSON is its RSS before the model was built).
- host / offloaded: peak host memory over the offloaded DiT weights. Ours: (peak RSS - bytes of the non-DiT
  components, which its host model holds but the peer model does not have) / DiT bytes, then in brackets its pinned
  host masters / DiT bytes (the steady state while streaming); peers: peak RSS / DiT bytes, then in brackets the
  RSS after the timed passes / DiT bytes.
- check: ours: output bit-exact vs resident; peers: output checksum equal to the resident variant's.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_spec as ps

GB = 1e9


def load(paths):
    out = []
    for p in paths or []:
        try:
            with open(p) as f:
                out.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"(skipped {p}: {e})", file=sys.stderr)
    return out


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def dit_bytes_of(preset, peers_preset):
    if peers_preset is not None:
        return peers_preset["spec"]["dit_bytes"]
    try:
        return ps.DitSpec(ps.load_document(preset)).total_bytes()
    except (OSError, ValueError, KeyError, NotImplementedError):
        return None


def render(ours_reports, peer_reports):
    ours_by = {}
    for rep in ours_reports:
        for r in rep.get("rows", []):
            ours_by.setdefault(r["preset"], {"rep": rep, "rows": []})["rows"].append(r)
    peers_by = {}
    for rep in peer_reports:
        for p in rep.get("presets", []):
            peers_by[p["preset"]] = dict(p, _rep=rep)
    presets = list(dict.fromkeys(list(ours_by) + list(peers_by)))
    lines = []
    dev = next((r.get("device") for r in ours_reports if r.get("device")), None) or next(
        (r.get("device") for r in peer_reports if r.get("device")), "?")
    pr = peer_reports[0] if peer_reports else {}
    lines.append(f"device: {dev}; peers: torch {pr.get('torch')}, diffusers {pr.get('diffusers')}, "
                 f"accelerate {pr.get('accelerate')}")
    lines.append("")
    lines.append("| preset | system | config | step s | bound s | ratio | GB/step | peak dev GB | peak host GB "
                 "| host / offloaded | check |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    notes = []
    for preset in presets:
        o = ours_by.get(preset)
        p = peers_by.get(preset)
        dit = dit_bytes_of(preset, p)
        head = [f"**{preset}**"]
        if o:
            rep = o["rep"]
            tok = next((t[1] for t in rep.get("tokens", []) if t[0] == preset), None)
            bw = next((b for q, b in rep.get("h2d_bytes_per_s", []) if q == preset), None)
            comp = next((c for q, c in rep.get("compute_s", []) if q == preset), None)
            head.append(
                f"ours: {tok} tokens, H2D {fmt(bw / GB if bw else None, '.1f')} GB/s, compute {fmt(comp, '.4f')} s"
            )
        if p:
            bws = sorted(r["h2d_bytes_per_s"] for r in p["rows"] if r.get("h2d_bytes_per_s"))
            head.append(f"peers: {p['tokens']} tokens, H2D {fmt(bws[len(bws) // 2] / GB if bws else None, '.1f')} GB/s "
                        f"(median of variants), compute {fmt(p.get('compute_s'), '.4f')} s")
            checks = p.get("plan_check")
            if checks:
                ok = all(c["equal"] for c in checks)
                lists = " + ".join(f"{v['blocks']} x {'/'.join(f'{b:,}' for b in v['bytes_per_block'])} B"
                                   for v in p["spec"]["block_lists"].values())
                head.append(f"DiT {dit:,} B ({lists} in blocks): peer model bytes "
                            f"{'equal' if ok else 'DIFFER FROM'} weightferry plan")
        elif dit:
            head.append(f"DiT {dit / GB:.3f} GB")
        notes.append("; ".join(head))
        if o:
            rep = o["rep"]
            hm = next((h for h in rep.get("host_memory", []) if h[0] == preset), None)
            weights, masters, rss = (hm[1], hm[2], hm[3]) if hm else (None, None, None)
            other = weights - dit if (weights is not None and dit) else None
            host_ratio = (rss - other) / dit if (rss and other is not None and dit) else None
            if hm:
                offl = f", RSS while offloaded {hm[4] / GB:.2f} GB" if len(hm) > 4 and hm[4] else ""
                en = next((e for e in rep.get("enable", []) if e[0] == preset), None)
                ens = f", enable {en[1]:.1f} s with peak RSS {en[2] / GB:.2f} GB" if en else ""
                notes.append(f"  ours {preset}: host model {weights / GB:.2f} GB (all components), pinned masters "
                             f"{masters / GB:.2f} GB, peak RSS {rss / GB:.2f} GB{offl}{ens}")
            for r in o["rows"]:
                dev_dit = r["peak_weight_bytes"] - other if other is not None else None
                lines.append(
                    f"| {preset} | weightferry | {r['config']} | {r['step_s']:.4f} | {r['bound_s']:.4f} "
                    f"| {r['ratio']:.3f} | {r['streamed_bytes_per_step'] / GB:.2f} "
                    f"| {fmt(dev_dit / GB if dev_dit is not None else None, '.2f')} "
                    f"| {fmt(rss / GB if rss else None, '.2f')} "
                    f"| {fmt(host_ratio, '.2f')} (masters {fmt(masters / dit if hm and dit else None, '.3f')}) "
                    f"| {'bit-exact' if r['outputs_match'] else 'NOT bit-exact'} |")
        if p:
            for r in p["rows"]:
                name = r["variant"]
                if "step_s" not in r:
                    lines.append(f"| {preset} | diffusers | {name} | not run: {r.get('error')} | | | | | | | |")
                    continue
                if r.get("extrapolated"):
                    name += f" (extrapolated from {r['extrapolated_from_blocks']} blocks per list)"
                system = {"resident": "pytorch", "sequential": "accelerate"}.get(r["variant"], "diffusers")
                chk = r.get("output_matches_resident")
                after = r.get("rss_after_passes")
                lines.append(
                    f"| {preset} | {system} | {name} | {r['step_s']:.4f} | {fmt(r.get('bound_s'), '.4f')} "
                    f"| {fmt(r.get('ratio'), '.3f')} | {r['streamed_bytes'] / GB:.2f} "
                    f"| {r['peak_device_weight_bytes'] / GB:.2f} | {r['peak_host_rss'] / GB:.2f} "
                    f"| {r['peak_host_rss'] / dit:.2f} (after passes {fmt(after / dit if after else None, '.2f')}) "
                    f"| {'n/a' if chk is None else ('= resident' if chk else 'differs')} |")
    return "\n".join([*lines, "", *notes]) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", action="append", help="weightferry bench --json output (repeatable)")
    ap.add_argument("--peers", action="append", help="peer_bench.py --json output (repeatable)")
    ap.add_argument("--out", help="also write the table here")
    a = ap.parse_args()
    text = render(load(a.ours), load(a.peers))
    sys.stdout.write(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
