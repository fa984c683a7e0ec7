"""The `picofx plan` command: arguments, the table on the terminal, the JSON."""
from __future__ import annotations

import argparse
import json
import sys
import time

from picofx.cli.train_parser import at_least
from picofx.compression.registry import spellings
from picofx.planner.compress import DEFAULT_KINDS
from picofx.planner.costs import PASSES
from picofx.planner.measure import calibrated_device, measure
from picofx.planner.models import MODELS, model_config
from picofx.planner.recipe import describe_passes, planned_recipe
from picofx.planner.run import (check_run, gpu_profile, gpus_table, measured_table, plan_layout, plan_run,
                                suggestions_table, table)
from picofx.planner.show import show
from picofx.planner.spec import FIELDS, parse_layout


def add_plan_parser(commands) -> None:
    p = commands.add_parser(
        "plan", help="rank the layouts (dp x tp x pp, sharding, micro-batches, checkpointing) for N GPUs",
        description="Predict memory per GPU and step time of every layout of MODEL's training over --gpus GPUs, "
                    "rank those that fit, and say what limits each and what to change.",
        epilog="examples:\n  picofx plan llama2-7b --gpus 8 --gpu h100 --seq 4096 --global-batch 256\n"
               "  picofx plan llama2-70b --gpus 64 --gpu h100 --seq 4096 --global-batch 512 --json plans.json\n"
               "  picofx plan llama3-8b --gpu h100-96gb --seq 8192 --global-batch 8 "
               "--layout dp=8,shard=true,checkpoint=full\n  picofx plan --list-gpus",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help=f"a zoo name ({', '.join(MODELS)}), a Hugging Face config.json or its "
                                            "directory, or module:function")
    p.add_argument("--gpus", type=at_least(1), help="GPUs (ranks) of the run; with --layout, dp x tp x pp by default")
    p.add_argument("--gpu", default="h100", help="the device profile (--list-gpus), or cpu: this machine's cores")
    p.add_argument("--list-gpus", action="store_true",
                   help="list the device profiles --gpu takes and the networks --network takes, with their sources")
    p.add_argument("--network", help="the cluster's network between nodes (--list-gpus), instead of the one the "
                                     "--gpu profile sits on (h100, h200: ib-ndr; h100-96gb: roce-400; a100: ib-hdr)")
    p.add_argument("--layout", metavar="SPEC",
                   help="predict this one layout (with its suggestions) instead of ranking them all: the plan's "
                        f"fields, key=value comma-separated ({', '.join(FIELDS)}), e.g. "
                        "dp=8,shard=true,tp=1,pp=1,microbatches=1,checkpoint=full; left out: tp and pp 1, dp the "
                        "rest of --gpus, the others as the plans' defaults")
    p.add_argument("--gpus-per-node", type=at_least(1), default=8)
    p.add_argument("--seq", type=at_least(1), default=4096)
    p.add_argument("--global-batch", type=at_least(1), help="sequences per optimizer step, over all GPUs")
    p.add_argument("--compress", metavar="KINDS",
                   help="gradient compressors to plan for replicated data parallel, comma-separated, as "
                        "Overlap(compress=...) spells them (default: " + ",".join(DEFAULT_KINDS) + "; on --gpu cpu "
                        f"none; lossy {' and '.join(spellings(lossy=True))} only when listed; 'none': no compression)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (the JSON has every plan)")
    p.add_argument("--json", help="write {'plans': [...], 'best': index} here")
    p.add_argument("--html", metavar="FILE", help="write the plan table and charts of step and memory per plan as "
                                                  "one self-contained HTML page")
    p.add_argument("--measure", action="store_true",
                   help="also run the top plans for a few steps on this machine's ranks (--gpu cpu: gloo) and "
                        "print predicted against measured")
    p.add_argument("--measure-top", type=at_least(1), default=3, help="how many plans --measure runs (default 3)")
    p.add_argument("--show", nargs="+", choices=("stages", "buckets"), default=[],
                   help="also, from the whole model's graph: stages, the best pipelined plan's stage cuts per "
                        "schedule (uniform against cost-balanced); buckets, the best replicated plan's gradient "
                        "buckets and exposed all-reduce (after the backward, overlapped, bf16)")


def progress(stream=None):
    """What `picofx plan` says while it works, a line each with the seconds since it began, on
    stderr where that is a terminal; None (silence) where it is not: a pipe or log gets the results
    alone."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None
    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f} s] {text} ...", file=stream, flush=True)

    return say


def plan_command(args) -> dict:
    if args.list_gpus:
        print(gpus_table())
        return {}
    for given, what in ((args.model, "MODEL"), (args.global_batch, "--global-batch"),
                        (args.gpus or args.layout, "--gpus (or --layout)")):
        if not given:
            raise ValueError(f"{what} is required (picofx plan --help)")
    if args.gpu != "cpu" or args.network:
        gpu_profile(args.gpu, args.network)  # an unknown profile or network is refused before the model is read
    layout = args.layout and parse_layout(args.layout, args.gpus)
    if layout and args.gpus and layout.gpus != args.gpus:
        raise ValueError(f"--layout {args.layout!r} is {layout.gpus} GPUs (dp x tp x pp"
                         f"{' x cp' if layout.cp > 1 else ''}), "
                         f"--gpus {args.gpus}: leave --gpus out or make them agree")
    gpus = args.gpus or layout.gpus
    here = args.measure and args.gpu == "cpu"  # plans run on this machine: predict for it as its ranks share it
    config, compute = model_config(args.model), ("fuse",) if here else PASSES
    check_run(config, args.model, gpus=gpus, gpus_per_node=args.gpus_per_node, seq=args.seq,
              global_batch=args.global_batch)
    device = calibrated_device(config, gpus) if here else None
    common = dict(gpu=args.gpu, gpus_per_node=args.gpus_per_node, seq=args.seq, global_batch=args.global_batch,
                  device=device, passes=compute, compress=args.compress, network=args.network, say=progress())
    if layout:
        run, one = plan_layout(args.model, layout, **common)
        predictions = [one]
    else:
        run, predictions = plan_run(args.model, gpus=gpus, **common)
    if not predictions:
        raise ValueError(f"no layout of {args.model} runs on {gpus} GPUs with a global batch of "
                         f"{args.global_batch}: the batch must divide over the data-parallel ranks")
    nodes = f"{run.gpus_per_node} per node" + (f"; {run.device.network_name}" if gpus > run.gpus_per_node else "")
    print(f"{args.model} on {gpus} x {run.device.name} ({nodes}), {args.seq} tokens per "
          f"sequence, {args.global_batch} sequences per step; " + (
              "the layout given" if layout else f"{len(predictions)} layouts, {sum(p.fits for p in predictions)} fit")
          + "\n")
    print(table(predictions, args.top))
    if layout:
        print("\nwhat to change:\n" + suggestions_table(predictions[0]))
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
        print("\n" + measured_table(measure(predictions, run, args.measure_top)))
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
                   subtitle=f"{gpus} x {run.device.name} ({nodes}), {args.seq} tokens per sequence, "
                            f"{args.global_batch} sequences per step")
        print(f"wrote {args.html}")
    return out
