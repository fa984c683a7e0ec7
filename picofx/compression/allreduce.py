"""overlap_compress: how one gradient bucket of the overlap pass travels between the ranks.

A compressor writes, into the backward graph, the nodes that exchange one bucket's flat gradient
and returns the node holding its average over the ranks, identical on every rank. Its `exchange`
is a generator: the nodes up to its first `yield` go where the bucket is ready (they issue its
first collective); each later part goes just before the graph returns, one round over all
buckets at a time, so each wait comes as late as the next round allows.

Spelling of `Overlap(compress=...)`: None, "bf16", "int8" (per-block int8; "int8:ef" adds error
feedback), "topk:F" (the fraction F of entries with the largest magnitude), "powersgd:R" (rank-R
factors of matrix gradients), or "sparse_rows" alone or before one of those with a "+"
("sparse_rows+int8"): the embedding gradient as (token ids, rows), the other buckets as named.

State that outlives a step (error-feedback residuals, PowerSGD's Q) is one tensor per parameter
in a CompressionState, which the graphs hold as buffers and update in place. Top-k and PowerSGD,
and the choice of a compressor by its name, are in overlap_codecs.py.
"""
from __future__ import annotations

import functools
import math
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
convert = torch.ops.prims.convert_element_type.default


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: 2(n-1)/n of them."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


