"""The `picofx plan` command: arguments, the table on the terminal, the JSON."""
from __future__ import annotations

import argparse
import json

from picofx.cli.train_args import at_least
from picofx.planner.compress import DEFAULT_KINDS
from picofx.planner.costs import PASSES
from picofx.planner.measure import calibrated_device, measure
from picofx.planner.models import MODELS, model_config
from picofx.planner.recipe import describe_passes, planned_recipe
from picofx.planner.run import check_run, measured_table, plan_run, table
from picofx.planner.show import show

GPU_KINDS = ("h100", "h200", "a100", "cpu")


def add_plan_parser(commands) -> None:
    p = commands.add_parser(
        "plan", help="rank the layouts (dp x tp x pp, sharding, micro-batches, checkpointing) for N GPUs",
        description="Predict memory per GPU and step time of every layout of MODEL's training over --gpus GPUs, "
                    "rank those that fit, and say what limits each and what to change.",
        epilog="examples:\n  picofx plan llama2-7b --gpus 8 --gpu h100 --seq 4096 --global-batch 256\n"
               "  picofx plan llama2-70b --gpus 64 --gpu h100 --seq 4096 --global-batch 512 --json plans.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help=f"a zoo name ({', '.join(MODELS)}), a Hugging Face config.json or its directory, "
                                 "or module:function")
    p.add_argument("--gpus", type=at_least(1), required=True)
    p.add_argument("--gpu", choices=GPU_KINDS, default="h100")
    p.add_argument("--gpus-per-node", type=at_least(1), default=8)
    p.add_argument("--seq", type=at_least(1), default=4096)
    p.add_argument("--global-batch", type=at_least(1), required=True, help="sequences per optimizer step, over all GPUs")
    p.add_argument("--compress", metavar="KINDS",
                   help="gradient compressors to plan for replicated data parallel, comma-separated, as "
                        "Overlap(compress=...) spells them (default: " + ",".join(DEFAULT_KINDS) + "; on --gpu cpu "
                        "none; lossy topk:F and powersgd:R only when listed; 'none': no compression)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (the JSON has every plan)")
    p.add_argument("--json", help="write {'plans': [...], 'best': index} here")
    p.add_argument("--html", metavar="FILE", help="write the plan table and charts of step and memory per plan as "
                                                  "one self-contained HTML page")
    p.add_argument("--measure", action="store_true",
                   help="also run the top plans for a few steps on this machine's ranks (--gpu cpu: gloo) and "
                        "print predicted against measured")
    p.add_argument("--measure-top", type=int, default=3, help="how many plans --measure runs (default 3)")
    p.add_argument("--show", nargs="+", choices=("stages", "buckets"), default=[],
                   help="also, from the whole model's graph: stages, the best pipelined plan's stage cuts per "
                        "schedule (uniform against cost-balanced); buckets, the best replicated plan's gradient "
                        "buckets and exposed all-reduce (after the backward, overlapped, bf16)")


def plan_command(args) -> dict:
    here = args.measure and args.gpu == "cpu"  # plans run on this machine: predict for it as its ranks share it
    config, compute = model_config(args.model), ("fuse",) if here else PASSES
    check_run(config, args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node, seq=args.seq,
              global_batch=args.global_batch)
    device = calibrated_device(config, args.gpus) if here else None
    run, predictions = plan_run(args.model, gpus=args.gpus, gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                                seq=args.seq, global_batch=args.global_batch, device=device, passes=compute,
                                compress=args.compress)
    if not predictions:
        raise ValueError(f"no layout of {args.model} runs on {args.gpus} GPUs with a global batch of "
                         f"{args.global_batch}: the batch must divide over the data-parallel ranks")
    print(f"{args.model} on {args.gpus} x {run.device.name} ({run.gpus_per_node} per node), {args.seq} tokens per "
          f"sequence, {args.global_batch} sequences per step; {len(predictions)} layouts, "
          f"{sum(p.fits for p in predictions)} fit\n")
    print(table(predictions, args.top))
    plain = [p for p in predictions if p.layout.tp == p.layout.pp == 1 and not p.layout.shard
             and not p.layout.checkpoint]
    if plain and not any(p.fits for p in plain):
        print(f"\nplain data parallel does not fit: {plain[0].reason}")
    made = planned_recipe(predictions[0].layout, run.device, compute) if predictions[0].fits else None
    if made is not None:
        mesh = " x ".join(f"{dim} {size}" for dim, size in made.mesh_shape.items() if size > 1) or "one rank"
        print(f"\nplan 0 runs as passes [{describe_passes(made.passes)}] on a mesh of {mesh} "
              "(picofx.plan(...).recipe())")
    if args.measure:
        print("\n" + measured_table(measure(predictions, run, max(3, args.measure_top))))
    out = {"plans": [p.as_json() for p in predictions], "best": 0 if made else None,
           "recipe": made and {"passes": describe_passes(made.passes), "mesh": made.mesh_shape}}
    for what in args.show:
        out[what], text = show(what, run, predictions, compute)
        print("\n" + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if getattr(args, "html", None):
        from picofx.report_html import write_html

        write_html(args.html, plans=out, title=f"picofx plan {args.model}",
                   subtitle=f"{args.gpus} x {run.device.name}, {args.seq} tokens per sequence, "
                            f"{args.global_batch} sequences per step")
        print(f"wrote {args.html}")
    return out
