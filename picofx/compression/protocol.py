"""The codec protocol: how one bucket of gradients travels between the ranks, for an all-reduce
(every rank gets the mean) and a reduce-scatter (each rank gets its slice of the mean) alike.

A codec writes nodes into the backward graph through an Emitter, in two explicit steps:

    pending = issue(codec, em, bucket)  # where the bucket is ready: what goes before the
                                        # collectives (cast, residual, quantize) and the collectives
    result = finish(em, pending)        # where the result is needed: the waits, then what follows
                                        # them: the mean (or this rank's slice of it), or the next
                                        # round in flight (int8's all-gather, PowerSGD's Q)

The passes choose the places (which gradients, which buckets, where each step goes); `drain`
finishes several buckets a round at a time, so each bucket's next collective is issued before
the following bucket's waits. A codec without a reduce-scatter form of its own (top-k, PowerSGD)
runs as an all-reduce of the bucket's whole gradients, and each rank keeps its slice.
"""
from __future__ import annotations

import functools
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from picofx.capture.annotate import fake_mode_of
from picofx.compression.state import CompressionState

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
convert = torch.ops.prims.convert_element_type.default


@dataclass
class Bucket:
    """One bucket of gradients as a codec sees it.

    All-reduce: `flat` is the gradients one after another, (numel,); the result is their mean over
    the ranks, the same bytes on every rank.
    Reduce-scatter (`shard_rows` given): `flat` is (N*M,); row r of flat.view(N, M) holds each
    gradient's rows [r*P_i, (r+1)*P_i) (zero-padded to N*P_i rows); the result is this rank's row
    of the mean, (M,)."""

    flat: fx.Node
    names: list[str]
    shapes: list[tuple]                        # the whole gradients'
    dtype: torch.dtype
    device: torch.device
    shard_rows: tuple[int, ...] | None = None  # reduce-scatter: each gradient's rows per rank, P_i
    index: int = 0                             # the bucket's number: names its state kept per bucket
    source: Any = None                         # sparse_rows: the embedding gradient's Rows

    @property
    def scatter(self) -> bool:
        return self.shard_rows is not None

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def shard_shapes(self) -> list[tuple]:
        return [(p, *s[1:]) for p, s in zip(self.shard_rows, self.shapes)]

    @property
    def widths(self) -> list[int]:
        return [math.prod(s) for s in self.shard_shapes]

    @property
    def width(self) -> int:  # M
        return sum(self.widths)


