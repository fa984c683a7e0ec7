"""shard: sharded data parallel (ZeRO-3, as FSDP2 shards) inside the captured step.

Forward stage: every parameter placeholder takes this rank's dim-0 shard, padded to the common
row count P = ceil(rows / N), instead of the whole tensor. The parameters, in the order the
forward first reads them, are cut into buckets (a decoder layer's by default); each bucket's shards
travel in one all-gather, issued `prefetch` buckets ahead and waited just before first use:

    gathered = _c10d_functional_autograd.all_gather_into_tensor(cat(shards), N, group)
    whole_i = wait_tensor(gathered).view(N, M)[:, off_i:off_i + m_i].reshape(N * P_i, ...)[:rows_i]

The autograd all-gather's backward is a reduce-scatter (sum), so the backward hands each rank the
gradient of its own padded shard. Partitioned stage (backward graph): those gradients are divided
by N, since gloo has no "avg" (DDP's average). Joint stage, with reshard_after_forward: the gathers
and what views them are tagged for recomputation, so the backward gathers again instead of keeping
the whole parameters alive between forward and backward. The decision is recorded as a ShardLayout
on the forward graph; the runtime (picofx.runtime.shard) turns the model's parameters into DTensor
shards and feeds the graph their padded local pieces.

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
from picofx.capture.vocabulary import COPY_PACKETS, input_slot, is_parameter, is_view, layer_of_path
from picofx.cost.units import parse_budget
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import ShardEntry, ShardLayout, layouts_of
from picofx.parallel.mesh import MeshDim, resolve_dim

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER = torch.ops._c10d_functional_autograd.all_gather_into_tensor.default
CAST = aten._to_copy.default
CASTS = (CAST, torch.ops.prims.convert_element_type.default)  # a dtype cast, before and after decomposition
GATHER_DTYPES = {"bf16": torch.bfloat16, torch.bfloat16: torch.bfloat16}
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
    from the forward (False). bucket: which parameters share one all-gather: "auto" (a decoder
    layer's; FSDP2's unit), bytes or a size string ("16MiB"), or 0 (one gather per parameter).
    prefetch: issue a bucket's gather this many buckets before its first use (0: just before it),
    so it overlaps the previous layer's compute. mixed_precision: None, or "bf16" (FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16) with reduce_dtype left to it): fp32 shards, the master
    copy, are gathered in bf16 and their gradients reduce-scattered in bf16; the graph computes in
    the dtype it did (list "precision" before "shard" to compute in bf16)."""

    mesh: Any = None
    reshard_after_forward: bool = True
    bucket: int | str = "auto"
    prefetch: int = 1
    mixed_precision: Any = None
    info = PassInfo(Stage.FORWARD, also_at=(Stage.JOINT, Stage.PARTITIONED), mesh_dims=("dp_shard",),
                    communicates=True)
    stage = info.stage

    def __post_init__(self):
        if self.mixed_precision not in (None, *GATHER_DTYPES):
            raise NotImplementedError(f"Shard(mixed_precision={self.mixed_precision!r}): give None or 'bf16' "
                                      "(gradients reduced in fp32 are not supported yet).")
        if self.bucket not in ("auto", 0):
            parse_budget(self.bucket)
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Shard(prefetch={self.prefetch!r}): give a count of buckets, 0 or more")

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
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        params = []  # (first use, placeholder, whole shape) in the order the forward first reads them
        for node in [n for n in gm.graph.nodes if is_parameter(n)]:
            val = node.meta["val"]
            if val.dim() == 0:
                raise NotImplementedError(f"Shard: parameter {input_slot(node).target} is a scalar; only "
                                          "parameters with a first dimension are sharded.")
            first = min(node.users, key=order.__getitem__) if node.users else None
            params.append((first, node, tuple(val.shape)))
            with mode:  # the placeholder now takes this rank's padded shard
                node.meta["val"] = torch.empty((padded_rows(val.shape[0], dim.size), *val.shape[1:]),
                                               dtype=val.dtype, device=val.device)
        params.sort(key=lambda p: order[p[0]] if p[0] is not None else len(order))
        buckets = self.buckets([p for p in params if p[0] is not None])
        unread = [p for p in params if p[0] is None]  # sharded all the same, in no bucket
        entries = [shard_entry(ctx, node, shape, k, dim) for k, bucket in [*enumerate(buckets), (-1, unread)]
                   for _, node, shape in bucket]
        issued = [buckets[max(0, k - self.prefetch)][0][0] for k in range(len(buckets))]
        wire = GATHER_DTYPES.get(self.mixed_precision)
        gathers = [issue_gather(gm.graph, bucket, dim, issued[k], wire) for k, bucket in enumerate(buckets)]
        for bucket, gathered in zip(buckets, gathers):  # waits after every gather issued at the same place
            wait_and_unpack(gm.graph, bucket, gathered, dim)
        gm.graph.eliminate_dead_code()
        layouts_of(gm).shards = ShardLayout(dim, self.reshard_after_forward, tuple(entries),
                                            str(wire) if wire else None)
        return PassResult(True, {"parameters": len(entries), "ranks": dim.size, "buckets": len(buckets),
                                 "prefetch": self.prefetch, "gather_dtype": str(wire) if wire else None,
                                 "reshard_after_forward": self.reshard_after_forward,
                                 "gathers": [describe_bucket(b, issued[k], dim.size) for k, b in enumerate(buckets)]})

    def buckets(self, params: list) -> list[list]:
        """Parameters in first-use order, cut into gathers: "auto": one per decoder layer, and one
        per run of parameters outside the layers (the embedding; the final norm and head); a size:
        consecutive parameters up to that many bytes; 0: one per parameter. Never mixing dtypes."""
        limit = None if self.bucket == "auto" else 0 if self.bucket == 0 else parse_budget(self.bucket)
        out: list[list] = []
        size = 0
        for param in params:
            node = param[1]
            val = node.meta["val"]
            nbytes = val.numel() * val.element_size()
            if out:
                last = out[-1][-1]
                same_dtype = last[1].meta["val"].dtype == val.dtype
                fits = (layer_of_parameter(last[1]) == layer_of_parameter(node) if limit is None
                        else size + nbytes <= limit)
                if same_dtype and fits:
                    out[-1].append(param)
                    size += nbytes
                    continue
            out.append([param])
            size = nbytes
        return out

    def tag_regather(self, gm: fx.GraphModule) -> PassResult:
        """Recompute each gather in the backward instead of saving what it gathered: the gather,
        the flattening of its shards, its wait and every view or copy of the gathered rows (a
        transposed weight is what a matmul's backward reads)."""
        tagged = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is GATHER:
                pending = [node, *[a for a in node.all_input_nodes if a.op == "call_function"]]
                pending += [a for n in pending[1:] for a in n.all_input_nodes if a.op == "call_function"]
                pending += [u for u in node.users if u.target is c10d.wait_tensor.default]
                while pending:
                    n = pending.pop()
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    pending += [u for u in n.users if is_view(u) or is_copy(u) or u.target in CASTS]
                tagged += 1
        return PassResult(tagged > 0, {"regathered": tagged})


