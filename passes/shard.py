"""shard: sharded data parallel (ZeRO-3, as FSDP2 shards) inside the captured step.

Forward stage: every parameter placeholder takes this rank's dim-0 shard, padded to the common
row count P = ceil(rows / N), instead of the whole tensor. Before the parameter's first use:

    gathered = _c10d_functional_autograd.all_gather_into_tensor(shard, N, group)   # (N*P, ...)
    full = slice(wait_tensor(gathered), 0, 0, rows)                                 # the parameter

The autograd all-gather's backward is a reduce-scatter (sum), so the backward hands each rank the
gradient of its own padded shard. Partitioned stage (backward graph): those gradients are divided
by N, since gloo has no "avg" (DDP's average). Joint stage, with reshard_after_forward: the gather
nodes are tagged for recomputation, so the backward gathers again instead of keeping the whole
parameters alive between forward and backward. The decision is recorded as a ShardLayout on the
forward graph; the runtime (picofx.runtime.shard) turns the model's parameters into DTensor shards
and feeds the graph their padded local pieces.

List `shard` after the passes that rewrite the forward graph (fuse, precision): they see the
parameters gathered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import input_slot, is_parameter, is_view, viewed_source
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import ShardEntry, ShardLayout, layouts_of
from picofx.parallel.mesh import MeshDim, resolve_dim

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER = torch.ops._c10d_functional_autograd.all_gather_into_tensor.default
SCATTER = (c10d.reduce_scatter_tensor.default, torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default)


def padded_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def local_rows(rows: int, world: int, rank: int) -> int:
    """This rank's rows under DTensor's Shard(0) (torch.chunk's split: full chunks first)."""
    return max(0, min(rows, (rank + 1) * padded_rows(rows, world)) - rank * padded_rows(rows, world))


@register_pass("shard")
@dataclass(frozen=True)
class Shard:
    """mesh: the ranks to shard over: a mesh dimension's name, a one-dimensional DeviceMesh or a
    ProcessGroup (None: the run's mesh's dp_shard dimension, else every rank).
    reshard_after_forward: gather again in the backward (True) or keep the gathered parameters
    from the forward (False). bucket, prefetch: accepted for FSDP2's surface; every parameter is
    gathered on its own, just before its first use, for now. mixed_precision: not yet (None)."""

    mesh: Any = None
    reshard_after_forward: bool = True
    bucket: int | str = "auto"
    prefetch: int = 1
    mixed_precision: Any = None
    info = PassInfo(Stage.FORWARD, also_at=(Stage.JOINT, Stage.PARTITIONED), mesh_dims=("dp_shard",),
                    communicates=True)
    stage = info.stage

    def __post_init__(self):
        if self.mixed_precision is not None:
            raise NotImplementedError("Shard(mixed_precision=...) is not supported yet; combine Shard with the "
                                      "'precision' pass for bf16 compute.")

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        if ctx.stage is Stage.FORWARD:
            return self.shard_forward(gm, ctx)
        if ctx.stage is Stage.JOINT:
            return self.tag_regather(gm) if self.reshard_after_forward else PassResult(False, {})
        if ctx.graph_role == "backward":
            return average_gradients(gm)
        return PassResult(False, {})

    def shard_forward(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        dim = resolve_dim(self.mesh, ctx.mesh, "dp_shard", "the shard pass")
        mode = fake_mode_of(gm)
        entries = []
        for node in [n for n in gm.graph.nodes if is_parameter(n)]:
            val = node.meta["val"]
            if val.dim() == 0:
                raise NotImplementedError(f"Shard: parameter {input_slot(node).target} is a scalar; only "
                                          "parameters with a first dimension are sharded.")
            name = input_slot(node).target
            rows, padded = val.shape[0], padded_rows(val.shape[0], dim.size)
            requires_grad = ctx.model.get_parameter(name).requires_grad
            entries.append(ShardEntry(name, tuple(val.shape), padded, str(val.dtype), len(entries), requires_grad,
                                      local_rows(rows, dim.size, dim.rank)))
            with mode:
                node.meta["val"] = torch.empty((padded, *val.shape[1:]), dtype=val.dtype, device=val.device)
            self.gather_before_first_use(gm, node, rows, dim)
        gm.graph.eliminate_dead_code()
        layouts_of(gm).shards = ShardLayout(dim, self.reshard_after_forward, tuple(entries))
        padding = sum(e.padded_rows * dim.size - e.shape[0] for e in entries)
        return PassResult(True, {"parameters": len(entries), "ranks": dim.size, "padded_rows": padding,
                                 "reshard_after_forward": self.reshard_after_forward})

    def gather_before_first_use(self, gm: fx.GraphModule, node: fx.Node, rows: int, dim: MeshDim) -> None:
        users = list(node.users)
        if not users:
            return
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(users, key=order.__getitem__)
        graph = gm.graph
        with graph.inserting_before(first):
            gathered = graph.call_function(GATHER, (node, dim.size, dim.group_name))
            full = graph.call_function(c10d.wait_tensor.default, (gathered,))
            if padded_rows(rows, dim.size) * dim.size != rows:
                full = graph.call_function(aten.slice.Tensor, (full, 0, 0, rows))
        for user in users:
            user.replace_input_with(node, full)

    def tag_regather(self, gm: fx.GraphModule) -> PassResult:
        """Recompute each gather, its wait and every view of the gathered parameter (a transposed
        weight is what a matmul's backward reads) in the backward instead of saving them."""
        tagged = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is GATHER:
                waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
                pending = [node, *waits]
                while pending:
                    n = pending.pop()
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    pending += [u for u in n.users if is_view(u)]
                tagged += 1
        return PassResult(tagged > 0, {"regathered": tagged})


def average_gradients(gm: fx.GraphModule) -> PassResult:
    """Divide each reduce-scattered gradient output by its group's size: DDP's average."""
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    averaged = 0
    for pos, node in enumerate(outputs):
        if not isinstance(node, fx.Node):
            continue
        waited = viewed_source(node)
        if waited.target is not c10d.wait_tensor.default or getattr(waited.args[0], "target", None) not in SCATTER:
            continue
        group_size = waited.args[0].args[2]
        with graph.inserting_before(output):
            outputs[pos] = graph.call_function(aten.div.Tensor, (node, group_size))
        averaged += 1
    output.args = (outputs,)
    return PassResult(averaged > 0, {"averaged_gradients": averaged})
