"""Benchmark: compile time of picofx on the Llama-2-7B shape, by stage and by pass, at 8, 16 and 32 layers.

    python tools/bench_compile.py [--layers 8 16 32] [--batch 2 --seq 4096] [--inductor]
                                  [--json results.json]

The model is Llama-2-7B's shape (hidden 4096, 32 heads, MLP 11008, vocab 32000) with the number
of decoder layers varied, built under `picofx.plan.fake_mode()`: no memory, no weights, the same
graphs as the real model. Each contender runs in a fresh process (a user's first run: nothing
traced yet, the on-disk cache off) with backend="eager", which runs every stage but generates
no code:
    none              no pass: capture + AOT (the joint graph, the partition) alone
    fuse              ["fuse"]
    checkpoint        [Checkpoint(budget=0.7)]: 70% of the predicted peak, so it must recompute
    fuse+precision    ["fuse", "precision"]
Columns, all from the report: capture; AOT (the compile less the joint and partitioned passes'
own time); each pass's own seconds (the pass manager's record); "manager" (the rest of the wall
time of `optimize`: the graph snapshot before each pass, re-annotation and verification after);
"added" = the contender's wall time less that of `none` at the same depth, over none's
capture + AOT: the figure issue 25 sets at <= 0.15 for fuse and checkpoint.
--inductor also times backend="inductor" for 8 layers (code generation for fake tensors; minutes
on 2 cores), once without passes and once with fuse.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from results import write_json  # tools/results.py

CONTENDERS = ("none", "fuse", "checkpoint", "fuse+precision")
TARGET = 0.15  # added time of fuse, and of checkpoint, over capture + AOT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--inductor", action="store_true", help="also time Inductor's code generation at 8 layers")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    p.add_argument("--one", nargs=3, metavar=("LAYERS", "CONTENDER", "BACKEND"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def passes_of(contender: str) -> list:
    from picofx.passes import Checkpoint

    return {"none": [], "fuse": ["fuse"], "checkpoint": [Checkpoint(budget=0.7)],
            "fuse+precision": ["fuse", "precision"]}[contender]


def run_one(layers: int, contender: str, backend: str, batch: int, seq: int) -> dict:
    """One optimize of the fake 7B shape in this process; the report's figures."""
    import torch

    import picofx
    from picofx.examples.llama import CONFIGS, Llama, causal_lm_loss
    from picofx.plan import fake_mode

    config = dataclasses.replace(CONFIGS["llama2-7b"], num_hidden_layers=layers,
                                 max_position_embeddings=max(seq, CONFIGS["llama2-7b"].max_position_embeddings))
    with fake_mode():
        model = Llama(config)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    start = time.perf_counter()
    opt = picofx.optimize(model, {"input_ids": ids, "labels": ids}, passes_of(contender), backend=backend,
                          loss_fn=causal_lm_loss)
    wall = time.perf_counter() - start
    report = opt.report
    passes = {}
    for r in report.records:
        passes[r.name] = passes.get(r.name, 0.0) + r.seconds
    in_compile = sum(r.seconds for r in report.records if r.stage.value != "forward")
    return {"layers": layers, "contender": contender, "backend": backend, "wall": wall,
            "capture": report.capture_seconds, "compile": report.compile_seconds,
            "aot": report.compile_seconds - in_compile, "passes": passes,
            "manager": wall - report.capture_seconds - report.compile_seconds
            - sum(r.seconds for r in report.records if r.stage.value == "forward"),
            "nodes": report.records[0].nodes_before if report.records else None}


def in_fresh_process(layers: int, contender: str, backend: str, args) -> dict:
    command = [sys.executable, __file__, "--one", str(layers), contender, backend,
               "--batch", str(args.batch), "--seq", str(args.seq)]
    env = {**os.environ, "PICOFX_CACHE": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{layers} layers, {contender}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    base = {r["layers"]: r for r in rows if r["contender"] == "none" and r["backend"] == "eager"}
    header = ["layers", "contender", "backend", "capture s", "AOT s", "passes (s)", "manager s", "wall s",
              "added / (capture+AOT)"]
    lines = [header]
    for r in rows:
        ref = base.get(r["layers"])
        added = "-"
        if ref and r is not ref and r["backend"] == "eager":
            added = f"{(r['wall'] - ref['wall']) / (ref['capture'] + ref['aot']):.2f}x"
        lines.append([str(r["layers"]), r["contender"], r["backend"], f"{r['capture']:.1f}", f"{r['aot']:.1f}",
                      " ".join(f"{k}={v:.2f}" for k, v in r["passes"].items()) or "-", f"{r['manager']:.2f}",
                      f"{r['wall']:.1f}", added])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "-" * len(text[0]))
    for name in ("fuse", "checkpoint"):
        for layers, ref in base.items():
            mine = next((r for r in rows if r["layers"] == layers and r["contender"] == name
                         and r["backend"] == "eager"), None)
            if mine:
                share = mine["passes"].get(name, 0.0) / (ref["capture"] + ref["aot"])
                text.append(f"{name} at {layers} layers: the pass alone {share:.2f}x of capture + AOT "
                            f"(target <= {TARGET}x)")
    return "\n".join(text)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.one:
        layers, contender, backend = args.one
        print(json.dumps(run_one(int(layers), contender, backend, args.batch, args.seq)))
        return []
    rows = []
    for layers in args.layers:
        for contender in args.contenders.split(","):
            rows.append(in_fresh_process(layers, contender, "eager", args))
            print(f"  {layers} layers, {contender}: {rows[-1]['wall']:.1f} s", file=sys.stderr)
    if args.inductor:
        for contender in ("none", "fuse"):
            rows.append(in_fresh_process(8, contender, "inductor", args))
    print(f"Llama-2-7B shape, fake tensors, batch {args.batch} x seq {args.seq}; each row a fresh process, "
          "on-disk cache off" + ("" if args.inductor else "; Inductor not timed (--inductor: 8 layers)"))
    print(table(rows))
    write_json({"batch": args.batch, "seq": args.seq, "rows": rows}, args.json, "bench_compile.json")
    return rows


if __name__ == "__main__":
    main()
