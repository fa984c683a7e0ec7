"""shard_compress: `Shard(compress=KIND)`: each bucket's gradient reduce-scatter as a compressor.

The shard pass's backward reduce-scatters each bucket's padded flat gradient, (N*M,) over N
ranks, into this rank's (M,) slice. Here that reduce-scatter and its wait are replaced by an
exchange whose result is this rank's slice of the MEAN over the ranks (so the shard pass does
not divide it again), the same bytes every rank computes for that slice:

- "bf16": the reduce-scatter carries bf16, summed, cast back and divided.
- "int8", "int8:ef": qgZ's reduce-scatter. Row r of flat.view(N, M) is what rank r keeps; each
  row's tensors are padded to whole blocks of 256 and quantized per block (one fp32 scale each);
  one all-to-all gives rank r every rank's row r, which it dequantizes, sums in fp32 and
  divides. With ":ef", each rank's quantization error of the whole flat is added next step.
- "topk:F", "powersgd:R": the Overlap codecs on the bucket's whole gradients (the padded layout
  unpacked); every rank computes the whole mean and keeps its slice.
- "sparse_rows" (+KIND): an embedding gradient alone in its bucket travels as all-gathered
  (token id, row) pairs; each rank adds only the ids in its own rows [r*P, (r+1)*P). Exact.
  Dense when tied, or when the rows are more bytes than the reduce-scatter's (N-1)/N of the table.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import is_view
from picofx.cost.gradients import gradients_in_order
from picofx.manager import Context, PassResult
from picofx.parallel.layouts import ShardEntry, ShardLayout
from picofx.compression.lossy import PowerSGD, TopK, parse_compress
from picofx.compression.allreduce import (BucketIn, Dense, Emitter, Int8, Rows, SparseRows, dequantize,
                                            embedding_rows, quantize)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
convert = torch.ops.prims.convert_element_type.default
SCATTERS = (c10d.reduce_scatter_tensor.default, torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default)
CASTS = (aten._to_copy.default, convert)
PADS = (aten.constant_pad_nd.default, aten.slice_backward.default)  # a gradient put into a larger zero tensor


def parse_shard_compress(spec: str | None):
    """Overlap's spelling, with Shard's name in the error."""
    try:
        return parse_compress(spec)
    except ValueError as error:
        raise ValueError(str(error).replace("Overlap(compress=", "Shard(compress=", 1)) from None


@dataclass
class ScatterBucket:
    """One reduce-scatter of the backward: its bucket's (N*M,) flat gradient and parameters."""

    index: int
    flat: fx.Node
    entries: list[ShardEntry]
    dtype: torch.dtype
    device: torch.device
    rank: int
    source: Rows | None = None

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def shard_shapes(self) -> list[tuple]:
        return [(e.padded_rows, *e.shape[1:]) for e in self.entries]

    @property
    def widths(self) -> list[int]:
        return [math.prod(s) for s in self.shard_shapes]

    @property
    def width(self) -> int:  # M
        return sum(self.widths)


def rs_bytes(numel: int, itemsize: int, world: int) -> int:
    """Bytes each rank sends in a reduce-scatter of `numel` entries: (N-1)/N of them."""
    return (world - 1) * numel * itemsize // world


@dataclass(frozen=True)
class ScatterCast:
    """The reduce-scatter in another dtype (bf16), cast back, divided."""

    cast: torch.dtype = torch.bfloat16
    label = "bf16"

    def wire_bytes(self, b: ScatterBucket, world: int) -> int:
        return rs_bytes(world * b.width, self.cast.itemsize, world)

    def exchange(self, em: Emitter, b: ScatterBucket):
        cast = em(convert, b.flat, self.cast)
        em.record_error(b, [em(aten.sub.Tensor, b.flat, em(convert, cast, b.dtype))], [b.flat])
        work = em(c10d.reduce_scatter_tensor.default, cast, "sum", em.world, em.group)
        with fake_mode_of(em.gm):  # the shard pass's report reads what its reduce-scatters carry
            cast.meta["val"] = torch.empty(em.world * b.width, dtype=self.cast, device=b.device)
            work.meta["val"] = torch.empty(b.width, dtype=self.cast, device=b.device)
        yield
        return em(aten.div.Tensor, em(convert, em.wait(work), b.dtype), em.world)


