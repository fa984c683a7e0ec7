"""overlap: bucketed gradient all-reduce inside the backward graph, overlapping the backward.

The backward graph's gradient outputs are grouped into buckets in the order the backward
produces them. Per bucket, right after its last gradient:

    flat = cat([g.reshape(-1) for g in bucket])      # (bucket numel,)
    work = _c10d_functional.all_reduce(flat, "sum", group_name)    # issued, not waited for

and just before the graph returns (as late as the gradients' consumers allow):

    flat = wait_tensor(work) / world                  # gloo has no "avg": sum, then divide
    grads = [piece.view(shape) for piece in split(flat, numels)]

With `compress`, a compressor (passes/overlap_compress.py) writes the exchange instead: bf16,
int8 blocks, top-k, PowerSGD, and the embedding's gradient as rows ("sparse_rows"); their state
between steps lives in a CompressionState the runtime resets (`opt.reset_compression()`).

so the all-reduce of one bucket runs while the backward computes the next. Under no_sync
(`ctx.gradient_sync == "local"`) the pass adds nothing; after a no_sync phase
("sync_accumulated") each bucket adds the gradients accumulated so far (an attribute of the
graph the runtime fills) before its all-reduce, as DDP all-reduces the accumulated `.grad`.
"""
from __future__ import annotations

import dataclasses
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from picofx.cost.comm import Gradient, fixed_bounds, link_for, plan_buckets, schedule
from picofx.cost.gradients import dtype_runs, gradients_in_order, ready_times
from picofx.cost.units import parse_budget
from picofx.manager import Context, PassInfo, PassResult, Stage, register_pass
from picofx.parallel.layouts import BucketLayout, LayoutEntry, layouts_of
from picofx.parallel.mesh import resolve_dim

from picofx.compression.lossy import parse_compress
from picofx.compression.allreduce import (BucketIn, CompressionState, Dense, Emitter, SparseRows, embedding_rows,
                                            ring_bytes, rows_worth_it)

aten = torch.ops.aten


