"""Dense: the bucket as it is, or cast to bf16, summed by an all-reduce or a reduce-scatter."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from picofx.compression.protocol import Bucket, Codec, Emitter, Pending, shard_shapes
from picofx.cost.comm import all_reduce_bytes, reduce_scatter_bytes

aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


@dataclass(frozen=True)
class Dense(Codec):
    """The bucket (in `cast`, e.g. bf16, when given) summed over the ranks, cast back, divided by
    their number. Dense() is no compression."""

    cast: torch.dtype | None = None
    kind, spelling, example = "bf16", '"bf16"', "bf16"

    @classmethod
    def parse(cls, argument: str | None) -> Dense | None:
        return cls(torch.bfloat16) if argument is None else None

    @property
    def traffic_per_element(self) -> int:
        return 12 if self.cast else 0  # cast to bf16 (4 + 2), back to fp32 (2 + 4)

    @property
    def label(self) -> str:
        return "bf16" if self.cast == torch.bfloat16 else "none"

    def wire_bytes(self, shapes, itemsize: int, world: int, scatter: bool = False) -> int:
        itemsize = self.cast.itemsize if self.cast else itemsize
        if scatter:
            return reduce_scatter_bytes(world * sum(math.prod(s) for s in shard_shapes(shapes, world)) * itemsize, world)
        return all_reduce_bytes(sum(math.prod(s) for s in shapes) * itemsize, world)

    def issue(self, em: Emitter, b: Bucket) -> Pending:
        x = em(convert, b.flat, self.cast) if self.cast else b.flat
        if self.cast:
            em.record_error(b, [em(aten.sub.Tensor, b.flat, widened(em, x, self.cast, b.dtype))], [b.flat])
        if b.scatter:
            work = em.reduce_scatter(x, em.world * b.width, self.cast or b.dtype, b.device)
        else:
            work = em.all_reduce(x)
        return Pending((work,), lambda waited: self.mean(em, b, waited[0]))

    def mean(self, em: Emitter, b: Bucket, summed: fx.Node) -> fx.Node:
        if self.cast:
            summed = em(convert, summed, b.dtype)
        return em(aten.div.Tensor, summed, em.averaged)


def widened(em: Emitter, x: fx.Node, narrow: torch.dtype, dtype: torch.dtype) -> fx.Node:
    """`x` (cast down to `narrow`) back in `dtype`; bf16 to float32 through its bits. Inductor's C++
    code takes a float32 -> bfloat16 -> float32 round trip inside one kernel for the identity (and
    Triton computes bf16 in float32), so the cast's rounding error would read 0."""
    if (narrow, dtype) != (torch.bfloat16, torch.float32):
        return em(convert, x, dtype)
    bits = em(convert, em(aten.view.dtype, x, torch.int16), torch.int32)  # sign-extended: *65536 stays in int32
    return em(aten.view.dtype, em(aten.mul.Tensor, bits, 65536), torch.float32)
