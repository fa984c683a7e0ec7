"""Shard(compress=KIND): each bucket's gradient reduce-scatter as a codec of picofx.compression.

The shard pass's backward reduce-scatters each bucket's padded flat gradient, (N*M,) over N
ranks, into this rank's (M,) slice. Here that reduce-scatter and its wait are replaced by the
codec's exchange in its reduce-scatter form (issued where the reduce-scatter was, finished before
the wait's first reader), whose result is this rank's slice of the MEAN over the ranks (so the
shard pass does not divide it again), the same bytes every rank computes for that slice:
bf16 and int8 reduce-scatter in their own form (int8: one all-to-all of each rank's row of
blocks); top-k and PowerSGD run on the bucket's whole gradients and each rank keeps its slice;
"sparse_rows" sends an embedding gradient alone in its bucket as all-gathered (token id, row)
pairs, each rank adding only the ids in its own rows (exact; dense when tied, or when the rows
are more bytes than the reduce-scatter's (N-1)/N of the table).
"""
from __future__ import annotations

import torch
from torch import fx

from picofx.capture.vocabulary import is_view
from picofx.compression import (Bucket, Dense, Emitter, Rows, SparseRows, drain, embedding_rows, issue, parse_compress,
                                rows_or_dense)
from picofx.cost.comm import reduce_scatter_bytes
from picofx.cost.gradients import gradients_in_order
from picofx.manager import Context, PassResult, SyncMode
from picofx.parallel.layouts import ShardEntry, ShardLayout

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
convert = torch.ops.prims.convert_element_type.default
SCATTERS = (c10d.reduce_scatter_tensor.default, torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default)
CASTS = (aten._to_copy.default, convert)
PADS = (aten.constant_pad_nd.default, aten.slice_backward.default)  # a gradient put into a larger zero tensor


def parse_shard_compress(spec: str | None):
    """The compress spelling, with Shard's name in its errors."""
    return parse_compress(spec, "Shard")


def scattered_sources(gm: fx.GraphModule, names) -> dict[fx.Node, list[str]]:
    """Each reduce-scatter of the backward and the parameters whose gradient outputs read its wait."""
    found: dict[fx.Node, list[str]] = {}
    for _, node, name in gradients_in_order(gm, names):
        while node.op == "call_function" and (is_view(node) or node.target in CASTS):
            node = node.args[0]
        if node.target is c10d.wait_tensor.default and node.args[0].target in SCATTERS:
            found.setdefault(node.args[0], []).append(name)
    return found


def embedding_source(flat: fx.Node, entries: list[ShardEntry], world: int) -> tuple[Rows | None, str]:
    """The bucket's gradient as Rows (the embedding, alone in its bucket, untied), or why not; the
    bytes compared are in the dtype the bucket is reduced in (`flat`'s)."""
    if len(entries) != 1 or len(entries[0].shape) != 2:
        return None, "dense: no bucket holds an embedding alone"
    node = flat
    while node.op == "call_function" and (is_view(node) or node.target in CASTS or node.target in PADS):
        node = node.args[0]
    _, rows, why = embedding_rows([(0, node, entries[0].name)], False)
    if rows is None:
        return None, why
    e, itemsize = entries[0], flat.meta["val"].element_size()
    dense = reduce_scatter_bytes(world * e.padded_rows * e.shape[1] * itemsize, world)
    return rows_or_dense(rows, e.name, e.shape[1], itemsize, world, dense, "its reduce-scatter")


def compress_scatters(gm: fx.GraphModule, ctx: Context, compress: str, layout: ShardLayout, state) -> PassResult:
    """Replace each bucket's reduce-scatter with its compressor's exchange; notes per bucket."""
    spec = parse_shard_compress(compress)
    dim, graph = layout.dim, gm.graph
    em = Emitter(gm, dim, state)
    by_name = {e.name: e for e in layout.entries}
    order = {n: i for i, n in enumerate(graph.nodes)}
    report, reasons = [], []
    other = Dense() if ctx.gradient_sync is SyncMode.SYNC_UNCOMPRESSED else spec.other  # Shard's warm-up steps
    for scatter, names in scattered_sources(gm, ctx.input_names).items():
        index = by_name[names[0]].bucket
        entries = [e for e in layout.entries if e.bucket == index]
        flat_in, val = scatter.args[0], scatter.args[0].meta["val"]
        wire_all = reduce_scatter_bytes(val.numel() * val.element_size(), dim.size)
        fp32 = reduce_scatter_bytes(val.numel() * 4, dim.size)
        source = None
        if spec.rows:
            source, why = embedding_source(flat_in, entries, dim.size)
            reasons.append(why)
        codec = SparseRows() if source is not None else other
        if codec == Dense():
            report.append({"bucket": index, "compressor": "none", "wire_bytes": wire_all,
                           "fp32_reduce_scatter_bytes": fp32})
            continue
        waits = [u for u in scatter.users if u.target is c10d.wait_tensor.default]
        with graph.inserting_before(scatter):
            flat = em(aten.reshape.default, flat_in, [-1])
            bucket = Bucket(flat, [e.name for e in entries], [tuple(e.shape) for e in entries], val.dtype, val.device,
                            shard_rows=tuple(e.padded_rows for e in entries), index=index, source=source)
            pending = issue(codec, em, bucket)
        readers = [r for w in waits for r in w.users]
        with graph.inserting_before(min(readers, key=order.__getitem__) if readers else graph.output_node()):
            result = em(aten.view.default, drain(em, [pending])[0], list(waits[0].meta["val"].shape))
        for wait in waits:
            wait.replace_all_uses_with(result)
            graph.erase_node(wait)
        graph.erase_node(scatter)
        report.append({"bucket": index, "compressor": codec.label, "wire_bytes": codec.bucket_bytes(bucket, dim.size),
                       "fp32_reduce_scatter_bytes": fp32})
    graph.eliminate_dead_code()
    gm.recompile()
    sent, fp32 = sum(r["wire_bytes"] for r in report), sum(r["fp32_reduce_scatter_bytes"] for r in report)
    notes = {"compress": compress, "gradient_sync": ctx.gradient_sync, "compression": report, "wire_bytes": sent,
             "fp32_reduce_scatter_bytes": fp32, "wire_ratio": round(sent / fp32, 4) if fp32 else 1.0}
    if spec.rows:  # the sparse bucket's reason, else why the embedding's bucket stayed dense
        notes["embedding_rows"] = min(reasons or ["dense: no gradient is reduce-scattered"],
                                      key=lambda why: (not why.startswith("sparse"), "alone" in why))
    return PassResult(any(r["compressor"] != "none" for r in report), notes)