def shard_shapes(shapes, world: int) -> list[tuple]:
    """Each gradient's slice on one rank of a reduce-scatter: ceil(rows / world) rows."""
    return [(-(-s[0] // world), *s[1:]) for s in shapes]


@dataclass
class Pending:
    """Collectives in flight, and what the graph does once they are waited for: `then(waited)`
    returns the exchange's result, or the next Pending."""

    works: tuple[fx.Node, ...]
    then: Callable[[tuple[fx.Node, ...]], "fx.Node | Pending"]


class Codec:
    """What every codec provides (each is a frozen dataclass deriving from this): a `label` (its
    spelling in notes), `issue`, and `bucket_bytes`, the bytes each rank sends. Each also has a
    `wire_bytes` over plain shapes, for the planner (its parameters are the codec's own).

    Its record, beside its class, is all that names it elsewhere (registry.py lists the classes):
    `kind`, `spelling` and `parse` (how `compress` names it), `example` (the setting the
    combination table trains), `lossy`, and `traffic_per_element` (the planner's compute price)."""

    label: str
    scatters = True  # it has a reduce-scatter form; False: it runs on the whole gradients
    starts = False   # its first synced steps go as int8 (picofx/compression/start.py)
    kind = ""        # the name `compress` spells it by: "int8" in "int8:ef"
    spelling = ""    # its spellings, as errors and help list them: '"topk:F" (0 < F < 1)'
    example = ""     # the spelling the combination table trains (a lossy codec at a setting whose error is bounded)
    # It changes what the model learns beyond rounding each entry (drops entries, or rank): the
    # planner plans it only when asked.
    lossy = False
    # Memory traffic per fp32 gradient element beyond the uncompressed exchange's (reads + writes,
    # bytes), counted from its ops as a GPU compiler fuses them: the planner's price of its compute.
    traffic_per_element = 0

    @classmethod
    def parse(cls, argument: str | None) -> "Codec | None":
        """The codec `kind:argument` spells (argument None: `kind` alone); None when it takes no such
        argument (a ValueError from float() or int() says the same)."""
        raise NotImplementedError

    def issue(self, em: "Emitter", b: Bucket) -> Pending:
        raise NotImplementedError

    def bucket_bytes(self, b: Bucket, world: int) -> int:
        return self.wire_bytes(b.shapes, b.itemsize, world, scatter=b.scatter)

    def wire_bytes(self, shapes, itemsize: int, world: int, scatter: bool = False) -> int:
        raise NotImplementedError


def issue(codec: Codec, em: "Emitter", b: Bucket) -> Pending:
    """Start exchanging `b` with `codec` at the graph's insertion point."""
    if not b.scatter or codec.scatters:
        return codec.issue(em, b)
    whole = Bucket(em.flat_of(whole_gradients(em, b)), b.names, b.shapes, b.dtype, b.device, index=b.index)
    return then(codec.issue(em, whole), lambda mean: own_slice(em, b, mean))


def finish(em: "Emitter", pending: Pending) -> "fx.Node | Pending":
    """Wait for `pending`'s collectives and write what follows, at the graph's insertion point."""
    return pending.then(tuple(em.wait(work) for work in pending.works))


def drain(em: "Emitter", pending: list[Pending]) -> list[fx.Node]:
    """Finish every bucket's exchange at the insertion point, one round over all buckets at a time."""
    results: dict[int, fx.Node] = {}
    active = list(enumerate(pending))
    while active:
        still = []
        for k, p in active:
            out = finish(em, p)
            if isinstance(out, Pending):
                still.append((k, out))
            else:
                results[k] = out
        active = still
    return [results[k] for k in range(len(pending))]


def then(pending: Pending, follow: Callable[[fx.Node], fx.Node]) -> Pending:
    """`pending`, with `follow` applied to its final result."""
    def step(waited):
        out = pending.then(waited)
        return then(out, follow) if isinstance(out, Pending) else follow(out)
    return Pending(pending.works, step)


def whole_gradients(em: "Emitter", b: Bucket) -> list[fx.Node]:
    """A reduce-scatter bucket's gradients, whole: rows[:, at:at + width].reshape(N * P, ...)[:rows]."""
    rows = em(aten.view.default, b.flat, [em.world, b.width])
    wholes, at = [], 0
    for shape, p, width in zip(b.shapes, b.shard_rows, b.widths):
        whole = em(aten.reshape.default, em(aten.slice.Tensor, rows, 1, at, at + width), [em.world * p, *shape[1:]])
        wholes.append(em(aten.slice.Tensor, whole, 0, 0, shape[0]) if shape[0] != em.world * p else whole)
        at += width
    return wholes


def own_slice(em: "Emitter", b: Bucket, mean: fx.Node) -> fx.Node:
    """This rank's row of the reduce-scatter layout, cut from the whole gradients' mean (flat)."""
    packed = []
    for shape, p, piece in zip(b.shapes, b.shard_rows, em.split(mean, b.shapes)):
        piece = em(aten.reshape.default, piece, [shape[0], -1])
        if shape[0] != em.world * p:
            piece = em(aten.constant_pad_nd.default, piece, [0, 0, 0, em.world * p - shape[0]])
        packed.append(em(aten.reshape.default, piece, [em.world, -1]))
    packed = em(aten.cat.default, packed, 1) if len(packed) > 1 else packed[0]
    return em(aten.select.int, packed, 0, em.rank)


class Emitter:
    """Writes nodes into a backward graph at its insertion point, for the ranks of one mesh dimension,
    and holds the codecs' state as the graph's buffers."""

    def __init__(self, gm: fx.GraphModule, dim, state: CompressionState, summed: int = 1):
        self.gm, self.graph, self.state, self.dim = gm, gm.graph, state, dim
        self.world, self.rank, self.group = dim.size, dim.rank, dim.group_name
        self.averaged = dim.size // summed  # the ranks a mean divides by: `summed` of them hold parts of one sum

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def wait(self, work: fx.Node) -> fx.Node:
        return self(c10d.wait_tensor.default, work)

    def all_reduce(self, x: fx.Node) -> fx.Node:
        return self(c10d.all_reduce.default, x, "sum", self.group)

    def reduce_scatter(self, x: fx.Node, numel: int, dtype: torch.dtype, device) -> fx.Node:
        """Sum `x` ((N*M,) of `dtype`) over the ranks, keeping row `rank` of it."""
        work = self(c10d.reduce_scatter_tensor.default, x, "sum", self.world, self.group)
        with fake_mode_of(self.gm):  # the shard pass's report reads what its reduce-scatters carry
            x.meta["val"] = torch.empty(numel, dtype=dtype, device=device)
            work.meta["val"] = torch.empty(numel // self.world, dtype=dtype, device=device)
        return work

    def all_gather(self, x: fx.Node) -> fx.Node:
        return self(c10d.all_gather_into_tensor.default, x, self.world, self.group)

    def all_to_all(self, x: fx.Node, rows: int) -> fx.Node:
        """Dim 0 (`rows` long) cut into one chunk per rank: rank r receives every rank's chunk r."""
        split = [rows // self.world] * self.world
        return self(c10d.all_to_all_single.default, x, split, split, self.group)

    def split(self, flat: fx.Node, shapes: list) -> list[fx.Node]:
        pieces = self(aten.split_with_sizes.default, flat, [math.prod(s) for s in shapes])
        return [self(aten.view.default, self(operator.getitem, pieces, i), list(s)) for i, s in enumerate(shapes)]

    def flat_of(self, nodes: list[fx.Node]) -> fx.Node:
        flats = [self(aten.reshape.default, n, [-1]) for n in nodes]
        return self(aten.cat.default, flats) if len(flats) > 1 else flats[0]

    def buffer(self, key: str, tensor: torch.Tensor) -> fx.Node:
        """A get_attr of state `tensor` (registered as the graph's buffer the first time)."""
        attr = "compress_" + re.sub(r"\W", "_", key)
        if attr not in self.gm._buffers:
            self.gm.register_buffer(attr, tensor, persistent=False)
        return self.graph.get_attr(attr)

    def store(self, kept: fx.Node, value: fx.Node) -> None:
        """Write `value` into the state buffer `kept` in place. Inductor otherwise takes a buffer of
        up to 8 elements (a relative error's) for a constant and inlines it, dropping the write; the
        graph's mutated_named_buffers keeps it a buffer."""
        self.gm.meta.setdefault("mutated_named_buffers", set()).add(kept.target)
        self(aten.copy_.default, kept, value)

    def residuals(self, b: Bucket) -> list[fx.Node]:
        """The bucket's error-feedback residuals: per gradient, or (reduce-scatter) one in its layout."""
        slots = [(f"shard_bucket{b.index}", (self.world * b.width,))] if b.scatter else zip(b.names, b.shapes)
        return [self.buffer(f"residual/{name}", self.state.residuals.get(name, shape, b.dtype, b.device))
                for name, shape in slots]

    def keep_residuals(self, kept: list[fx.Node], flat: fx.Node) -> None:
        """Store `flat` (the bucket's residuals one after another) into the `kept` residuals."""
        for node, piece in zip(kept, self.split(flat, [tuple(getattr(self.gm, k.target).shape) for k in kept])):
            self.store(node, piece)

    def record_error(self, b: Bucket, left_out: list[fx.Node], given: list[fx.Node]) -> None:
        """Keep this step's ||left_out|| / ||given|| (norms over all the nodes) as the bucket's
        relative error (by its first gradient's name), for the report."""
        def squares(nodes):
            sums = [self(aten.sum.default, self(aten.mul.Tensor, n, n), dtype=torch.float32) for n in nodes]
            return functools.reduce(lambda x, y: self(aten.add.Tensor, x, y), sums)
        ratio = self(aten.sqrt.default, self(aten.div.Tensor, squares(left_out),
                                             self(aten.clamp_min.default, squares(given), 1e-30)))
        self.store(self.buffer(f"error/{b.names[0]}", self.state.relative_errors.get(b.names[0], b.device)), ratio)
