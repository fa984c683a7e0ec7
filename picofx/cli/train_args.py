"""picofx train's options, and every check on them that can fail before a process group or a
compile: a bad option is one line on stderr (rank 0 only under torchrun) and exit status 2."""
from __future__ import annotations

import dataclasses
import os
import pathlib

import torch

from picofx.cli.train_layout import replica_batch, run_layout, train_recipe
from picofx.cost.device import device_for
from picofx.cost.units import format_bytes
from picofx.models.llama import CONFIGS
from picofx.cli.train_data import check_data_source
from picofx.cli.train_float8 import check_float8
from picofx.cli.train_guards import check_guard_options
from picofx.cli.train_profile import check_profile_options
from picofx.cli.train_parser import build_parser, step_bytes
from picofx.cli.train_model import check_model, planned_shape
from picofx.cli.train_state import saved_run
from picofx.runtime.checkpoints import checkpoint_to_resume
from picofx.manager import resolve_pass
from picofx.compression import parse_compress
from picofx.runtime.distributed import launched_world
from picofx.planner.layouts import Layout
from picofx.planner.recipe import refusal
from picofx.planner.spec import layout_spec, parse_layout

# what a resumed run must repeat to go on as the saved run would have: these options and its layout
# (picofx.planner.spec.layout_spec's spelling), which a checkpoint records
RUN_OPTIONS = ("size", "model", "batch", "seq", "max_positions", "seed", "data", "layout")
# a checkpoint saved before it recorded its layout holds these options instead; cp came later still
LAYOUT_OPTIONS_BEFORE = ("dp", "dp_replicate", "pp", "microbatches", "shard", "tp", "sequence_parallel", "async_tp",
                         "compress", "cp")
RESUMABLE_CHANGES = ("checkpoint",)  # layout fields a resumed run may change: what is saved stays the same
SET_BY_LAYOUT = {"overlap": "--dp (or the default data parallelism under torchrun)", "pipeline": "--pp",
                 "shard": "--shard", "tensor_parallel": "--tp"}


def parse_args(argv=None, doc: str = "", environ=None):
    """The options, checked; `args.world` is the number of processes and `args.dp` is resolved."""
    environ = os.environ if environ is None else environ
    p = build_parser(doc, speaks=environ.get("RANK", "0") == "0")
    args = p.parse_args(argv)
    args.layout_chosen = None  # --layout auto --resume: the saved run's layout, said when the run starts
    args.complete = None  # --resume auto on a finished run: the line that says so (set by check_paths)
    try:
        check_layout(args, launched_world(environ))
        check_passes(args)
        check_runnable(args)
        check_float8(args)
        check_positions(args)
        check_device(args)
        check_paths(args)
        check_guard_options(args)
        check_profile_options(args)
        check_model(args)
    except ValueError as e:
        p.error(str(e))
    config, tied = planned_shape(args)  # --size's reference LLaMA, or --model's config
    if step_bytes(config, args.batch, args.seq, tied) > device_for(args.device).memory_capacity:
        model = f"--model {args.model}" if args.model else f"--size {args.size}"
        p.error(f"{model} needs about {format_bytes(step_bytes(config, args.batch, args.seq, tied))} per step "
                f"at batch {args.batch}, seq {args.seq}; {args.device} has "
                f"{format_bytes(device_for(args.device).memory_capacity)}: pick a smaller "
                f"{'model' if args.model else 'size'}, batch or sequence")
    return args


