"""overlap: bucketed gradient all-reduce inside the backward graph, overlapping the backward.

The backward graph's gradient outputs are grouped into buckets in the order the backward
produces them. Per bucket, right after its last gradient:

    flat = cat([g.reshape(-1) for g in bucket])      # (bucket numel,)
    work = _c10d_functional.all_reduce(flat, "sum", group_name)    # issued, not waited for

and just before the graph returns (as late as the gradients' consumers allow):

    flat = wait_tensor(work) / world                  # gloo has no "avg": sum, then divide
    grads = [piece.view(shape) for piece in split(flat, numels)]

so the all-reduce of one bucket runs while the backward computes the next. Beside context
parallelism the group spans dp_replicate x cp: the all-reduce also sums what the cp ranks computed
from their parts of the sequences (taken out of the graph as context_parallel wrote it), and the
average is over dp_replicate. With `compress`, a codec of picofx.compression writes each
bucket's exchange instead (bf16, int8 blocks, top-k, PowerSGD, the embedding's gradient as rows):
its issue step where the bucket is ready, its finish steps before the graph returns; their state
between steps lives in a CompressionState the runtime resets (`opt.reset_compression()`). Under
no_sync (`ctx.gradient_sync is SyncMode.LOCAL`) the pass adds no all-reduce (beside context
parallelism it still takes the cp sums out, so what accumulates is this rank's own gradient);
after a no_sync phase ("sync_accumulated") each bucket adds the gradients accumulated so far (an
attribute of the graph the runtime fills) before its all-reduce, as DDP all-reduces the
accumulated `.grad`.
"""
from __future__ import annotations

import dataclasses
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from picofx.compression import (START_STEPS, Bucket, CompressionState, Dense, Emitter, SparseRows, drain,
                                embedding_rows, issue, parse_compress, rows_or_dense, start_of)
from picofx.cost.comm import (Gradient, all_reduce_bytes, all_reduce_size_sending, fixed_bounds, link_for,
                              plan_buckets, schedule)
from picofx.cost.gradients import dtype_runs, gradients_in_order, ready_times
from picofx.cost.units import parse_budget
from picofx.manager import Context, GraphRole, PassInfo, PassResult, Stage, SyncMode, register_pass
from picofx.parallel.layouts import BucketLayout, LayoutEntry, layouts_of
from picofx.parallel.mesh import resolve_dim
from picofx.parallel.gradient_sums import backward_gradient_sums, drop_gradient_sums

aten = torch.ops.aten


