"""Shard's stages 1 and 2 (ZeRO-1, ZeRO-2): what the pass does and refuses; the runtime is
picofx.runtime.shard_stages.

Stage 3 gathers each parameter inside the compiled step, once per micro-batch (twice with
reshard_after_forward). Stages 1 and 2 leave the graph as it is: it reads every parameter whole,
which the runtime gathers once per step (after the optimizer changed the shards) and keeps across
micro-batches, and its gradients come out whole. The pass records a ShardLayout with the stage, so
the runtime makes the parameters Shard(0) DTensors (the optimizer state, what stage 1 shards, is
then per shard) and exchanges the gradients outside the graph: stage 1 reduce-scatters the
whole gradients accumulated over the micro-batches once per step; stage 2 reduce-scatters after
every micro-batch's backward into the sharded gradient (DeepSpeed's way, not Megatron's whole
buffer reduced once, which is stage 1 here: the accumulated gradient takes a shard's memory).
With HSDP the shards are replicated over dp_replicate, as stage 3's, and each reduce-scatter's
shard is then all-reduced across the replicas.
"""
from __future__ import annotations

from torch import fx

from picofx.capture.vocabulary import input_slot, is_parameter
from picofx.manager import Context, PassResult
from picofx.parallel.layouts import ShardLayout, layouts_of
from picofx.parallel.gradient_sums import drop_gradient_sums, forward_gradient_sums

STAGES = (1, 2, 3)


def check_stage(shard) -> None:
    """Shard(stage=...): 1, 2 or 3; stages 1 and 2 without what only stage 3 builds."""
    if shard.stage not in STAGES:
        raise ValueError(f"Shard(stage={shard.stage!r}): give 1 (optimizer state sharded), 2 (and the "
                         "gradients) or 3 (and the parameters, the default).")
    if shard.stage == 3:
        return
    for name, value, default in (("compress", shard.compress, None), ("mixed_precision", shard.mixed_precision, None)):
        if value != default:
            raise NotImplementedError(f"Shard(stage={shard.stage}, {name}={value!r}) is not supported: stages 1 and "
                                      f"2 reduce-scatter whole fp32 gradients outside the graph; drop {name} or "
                                      "use stage=3.")


def record_whole(shard, gm: fx.GraphModule, ctx: Context, shard_dims, shard_entry) -> PassResult:
    """The forward stage of stages 1 and 2: the graph unchanged, its parameters recorded as a
    ShardLayout over the shard dimension (shard_dims and shard_entry: shard.py's, as stage 3's)."""
    mesh = ctx.mesh
    dim, replicas, placed_on = shard_dims(shard, mesh)
    sums = forward_gradient_sums(gm, mesh) if shard.mesh is None else []
    if sums:  # as stage 3: the cp ranks' gradients summed by the reduce-scatter over dp_shard x cp
        drop_gradient_sums(gm, sums)
        gm.recompile()
        dim = mesh.joined("dp_shard", "cp")
        placed_on = mesh.placement_mesh(replicas, dim) if replicas is not None else None
    params = [n for n in gm.graph.nodes if is_parameter(n)]
    scalars = [input_slot(n).target for n in params if n.meta["val"].dim() == 0]
    if scalars:
        raise NotImplementedError(f"Shard: parameter {scalars[0]} is a scalar; only parameters with a first "
                                  "dimension are sharded.")
    entries = tuple(shard_entry(ctx, n, tuple(n.meta["val"].shape), 0, dim) for n in params)
    layout = ShardLayout(dim, False, entries, stage=shard.stage, summed=mesh.size("cp") if sums else 1,
                         replicas=replicas, mesh=placed_on)  # HSDP: the replicas all-reduce the shard
    layouts_of(gm).shards = layout
    shard.layouts[ctx.model] = layout
    return PassResult(True, {"stage": shard.stage, "parameters": len(entries), "ranks": dim.size,
                             "replicas": replicas.size if replicas else 1,
                             "spans": dim.name, "context_sums_absorbed": len(sums), "gathers_per_step": 1,
                             "reduce_scatters_per_step": "1" if shard.stage == 1 else "1 per micro-batch"})