def check_layout(args, world: int | None) -> None:
    """dp x pp must be the number of processes; under torchrun the replicas default to the rest."""
    if getattr(args, "shard_stage", 3) != 3 and not args.shard:
        raise ValueError(f"--shard-stage {args.shard_stage} says what --shard shards: add --shard")
    layout = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("dp", args.dp), ("dp_replicate", args.dp_replicate),
                      ("tp", args.tp), ("pp", args.pp), ("cp", args.cp)) if v not in (None, 1)) + \
        (" --shard" if args.shard else "")
    layout = layout.strip()
    if world is None and args.compress is not None and not layout:
        raise ValueError(f"--compress compresses the gradients data-parallel ranks exchange, and one process has "
                         f"none: it needs --dp or --shard under torchrun, e.g. torchrun --nproc-per-node 2 -m picofx "
                         f"train --dp 2 --compress {args.compress}")
    if getattr(args, "layout", None) == "auto":  # the layout is chosen once the ranks are up (train_layout.py)
        given = (layout + (" --sequence-parallel" if args.sequence_parallel else "") +
                 (" --async-tp" if args.async_tp is not None else "")).strip()
        if given:
            raise ValueError(f"--layout auto chooses {given} itself: leave them out, or drop --layout auto")
        args.dp_default, args.world, args.dp = False, world or 1, 1
        return
    args.dp_default = world is not None and args.dp is None
    if world is None:  # one process, not launched by torchrun
        if layout:
            ranks = (args.dp or 1) * args.dp_replicate * args.pp * args.tp * args.cp
            raise ValueError(f"{layout} runs one process per rank: launch it with torchrun, e.g. torchrun "
                             f"--nproc-per-node {ranks} -m picofx train {layout}")
        args.dp, args.world = 1, 1
        return
    args.world = world
    if args.dp_replicate > 1 and not args.shard:
        raise ValueError(f"--dp-replicate {args.dp_replicate} is HSDP's replicas of a sharded group: add --shard "
                         f"(replicas alone are --dp {args.dp_replicate})")
    model_ranks = args.pp * args.tp * args.cp * args.dp_replicate  # the ranks outside one dp (or dp_shard) group
    named = " x ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("dp_replicate", args.dp_replicate), ("tp", args.tp),
                                                                   ("pp", args.pp), ("cp", args.cp)) if v > 1)
    if args.dp is None:
        if world % model_ranks:
            raise ValueError(f"{named or '--pp 1 x --tp 1'} does not divide the {world} ranks torchrun started: use "
                             f"--nproc-per-node {model_ranks * max(1, world // model_ranks)}, or another layout")
        args.dp = world // model_ranks
    elif args.dp * model_ranks != world:
        raise ValueError(f"the layout --dp {args.dp} x --tp {args.tp} x --pp {args.pp}"
                         f"{f' x --dp-replicate {args.dp_replicate}' if args.dp_replicate > 1 else ''} is "
                         f"{args.dp * model_ranks} ranks, but torchrun started {world}: launch with --nproc-per-node "
                         f"{args.dp * model_ranks}, or change --dp/--tp/--pp")
    if args.compress is not None:
        parse_compress(args.compress)
        if args.dp * args.dp_replicate < 2:
            raise ValueError("--compress compresses the data-parallel ranks' gradient all-reduce (--dp) or "
                             "reduce-scatter (--shard): run it with --dp 2 or more")
    if args.async_tp is not None and not args.sequence_parallel:
        raise ValueError("--async-tp overlaps the gathers and reduce-scatters of --sequence-parallel: add it")
    if args.compress_warmup and args.compress is None:
        raise ValueError("--compress-warmup counts steps before --compress's compressor starts: give --compress KIND")
    if args.sequence_parallel and args.tp == 1:
        raise ValueError("--sequence-parallel splits the sequence over the --tp ranks: give --tp 2 or more")
    if args.pp > 1:
        if args.batch % args.microbatches:
            raise ValueError(f"--batch {args.batch} does not split into --microbatches {args.microbatches}: "
                             "pick a batch that is a multiple of it")


def check_runnable(args) -> None:
    """The run's layout with its --passes, as the recipe's authorities judge it (the micro-batch rule,
    the composability table: picofx.planner.recipe.refusal); after check_layout and check_passes."""
    layout = run_layout(args)
    found = refusal(layout, compute=[name for name in args.passes if name != "checkpoint"])
    if found is not None:
        raise ValueError(f"{layout_options(layout, args)}{f' --schedule {args.schedule}' if args.pp > 1 else ''}: "
                         f"{found}")


