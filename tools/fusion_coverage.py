"""Fusion coverage per model: the sites each fuse rule could fuse (norms, gated MLPs, RoPE,
attention, loss), and how many `fuse` fused.

    python tools/fusion_coverage.py                       # every model of picofx.examples.real_models
    python tools/fusion_coverage.py hf-gemma2 meta-llama --sites --json coverage.json

Each model (tiny, fp32) is captured; picofx.passes.fuse_sites counts its unfused sites by kind;
Fuse(explain=True) runs; the census is taken again. A kind's coverage is the share of its sites
that are no longer there: (before - after) / before. Sites no rule may fuse (soft-capped
attention) are counted apart, as "kept". --sites lists each site left and the reason the fuse
pass gives for it.
"""
from __future__ import annotations

import argparse
import json
import sys

from picofx.examples import real_models
from picofx.passes.fuse import Fuse
from picofx.passes.fuse_sites import KINDS, census
from picofx.testing import captured, run_pass


def coverage(name: str) -> dict:
    gm, ctx = captured(real_models.build(name))
    before = census(gm.graph)
    record = run_pass(Fuse(explain=True), gm, ctx, verify=None)
    after = census(gm.graph)
    kinds = {kind: {"sites": before[kind]["unfused"], "fused": before[kind]["unfused"] - after[kind]["unfused"],
                    "kept": after[kind]["not_fusible"]} for kind in KINDS}
    sites = sum(k["sites"] for k in kinds.values())
    fused = sum(k["fused"] for k in kinds.values())
    return {"model": name, "kinds": kinds, "sites": sites, "fused": fused,
            "coverage": fused / sites if sites else 1.0, "unfused": record.notes.get("unfused_sites", [])}


def table(rows: list[dict]) -> str:
    lines = [f"{'model':18}" + "".join(f"{kind:>12}" for kind in KINDS) + f"{'total':>10}{'coverage':>10}"]
    for row in rows:
        cells = "".join(f"{k['fused']:>5}/{k['sites']:<3}" + (f"+{k['kept']}k" if k["kept"] else "   ")
                        for k in row["kinds"].values())
        lines.append(f"{row['model']:18}{cells}{row['fused']:>5}/{row['sites']:<4}{row['coverage']:>9.0%}")
    sites, fused = sum(r["sites"] for r in rows), sum(r["fused"] for r in rows)
    lines.append(f"{'all':18}{'':{12 * len(KINDS)}}{fused:>5}/{sites:<4}{fused / max(sites, 1):>9.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=list(real_models.MODELS), help="model names (default: all)")
    p.add_argument("--sites", action="store_true", help="list every site left unfused and why")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    rows = [coverage(name) for name in args.models]
    print(table(rows))
    print("fused/sites per kind; +Nk: N sites no rule may fuse (kept as written)")
    if args.sites:
        for row in rows:
            for line in row["unfused"]:
                print(f"{row['model']}: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
