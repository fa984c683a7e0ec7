"""overlap_codecs: the compressors with error feedback (top-k, PowerSGD) and the choice of a
compressor by its name in `Overlap(compress=...)` (the spelling: overlap_compress.py)."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from picofx.compression.allreduce import BucketIn, Dense, Emitter, Int8, ring_bytes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
convert = torch.ops.prims.convert_element_type.default


@dataclass(frozen=True)
class TopK:
    """The `fraction` of entries (plus last step's residual) with the largest magnitude, sent as
    (int32 index, value) pairs by all-gather and added into zeros; the rest is the new residual."""

    fraction: float

    @property
    def label(self) -> str:
        return f"topk:{self.fraction:g}"

    def kept_count(self, numel: int) -> int:
        return max(1, math.ceil(self.fraction * numel))

    def wire_bytes(self, shapes, itemsize: int, world: int) -> int:
        return (world - 1) * self.kept_count(sum(math.prod(s) for s in shapes)) * (4 + itemsize)

    def exchange(self, em: Emitter, b: BucketIn):
        residual = em.residual(b)
        x = em(aten.add.Tensor, b.flat, em.flat_of(residual))
        index = em(operator.getitem, em(aten.topk.default, em(aten.abs.default, x), self.kept_count(b.numel)), 1)
        values = em(aten.gather.default, x, 0, index)
        left = em(aten.scatter.value, x, 0, index, 0.0)
        em.record_error(b, [left], [x])
        for kept, piece in zip(residual, em.split(left, b.shapes)):
            em.store(kept, piece)
        index_work, value_work = em.all_gather(em(convert, index, torch.int32)), em.all_gather(values)
        yield
        zeros = em(aten.full.default, [b.numel], 0.0, dtype=b.dtype, device=b.device)
        index = em(convert, em.wait(index_work), torch.int64)
        summed = em(aten.index_put.default, zeros, [index], em.wait(value_work), True)
        return em(aten.div.Tensor, summed, em.world)


@dataclass(frozen=True)
class PowerSGD:
    """Rank-`rank` factors of each matrix gradient M (plus its residual): P = M Q, all-reduced
    and orthonormalized; Q = M^T P, all-reduced and averaged; the average is P Q^T, and M - P Q^T
    the residual. Q starts the next step from this one's. Vectors, and matrices too small to gain,
    are all-reduced as they are. One all-reduce per bucket and round."""

    rank: int

    @property
    def label(self) -> str:
        return f"powersgd:{self.rank}"

    def compresses(self, shape) -> bool:
        if len(shape) < 2:
            return False
        rows, cols = shape[0], math.prod(shape[1:])
        return (rows + cols) * self.rank < rows * cols

    def wire_bytes(self, shapes, itemsize: int, world: int) -> int:
        numel = sum((s[0] + math.prod(s[1:])) * self.rank if self.compresses(s) else math.prod(s) for s in shapes)
        return ring_bytes(numel * itemsize, world)

    def exchange(self, em: Emitter, b: BucketIn):
        grads = em.split(b.flat, b.shapes)
        matrices = [i for i, s in enumerate(b.shapes) if self.compresses(s)]
        plain = [i for i in range(len(grads)) if i not in matrices]
        plain_work = em.all_reduce(em.flat_of([grads[i] for i in plain])) if plain else None
        ms, qs, residuals, ps = {}, {}, {}, {}
        for i in matrices:
            rows, cols = b.shapes[i][0], math.prod(b.shapes[i][1:])
            residuals[i] = em.kept(f"residual/{b.names[i]}", lambda r=rows, c=cols: torch.zeros(
                r, c, dtype=b.dtype, device=b.device))
            qs[i] = em.kept(f"powersgd{self.rank}/{b.names[i]}",
                            lambda c=cols: first_q(c, self.rank, b.dtype, b.device))
            ms[i] = em(aten.add.Tensor, em(aten.reshape.default, grads[i], [rows, cols]), residuals[i])
            ps[i] = em(aten.mm.default, ms[i], orthonormal(em, qs[i]))  # last step's Q, as torch's hook
        p_work = em.all_reduce(em.flat_of([ps[i] for i in matrices])) if matrices else None
        yield
        if matrices:
            summed = em.split(em.wait(p_work), [(b.shapes[i][0], self.rank) for i in matrices])
            for i, p in zip(matrices, summed):
                ps[i] = orthonormal(em, p)
            new_q = [em(aten.mm.default, em(aten.permute.default, ms[i], [1, 0]), ps[i]) for i in matrices]
            q_work = em.all_reduce(em.flat_of(new_q))
        yield
        out, left = {}, {}
        if plain:
            mean = em(aten.div.Tensor, em.wait(plain_work), em.world)
            out.update(zip(plain, em.split(mean, [b.shapes[i] for i in plain])))
        if matrices:
            q_mean = em(aten.div.Tensor, em.wait(q_work), em.world)
            q_shapes = [(math.prod(b.shapes[i][1:]), self.rank) for i in matrices]
            for i, q in zip(matrices, em.split(q_mean, q_shapes)):
                approx = em(aten.mm.default, ps[i], em(aten.permute.default, q, [1, 0]))
                em.store(qs[i], q)
                left[i] = em(aten.sub.Tensor, ms[i], approx)
                em.store(residuals[i], left[i])
                out[i] = approx
            em.record_error(b, list(left.values()), [ms[i] for i in matrices] + [grads[i] for i in plain])
        return em.flat_of([out[i] for i in range(len(grads))])


def orthonormal(em: Emitter, matrix: fx.Node) -> fx.Node:
    """An orthonormal basis of the columns' span (QR's Q): the same bytes on every rank given the same input."""
    return em(operator.getitem, em(aten.linalg_qr.default, matrix, "reduced"), 0)


def first_q(cols: int, rank: int, dtype, device) -> torch.Tensor:
    """The same orthonormal start on every rank (a fixed seed), as torch's PowerSGD hook."""
    q = torch.randn(cols, rank, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    return torch.linalg.qr(q).Q.to(dtype=dtype, device=device)


@dataclass(frozen=True)
class CompressSpec:
    """`compress` parsed: whether the embedding goes as rows, and the other buckets' compressor."""

    rows: bool
    other: Any = field(default_factory=Dense)


KINDS = ('None, "bf16", "int8", "int8:ef", "topk:F" (0 < F < 1), "powersgd:R" (R >= 1), "sparse_rows", '
         '"sparse_rows+KIND"')


def parse_compress(spec: str | None) -> CompressSpec:
    if spec is None:
        return CompressSpec(False)
    if not isinstance(spec, str):
        raise ValueError(f"Overlap(compress={spec!r}): a string, one of {KINDS}")
    parts = spec.split("+")
    rows = parts[0] == "sparse_rows"
    rest = parts[1:] if rows else parts
    if len(rest) > 1:
        raise ValueError(f"Overlap(compress={spec!r}): at most 'sparse_rows+KIND'; use one of {KINDS}")
    if not rest:
        return CompressSpec(True)
    return CompressSpec(rows, compressor(rest[0], spec))


def compressor(kind: str, spec: str):
    name, _, arg = kind.partition(":")
    try:
        if kind == "bf16":
            return Dense(torch.bfloat16)
        if name == "int8" and arg in ("", "ef"):
            return Int8(feedback=arg == "ef")
        if name == "topk" and 0 < float(arg) < 1:
            return TopK(float(arg))
        if name == "powersgd" and int(arg) >= 1:
            return PowerSGD(int(arg))
    except ValueError:
        pass
    raise ValueError(f"Overlap(compress={spec!r}): {kind!r} is not a compressor; use one of {KINDS}")
