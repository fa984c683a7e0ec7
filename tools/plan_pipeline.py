"""Plan: Llama-2-7B pipelined over 4 and 8 H100s, as picofx's cost model predicts it (no GPU needed).

    python tools/plan_pipeline.py [--seq 4096] [--microbatches 16] [--json bench_out/plan_pipeline.json]

The model is captured on the meta device in bf16 (one micro-batch of 1 x --seq tokens, loss
included) and cut by pass `pipeline`'s own analysis: uniform layers (an equal share of decoder
layers per stage, the embedding with the first, norm, projection and loss with the last) against
cost-balanced cuts (`picofx.cost.balance.balanced_cuts`, memory within 80 GB), for GPipe, 1F1B
and interleaved 1F1B (2 stages per GPU). Per row: predicted step time, bubble, the slowest
stage's time per micro-batch and each GPU's predicted peak memory (parameters, gradients and
AdamW state at 16 bytes per parameter; activations of the micro-batches the schedule keeps in
flight, every value the forward computes counted as saved: an upper bound without checkpointing).
"""
from __future__ import annotations

import argparse
import time

import torch

from picofx.capture.export import capture
from picofx.cost.balance import balanced_cuts, plan_for
from picofx.cost.device import H100
from picofx.cost.model import CostModel
from picofx.examples.llama import CONFIGS, Llama, causal_lm_loss
from picofx.cost.chain import chain_units, layer_bounds, state_per_parameter_byte
from picofx.passes.pipeline import keep_loss_only
from results import write_json  # tools/results.py

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--gpus", type=int, nargs="+", default=[4, 8])
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def rank_memory(plan) -> list[int]:
    ranks = len(plan.stages) // plan.virtual
    return [sum(s.memory for s in plan.stages if s.rank == r) for r in range(ranks)]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    start = time.perf_counter()
    with torch.device("meta"):
        model = Llama(CONFIGS["llama2-7b"]).to(torch.bfloat16)
        ids = torch.zeros(1, args.seq, dtype=torch.long)
    gm = capture(model, {"input_ids": ids, "labels": ids}, causal_lm_loss)
    keep_loss_only(gm)
    units, _, _ = chain_units(gm, CostModel(H100), "layers")
    print(f"captured Llama-2-7B (1 x {args.seq} tokens per micro-batch) in {time.perf_counter() - start:.0f} s: "
          f"{len(units)} places to cut; H100 SXM {H100.memory_capacity / 1e9:.0f} GB, NVLink 4")
    common = dict(microbatches=args.microbatches, link=H100.intra_node_link,
                  state_per_parameter_byte=state_per_parameter_byte(model))
    rows = []
    header = f"{'GPUs':>4s}  {'schedule':16s} {'cuts':15s} {'step s':>7s} {'bubble':>7s} {'slowest ms':>10s}  peak GB per GPU"
    print(header + "\n" + "-" * len(header))
    for gpus in args.gpus:
        for schedule, virtual in SCHEDULES:
            stages = gpus * virtual
            plans = {"uniform layers": plan_for(units, layer_bounds(units, stages), schedule=schedule,
                                                virtual=virtual, capacity=H100.memory_capacity, **common)}
            try:
                plans["cost-balanced"] = balanced_cuts(units, stages, schedule=schedule, virtual=virtual,
                                                       capacity=H100.memory_capacity, **common)
            except MemoryError:
                plans["cost-balanced (no fit)"] = balanced_cuts(units, stages, schedule=schedule, virtual=virtual,
                                                                **common)
            for split, plan in plans.items():
                memory = rank_memory(plan)
                fits = max(memory) <= H100.memory_capacity
                row = {"gpus": gpus, "schedule": schedule, "virtual": virtual, "cuts": split,
                       "step_s": plan.step_time, "bubble": plan.bubble,
                       "slowest_stage_ms": max(s.time for s in plan.stages) * 1e3,
                       "peak_gb_per_gpu": [m / 1e9 for m in memory], "fits": fits,
                       "stage_starts": [units[s.units.start].label for s in plan.stages]}
                rows.append(row)
                print(f"{gpus:4d}  {schedule:16s} {split[:15]:15s} {plan.step_time:7.3f} {plan.bubble:7.1%} "
                      f"{row['slowest_stage_ms']:10.1f}  " + " ".join(f"{m:.0f}" for m in row["peak_gb_per_gpu"])
                      + ("" if fits else "  (over 80 GB)"))
    write_json({"seq": args.seq, "microbatches": args.microbatches, "rows": rows}, args.json, "plan_pipeline.json")
    return rows


if __name__ == "__main__":
    main()