@register_pass("overlap", Stage.PARTITIONED)
@dataclass(frozen=True)
class Overlap:
    """bucket: "auto" (from the cost model), bytes, or a size string ("25MiB"); first_bucket: the
    first bucket's size, small so communication starts early; compress: None, "bf16", "int8",
    "int8:ef", "topk:F", "powersgd:R", "sparse_rows" or "sparse_rows+KIND" (see
    passes/overlap_compress.py); group: the ranks to average over: a mesh dimension's name, a
    one-dimensional DeviceMesh or a ProcessGroup (None: the run's mesh's dp_replicate dimension,
    else every rank); warmup: the first synced steps all-reduce whole gradients instead of
    compressing (the runtime runs a variant of the step; sparse_rows, being exact, stays), so the
    optimizer's state starts from them, as torch's PowerSGD hook's start_powerSGD_iter."""

    bucket: int | str = "auto"
    first_bucket: int | str = "1MiB"
    compress: str | None = None
    group: Any = None
    warmup: int = 0
    info = PassInfo(Stage.PARTITIONED, mesh_dims=("dp_replicate",), communicates=True)
    stage = info.stage
    # compressor state per optimized model: shared by every graph the model's runs compile
    states: Any = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "spec", parse_compress(self.compress))
        if self.bucket != "auto":
            parse_budget(self.bucket)
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"Overlap(warmup={self.warmup!r}): a number of steps, 0 or more")

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
        accumulate = mode == "sync_accumulated"
        rows, source, rows_note = self.sparse_rows(grads, accumulate, dim.size)
        other = Dense() if mode == "sync_uncompressed" else self.spec.other
        plan = self.plan(gm, grads, ctx, dim.size, rows, source, other)
        codecs = [SparseRows() if rows is not None and b.first == rows else other for b in plan.buckets]
        state = self.states.setdefault(ctx.model, CompressionState(dim.rank))
        layout, wire = self.rewrite(gm, grads, plan, codecs, Emitter(gm, dim, state), source, accumulate)
        layouts_of(gm).buckets = dataclasses.replace(layout, warmup=self.warmup if self.spec.other != Dense() else 0)
        notes = {**plan.notes(), "compress": self.compress, "gradient_sync": mode, **wire}
        if self.spec.rows:
            notes["embedding_rows"] = rows_note
        return PassResult(True, notes)

    def sparse_rows(self, grads, accumulate: bool, world: int):
        """Which gradient goes as rows (its index in `grads`), its Rows, and why it does or does not."""
        if not self.spec.rows:
            return None, None, "off"
        index, source, why = embedding_rows(grads, accumulate)
        if index is None:
            return None, None, why
        fewer, sparse, dense = rows_worth_it(source, grads[index][1].meta["val"], world)
        name = grads[index][2]
        if not fewer:
            return None, None, f"dense: {name} as rows is {sparse} bytes per rank, the table {dense}"
        return index, source, f"sparse: {name} as rows is {sparse} bytes per rank instead of {dense}"

    def wire_bytes(self, codec, members, world: int, source=None) -> int:
        """Bytes each rank sends for one bucket with `codec`."""
        if isinstance(codec, SparseRows):
            return rows_worth_it(source, members[0][1].meta["val"], world)[1]
        shapes = [tuple(node.meta["val"].shape) for _, node, _ in members]
        return codec.wire_bytes(shapes, members[0][1].meta["val"].element_size(), world)

    def plan(self, gm, grads, ctx: Context, world: int, rows: int | None, source, other):
        """Bucket bounds (auto: from the cost model) and their predicted timing, in all-reduce
        bytes that take as long as what the compressor sends (the embedding as rows: its own bucket)."""
        ring = lambda b: b * world / (2 * (world - 1)) if world > 1 else b  # noqa: E731
        wire = [int(ring(self.wire_bytes(SparseRows() if i == rows else other, [g], world, source)))
                for i, g in enumerate(grads)]
        ready, total = ready_times(gm, [g[1] for g in grads], ctx.cost_model)
        items = [Gradient(g[2], b, t) for g, b, t in zip(grads, wire, ready)]
        link = link_for(ctx.cost_model.device, world)
        first = parse_budget(self.first_bucket)
        if self.bucket == "auto":
            bounds = [b.last for b in plan_buckets(items, total, world, link, first).buckets]
        else:
            bounds = fixed_bounds(items, parse_budget(self.bucket), first)
        alone = [] if rows is None else [i for i in (rows - 1, rows) if i >= 0]
        bounds = sorted(set(bounds) | set(dtype_runs(grads)) | set(alone))
        return schedule(items, bounds, total, world, link)

    def rewrite(self, gm, grads, plan, codecs, em: Emitter, source, accumulate: bool):
        graph = gm.graph
        output = graph.output_node()
        outputs = list(output.args[0])
        entries, pending_names, exchanges, report = [], [], [], []
        for k, (bucket, codec) in enumerate(zip(plan.buckets, codecs)):
            members = grads[bucket.first:bucket.last + 1]  # in production order: the last one is made last
            val = members[0][1].meta["val"]
            with graph.inserting_before(members[-1][1].next):  # right after the bucket's last gradient
                flats = [graph.call_function(aten.reshape.default, (node, [-1])) for _, node, _ in members]
                flat = graph.call_function(aten.cat.default, (flats,)) if len(flats) > 1 else flats[0]
                if accumulate:
                    name = f"overlap_pending_{k}"
                    gm.register_buffer(name, torch.zeros(flat_numel(members), dtype=val.dtype, device=val.device),
                                       persistent=False)
                    pending_names.append(name)
                    flat = graph.call_function(aten.add.Tensor, (flat, graph.get_attr(name)))
                shapes = [tuple(node.meta["val"].shape) for _, node, _ in members]
                rows = source if isinstance(codec, SparseRows) else None
                exchange = codec.exchange(em, BucketIn(flat, [m[2] for m in members], shapes, val.dtype,
                                                       val.device, rows))
                next(exchange)  # issues the bucket's first collective here
            exchanges.append((exchange, members))
            entries += [LayoutEntry(name, tuple(node.meta["val"].shape), str(node.meta["val"].dtype), k)
                        for _, node, name in members]
            report.append({"bucket": k, "compressor": codec.label,
                           "wire_bytes": self.wire_bytes(codec, members, em.world, source),
                           "fp32_ring_bytes": ring_bytes(4 * flat_numel(members), em.world)})
        results = self.finish([e for e, _ in exchanges], graph, output)
        with graph.inserting_before(output):
            for flat, (_, members) in zip(results, exchanges):
                numels = [node.meta["val"].numel() for _, node, _ in members]
                pieces = graph.call_function(aten.split_with_sizes.default, (flat, numels))
                for i, (pos, node, _) in enumerate(members):
                    piece = graph.call_function(operator.getitem, (pieces, i))
                    outputs[pos] = graph.call_function(aten.view.default, (piece, list(node.meta["val"].shape)))
        output.args = (outputs,)
        graph.eliminate_dead_code()
        layout = BucketLayout(dim=em.dim, compress=self.compress, entries=tuple(entries),
                              pending=tuple(pending_names), codecs=tuple(c.label for c in codecs), state=em.state)
        return layout, wire_notes(report)

    @staticmethod
    def finish(exchanges: list, graph: fx.Graph, output: fx.Node) -> list[fx.Node]:
        """Run each bucket's remaining rounds before the output, round by round over the buckets,
        so a bucket's next collective is issued before the following bucket's waits."""
        results: dict[int, fx.Node] = {}
        active = list(enumerate(exchanges))
        with graph.inserting_before(output):
            while active:
                still = []
                for k, exchange in active:
                    try:
                        next(exchange)
                        still.append((k, exchange))
                    except StopIteration as done:
                        results[k] = done.value
                active = still
        return [results[k] for k in range(len(exchanges))]


def wire_notes(report: list[dict]) -> dict:
    sent = sum(r["wire_bytes"] for r in report)
    ring = sum(r["fp32_ring_bytes"] for r in report)
    return {"compression": report, "wire_bytes": sent, "fp32_ring_bytes": ring,
            "wire_ratio": round(sent / ring, 4) if ring else 1.0}


def flat_numel(members) -> int:
    return sum(node.meta["val"].numel() for _, node, _ in members)
