"""overlap: bucketed gradient all-reduce inside the backward graph, overlapping the backward.

The backward graph's gradient outputs are grouped into buckets in the order the backward
produces them. Per bucket, right after its last gradient:

    flat = cat([g.reshape(-1) for g in bucket])      # (bucket numel,)
    flat = flat.to(bf16)                              # compress="bf16" only
    work = _c10d_functional.all_reduce(flat, "sum", group_name)    # issued, not waited for

and just before the graph returns (as late as the gradients' consumers allow):

    flat = wait_tensor(work).to(grad dtype) / world   # gloo has no "avg": sum, then divide
    grads = [piece.view(shape) for piece in split(flat, numels)]

so the all-reduce of one bucket runs while the backward computes the next. Under no_sync
(`ctx.gradient_sync == "local"`) the pass adds nothing; after a no_sync phase
("sync_accumulated") each bucket adds the gradients accumulated so far (an attribute of the
graph the runtime fills) before its all-reduce, as DDP all-reduces the accumulated `.grad`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from picofx.cost.comm import Gradient, fixed_bounds, link_for, plan_buckets, schedule
from picofx.cost.gradients import dtype_runs, gradients_in_order, ready_times
from picofx.cost.units import parse_budget
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import BucketLayout, LayoutEntry, layouts_of
from picofx.parallel.mesh import MeshDim, resolve_dim

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
COMPRESSED = {"bf16": torch.bfloat16}


@register_pass("overlap", Stage.PARTITIONED)
@dataclass(frozen=True)
class Overlap:
    """bucket: "auto" (from the cost model), bytes, or a size string ("25MiB"); first_bucket: the
    first bucket's size, small so communication starts early; compress: None or "bf16" (all-reduce
    in bf16, gradients back in their own dtype); group: the ranks to average over: a mesh dimension's
    name, a one-dimensional DeviceMesh or a ProcessGroup (None: the run's mesh's dp_replicate
    dimension, else every rank)."""

    bucket: int | str = "auto"
    first_bucket: int | str = "1MiB"
    compress: str | None = None
    group: Any = None
    info = PassInfo(Stage.PARTITIONED, mesh_dims=("dp_replicate",), communicates=True)
    stage = info.stage

    def __post_init__(self):
        if self.compress not in (None, *COMPRESSED):
            raise ValueError(f"Overlap(compress={self.compress!r}): use None or one of {sorted(COMPRESSED)}")
        if self.bucket != "auto":
            parse_budget(self.bucket)

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        if ctx.graph_role != "backward":
            return PassResult(False, {})
        mode = ctx.gradient_sync
        if mode == "local":
            return PassResult(False, {"gradient_sync": "local (no_sync): no all-reduce"})
        dim = resolve_dim(self.group, ctx.mesh, "dp_replicate", "the overlap pass")
        grads = gradients_in_order(gm, ctx.input_names)
        if not grads:
            return PassResult(False, {"buckets": 0})
        plan = self.plan(gm, grads, ctx, dim.size)
        layouts_of(gm).buckets = self.rewrite(gm, grads, plan, dim, accumulate=mode == "sync_accumulated")
        return PassResult(True, {**plan.notes(), "compress": self.compress, "gradient_sync": mode})

    def plan(self, gm, grads, ctx: Context, world: int):
        """Bucket bounds (auto: from the cost model) and their predicted timing, in bytes on the wire."""
        wire = [g[1].meta["val"].numel() * (COMPRESSED[self.compress].itemsize if self.compress
                                             else g[1].meta["val"].element_size()) for g in grads]
        ready, total = ready_times(gm, [g[1] for g in grads], ctx.cost_model)
        items = [Gradient(g[2], b, t) for g, b, t in zip(grads, wire, ready)]
        link = link_for(ctx.cost_model.device, world)
        first = parse_budget(self.first_bucket)
        if self.bucket == "auto":
            bounds = [b.last for b in plan_buckets(items, total, world, link, first).buckets]
        else:
            bounds = fixed_bounds(items, parse_budget(self.bucket), first)
        bounds = sorted(set(bounds) | set(dtype_runs(grads)))
        return schedule(items, bounds, total, world, link)

    def rewrite(self, gm, grads, plan, dim: MeshDim, accumulate: bool) -> BucketLayout:
        graph = gm.graph
        output = graph.output_node()
        outputs = list(output.args[0])
        entries, pending_names, works = [], [], []
        for k, bucket in enumerate(plan.buckets):
            members = grads[bucket.first:bucket.last + 1]  # in production order: the last one is made last
            dtype = members[0][1].meta["val"].dtype
            with graph.inserting_before(members[-1][1].next):  # right after the bucket's last gradient
                flats = [graph.call_function(aten.reshape.default, (node, [-1])) for _, node, _ in members]
                flat = graph.call_function(aten.cat.default, (flats,)) if len(flats) > 1 else flats[0]
                if accumulate:
                    name = f"overlap_pending_{k}"
                    gm.register_buffer(name, torch.zeros(flat_numel(members), dtype=dtype,
                                                         device=members[0][1].meta["val"].device), persistent=False)
                    pending_names.append(name)
                    flat = graph.call_function(aten.add.Tensor, (flat, graph.get_attr(name)))
                if self.compress:
                    flat = graph.call_function(torch.ops.prims.convert_element_type.default,
                                               (flat, COMPRESSED[self.compress]))
                work = graph.call_function(c10d.all_reduce.default, (flat, "sum", dim.group_name))
            works.append((work, members, dtype))
            entries += [LayoutEntry(name, tuple(node.meta["val"].shape), str(node.meta["val"].dtype), k)
                        for _, node, name in members]
        for work, members, dtype in works:  # waits last: nothing but the outputs reads them
            with graph.inserting_before(output):
                flat = graph.call_function(c10d.wait_tensor.default, (work,))
                if self.compress:
                    flat = graph.call_function(torch.ops.prims.convert_element_type.default, (flat, dtype))
                flat = graph.call_function(aten.div.Tensor, (flat, dim.size))
                numels = [node.meta["val"].numel() for _, node, _ in members]
                pieces = graph.call_function(aten.split_with_sizes.default, (flat, numels))
                for i, (pos, node, _) in enumerate(members):
                    piece = graph.call_function(operator.getitem, (pieces, i))
                    outputs[pos] = graph.call_function(aten.view.default, (piece, list(node.meta["val"].shape)))
        output.args = (outputs,)
        graph.eliminate_dead_code()
        return BucketLayout(dim=dim, compress=self.compress, entries=tuple(entries), pending=tuple(pending_names))



def flat_numel(members) -> int:
    return sum(node.meta["val"].numel() for _, node, _ in members)
