"""picofx train's layout: its --dp/--tp/--pp/--shard options as a planner Layout, run by the planner's one
recipe (picofx.planner.recipe); and --layout auto: the layout `picofx.plan` predicts fastest among those
the script runs.

Rank 0 plans and broadcasts its choice: on a CPU the plan's device is calibrated by measuring (a
single-rank step of the model; the link by all-reduces every rank takes part in), and measurements
differ from rank to rank, so ranks planning each for itself could choose different layouts.
`--batch` is the global batch: the chosen layout's replicas split it (the planner ranks layouts at
equal work per step).
"""
from __future__ import annotations

import dataclasses

from picofx.manager.combinations import COMPRESSION, closed, refused
from picofx.cli.train_float8 import compute_passes
from picofx.cli.train_model import planned_shape
from picofx.passes import ContextParallel, TensorParallel
from picofx.planner.layouts import Layout
from picofx.planner.recipe import Recipe, recipe


def args_layout(args) -> Layout:
    """The run's layout as the options give it (after check_layout, or --layout auto's choice);
    --passes checkpoint is the layout's checkpointing."""
    return Layout(dp=args.dp, tp=args.tp, pp=args.pp, shard=args.shard,
                  microbatches=args.microbatches if args.pp > 1 else 1, schedule=args.schedule,
                  checkpoint="checkpoint" in args.passes, sequence_parallel=args.sequence_parallel,
                  compress=args.compress, cp=getattr(args, "cp", 1))


def layout_features(args=None, *, layout: Layout | None = None) -> frozenset:
    """The run's features as the composability table names them (picofx/manager/combinations.py):
    from picofx train's options, or from a planner Layout."""
    layout = layout or args_layout(args)
    replicate = getattr(args, "dp_replicate", 1)
    found = {name for name in getattr(args, "passes", ()) if name in ("fuse", "precision", "checkpoint")}
    found |= {"shard"} if layout.shard else set()
    found |= {"overlap"} if replicate > 1 or (layout.dp > 1 and not layout.shard) else set()
    found |= {"tensor_parallel"} if layout.tp > 1 else set()
    if layout.sequence_parallel:
        found.add("sequence_parallel" if getattr(args, "async_tp", None) is False else "async_tp")
    found |= {"pipeline"} if layout.pp > 1 else set()
    found |= {"context_parallel"} if layout.cp > 1 else set()
    found |= {"ring"} if layout.cp > 1 and getattr(args, "cp_method", "allgather") == "ring" else set()
    kinds = (layout.compress or "").split("+")
    found |= {k for k in COMPRESSION if any(kind.split(":")[0] == k for kind in kinds)}
    return closed(found)


def train_recipe(args) -> Recipe:
    """The passes (--passes and the layout's) and the mesh of the run, by the planner's recipe; with
    --dp-replicate, HSDP (the shard pass over dp_replicate x dp_shard); --no-async-tp: sequence
    parallelism without its chunked overlap; --cp-method: context parallelism's method."""
    made = recipe(args_layout(args), compute=compute_passes(args),
                  checkpoint_budget=args.memory_budget, compress_warmup=args.compress_warmup,
                  measure_cuts=args.measure_cuts)
    passes, shape = list(made.passes), dict(made.mesh_shape)
    if args.async_tp is False:
        passes = [dataclasses.replace(p, async_overlap=False) if isinstance(p, TensorParallel) else p for p in passes]
    method = getattr(args, "cp_method", "allgather")
    passes = [dataclasses.replace(p, method=method) if isinstance(p, ContextParallel) else p for p in passes]
    if args.dp_replicate > 1:  # HSDP: the shard pass on (dp_replicate, dp_shard), averaging across replicas too
        shape["dp_replicate"] = args.dp_replicate
    return Recipe(passes, shape)


def train_mesh(args):
    """The run's ParallelMesh (None in one process)."""
    return None if args.world == 1 else train_recipe(args).mesh(args.device.split(":")[0])


