"""The one recipe from a layout (picofx.planner.layouts.Layout) to the passes that run it and the mesh they run on, as torchtitan's
parallelize.py composes its parallelisms: `picofx.plan(...).passes()`, `picofx plan` (its best plan's
recipe), `picofx plan --measure`, and `picofx train` (its --dp/--tp/--pp/--shard options or
--layout auto's choice, as a Layout) all take their passes from here.

    made = recipe(Layout(dp=2, tp=2, pp=1, shard=True), compute=["fuse", "precision"])
    opt = picofx.optimize(model, batch, made.passes, mesh=made.mesh())
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from picofx.cost.balance import microbatch_refusal
from picofx.cost.device import MAX_MEMORY_FRACTION
from picofx.manager import pass_info, resolve_pass
from picofx.manager.combinations import features_of, refused
from picofx.manager.order import STAGE_ORDER, run_order
from picofx.passes import Checkpoint, ContextParallel, Overlap, Pipeline, Precision, Shard, TensorParallel
from picofx.planner.float8 import RECIPES as FLOAT8_RECIPES


@dataclass(frozen=True)
class Recipe:
    passes: list
    mesh_shape: dict  # ParallelMesh.build's sizes: pp, dp_replicate, dp_shard, tp (and cp where it splits)

    def mesh(self, device_type: str = "cpu"):
        """The ParallelMesh of `mesh_shape` (under torch.distributed, every rank builds it at once)."""
        from picofx.parallel import ParallelMesh

        return ParallelMesh.build(**self.mesh_shape, device_type=device_type)


def recipe(layout: Layout, *, compute=("fuse",), checkpoint_budget=None, checkpoint_optimizer=None,
           compress_warmup: int = 0, measure_cuts: bool = False) -> Recipe:
    """The passes that run `layout`, in the order their PassInfo declares, and its mesh.

    compute: the passes that rewrite the computation (names or pass objects: fuse, precision, a
    user's), kept in their order. checkpoint_budget, checkpoint_optimizer: Checkpoint's budget and
    optimizer where `layout.checkpoint` (both None: the pass by its name, with its defaults).
    compress_warmup: the steps the data-parallel exchange runs uncompressed first (its warmup).
    measure_cuts: the pipeline cuts where measured unit times balance, instead of predicted ones."""
    passes = in_precision(list(compute), layout.precision)
    if layout.checkpoint:
        given = checkpoint_budget is not None or checkpoint_optimizer is not None
        passes.append(Checkpoint(budget=checkpoint_budget, optimizer=checkpoint_optimizer) if given else "checkpoint")
    if layout.pp > 1:
        passes.append(Pipeline(stages=layout.pp, schedule=layout.schedule, microbatches=layout.microbatches,
                               virtual=layout.virtual, measure=measure_cuts))
    if layout.tp > 1:
        passes.append(TensorParallel(sequence_parallel=layout.sequence_parallel,
                                     async_overlap=layout.async_tp))
    if layout.cp > 1:  # each rank of the cp group keeps its part of every sequence
        passes.append(ContextParallel(method=layout.cp_method))
    if layout.shard or layout.dp > 1:  # sharded over dp_shard (one included; x cp, and HSDP's replicas), or replicas'
        exchange = Shard if layout.shard else Overlap
        stage = {"stage": layout.shard_stage} if layout.shard and layout.shard_stage != 3 else {}
        passes.append(exchange(compress=layout.compress, warmup=compress_warmup if layout.compress else 0, **stage))
    shape = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp}
    if layout.cp > 1:
        shape["cp"] = layout.cp
    return Recipe(declared_order(passes), shape)


def declared_order(passes: list) -> list:
    """`passes` in the order the manager runs them: as their PassInfo declares (tensor and context
    parallelism before the compute passes and after the pipeline's cut, shard after them all). The
    passes they require (PassInfo.requires) are left to the manager, which adds them."""
    resolved = [resolve_pass(p) for p in passes]
    ordered, _ = run_order(resolved)
    ordered.sort(key=lambda p: STAGE_ORDER[pass_info(p).stage])  # stable: the stages run one after another
    given = {id(r): i for i, r in enumerate(resolved)}
    return [passes[given[id(o)]] for o in ordered if id(o) in given]


def in_precision(compute: list, precision: str) -> list:
    """`compute` with the precision pass running a float8 layout's recipe (torchao's name: "tensorwise",
    "rowwise"), added after the others where `compute` lacks it; a precision pass given a float8
    recipe of its own keeps it."""
    if precision not in FLOAT8_RECIPES:
        return compute
    float8 = Precision(float8=FLOAT8_RECIPES[precision])
    named = [i for i, p in enumerate(compute) if p == "precision" or isinstance(p, Precision)]
    if not named:
        return [*compute, float8]
    given = compute[named[0]]
    if isinstance(given, Precision) and given.float8 is not None:  # its own recipe (rowwise_with_gw_hp included)
        return compute
    compute[named[0]] = dataclasses.replace(given, float8=float8.float8) if isinstance(given, Precision) else float8
    return compute


def planned_recipe(layout: Layout, device, compute) -> Recipe:
    """The recipe of a plan predicted for `device` with the `compute` passes: checkpointing, where the
    plan checkpoints, to the memory a step may use of the device's, with AdamW's state counted."""
    budget = int(device.memory_capacity * MAX_MEMORY_FRACTION)
    return recipe(layout, compute=list(compute), checkpoint_budget=budget, checkpoint_optimizer="adamw")


def refusal(layout: Layout, compute=()) -> str | None:
    """Why picofx cannot run `layout` (None: it can), as the authorities say: the one micro-batch rule
    (picofx.cost.balance) and the composability table (picofx.manager.combinations), asked of the
    passes and mesh this recipe makes (with the `compute` passes). The planner, `picofx plan` and
    `picofx train` ask here."""
    reason = microbatch_refusal(layout.pp, layout.microbatches, layout.schedule)
    if reason is not None:
        return reason
    try:
        made = recipe(layout, compute=compute)
    except (NotImplementedError, ValueError) as e:  # a pass refusing its own options where they are declared
        return str(e)
    found = refused(features_of(made.passes, made.mesh_shape))
    return None if found is None else found.reason


def describe_passes(passes: list) -> str:
    """The passes as one line: names, and the options each pass object sets beyond its defaults."""
    out = []
    for p in passes:
        if isinstance(p, str) or not dataclasses.is_dataclass(p):
            out.append(p if isinstance(p, str) else getattr(p, "__name__", type(p).__name__))
            continue
        options = [f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p)
                   if f.init and f.default is not dataclasses.MISSING and getattr(p, f.name) != f.default]
        out.append(f"{type(p).__name__}({', '.join(options)})")
    return ", ".join(out)
