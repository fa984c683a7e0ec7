"""picofx train's layout: its options as the planner's Layout, built once (run_layout), run by the planner's
one recipe (picofx.planner.recipe) and read by the replica index, the layout line, metrics and checkpoints;
and --layout auto: the layout `picofx.plan` predicts fastest among those the script runs.

Rank 0 plans and broadcasts its choice: on a CPU the plan's device is calibrated by measuring (a
single-rank step of the model; the link by all-reduces every rank takes part in), and measurements
differ from rank to rank, so ranks planning each for itself could choose different layouts.
`--batch` is the global batch: the chosen layout's replicas split it (the planner ranks layouts at
equal work per step).
"""
from __future__ import annotations

from picofx.cli.train_float8 import compute_passes, layout_precision
from picofx.cli.train_model import planned_shape
from picofx.planner.layouts import Layout
from picofx.planner.recipe import Recipe, recipe, refusal


def run_layout(args) -> Layout:
    """The run's one layout, built from its options (after check_layout): --dp/--dp-replicate/--shard,
    --shard-stage, --tp/--sequence-parallel/--async-tp, --pp/--schedule/--microbatches, --cp/--cp-method, --compress;
    --passes checkpoint is its checkpointing. Under --layout auto with --resume: the saved run's."""
    if getattr(args, "layout", None) == "auto" and getattr(args, "resumed_layout", None) is not None:
        return args.resumed_layout
    replicas = args.dp_replicate * (1 if args.shard else args.dp)
    return Layout(dp_replicate=replicas, dp_shard=args.dp if args.shard else 1, tp=args.tp, pp=args.pp,
                  shard=args.shard, microbatches=args.microbatches if args.pp > 1 else 1, schedule=args.schedule,
                  checkpoint="checkpoint" in args.passes, sequence_parallel=args.sequence_parallel,
                  async_tp=args.async_tp is not False, compress=args.compress, cp=args.cp, cp_method=args.cp_method,
                  shard_stage=args.shard_stage, precision=layout_precision(args))


def train_recipe(args, layout: Layout | None = None) -> Recipe:
    """The passes (--passes and the layout's) and the mesh of the run, by the planner's recipe."""
    return recipe(layout or run_layout(args), compute=compute_passes(args),
                  checkpoint_budget=args.memory_budget, compress_warmup=args.compress_warmup,
                  measure_cuts=args.measure_cuts)


def train_mesh(args, layout: Layout):
    """The run's ParallelMesh (None in one process)."""
    return None if args.world == 1 else train_recipe(args, layout).mesh(args.device.split(":")[0])


def replica_of(rank: int, layout: Layout) -> int:
    """The mesh is (pp, dp_replicate, dp_shard, cp, tp), outermost first: the ranks of one replica (its
    stages, its cp and tp ranks) share its batches; HSDP's replicas each count their dp_shard ranks."""
    return (rank // (layout.tp * layout.cp)) % layout.dp


def replica_batch(args, layout: Layout) -> int:
    """Sequences per step of one replica: --batch, which --layout auto splits among the replicas."""
    return args.batch // layout.dp if getattr(args, "layout", None) == "auto" else args.batch


def unrunnable(layout: Layout) -> str | None:
    """Why picofx train cannot run `layout` (None: it can): what its options cannot say, then what the
    recipe's authorities refuse (picofx.planner.recipe.refusal)."""
    if layout.checkpoint:
        return "checkpointing the planned way (every layer) is not one of its options"
    if layout.compress and layout.dp < 2:
        return "--compress without data-parallel ranks"
    if layout.pp == 1 and layout.microbatches > 1:
        return "micro-batches without a pipeline (gradient accumulation)"
    return refusal(layout)


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
    """On rank 0: (the chosen Layout, the line saying why), or (None, the error)."""
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
        return plans.predictions[index].layout, explain(plans, index)
    except Exception as e:  # noqa: BLE001  the other ranks wait on the broadcast: they must hear of it
        return None, f"--layout auto: planning failed: {type(e).__name__}: {e}"


def choose_layout(args, rank: int) -> tuple[Layout, str]:
    """Every rank: rank 0's plan as the run's Layout, and the line saying why (raises ValueError, on
    every rank, where planning failed). --batch stays the global batch (replica_batch splits it)."""
    import torch.distributed as dist

    from picofx.cost.device import calibrate_link

    config, _ = planned_shape(args)  # --size's reference LLaMA, or --model's shape
    link = calibrate_link(None) if args.device == "cpu" else None  # every rank takes part
    choice = [planned_choice(args, config, link) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    layout, line = choice[0]
    if layout is None:
        raise ValueError(line)
    return layout, line


def layout_line(layout: Layout, world: int, dp_default: bool = False) -> str:
    """The run's layout in words, as `picofx train` says it first."""
    dp, tp, pp, compress = layout.dp, layout.tp, layout.pp, layout.compress
    if world == 1:
        return "one process"
    if layout.cp > 1:
        return f"{world} ranks: {layout.cp}-way context parallel, each rank its part of every sequence"
    if layout.shard and layout.dp_replicate > 1:
        parts = [f"{pp} pipeline stages" if pp > 1 else "", f"{layout.dp_replicate} replicas",
                 f"each sharded over {layout.dp_shard} ranks", f"{tp}-way tensor parallel" if tp > 1 else ""]
        compressed = f", replicas' gradients all-reduced as {compress}" if compress else ""
        return f"{world} ranks: HSDP, {' x '.join(p for p in parts if p)}{compressed}"
    if tp > 1 and (layout.shard or pp > 1):
        if layout.shard and pp > 1:
            return (f"{world} ranks: {pp} pipeline stages x {dp} sharded data-parallel x {tp}-way tensor parallel, "
                    f"each rank holding 1/{dp * tp} of its stage")
        if layout.shard:
            return (f"{world} ranks: {dp} sharded data-parallel x {tp}-way tensor parallel, each rank holding "
                    f"1/{dp * tp} of the model, each data-parallel rank on its own batches")
        return f"{world} ranks: {pp} pipeline stages, each {tp}-way tensor parallel"
    if layout.shard:
        stages = f"{pp} pipeline stages, each " if pp > 1 else ""
        compressed = f", gradients reduce-scattered as {compress}" if compress else ""
        return (f"{world} ranks: {stages}sharded data parallel, each rank holding 1/{dp} of "
                f"{'its stage' if pp > 1 else 'the model'}, each replica on its own batches{compressed}")
    replicas = f" x {dp} data-parallel replicas each on its own batches" if dp > 1 else ""
    if tp > 1:
        sequence = " with sequence parallelism" if layout.sequence_parallel else ""
        return f"{world} ranks: {tp}-way tensor parallel{sequence}{replicas}"
    if pp == 1:
        default = " (the default under torchrun: --dp/--pp choose another layout)" if dp_default else ""
        compressed = f", gradients exchanged as {compress}" if compress else ""
        return f"{world} ranks: data parallel, {dp} replicas each on its own batches{compressed}{default}"
    return f"{world} ranks: {pp} pipeline stages{replicas}"