@dataclass(frozen=True)
class ScatterInt8:
    """qgZ's quantized reduce-scatter: one all-to-all of int8 blocks and their fp32 scales."""

    block: int = 256
    feedback: bool = False

    @property
    def label(self) -> str:
        return "int8:ef" if self.feedback else "int8"

    def starts(self, b: ScatterBucket) -> list[int]:
        """Where each tensor starts in a rank's row of blocks (on whole blocks of its own), and the row's length."""
        return Int8(self.block).starts(b.shard_shapes)

    def wire_bytes(self, b: ScatterBucket, world: int) -> int:
        row = self.starts(b)[-1]
        return (world - 1) * (row + 4 * (row // self.block))  # int8 values and scales of every other rank's row

    def to_blocks(self, em: Emitter, rows: fx.Node, b: ScatterBucket) -> fx.Node:
        starts = self.starts(b)
        pieces = em(aten.split_with_sizes.default, rows, b.widths, 1)
        padded = [em(aten.constant_pad_nd.default, em(operator.getitem, pieces, i), [0, starts[i + 1] - starts[i] - w])
                  for i, w in enumerate(b.widths)]
        row = em(aten.cat.default, padded, 1) if len(padded) > 1 else padded[0]
        return em(aten.view.default, row, [-1, self.block])

    def from_blocks(self, em: Emitter, blocks: fx.Node, b: ScatterBucket, rows: int) -> fx.Node:
        """(rows, M) from blocks of `rows` rows: each tensor's padding dropped."""
        row = em(aten.view.default, blocks, [rows, self.starts(b)[-1]])
        pieces = [em(aten.slice.Tensor, row, 1, start, start + w) for start, w in zip(self.starts(b), b.widths)]
        return em(aten.cat.default, pieces, 1) if len(pieces) > 1 else pieces[0]

    def exchange(self, em: Emitter, b: ScatterBucket):
        x = em(convert, b.flat, torch.float32) if b.dtype != torch.float32 else b.flat
        if self.feedback:
            residual = em.kept(f"residual/shard_bucket{b.index}", lambda: torch.zeros(
                em.world * b.width, dtype=b.dtype, device=b.device))
            x = em(aten.add.Tensor, x, em(convert, residual, torch.float32))
        blocks = self.to_blocks(em, em(aten.view.default, x, [em.world, b.width]), b)
        q, scale = quantize(em, blocks)
        error = em(aten.sub.Tensor, blocks, dequantize(em, q, scale))
        em.record_error(b, [error], [blocks])
        if self.feedback:
            error = self.from_blocks(em, error, b, em.world)
            em.store(residual, em(convert, em(aten.reshape.default, error, [-1]), b.dtype))
        count = em.world * (self.starts(b)[-1] // self.block)
        q_work, scale_work = em.all_to_all(q, count), em.all_to_all(scale, count)
        yield
        copies = dequantize(em, em.wait(q_work), em.wait(scale_work))
        copies = em(aten.view.default, copies, [em.world, count // em.world, self.block])
        mean = em(aten.div.Tensor, em(aten.sum.dim_IntList, copies, [0]), em.world)
        out = em(aten.reshape.default, self.from_blocks(em, mean, b, 1), [-1])
        return em(convert, out, b.dtype) if b.dtype != torch.float32 else out


@dataclass(frozen=True)
class WholeGradients:
    """An Overlap codec (top-k, PowerSGD) on the bucket's whole gradients; this rank keeps its slice."""

    codec: Any

    @property
    def label(self) -> str:
        return self.codec.label

    def wire_bytes(self, b: ScatterBucket, world: int) -> int:
        return self.codec.wire_bytes([e.shape for e in b.entries], b.dtype.itemsize, world)

    def exchange(self, em: Emitter, b: ScatterBucket):
        rows = em(aten.view.default, b.flat, [em.world, b.width])
        wholes, at = [], 0
        for e, width in zip(b.entries, b.widths):  # rows[:, at:at + width].reshape(N * P, ...)[:rows]
            whole = em(aten.reshape.default, em(aten.slice.Tensor, rows, 1, at, at + width),
                       [em.world * e.padded_rows, *e.shape[1:]])
            wholes.append(em(aten.slice.Tensor, whole, 0, 0, e.shape[0]) if e.shape[0] != em.world * e.padded_rows
                          else whole)
            at += width
        whole = BucketIn(em.flat_of(wholes), [e.name for e in b.entries], [tuple(e.shape) for e in b.entries],
                         b.dtype, b.device)
        mean = yield from self.codec.exchange(em, whole)
        packed = []
        for e, piece in zip(b.entries, em.split(mean, [tuple(e.shape) for e in b.entries])):
            piece = em(aten.reshape.default, piece, [e.shape[0], -1])
            if e.shape[0] != em.world * e.padded_rows:
                piece = em(aten.constant_pad_nd.default, piece, [0, 0, 0, em.world * e.padded_rows - e.shape[0]])
            packed.append(em(aten.reshape.default, piece, [em.world, -1]))
        packed = em(aten.cat.default, packed, 1) if len(packed) > 1 else packed[0]
        return em(aten.select.int, packed, 0, b.rank)


@dataclass(frozen=True)
class ScatterRows:
    """The embedding's gradient as (token id, row) pairs all-gathered; this rank adds the ids in its rows."""

    label = "sparse_rows"

    def wire_bytes(self, b: ScatterBucket, world: int) -> int:
        return SparseRows().wire_bytes(b.source.ids.meta["val"].numel(), b.entries[0].shape[1], b.dtype.itemsize, world)

    def exchange(self, em: Emitter, b: ScatterBucket):
        e = b.entries[0]
        id_work, row_work = SparseRows().gather(em, BucketIn(b.flat, [e.name], [e.shape], b.dtype, b.device, b.source))
        yield
        local = em(aten.sub.Tensor, em(convert, em.wait(id_work), torch.int64), b.rank * e.padded_rows)
        mine = em(aten.logical_and.default, em(aten.ge.Scalar, local, 0), em(aten.lt.Scalar, local, e.padded_rows))
        local = em(aten.where.self, mine, local, em(aten.full.default, [], 0, dtype=torch.int64, device=b.device))
        rows = em(aten.where.self, em(aten.unsqueeze.default, mine, -1), em.wait(row_work),
                  em(aten.full.default, [], 0.0, dtype=b.dtype, device=b.device))
        table = em(aten.full.default, [e.padded_rows, e.shape[1]], 0.0, dtype=b.dtype, device=b.device)
        table = em(aten.index_put.default, table, [local], rows, True)
        return em(aten.reshape.default, em(aten.div.Tensor, table, em.world), [-1])


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
    e = entries[0]
    itemsize = flat.meta["val"].element_size()
    sparse = SparseRows().wire_bytes(rows.ids.meta["val"].numel(), e.shape[1], itemsize, world)
    dense = rs_bytes(world * e.padded_rows * e.shape[1], itemsize, world)
    if sparse >= dense:
        return None, f"dense: {e.name} as rows is {sparse} bytes per rank, its reduce-scatter {dense}"
    return rows, f"sparse: {e.name} as rows is {sparse} bytes per rank instead of {dense}"


def codec_for(other) -> Any:
    """Overlap's compressor for the buckets that are not the embedding's, as a reduce-scatter; None: uncompressed."""
    if isinstance(other, Dense):
        return ScatterCast(other.cast) if other.cast is not None else None
    if isinstance(other, Int8):
        return ScatterInt8(other.block, other.feedback)
    if isinstance(other, (TopK, PowerSGD)):
        return WholeGradients(other)
    raise NotImplementedError(f"Shard(compress=...): no reduce-scatter form of {other!r}")


def compress_scatters(gm: fx.GraphModule, ctx: Context, compress: str, layout: ShardLayout, state) -> PassResult:
    """Replace each bucket's reduce-scatter with its compressor's exchange; notes per bucket."""
    spec = parse_shard_compress(compress)
    dim, graph = layout.dim, gm.graph
    em = Emitter(gm, dim, state)
    by_name = {e.name: e for e in layout.entries}
    order = {n: i for i, n in enumerate(graph.nodes)}
    report, reasons = [], []
    other = Dense() if ctx.gradient_sync == "sync_uncompressed" else spec.other  # Shard's warm-up steps
    for scatter, names in scattered_sources(gm, ctx.input_names).items():
        index = by_name[names[0]].bucket
        entries = [e for e in layout.entries if e.bucket == index]
        flat_in, val = scatter.args[0], scatter.args[0].meta["val"]
        wire_all = rs_bytes(val.numel(), val.element_size(), dim.size)
        fp32 = rs_bytes(val.numel(), 4, dim.size)
        source = None
        if spec.rows:
            source, why = embedding_source(flat_in, entries, dim.size)
            reasons.append(why)
        codec = ScatterRows() if source is not None else codec_for(other)
        if codec is None:
            report.append({"bucket": index, "compressor": "none", "wire_bytes": wire_all,
                           "fp32_reduce_scatter_bytes": fp32})
            continue
        waits = [u for u in scatter.users if u.target is c10d.wait_tensor.default]
        with graph.inserting_before(scatter):
            flat = em(aten.reshape.default, flat_in, [-1])
            bucket = ScatterBucket(index, flat, entries, val.dtype, val.device, dim.rank, source)
            exchange = codec.exchange(em, bucket)
            next(exchange)
        readers = [r for w in waits for r in w.users]
        with graph.inserting_before(min(readers, key=order.__getitem__) if readers else graph.output_node()):
            try:
                while True:
                    next(exchange)
            except StopIteration as done:
                result = em(aten.view.default, done.value, list(waits[0].meta["val"].shape))
        for wait in waits:
            wait.replace_all_uses_with(result)
            graph.erase_node(wait)
        graph.erase_node(scatter)
        report.append({"bucket": index, "compressor": codec.label, "wire_bytes": codec.wire_bytes(bucket, dim.size),
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