def check_passes(args) -> None:
    """Pass names resolve now (with the registry's suggestion); the layout adds its own passes."""
    for name in args.passes:
        if name in SET_BY_LAYOUT:
            if name == "overlap" and args.world == 1:
                raise ValueError("the overlap pass all-reduces gradients between data-parallel ranks, and one "
                                 "process has none: drop it, or launch with torchrun --nproc-per-node N "
                                 "(data parallel over N ranks adds it)")
            raise ValueError(f"--passes {name}: this script adds it from {SET_BY_LAYOUT[name]}; leave it out of "
                             "--passes")
        try:
            resolve_pass(name)
        except KeyError as e:
            raise ValueError(f"--passes: {e.args[0]}") from None
    if args.memory_budget is not None and "checkpoint" not in args.passes:
        raise ValueError("--memory-budget is the checkpoint pass's budget: add checkpoint to --passes")


def check_positions(args) -> None:
    if args.model is not None:  # the Hugging Face model's own limit (train_model.check_model)
        return
    limit = args.max_positions or CONFIGS[args.size].max_position_embeddings
    if args.seq > limit:
        raise ValueError(f"--seq {args.seq} is longer than the {args.size} model's position limit, {limit} "
                         f"(max_position_embeddings): pass --max-positions {args.seq} to build it with a "
                         "longer rotary table, or a shorter --seq")


