"""Fusion coverage per model: the sites the fuse rules could fuse (norms, gated MLPs, RoPE,
attention, loss), how many `fuse` fused, and why each one left was left.

    python tools/fusion_coverage.py                       # every model of picofx.models.real_models
    python tools/fusion_coverage.py hf-gemma2 meta-llama --json coverage.json

Each model (tiny, fp32) is captured; picofx.passes.fuse.sites finds its sites by kind;
Fuse(explain=True) runs; the sites are found again. Per kind and model:
  found        sites before `fuse`
  fused        fusible sites that `fuse` replaced (found, less those left)
  unfused      fusible sites left: no rule matched them, or a rule's check rejected them
  not fusible  sites the fused ops do not compute (soft-capped attention, label smoothing, class
               or per-token loss weights): left alone, with the reason
coverage = fused / (found - not fusible), over the fusible sites; the table also gives
fused / found. Below the table, each site left and the reason the fuse pass gives for it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

import transformers

from picofx.models import real_models
from picofx.passes.fuse.fuse import Fuse
from picofx.passes.fuse.sites import KINDS, accounting, census
from picofx.testing import captured, run_pass

TARGET = 0.95  # issue 25: fused share of the fusible sites across the real models


def coverage(name: str) -> dict:
    gm, ctx = captured(real_models.build(name))
    before = census(gm.graph)
    record = run_pass(Fuse(explain=True), gm, ctx, verify=None)
    kinds = accounting(before, census(gm.graph))
    return {"model": name, "kinds": kinds, **totals(kinds.values()), "left": record.notes.get("unfused_sites", [])}


def totals(counts) -> dict:
    counts = list(counts)
    found, fused, fusible = (sum(c["found"] for c in counts), sum(c["fused"] for c in counts),
                             sum(c["found"] - c["not_fusible"] for c in counts))
    return {"found": found, "fusible": fusible, "fused": fused,
            "not_fusible": found - fusible, "coverage": fused / fusible if fusible else 1.0}


def zoo_totals(rows: list[dict]) -> dict:
    by_kind = {kind: totals(row["kinds"][kind] for row in rows) for kind in KINDS}
    return {**totals(rows), "kinds": by_kind}


def reasons(row: dict) -> Counter:
    """The model's left sites grouped by kind and reason (layer names and node numbers dropped)."""
    grouped = Counter()
    for line in row["left"]:
        where, why = line.split(": ", 1)
        grouped[(where.split(" at ")[0], re.sub(r"\b(layers\.)\d+", r"\1N", why))] += 1
    return grouped


def table(rows: list[dict]) -> str:
    head = f"{'model':22}" + "".join(f"{kind:>11}" for kind in KINDS) + f"{'fused/fusible':>15}{'fused/found':>13}"
    lines = [head]
    for row in [*rows, {"model": "all", **zoo_totals(rows)}]:
        cells = "".join(f"{k['fused']:>6}/{k['found'] - k['not_fusible']:<2}" + (f"+{k['not_fusible']}" if
                        k["not_fusible"] else "  ") for k in row["kinds"].values())
        lines.append(f"{row['model']:22}{cells}{row['fused']:>8}/{row['fusible']:<4}{row['coverage']:>5.0%}"
                     f"{row['fused']:>6}/{row['found']}")
    lines.append("fused/fusible sites per kind; +N: N sites left alone (the fused ops do not compute them)")
    left = [f"  {row['model']}: {n} x {kind}: {why}" for row in rows for (kind, why), n in reasons(row).items()]
    return "\n".join(lines + (["sites left, and why:", *left] if left else ["every fusible site fused"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=list(real_models.MODELS), help="model names (default: all)")
    p.add_argument("--json", help="write the figures (per model, per kind, the totals) to this file")
    args = p.parse_args(argv)
    transformers.logging.set_verbosity_error()  # config notes from building the tiny models
    rows = [coverage(name) for name in args.models]
    print(table(rows))
    total = zoo_totals(rows)
    print(f"coverage {total['coverage']:.1%} of {total['fusible']} fusible sites over {len(rows)} models "
          f"(target {TARGET:.0%}); {total['not_fusible']} left alone for a reason")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models": rows, "totals": total, "target": TARGET}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