@register_pass("overlap")
@dataclass(frozen=True)
class Overlap:
    """bucket: "auto" (from the cost model), bytes, or a size string ("25MiB"); first_bucket: the
    first bucket's size, small so communication starts early; compress: None, "bf16", "int8",
    "int8:ef", "topk:F", "powersgd:R", "sparse_rows" or "sparse_rows+KIND" (see
    picofx/compression/parse.py); group: the ranks to average over: a mesh dimension's name, a
    one-dimensional DeviceMesh or a ProcessGroup (None: the run's mesh's dp_replicate dimension,
    else every rank); warmup: the first synced steps all-reduce whole gradients instead of
    compressing (the runtime runs a variant of the step; sparse_rows, being exact, stays), so the
    optimizer's state starts from them, as torch's PowerSGD hook's start_powerSGD_iter; start: without
    a warmup, the first synced steps PowerSGD sends as int8 (picofx/compression/start.py; 0:
    compressed from the first step). Neither runs
    under a pipeline, whose stages have no step variants."""

    bucket: int | str = "auto"
    first_bucket: int | str = "1MiB"
    compress: str | None = None
    group: Any = None
    warmup: int = 0
    start: int = START_STEPS
    info = PassInfo(Stage.PARTITIONED, mesh_dims=("dp_replicate",), communicates=True)
    # compressor state per optimized model: shared by every graph the model's runs compile
    states: Any = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "spec", parse_compress(self.compress))
        if self.bucket != "auto":
            parse_budget(self.bucket)
        for option in ("warmup", "start"):
            if not isinstance(getattr(self, option), int) or getattr(self, option) < 0:
                raise ValueError(f"Overlap({option}={getattr(self, option)!r}): a number of steps, 0 or more")

    def __call__(self, gm: fx.GraphModule, ctx: Context) -> PassResult:
        if ctx.graph_role is not GraphRole.BACKWARD:
            return PassResult(False, {})
        mode = ctx.gradient_sync
        summed = self.take_context_sums(gm, ctx)
        if mode is SyncMode.LOCAL:
            return PassResult(summed > 1, {"gradient_sync": "local (no_sync): no all-reduce"})
        dim = resolve_dim(self.group, ctx.mesh, "dp_replicate", "the overlap pass")
        if summed > 1:
            dim = ctx.mesh.joined("dp_replicate", "cp")
        if self.warmup and ctx.mesh is not None and "pp" in ctx.mesh.used():
            raise ValueError(f"Overlap(warmup={self.warmup}): a pipeline's stages have no uncompressed variant to "
                             "warm up with; drop warmup under Pipeline (picofx train: --compress-warmup with --pp)")
        grads = gradients_in_order(gm, ctx.input_names)
        if not grads:
            return PassResult(False, {"buckets": 0})
        accumulate = mode is SyncMode.SYNC_ACCUMULATED
        rows, source, rows_bytes, rows_note = self.sparse_rows(grads, accumulate, dim.size)
        pipelined = ctx.mesh is not None and "pp" in ctx.mesh.used()
        first, start_steps = start_of(self.spec.other, 0 if self.warmup or pipelined else self.start)
        # the warm-up steps' variant: whole gradients, or a lossy compressor's int8 start
        other = (first or Dense()) if mode is SyncMode.SYNC_UNCOMPRESSED else self.spec.other
        plan = self.plan(gm, grads, ctx, dim.size, rows, rows_bytes, other)
        codecs = [SparseRows() if rows is not None and b.first == rows else other for b in plan.buckets]
        state = self.states.setdefault(ctx.model, CompressionState.for_dim(dim))
        layout, wire = self.rewrite(gm, grads, plan, codecs, Emitter(gm, dim, state, summed), source, accumulate)
        steps = (self.warmup or start_steps) if self.spec.other != Dense() else 0
        layouts_of(gm).buckets = dataclasses.replace(layout, warmup=steps)
        notes = {**plan.notes(), "compress": self.compress, "gradient_sync": mode, "spans": dim.name, **wire}
        if start_steps:
            notes["start"] = f"the first {start_steps} synced steps as {first.label}"
        if self.spec.rows:
            notes["embedding_rows"] = rows_note
        return PassResult(True, notes)

    def take_context_sums(self, gm: fx.GraphModule, ctx: Context) -> int:
        """Beside context parallelism (the run's cp ranks, this pass given no group and no compress),
        take its all-reduce of each gradient over cp out of the backward: the buckets' all-reduce
        spans dp_replicate x cp and sums them, averaging over dp_replicate only. Returns how many
        ranks' gradients the all-reduce then sums beside the averaged ones (cp; 1: none taken)."""
        if self.group is not None or self.compress is not None:
            return 1
        grads = gradients_in_order(gm, ctx.input_names)
        sums = backward_gradient_sums(gm, ctx.mesh, [node for _, node, _ in grads]) if grads else []
        if not sums:
            return 1
        drop_gradient_sums(gm, sums)
        gm.recompile()
        return ctx.mesh.size("cp")

    def sparse_rows(self, grads, accumulate: bool, world: int):
        """Which gradient goes as rows (its index in `grads`), its Rows, the bytes they send, and why
        it does or does not."""
        if not self.spec.rows:
            return None, None, 0, "off"
        index, source, why = embedding_rows(grads, accumulate)
        if index is None:
            return None, None, 0, why
        table = grads[index][1].meta["val"]
        dense = all_reduce_bytes(table.numel() * table.element_size(), world)
        source, why = rows_or_dense(source, grads[index][2], table.shape[1], table.element_size(), world, dense,
                                    "the table")
        if source is None:
            return None, None, 0, why
        return index, source, SparseRows().wire_bytes(source.tokens, table.shape[1], table.element_size(), world), why

    def plan(self, gm, grads, ctx: Context, world: int, rows: int | None, rows_bytes: int, other):
        """Bucket bounds (auto: from the cost model) and their predicted timing, in all-reduce
        bytes that take as long as what the compressor sends (the embedding as rows: its own bucket)."""
        def sent(i, node):
            val = node.meta["val"]
            return rows_bytes if i == rows else other.wire_bytes([tuple(val.shape)], val.element_size(), world)
        wire = [int(all_reduce_size_sending(sent(i, g[1]), world)) for i, g in enumerate(grads)]
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
        entries, pending_names, exchanges, report = [], [], [], []  # exchanges: (in flight, members)
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
                bucket = Bucket(flat, [m[2] for m in members], shapes, val.dtype, val.device, index=k,
                                source=source if isinstance(codec, SparseRows) else None)
                exchanges.append((issue(codec, em, bucket), members))  # the bucket's first collectives here
            entries += [LayoutEntry(name, tuple(node.meta["val"].shape), str(node.meta["val"].dtype), k)
                        for _, node, name in members]
            report.append({"bucket": k, "compressor": codec.label, "wire_bytes": codec.bucket_bytes(bucket, em.world),
                           "fp32_ring_bytes": all_reduce_bytes(4 * flat_numel(members), em.world)})
        with graph.inserting_before(output):  # each wait as late as the next round allows
            results = drain(em, [pending for pending, _ in exchanges])
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


def wire_notes(report: list[dict]) -> dict:
    sent = sum(r["wire_bytes"] for r in report)
    ring = sum(r["fp32_ring_bytes"] for r in report)
    return {"compression": report, "wire_bytes": sent, "fp32_ring_bytes": ring,
            "wire_ratio": round(sent / ring, 4) if ring else 1.0}


def flat_numel(members) -> int:
    return sum(node.meta["val"].numel() for _, node, _ in members)
