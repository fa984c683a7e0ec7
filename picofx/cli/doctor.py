"""`picofx doctor PATH`: what a finished or stopped run's own numbers say to change, read afterwards
from its --metrics file or its --save directory (which holds metrics.jsonl): the loss trend
(divergence, spikes, plateau), the data wait, the memory headroom on a GPU, a rank slower than the
others and why. Exit status 0 with or without findings; 2 when PATH holds no run's records."""
from __future__ import annotations

import argparse
import json
import sys

from picofx.diagnose import diagnose, read_run, what_to_change
from picofx.diagnose.breakdown import COMPONENTS, StepBreakdown, mean_breakdown
from picofx.diagnose.profiler import where_the_time_went
from picofx.diagnose.finding import finite, median, seconds
from picofx.diagnose.stragglers import per_rank_medians

CHECKED = "divergence, loss spikes, warm-up, plateau, data wait, memory headroom, slow ranks, exposed communication"


def add_doctor_parser(commands) -> None:
    p = commands.add_parser("doctor", help="read a run afterwards and say what to change (picofx doctor --help)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="PATH", help="a run's --metrics file (JSON lines) or its --save directory")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON list instead")


def overview(records: list[dict]) -> list[str]:
    """What was read: the steps, the loss from first to last, the step and its data wait; per rank."""
    first, last = records[0], records[-1]
    ranks = len(last["ranks"]) if isinstance(last.get("ranks"), list) else 1
    lines = [f"  {len(records)} steps ({first['step']}-{last['step']}) on {last.get('device', 'an unnamed device')}"
             f"{f', {ranks} ranks' if ranks > 1 else ''}"]
    loss = [f"{r['loss']:.4g}" if finite(r.get("loss")) else "not finite" for r in (first, last)]
    lines.append(f"  loss {loss[0]} -> {loss[1]}, first step to last")
    steps = [r["step_s"] for r in records[2:] or records if finite(r.get("step_s"))]
    if steps:
        waited = sum(r.get("data_s") or 0.0 for r in records[2:] or records) / sum(steps)
        lines.append(f"  median step {seconds(median(steps))}, waiting for data {100 * waited:.2f}% of it")
    lines += traced_lines(records)
    for rank, figures in enumerate(per_rank_medians(records)):
        lines.append(f"  rank {rank}: median step {seconds(figures['step_s'])}, data wait {seconds(figures['data_s'])}, "
                     f"CPU time {seconds(figures['cpu_s']) if finite(figures['cpu_s']) else 'unknown'}")
    return lines


def traced_lines(records: list[dict]) -> list[str]:
    """Where the time of the steps `picofx train --profile` traced went, per rank (their `breakdown`)."""
    traced = [r["breakdown"] for r in records if isinstance(r.get("breakdown"), list)]
    if not traced:
        return []
    lines = [f"  where the time went ({len(traced)} traced steps):"]
    for rank in range(len(traced[0])):
        steps = [StepBreakdown(i, row[rank]["seconds"], {k: row[rank][k] for k in COMPONENTS},
                               row[rank]["hidden_comm"], row[rank]["comm_in_flight"])
                 for i, row in enumerate(traced) if rank < len(row) and row[rank]]
        lines.append(f"    rank {rank}: {where_the_time_went(mean_breakdown(steps))}")
    return lines


def run_doctor(args) -> int:
    try:
        records = read_run(args.path)
    except (OSError, ValueError) as e:
        print(f"picofx doctor: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"picofx doctor: {args.path}: no steps recorded yet", file=sys.stderr)
        return 2
    findings = diagnose(records)
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=1))
        return 0
    print(f"picofx doctor: {args.path}")
    print("\n".join(overview(records)))
    print("\n".join(what_to_change(findings)) if findings else f"no findings: nothing to change (checked {CHECKED})")
    return 0
