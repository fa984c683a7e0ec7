"""Benchmark: how long picofx train's steps wait for their batches, DataLoader workers preparing
them ahead against each batch prepared in the step.

    python tools/bench_data_wait.py [--steps 30] [--rounds 3] [--size tiny] [--batch 8] [--seq 128]
                                    [--backend eager] [--model DIR --data FILE] [--json PATH]

Contenders, each a whole `picofx train` run of --steps steps (the reference LLaMA at --size on
the byte tokenizer, or --model on its tokenizer's token file), taken in turn for --rounds rounds
so they share the machine's load alike:
  in the step   --data-workers 0: the step draws, reads and stacks its windows itself
  1 worker      --data-workers 1: a DataLoader worker prepares batches ahead of the step
  2 workers     --data-workers 2
For each: the median over rounds of the run's step time and of the time a step waited for its
batch (the summary's data line), and that wait as a share of the step. Target: at most 1% of the
step on the reference model. The first step's batch (drawn for the capture) is not waited for.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics

from picofx.cli import train
from results import write_json  # tools/results.py

CONTENDERS = {"in the step": 0, "1 worker": 1, "2 workers": 2}


def run(workers: int, args) -> dict:
    options = ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--backend",
               args.backend, "--log-every", str(args.steps), "--data-workers", str(workers)]
    options += ["--model", args.model] if args.model else ["--size", args.size]
    options += ["--data", args.data] if args.data else []
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.main(options)
    steps = args.steps - 1  # the loader's batches: the first step trains on the capture's
    return {"step_s": result["run_s"] / args.steps, "wait_s": result["data_wait_s"] / steps}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--backend", default="eager")
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--json")
    args = p.parse_args(argv)
    runs = {name: [] for name in CONTENDERS}
    for _ in range(args.rounds):
        for name, workers in CONTENDERS.items():
            runs[name].append(run(workers, args))
    rows = []
    for name, measured in runs.items():
        step, wait = (statistics.median(m[k] for m in measured) for k in ("step_s", "wait_s"))
        rows.append({"contender": name, "step_ms": 1e3 * step, "wait_ms": 1e3 * wait, "wait_share": wait / step})
    base = rows[0]["wait_ms"]
    print(f"{args.model or args.size}, {args.steps} steps of {args.batch} x {args.seq}, backend {args.backend}, "
          f"medians of {args.rounds} rounds")
    print(f"{'contender':<12} {'step ms':>9} {'waited ms':>10} {'% of step':>10} {'wait vs in the step':>20}")
    for r in rows:
        ratio = r["wait_ms"] / base if base else float("nan")
        print(f"{r['contender']:<12} {r['step_ms']:9.1f} {r['wait_ms']:10.3f} {100 * r['wait_share']:9.3f}% "
              f"{ratio:19.2f}x")
    result = {"config": vars(args), "rows": rows}
    print(f"wrote {write_json(result, args.json, 'bench_data_wait')}")
    return result


if __name__ == "__main__":
    main()
