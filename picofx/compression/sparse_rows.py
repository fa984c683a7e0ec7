"""SparseRows: an embedding's gradient as the (token id, row) pairs it is made of, which gradients
are such tables, and when the pairs are fewer bytes than the table."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from picofx.compression.protocol import Bucket, Codec, Emitter, Pending
from picofx.cost.comm import all_gather_bytes

aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


@dataclass(frozen=True)
class Rows:
    """A gradient that is a zero table with rows added at token ids: an embedding's backward,
    as aten writes it (embedding_dense_backward) or as Inductor decomposes it (index_put with
    accumulate into zeros, masked or not)."""

    ids: fx.Node       # token ids, any shape
    rows: fx.Node      # one gradient row per id: (*ids.shape, hidden)
    padding_idx: int   # rows at this id are dropped (-1: none)
    mask: fx.Node | None = None  # (*ids.shape, 1): rows where it is False are dropped

    @property
    def tokens(self) -> int:
        return self.ids.meta["val"].numel()


@dataclass(frozen=True)
class SparseRows(Codec):
    """Lossless: each rank's (token id, gradient row) pairs all-gathered and added into a zero
    table: all of it (all-reduce), or the rows of this rank's slice (reduce-scatter). The bucket
    holds the embedding's gradient alone; `source` is its Rows."""

    label = "sparse_rows"

    def wire_bytes(self, tokens: int, hidden: int, itemsize: int, world: int) -> int:
        """Bytes each rank sends for `tokens` rows of `hidden` entries and their int32 ids."""
        return all_gather_bytes(world * tokens * (hidden * itemsize + 4), world)

    def bucket_bytes(self, b: Bucket, world: int) -> int:
        return self.wire_bytes(b.source.tokens, b.shapes[0][1], b.itemsize, world)

    def issue(self, em: Emitter, b: Bucket) -> Pending:
        """All-gather every rank's int32 ids and their rows (dropped and padding rows zeroed)."""
        hidden, rows = b.shapes[0][1], b.source
        ids, values = rows.ids, rows.rows
        if rows.mask is not None:  # a dropped row adds zeros at id 0
            values = em(aten.where.self, rows.mask, values, em(aten.full.default, [], 0.0, dtype=b.dtype, device=b.device))
            ids = em(aten.where.self, em(aten.squeeze.dim, rows.mask, -1), ids,
                     em(aten.full.default, [], 0, dtype=torch.int64, device=b.device))
        ids = em(convert, em(aten.reshape.default, ids, [-1]), torch.int32)
        values = em(convert, em(aten.reshape.default, values, [-1, hidden]), b.dtype)
        if rows.padding_idx >= 0:  # as embedding_dense_backward: the padding row gets no gradient
            keep = em(aten.ne.Scalar, ids, rows.padding_idx)
            values = em(aten.mul.Tensor, values, em(aten.unsqueeze.default, em(convert, keep, b.dtype), -1))
        return Pending((em.all_gather(ids), em.all_gather(values)), lambda waited: self.added(em, b, *waited))

    def added(self, em: Emitter, b: Bucket, ids: fx.Node, values: fx.Node) -> fx.Node:
        """Every rank's rows added into zeros at their ids (reduce-scatter: only this rank's rows
        [rank * P, (rank + 1) * P)), divided by the world."""
        table_rows, hidden = b.shapes[0]
        ids = em(convert, ids, torch.int64)
        if b.scatter:
            table_rows = b.shard_rows[0]
            ids = em(aten.sub.Tensor, ids, em.rank * table_rows)
            mine = em(aten.logical_and.default, em(aten.ge.Scalar, ids, 0), em(aten.lt.Scalar, ids, table_rows))
            ids = em(aten.where.self, mine, ids, em(aten.full.default, [], 0, dtype=torch.int64, device=b.device))
            values = em(aten.where.self, em(aten.unsqueeze.default, mine, -1), values,
                        em(aten.full.default, [], 0.0, dtype=b.dtype, device=b.device))
        table = em(aten.full.default, [table_rows, hidden], 0.0, dtype=b.dtype, device=b.device)
        table = em(aten.index_put.default, table, [ids], values, True)
        return em(aten.reshape.default, em(aten.div.Tensor, table, em.world), [-1])


def rows_of(node: fx.Node) -> Rows | str:
    """`node` as Rows, or why it is not (a string)."""
    if node.target == convert and node.args[1] == node.meta["val"].dtype:
        node = node.args[0]
    if node.target == aten.embedding_dense_backward.default:
        grad_rows, ids, _, padding_idx, scale_grad_by_freq = node.args[:5]
        return "dense: scale_grad_by_freq" if scale_grad_by_freq else Rows(ids, grad_rows, padding_idx)
    if node.target == aten.index_put.default and len(node.args) > 3 and node.args[3] and len(node.args[1]) == 1:
        base = node.args[0]
        if base.target == aten.full.default and base.args[1] == 0 and node.meta["val"].dim() == 2:
            return Rows(node.args[1][0], node.args[2], -1)
    if node.target == aten._unsafe_masked_index_put_accumulate.default and len(node.args[2]) == 1:
        base, mask, (ids,), values = node.args
        if base.target == aten.full.default and base.args[1] == 0 and node.meta["val"].dim() == 2:
            return Rows(ids, values, -1, mask)
    return NOT_ROWS


NOT_ROWS = "dense: not an embedding's backward"


def embedding_rows(grads: list, accumulate: bool) -> tuple[int | None, Rows | None, str]:
    """The index (in `grads`: (position, node, name)) of the gradient that is an embedding's
    backward and nothing else, its Rows, and why or why not. Tied embeddings (the head adds its own
    gradient), scale_grad_by_freq and gradients accumulated under no_sync are dense tables."""
    for i, (_, node, name) in enumerate(grads):
        found = rows_of(node)
        if isinstance(found, Rows):
            if accumulate:
                return None, None, "dense: gradients accumulated under no_sync are a dense table"
            return i, found, "sparse"
        if found != NOT_ROWS:
            return None, None, found
        if any(isinstance(rows_of(a), Rows) for a in node.all_input_nodes):
            return None, None, f"dense: {name}'s gradient also has the tied head's, a dense table"
    return None, None, "dense: no gradient is an embedding's backward"


def rows_or_dense(rows: Rows, name: str, hidden: int, itemsize: int, world: int, dense_bytes: int,
                  dense: str) -> tuple[Rows | None, str]:
    """`rows` where sending them is fewer bytes per rank than `dense_bytes` (the `dense` exchange's:
    "the table", "its reduce-scatter"), else None; and why."""
    sparse = SparseRows().wire_bytes(rows.tokens, hidden, itemsize, world)
    if sparse >= dense_bytes:
        return None, f"dense: {name} as rows is {sparse} bytes per rank, {dense} {dense_bytes}"
    return rows, f"sparse: {name} as rows is {sparse} bytes per rank instead of {dense_bytes}"