class CompressionState:
    """Compressor tensors kept between steps: residuals (this rank's own) and PowerSGD's Q
    (the same on every rank). A DCP `Stateful`: `dcp.save({"model": ..., "compression": state})`
    saves each rank's residuals under its own keys ("rank<r>/..."); loading needs the same world."""

    def __init__(self, rank: int):
        self.rank = rank
        self.tensors: dict[str, torch.Tensor] = {}
        self.initial: dict[str, torch.Tensor] = {}

    def tensor(self, key: str, make) -> torch.Tensor:
        if key not in self.tensors:
            self.tensors[key] = make()
            self.initial[key] = self.tensors[key].clone()
        return self.tensors[key]

    @torch.no_grad()
    def reset(self) -> None:
        """Residuals back to zero, Q back to its first value (as after optimize)."""
        for key, value in self.tensors.items():
            value.copy_(self.initial[key])

    def saved_name(self, key: str) -> str:
        return f"rank{self.rank}/{key}" if key.startswith(("residual", "error")) else key

    def errors(self) -> dict[str, float]:
        """The last compressed step's relative error per bucket, by the bucket's first parameter:
        what this rank's compressor left out of its input, ||left out|| / ||input||."""
        return {k.removeprefix("error/"): v.item() for k, v in self.tensors.items() if k.startswith("error/")}

    def state_dict(self) -> dict:
        return {self.saved_name(k): v for k, v in self.tensors.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for key, value in self.tensors.items():
            value.copy_(state[self.saved_name(key)])


class Emitter:
    """Adds nodes to a backward graph at its current insertion point, over one mesh dimension."""

    def __init__(self, gm: fx.GraphModule, dim, state: CompressionState):
        self.gm, self.graph, self.state, self.dim = gm, gm.graph, state, dim
        self.world, self.group = dim.size, dim.group_name

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def wait(self, work: fx.Node) -> fx.Node:
        return self(c10d.wait_tensor.default, work)

    def all_reduce(self, x: fx.Node) -> fx.Node:
        return self(c10d.all_reduce.default, x, "sum", self.group)

    def all_gather(self, x: fx.Node) -> fx.Node:
        return self(c10d.all_gather_into_tensor.default, x, self.world, self.group)

    def all_to_all(self, x: fx.Node, rows: int) -> fx.Node:
        """Dim 0 (`rows` long) cut into one chunk per rank: rank r receives every rank's chunk r."""
        split = [rows // self.world] * self.world
        return self(c10d.all_to_all_single.default, x, split, split, self.group)

    def split(self, flat: fx.Node, shapes: list) -> list[fx.Node]:
        pieces = self(aten.split_with_sizes.default, flat, [math.prod(s) for s in shapes])
        return [self(aten.view.default, self(operator.getitem, pieces, i), list(s)) for i, s in enumerate(shapes)]

    def kept(self, key: str, make) -> fx.Node:
        """A get_attr of the state tensor `key` (made by `make()` the first time)."""
        attr = "compress_" + re.sub(r"\W", "_", key)
        if attr not in self.gm._buffers:
            self.gm.register_buffer(attr, self.state.tensor(key, make), persistent=False)
        return self.graph.get_attr(attr)

    def store(self, kept: fx.Node, value: fx.Node) -> None:
        self(aten.copy_.default, kept, value)

    def residual(self, bucket: "BucketIn") -> list[fx.Node]:
        return [self.kept(f"residual/{name}", lambda s=shape: torch.zeros(s, dtype=bucket.dtype, device=bucket.device))
                for name, shape in zip(bucket.names, bucket.shapes)]

    def record_error(self, b: "BucketIn", left_out: list[fx.Node], given: list[fx.Node]) -> None:
        """Keep this step's ||left_out|| / ||given|| (norms over all the nodes) as the bucket's
        "error/<first parameter>" in the state, for the report."""
        def squares(nodes):
            sums = [self(aten.sum.default, self(aten.mul.Tensor, n, n), dtype=torch.float32) for n in nodes]
            return functools.reduce(lambda a, b: self(aten.add.Tensor, a, b), sums)
        ratio = self(aten.sqrt.default, self(aten.div.Tensor, squares(left_out),
                                             self(aten.clamp_min.default, squares(given), 1e-30)))
        # one element, not 0-d: Inductor would take a 0-d buffer for a constant and refuse to write it
        self.store(self.kept(f"error/{b.names[0]}", lambda: torch.zeros(1, dtype=torch.float32, device=b.device)),
                   ratio)

    def flat_of(self, nodes: list[fx.Node]) -> fx.Node:
        flats = [self(aten.reshape.default, n, [-1]) for n in nodes]
        return self(aten.cat.default, flats) if len(flats) > 1 else flats[0]


@dataclass
class BucketIn:
    """One bucket as a compressor sees it: its flat gradient and what it is made of."""

    flat: fx.Node
    names: list[str]
    shapes: list[tuple]
    dtype: torch.dtype
    device: torch.device
    source: Any = None  # SparseRows: the gradient's Rows

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Dense:
    """All-reduce of the flat bucket (in `cast`, e.g. bf16, when given), divided by the world."""

    cast: torch.dtype | None = None

    @property
    def label(self) -> str:
        return "bf16" if self.cast == torch.bfloat16 else "none"

    def wire_bytes(self, shapes, itemsize: int, world: int) -> int:
        return ring_bytes(sum(math.prod(s) for s in shapes) * (self.cast.itemsize if self.cast else itemsize), world)

    def exchange(self, em: Emitter, b: BucketIn):
        x = em(convert, b.flat, self.cast) if self.cast else b.flat
        if self.cast:
            em.record_error(b, [em(aten.sub.Tensor, b.flat, em(convert, x, b.dtype))], [b.flat])
        work = em.all_reduce(x)
        yield
        out = em.wait(work)
        if self.cast:
            out = em(convert, out, b.dtype)
        return em(aten.div.Tensor, out, em.world)


@dataclass(frozen=True)
class SparseRows:
    """Lossless: each rank's (token id, gradient row) pairs all-gathered and added into a zero
    table; chosen for the embedding only where that is fewer bytes (see `rows_worth_it`)."""

    label = "sparse_rows"

    def wire_bytes(self, rows: int, hidden: int, itemsize: int, world: int) -> int:
        return (world - 1) * rows * (hidden * itemsize + 4)  # ring all-gather of rows and int32 ids

    def exchange(self, em: Emitter, b: BucketIn):
        vocab, hidden = b.shapes[0]
        id_work, row_work = self.gather(em, b)
        yield
        table = em(aten.full.default, [vocab, hidden], 0.0, dtype=b.dtype, device=b.device)
        table = em(aten.index_put.default, table, [em(convert, em.wait(id_work), torch.int64)], em.wait(row_work), True)
        return em(aten.reshape.default, em(aten.div.Tensor, table, em.world), [-1])

    def gather(self, em: Emitter, b: BucketIn) -> tuple[fx.Node, fx.Node]:
        """Issue the all-gathers of every rank's int32 ids and their rows (dropped and padding rows zeroed)."""
        hidden = b.shapes[0][1]
        padding_idx = b.source.padding_idx
        ids, rows, mask = b.source.ids, b.source.rows, b.source.mask
        if mask is not None:  # a dropped row adds zeros at id 0
            rows = em(aten.where.self, mask, rows, em(aten.full.default, [], 0.0, dtype=b.dtype, device=b.device))
            ids = em(aten.where.self, em(aten.squeeze.dim, mask, -1), ids, em(aten.full.default, [], 0,
                                                                              dtype=torch.int64, device=b.device))
        ids = em(convert, em(aten.reshape.default, ids, [-1]), torch.int32)
        rows = em(aten.reshape.default, rows, [-1, hidden])
        rows = em(convert, rows, b.dtype)
        if padding_idx >= 0:  # as embedding_dense_backward: the padding row gets no gradient
            keep = em(aten.ne.Scalar, ids, padding_idx)
            rows = em(aten.mul.Tensor, rows, em(aten.unsqueeze.default, em(convert, keep, b.dtype), -1))
        return em.all_gather(ids), em.all_gather(rows)


def quantize(em: Emitter, blocks: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Per-row absmax int8: (int8 values, fp32 scale per row), value ~= int8 * scale."""
    amax = em(aten.amax.default, em(aten.abs.default, blocks), [-1], True)
    scale = em(aten.clamp_min.default, em(aten.div.Tensor, amax, 127.0), 1e-30)
    q = em(aten.round.default, em(aten.div.Tensor, blocks, scale))
    q = em(aten.clamp_max.default, em(aten.clamp_min.default, q, -127.0), 127.0)
    return em(convert, q, torch.int8), scale


def dequantize(em: Emitter, q: fx.Node, scale: fx.Node) -> fx.Node:
    return em(aten.mul.Tensor, em(convert, q, torch.float32), scale)


@dataclass(frozen=True)
class Int8:
    """qgZ's scheme: blocks of `block` entries quantized with one fp32 scale each; an all-to-all
    gives each rank every rank's copy of its slice, which it dequantizes, sums in fp32 and
    averages; the averaged slices, quantized again, are all-gathered, and every rank dequantizes
    the same bytes. With `feedback`, each rank's first quantization error is added next step."""

    block: int = 256
    feedback: bool = False

    @property
    def label(self) -> str:
        return "int8:ef" if self.feedback else "int8"

    def starts(self, shapes) -> list[int]:
        """Where each tensor starts in the quantized layout: every tensor on whole blocks of its
        own, so that a small gradient never shares a scale with a large neighbour's."""
        out, at = [], 0
        for s in shapes:
            out.append(at)
            at += -(-math.prod(s) // self.block) * self.block
        return out + [at]

    def padded(self, shapes, world: int) -> int:
        unit = self.block * world
        return -(-self.starts(shapes)[-1] // unit) * unit

    def wire_bytes(self, shapes, itemsize: int, world: int) -> int:
        n = self.padded(shapes, world)
        quantized = n + 4 * (n // self.block)  # int8 values and fp32 scales
        return 2 * (world - 1) * quantized // world  # all-to-all of all of it, then all-gather of one slice each

    def to_blocks(self, em: Emitter, flat: fx.Node, b: BucketIn) -> fx.Node:
        n, starts = self.padded(b.shapes, em.world), self.starts(b.shapes)
        pieces = em(aten.split_with_sizes.default, flat, [math.prod(s) for s in b.shapes])
        padded = [em(aten.constant_pad_nd.default, em(operator.getitem, pieces, i),
                     [0, starts[i + 1] - starts[i] - math.prod(s) + (n - starts[-1] if i == len(b.shapes) - 1 else 0)])
                  for i, s in enumerate(b.shapes)]
        return em(aten.view.default, em(aten.cat.default, padded) if len(padded) > 1 else padded[0],
                  [n // self.block, self.block])

    def from_blocks(self, em: Emitter, blocks: fx.Node, b: BucketIn) -> fx.Node:
        flat, starts = em(aten.reshape.default, blocks, [-1]), self.starts(b.shapes)
        pieces = [em(aten.slice.Tensor, flat, 0, start, start + math.prod(s)) for start, s in zip(starts, b.shapes)]
        return em(aten.cat.default, pieces) if len(pieces) > 1 else pieces[0]

    def exchange(self, em: Emitter, b: BucketIn):
        x = em(convert, b.flat, torch.float32) if b.dtype != torch.float32 else b.flat
        if self.feedback:
            residual = em.residual(b)
            x = em(aten.add.Tensor, x, em(convert, em.flat_of(residual), torch.float32))
        blocks = self.to_blocks(em, x, b)
        rows = self.padded(b.shapes, em.world) // self.block
        q, scale = quantize(em, blocks)
        error = em(aten.sub.Tensor, blocks, dequantize(em, q, scale))
        em.record_error(b, [error], [blocks])
        if self.feedback:
            error = self.from_blocks(em, error, b)
            for kept, piece in zip(residual, em.split(em(convert, error, b.dtype), b.shapes)):
                em.store(kept, piece)
        q_work, scale_work = em.all_to_all(q, rows), em.all_to_all(scale, rows)
        yield
        mine = rows // em.world
        copies = dequantize(em, em.wait(q_work), em.wait(scale_work))
        copies = em(aten.view.default, copies, [em.world, mine, self.block])
        mean = em(aten.div.Tensor, em(aten.sum.dim_IntList, copies, [0]), em.world)
        q2, scale2 = quantize(em, mean)
        q_work, scale_work = em.all_gather(q2), em.all_gather(scale2)
        yield
        out = self.from_blocks(em, dequantize(em, em.wait(q_work), em.wait(scale_work)), b)
        return em(convert, out, b.dtype) if b.dtype != torch.float32 else out


@dataclass(frozen=True)
class Rows:
    """A gradient that is a zero table with rows added at token ids: an embedding's backward,
    as aten writes it (embedding_dense_backward) or as Inductor decomposes it (index_put with
    accumulate into zeros, masked or not)."""

    ids: fx.Node       # token ids, any shape
    rows: fx.Node      # one gradient row per id: (*ids.shape, hidden)
    padding_idx: int   # rows at this id are dropped (-1: none)
    mask: fx.Node | None = None  # (*ids.shape, 1): rows where it is False are dropped


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
    return "dense: not an embedding's backward"


def embedding_rows(grads: list, accumulate: bool) -> tuple[int | None, Rows | None, str]:
    """The index (in `grads`) of the gradient that is an embedding's backward and nothing else,
    its Rows, and why or why not. Tied embeddings (the head adds its own gradient),
    scale_grad_by_freq and gradients accumulated under no_sync are dense tables."""
    for i, (_, node, name) in enumerate(grads):
        found = rows_of(node)
        if isinstance(found, Rows):
            if accumulate:
                return None, None, "dense: gradients accumulated under no_sync are a dense table"
            return i, found, "sparse"
        if found != "dense: not an embedding's backward":
            return None, None, found
        if any(isinstance(rows_of(a), Rows) for a in node.all_input_nodes):
            return None, None, f"dense: {name}'s gradient also has the tied head's, a dense table"
    return None, None, "dense: no gradient is an embedding's backward"


def rows_worth_it(rows: Rows, table: torch.Tensor, world: int) -> tuple[bool, int, int]:
    """(sparse is fewer bytes, sparse bytes, dense bytes) per rank for an embedding gradient `table`."""
    tokens = rows.ids.meta["val"].numel()
    sparse = SparseRows().wire_bytes(tokens, table.shape[1], table.element_size(), world)
    dense = ring_bytes(table.numel() * table.element_size(), world)
    return sparse < dense, sparse, dense
