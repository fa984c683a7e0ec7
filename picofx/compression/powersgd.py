"""PowerSGD: low-rank factors of each matrix gradient, warm-started from the last step's."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from picofx.compression.protocol import Bucket, Codec, Emitter, Pending
from picofx.cost.comm import all_reduce_bytes

aten = torch.ops.aten
MIN_COMPRESSION_RATE = 2


@dataclass(frozen=True)
class PowerSGD(Codec):
    """Rank-`rank` factors of each matrix gradient M (plus its residual): P = M Q, all-reduced
    and orthonormalized; Q = M^T P, all-reduced and averaged; the average is P Q^T, and M - P Q^T
    the residual. Q starts the next step from this one's. Vectors, and matrices whose factors would
    be half their entries or more, are all-reduced as they are. One all-reduce per bucket and round.
    Under a reduce-scatter it runs on the whole gradients (the factors are of whole matrices)."""

    rank: int
    scatters = False
    starts = True
    kind, spelling, example, lossy = "powersgd", '"powersgd:R" (R >= 1)', "powersgd:8", True
    # residual added (12), M Q and M^T P read M (8), P Q^T written (4), residual stored (12), cast (8)
    traffic_per_element = 44

    @classmethod
    def parse(cls, argument: str | None) -> PowerSGD | None:
        return cls(int(argument)) if argument is not None and int(argument) >= 1 else None

    @property
    def label(self) -> str:
        return f"powersgd:{self.rank}"

    def compresses(self, shape) -> bool:
        """A matrix whose factors are fewer than half its entries (torch's hook's min_compression_rate,
        2): nearer, the bytes saved are few for what a rank-R approximation leaves out."""
        if len(shape) < 2:
            return False
        rows, cols = shape[0], math.prod(shape[1:])
        return MIN_COMPRESSION_RATE * (rows + cols) * self.rank < rows * cols

    def wire_bytes(self, shapes, itemsize: int, world: int, scatter: bool = False) -> int:
        numel = sum((s[0] + math.prod(s[1:])) * self.rank if self.compresses(s) else math.prod(s) for s in shapes)
        return all_reduce_bytes(numel * itemsize, world)

    def issue(self, em: Emitter, b: Bucket) -> Pending:
        grads = em.split(b.flat, b.shapes)
        f = Factors([i for i, s in enumerate(b.shapes) if self.compresses(s)])
        plain = [i for i in range(len(grads)) if i not in f.matrices]
        plain_work = (em.all_reduce(em.flat_of([grads[i] for i in plain])),) if plain else ()
        if not f.matrices:
            return Pending(plain_work, lambda waited: self.averaged(em, b, grads, plain, f, waited[0], None))
        for i in f.matrices:
            name, rows, cols = b.names[i], b.shapes[i][0], math.prod(b.shapes[i][1:])
            f.residuals[i] = em.buffer(f"residual/{name}",
                                       em.state.residuals.get(name, (rows, cols), b.dtype, b.device))
            f.qs[i] = em.buffer(f"powersgd{self.rank}/{name}",
                                em.state.powersgd.get(self.rank, name, cols, b.dtype, b.device))
            f.ms[i] = em(aten.add.Tensor, em(aten.reshape.default, grads[i], [rows, cols]), f.residuals[i])
        ps = [em(aten.mm.default, f.ms[i], orthonormal(em, f.qs[i])) for i in f.matrices]  # last step's Q, as torch's hook
        return Pending((em.all_reduce(em.flat_of(ps)),),
                       lambda waited: self.second_round(em, b, grads, plain, f, waited[0], plain_work))

    def second_round(self, em: Emitter, b: Bucket, grads, plain, f: "Factors", p_sum: fx.Node, plain_work) -> Pending:
        """P summed, orthonormalized per matrix; Q = M^T P all-reduced (the plain gradients' still in flight)."""
        for i, p in zip(f.matrices, em.split(p_sum, [(b.shapes[i][0], self.rank) for i in f.matrices])):
            f.ps[i] = orthonormal(em, p)
        new_q = [em(aten.mm.default, em(aten.permute.default, f.ms[i], [1, 0]), f.ps[i]) for i in f.matrices]
        return Pending((em.all_reduce(em.flat_of(new_q)), *plain_work),
                       lambda waited: self.averaged(em, b, grads, plain, f, waited[1] if plain else None, waited[0]))

    def averaged(self, em: Emitter, b: Bucket, grads, plain, f: "Factors", plain_sum, q_sum) -> fx.Node:
        """The mean: plain gradients divided, matrices as P Q^T of the averaged Q; Q and residuals kept."""
        out = {}
        if plain:
            mean = em(aten.div.Tensor, plain_sum, em.world)
            out.update(zip(plain, em.split(mean, [b.shapes[i] for i in plain])))
        if f.matrices:
            q_mean = em(aten.div.Tensor, q_sum, em.world)
            left = []
            for i, q in zip(f.matrices, em.split(q_mean, [(math.prod(b.shapes[i][1:]), self.rank) for i in f.matrices])):
                out[i] = em(aten.mm.default, f.ps[i], em(aten.permute.default, q, [1, 0]))
                em.store(f.qs[i], q)
                left.append(em(aten.sub.Tensor, f.ms[i], out[i]))
                em.store(f.residuals[i], left[-1])
            em.record_error(b, left, [f.ms[i] for i in f.matrices] + [grads[i] for i in plain])
        return em.flat_of([out[i] for i in range(len(grads))])


@dataclass
class Factors:
    """One bucket's matrices (their indices) and, per index, M plus its residual, the Q and
    residual buffers, and P once summed."""

    matrices: list[int]
    ms: dict = field(default_factory=dict)
    qs: dict = field(default_factory=dict)
    residuals: dict = field(default_factory=dict)
    ps: dict = field(default_factory=dict)


def orthonormal(em: Emitter, matrix: fx.Node) -> fx.Node:
    """An orthonormal basis of the columns' span (QR's Q): the same bytes on every rank given the same input."""
    return em(operator.getitem, em(aten.linalg_qr.default, matrix, "reduced"), 0)