def is_copy(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in COPY_PACKETS


def layer_of_parameter(node: fx.Node) -> str | None:
    """The decoder layer a parameter belongs to, by its name (a fused op reading it may span two)."""
    return layer_of_path(input_slot(node).target)


def shard_entry(ctx: Context, node: fx.Node, shape: tuple, bucket: int, dim: MeshDim) -> ShardEntry:
    name = input_slot(node).target
    return ShardEntry(name, shape, padded_rows(shape[0], dim.size), str(node.meta["val"].dtype), bucket,
                      ctx.model.get_parameter(name).requires_grad, local_rows(shape[0], dim.size, dim.rank))


def issue_gather(graph: fx.Graph, bucket: list, dim: MeshDim, before: fx.Node, wire) -> fx.Node:
    """All-gather the bucket's padded shards as one flat tensor, issued before node `before`:

        flat = cat([shard.reshape(-1) for shard in bucket])     # (M,), M = the shards' numel
        flat = flat.to(wire)                                    # mixed precision only
        gathered = all_gather(flat, N, group)                   # (N * M,): rank r's shards at r * M
    """
    shards = [node for _, node, _ in bucket]
    with graph.inserting_before(before):
        flat = shards[0] if len(shards) == 1 else graph.call_function(
            aten.cat.default, ([graph.call_function(aten.reshape.default, (s, [-1])) for s in shards],))
        if wire is not None and shards[0].meta["val"].dtype != wire and shards[0].meta["val"].is_floating_point():
            flat = graph.call_function(CAST, (flat,), {"dtype": wire})
        return graph.call_function(GATHER, (flat, dim.size, dim.group_name))


def wait_and_unpack(graph: fx.Graph, bucket: list, gathered: fx.Node, dim: MeshDim) -> None:
    """Wait for the bucket's gather before its first use and cut each whole parameter out of it,
    `rows = gathered.view(N, M); whole_i = rows[:, off_i:off_i + m_i].reshape(N * P_i, ...)[:rows_i]`;
    the parameters' readers read those instead."""
    shards = [node for _, node, _ in bucket]
    with graph.inserting_before(bucket[0][0]):
        waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
        if len(shards) > 1:
            rows = graph.call_function(aten.view.default,
                                       (waited, [dim.size, sum(s.meta["val"].numel() for s in shards)]))
        offset, wholes = 0, []
        for (_, node, shape), shard in zip(bucket, (s.meta["val"] for s in shards)):
            whole = waited
            if len(shards) > 1:
                piece = graph.call_function(aten.slice.Tensor, (rows, 1, offset, offset + shard.numel()))
                whole = graph.call_function(aten.reshape.default,
                                            (piece, [dim.size * shard.shape[0], *shard.shape[1:]]))
                offset += shard.numel()
            if shard.shape[0] * dim.size != shape[0]:
                whole = graph.call_function(aten.slice.Tensor, (whole, 0, 0, shape[0]))
            if gathered.args[0].target is CAST:  # gathered in the wire dtype: back to the parameter's
                whole = graph.call_function(CAST, (whole,), {"dtype": shard.dtype})
            wholes.append(whole)
    flat = gathered.args[0]
    own = {gathered, flat, *flat.all_input_nodes}  # the nodes that read the shards themselves
    own |= {a for n in flat.all_input_nodes for a in n.all_input_nodes} if flat.target is CAST else set()
    for node, whole in zip(shards, wholes):
        for user in [u for u in node.users if u not in own]:
            user.replace_input_with(node, whole)


def describe_bucket(bucket: list, issued: fx.Node, world: int) -> str:
    names = [input_slot(node).target for _, node, _ in bucket]
    nbytes = sum(node.meta["val"].numel() * node.meta["val"].element_size() for _, node, _ in bucket) * world
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{shown}: {nbytes / 2**20:.2f} MiB gathered, issued before {issued.name}, "
            f"awaited before {bucket[0][0].name}")


def average_gradients(gm: fx.GraphModule) -> PassResult:
    """Divide each reduce-scattered gradient output by its group's size: DDP's average."""
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    averaged = 0
    for pos, node in enumerate(outputs):
        if not isinstance(node, fx.Node):
            continue
        waited = node
        while waited.op == "call_function" and (is_view(waited) or waited.target in CASTS):
            waited = waited.args[0]  # through views and mixed precision's cast back to the parameter's dtype
        if waited.target is not c10d.wait_tensor.default or getattr(waited.args[0], "target", None) not in SCATTER:
            continue
        group_size = waited.args[0].args[2]
        with graph.inserting_before(output):
            outputs[pos] = graph.call_function(aten.div.Tensor, (node, group_size))
        averaged += 1
    output.args = (outputs,)
    return PassResult(averaged > 0, {"averaged_gradients": averaged})