def check_device(args) -> None:
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: torch sees no CUDA GPU here (torch.cuda.is_available() is "
                             "False; this torch is built for " + ("CPU only" if torch.version.cuda is None else
                                                                 f"CUDA {torch.version.cuda}") + "): use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {args.device}: there are {torch.cuda.device_count()} GPUs "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif device.type != "cpu":
        raise ValueError(f"--device {args.device}: this script runs on cpu or cuda")


def check_paths(args) -> None:
    for option, path in (("--dump-dir", args.dump_dir), ("--save", args.save)):
        if path is None:
            continue
        existing = next((p for p in [pathlib.Path(path), *pathlib.Path(path).parents] if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ValueError(f"{option} {path}: {existing} is a file, not a directory: name a directory "
                             "(it is created if missing)")
    for option, value in (("--save-every", args.save_every), ("--keep", args.keep)):
        if value is not None and args.save is None:
            raise ValueError(f"{option} {value}: saves under --save DIR: pass --save DIR too")
    automatic = args.resume == "auto"
    if args.resume is not None:
        args.resume = checkpoint_to_resume(args.resume, args.save)  # auto with none saved yet: a fresh start
    args.resumed_layout = None  # --layout auto --resume: the layout the checkpoint records
    if args.resume is not None:
        step, saved = saved_run(args.resume, RUN_OPTIONS + LAYOUT_OPTIONS_BEFORE)
        recorded = saved_layout(saved)
        if getattr(args, "layout", None) == "auto" and args.world > 1:
            adopt_saved_layout(args, recorded)
        layout = run_layout(args)
        changed = [f"--{name.replace('_', '-')} {saved[name]} there, {value} here" for name, value in
                   run_options(args, layout).items() if name != "layout" and saved[name] != value]
        changed += layout_changes(recorded, layout)
        if changed:
            raise ValueError(f"--resume {args.resume} was saved by a run with other options ({'; '.join(changed)}): "
                             "resume with the options it was saved with")
        args.compress_warmup = max(0, args.compress_warmup - step)  # the warm-up counts the run's steps
        if step >= args.steps and automatic:  # a requeued job whose run had finished: done, not an error
            args.complete = (f"--resume auto: the run under --save {args.save} is complete (saved after step {step}, "
                             f"--steps {args.steps}): nothing to do")
        elif step >= args.steps:
            raise ValueError(f"--resume {args.resume} was saved after step {step}, and --steps {args.steps} ends "
                             f"there: pass a larger --steps (the total, e.g. --steps {2 * step})")
    if args.data is not None:
        check_data_source(args.data)


def saved_layout(saved: dict) -> Layout:
    """The layout a checkpoint's options record (a checkpoint from before the record: its layout options)."""
    if saved.get("layout") is not None:
        return parse_layout(saved["layout"])
    old = {name: saved.get(name) for name in LAYOUT_OPTIONS_BEFORE}
    dp, replicas, pp, shard = int(old["dp"]), int(old["dp_replicate"] or 1), int(old["pp"]), old["shard"] == "True"
    return Layout(dp_replicate=replicas * (1 if shard else dp), dp_shard=dp if shard else 1, tp=int(old["tp"]), pp=pp,
                  shard=shard, microbatches=int(old["microbatches"]) if pp > 1 else 1,
                  sequence_parallel=old["sequence_parallel"] == "True", async_tp=old["async_tp"] != "False",
                  compress=None if old["compress"] in (None, "None") else old["compress"], cp=int(old["cp"] or 1))


def layout_changes(saved: Layout, here: Layout) -> list[str]:
    """Where the run's layout differs from the one a checkpoint was saved under, field by field: a
    resume under another layout is refused (its shards, stages and data replicas would not match)."""
    return [f"layout {f.name}={getattr(saved, f.name)} there, {getattr(here, f.name)} here"
            for f in dataclasses.fields(Layout) if f.name not in RESUMABLE_CHANGES
            and getattr(saved, f.name) != getattr(here, f.name)
            and (f.name != "schedule" or here.pp > 1) and (f.name != "shard_stage" or here.shard)]


def adopt_saved_layout(args, layout: Layout) -> None:
    """--layout auto with --resume: the layout the saved run chose, not a new plan (one made now,
    on other timings, could differ, and the checkpoint is of that layout). --batch stays the global
    batch, as the saved run was given it."""
    if layout.gpus != args.world:
        raise ValueError(f"--resume {args.resume} was saved by a run on {layout.gpus} ranks ({layout.describe()}), "
                         f"and torchrun started {args.world}: launch with --nproc-per-node {layout.gpus}")
    args.resumed_layout = dataclasses.replace(layout, checkpoint="checkpoint" in args.passes)
    args.layout_chosen = f"layout auto: resumed with the layout the saved run chose ({layout_options(layout)})"


def layout_options(layout: Layout, args=None) -> str:
    """The layout as the options that give it (with `args`: --compress and --passes too)."""
    given = [f"--{name.replace('_', '-')} {value}" for name, value in (
        ("dp", layout.dp_shard if layout.shard else layout.dp), ("dp_replicate", layout.dp_replicate if layout.shard
                                                                else 1),
        ("tp", layout.tp), ("pp", layout.pp), ("cp", layout.cp)) if value > 1]
    flags = [flag for flag, on in (("--shard", layout.shard), ("--sequence-parallel", layout.sequence_parallel),
                                   ("--no-async-tp", layout.sequence_parallel and not layout.async_tp)) if on]
    flags += [f"--shard-stage {layout.shard_stage}"] if layout.shard and layout.shard_stage != 3 else []
    flags += [f"--microbatches {layout.microbatches}"] if layout.pp > 1 else []
    flags += [f"--cp-method {layout.cp_method}"] if layout.cp > 1 and layout.cp_method != "allgather" else []
    extra = [f"--compress {layout.compress}"] if args is not None and layout.compress else []
    extra += [f"--passes {' '.join(args.passes)}"] if args is not None and args.passes else []
    return " ".join(given + flags + extra)


def run_options(args, layout: Layout) -> dict:
    """The options a resumed run must repeat to go on as the saved one would have, as text: the batch
    one replica takes, and the layout as --layout spells it."""
    return {name: str(getattr(args, name)) for name in RUN_OPTIONS if name not in ("batch", "layout")} | {
        "batch": str(replica_batch(args, layout)), "layout": layout_spec(layout)}


def picofx_passes(args) -> list:
    """The passes of the run: --passes (checkpoint built on --memory-budget) and those of its layout
    (--dp/--tp/--pp/--shard/--compress), by the planner's one recipe (train_layout.train_recipe)."""
    return train_recipe(args).passes
