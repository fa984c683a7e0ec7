"""The one recipe from a layout to the passes that run it and the mesh they run on, as torchtitan's
parallelize.py composes its parallelisms: `picofx.plan(...).passes()`, `picofx plan` (its best plan's
recipe), `picofx plan --measure`, and `picofx train` (its --dp/--tp/--pp/--shard options or
--layout auto's choice, as a Layout) all take their passes from here.

    made = recipe(Layout(dp=2, tp=2, pp=1, shard=True), compute=["fuse", "precision"])
    opt = picofx.optimize(model, batch, made.passes, mesh=made.mesh())
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from picofx.cost.balance import INTERLEAVED_SCHEDULES
from picofx.passes import Checkpoint, ContextParallel, Overlap, Pipeline, Shard, TensorParallel
from picofx.planner.layouts import MAX_MEMORY_FRACTION, Layout


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
    """The passes that run `layout`, and its mesh.

    compute: the passes that rewrite the computation (names or pass objects: fuse, precision, a
    user's), kept in their order. checkpoint_budget, checkpoint_optimizer: Checkpoint's budget and
    optimizer where `layout.checkpoint` (both None: the pass by its name, with its defaults).
    compress_warmup: the steps the data-parallel exchange runs uncompressed first (its warmup).
    measure_cuts: the pipeline cuts where measured unit times balance, instead of predicted ones."""
    tensor_parallel = [TensorParallel(sequence_parallel=layout.sequence_parallel)] if layout.tp > 1 else []
    pipeline = [Pipeline(stages=layout.pp, schedule=layout.schedule, microbatches=layout.microbatches,
                         virtual=layout.virtual_stages if layout.schedule in INTERLEAVED_SCHEDULES else 1,
                         measure=measure_cuts)
                ] if layout.pp > 1 else []
    checkpoint = []
    if layout.checkpoint:
        given = checkpoint_budget is not None or checkpoint_optimizer is not None
        checkpoint = [Checkpoint(budget=checkpoint_budget, optimizer=checkpoint_optimizer) if given else "checkpoint"]
    data = []
    if layout.shard or layout.dp > 1:  # sharded over the dp_shard ranks (one included), or replicas' exchange
        exchange = Shard if layout.shard else Overlap
        data = [exchange(compress=layout.compress, warmup=compress_warmup if layout.compress else 0)]
    # tensor parallel reads the plain linears that fuse and precision rewrite, so it comes before
    # them; under a pipeline the cut comes first and tensor parallel splits each stage's graph.
    # Checkpointing plans the joint graph the compute passes made; the data-parallel exchange
    # buckets the gradients of the (stage's) backward, last.
    if tensor_parallel and pipeline:
        passes = [*pipeline, *tensor_parallel, *compute, *checkpoint, *data]
    else:
        passes = [*tensor_parallel, *compute, *checkpoint, *pipeline, *data]
    shape = {"pp": layout.pp, "dp_replicate": 1 if layout.shard else layout.dp,
             "dp_shard": layout.dp if layout.shard else 1, "tp": layout.tp}
    if layout.cp > 1:  # each rank of the cp group keeps its part of every sequence, first of all
        passes.insert(0, ContextParallel())
        shape["cp"] = layout.cp
    return Recipe(passes, shape)


def planned_recipe(layout: Layout, device, compute) -> Recipe:
    """The recipe of a plan predicted for `device` with the `compute` passes: checkpointing, where the
    plan checkpoints, to the memory a step may use of the device's, with AdamW's state counted."""
    budget = int(device.memory_capacity * MAX_MEMORY_FRACTION)
    return recipe(layout, compute=list(compute), checkpoint_budget=budget, checkpoint_optimizer="adamw")


def unsupported(layout: Layout) -> str | None:
    """Why picofx's passes cannot run `layout` together (None: they can)."""
    if layout.tp > 1 and layout.pp > 1 and layout.dp > 1 and not layout.shard:
        return "replicated data parallel over tensor-parallel pipeline stages (shard them instead)"
    if layout.sequence_parallel and layout.pp > 1:
        return "sequence parallelism under a pipeline"
    return None


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