def unrunnable(layout: Layout) -> str | None:
    """Why picofx train cannot run `layout` (None: it can); see train_args.check_layout."""
    if layout.checkpoint:
        return "checkpointing the planned way (every layer) is not one of its options"
    if layout.compress and layout.dp < 2:
        return "--compress without data-parallel ranks"
    if layout.pp == 1 and layout.microbatches > 1:
        return "micro-batches without a pipeline (gradient accumulation)"
    found = refused(layout_features(layout=layout))
    return None if found is None else found.reason


def explain(plans, index: int) -> str:
    """Which plan, and why: its predicted step, memory and bottleneck, and the runner-up's."""
    chosen = plans.predictions[index]
    runnable = [p for p in plans.predictions if p.fits and unrunnable(p.layout) is None]
    line = (f"layout auto: {chosen.layout.describe()} (the fastest of {len(runnable)} runnable plans that fit, "
            f"{len(plans.predictions)} planned for {plans.run.gpus} x {plans.run.device.name}): predicted step "
            f"{chosen.step_s * 1e3:.1f} ms, {chosen.memory_per_gpu / 1e6:.1f} MB per rank, bottleneck "
            f"{chosen.bottleneck}")
    second = next((p for p in runnable if p is not chosen), None)
    if second is not None:
        line += (f"; runner-up {second.layout.describe()}: {second.step_s * 1e3:.1f} ms "
                 f"({100 * (second.step_s / chosen.step_s - 1):+.0f}%), bottleneck {second.bottleneck}")
    skipped = plans.predictions.index(chosen)
    if skipped:
        line += f"; {skipped} faster plans skipped ({unrunnable(plans.predictions[0].layout)}, ...)"
    return line + "; mb: the micro-batches a step's batch is split into"


def planned_choice(args, config, link) -> tuple:
    """On rank 0: (the chosen Layout's fields, the line saying why), or (None, the error)."""
    import picofx

    try:
        compressed = dict(tp=1, pp=1, shard=False) if args.compress else {}  # --compress: replicated dp alone
        plans = picofx.plan(config, world=args.world, seq=args.seq, global_batch=args.batch,
                            gpu="cpu" if args.device == "cpu" else args.device, link=link, compress=args.compress,
                            say=lambda *a: None, schedule="1F1B", **compressed)
        index = next((i for i, p in enumerate(plans.predictions) if p.fits and unrunnable(p.layout) is None
                      and p.layout.compress == (args.compress or p.layout.compress)), None)
        if index is None:
            return None, (f"--layout auto: none of the {len(plans)} plans for {args.world} ranks both fits and is "
                          f"runnable here at --batch {args.batch}; give the layout with --dp/--tp/--pp/--shard")
        return dataclasses.asdict(plans.predictions[index].layout), explain(plans, index)
    except Exception as e:  # noqa: BLE001  the other ranks wait on the broadcast: they must hear of it
        return None, f"--layout auto: planning failed: {type(e).__name__}: {e}"


def choose_layout(args, rank: int) -> str:
    """Every rank: set args' --dp/--tp/--pp/--shard/--sequence-parallel/--microbatches/--batch (and
    --compress) to rank 0's plan; returns the line saying why (raises ValueError, on every rank, where planning failed)."""
    import torch.distributed as dist

    from picofx.cost.device import calibrate_link

    config, _ = planned_shape(args)  # --size's reference LLaMA, or --model's shape
    link = calibrate_link(None) if args.device == "cpu" else None  # every rank takes part
    choice = [planned_choice(args, config, link) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    fields, line = choice[0]
    if fields is None:
        raise ValueError(line)
    layout = Layout(**fields)
    args.dp, args.tp, args.pp, args.shard = layout.dp, layout.tp, layout.pp, layout.shard
    args.sequence_parallel, args.schedule, args.cp = layout.sequence_parallel, layout.schedule, layout.cp
    args.batch //= layout.dp  # sequences per replica
    if layout.pp > 1:
        args.microbatches = layout.microbatches
    if layout.compress:
        args.compress = layout.compress
    return line
