"""Int8: qgZ's quantized exchange, blocks of int8 values with one fp32 scale each."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

from picofx.compression.protocol import Bucket, Codec, Emitter, Pending, shard_shapes
from picofx.cost.comm import all_gather_bytes, all_to_all_bytes

aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


@dataclass(frozen=True)
class Blocks:
    """Where a bucket's gradients lie in `rows` rows of quantization blocks: each gradient on whole
    blocks of its own (a small one never shares a scale with a large neighbour), starting at
    starts[i] of a row `length` entries long."""

    widths: list[int]  # each gradient's entries in one row
    starts: list[int]
    length: int
    rows: int


@dataclass(frozen=True)
class Int8(Codec):
    """Each rank's blocks of `block` entries quantized with one fp32 scale each; an all-to-all gives
    each rank every rank's copy of its share of the blocks, which it dequantizes, sums in fp32 and
    averages. Reduce-scatter: its share is its row of the bucket. All-reduce: its share is a 1/N
    slice of the bucket; the averaged slices, quantized again, are all-gathered, and every rank
    dequantizes the same bytes. With `feedback`, each rank's first quantization error is added to
    its next step."""

    block: int = 256
    feedback: bool = False
    kind, spelling, example = "int8", '"int8", "int8:ef"', "int8"

    @classmethod
    def parse(cls, argument: str | None) -> Int8 | None:
        return cls(feedback=argument == "ef") if argument in (None, "ef") else None

    @property
    def traffic_per_element(self) -> int:
        # blocks (8), quantize (4 + 4 + 1), dequantize and sum the copies (1 + 4 + 4), dequantize the
        # gathered result (1 + 4), back from blocks (8); error feedback: the residual added (4 + 4), the
        # quantization error stored (4 + 4)
        return 55 if self.feedback else 39

    @property
    def label(self) -> str:
        return "int8:ef" if self.feedback else "int8"

    def starts(self, shapes) -> list[int]:
        """Where each tensor starts on whole blocks of its own, and where the last one ends."""
        out, at = [], 0
        for s in shapes:
            out.append(at)
            at += -(-math.prod(s) // self.block) * self.block
        return out + [at]

    def padded(self, shapes, world: int) -> int:
        """The all-reduce's row: the tensors' blocks, padded to a whole number of blocks per rank."""
        unit = self.block * world
        return -(-self.starts(shapes)[-1] // unit) * unit

    def quantized_bytes(self, entries: int) -> int:
        return entries + 4 * (entries // self.block)  # int8 values and fp32 scales

    def wire_bytes(self, shapes, itemsize: int, world: int, scatter: bool = False) -> int:
        if scatter:  # every rank's row in one all-to-all
            return all_to_all_bytes(world * self.quantized_bytes(self.starts(shard_shapes(shapes, world))[-1]), world)
        n = self.quantized_bytes(self.padded(shapes, world))
        return all_to_all_bytes(n, world) + all_gather_bytes(n, world)

    def layout(self, b: Bucket, world: int) -> Blocks:
        if b.scatter:
            starts = self.starts(b.shard_shapes)
            return Blocks(b.widths, starts, starts[-1], world)
        return Blocks([math.prod(s) for s in b.shapes], self.starts(b.shapes), self.padded(b.shapes, world), 1)

    def issue(self, em: Emitter, b: Bucket) -> Pending:
        x = em(convert, b.flat, torch.float32) if b.dtype != torch.float32 else b.flat
        if self.feedback:
            residuals = em.residuals(b)
            x = em(aten.add.Tensor, x, em(convert, em.flat_of(residuals), torch.float32))
        layout = self.layout(b, em.world)
        blocks = self.to_blocks(em, x, layout)
        q, scale = quantize(em, blocks)
        error = em(aten.sub.Tensor, blocks, dequantize(em, q, scale))
        em.record_error(b, [error], [blocks])
        if self.feedback:
            error = em(aten.reshape.default, self.from_blocks(em, error, layout, layout.rows), [-1])
            em.keep_residuals(residuals, em(convert, error, b.dtype))
        count = layout.rows * layout.length // self.block
        return Pending((em.all_to_all(q, count), em.all_to_all(scale, count)),
                       lambda waited: self.averaged(em, b, layout, *waited))

    def averaged(self, em: Emitter, b: Bucket, layout: Blocks, q: fx.Node, scale: fx.Node):
        """Every rank's copy of this rank's share of the blocks, dequantized and averaged."""
        count = layout.rows * layout.length // self.block
        copies = em(aten.view.default, dequantize(em, q, scale), [em.world, count // em.world, self.block])
        mean = em(aten.div.Tensor, em(aten.sum.dim_IntList, copies, [0]), em.world)
        if b.scatter:
            return self.unpacked(em, b, mean, layout)
        q, scale = quantize(em, mean)
        return Pending((em.all_gather(q), em.all_gather(scale)),
                       lambda waited: self.unpacked(em, b, dequantize(em, *waited), layout))

    def unpacked(self, em: Emitter, b: Bucket, blocks: fx.Node, layout: Blocks) -> fx.Node:
        out = em(aten.reshape.default, self.from_blocks(em, blocks, layout, 1), [-1])
        return em(convert, out, b.dtype) if b.dtype != torch.float32 else out

    def to_blocks(self, em: Emitter, flat: fx.Node, layout: Blocks) -> fx.Node:
        """(rows * length / block, block): each row's gradients zero-padded to their blocks."""
        rows = em(aten.view.default, flat, [layout.rows, sum(layout.widths)])
        pieces = em(aten.split_with_sizes.default, rows, layout.widths, 1)
        end = len(layout.widths) - 1
        padded = [em(aten.constant_pad_nd.default, em(operator.getitem, pieces, i),
                     [0, layout.starts[i + 1] - layout.starts[i] - w + (layout.length - layout.starts[-1] if i == end else 0)])
                  for i, w in enumerate(layout.widths)]
        row = em(aten.cat.default, padded, 1) if len(padded) > 1 else padded[0]
        return em(aten.view.default, row, [-1, self.block])

    def from_blocks(self, em: Emitter, blocks: fx.Node, layout: Blocks, rows: int) -> fx.Node:
        """(rows, M) from `rows` rows of blocks: each gradient's padding dropped."""
        row = em(aten.view.default, blocks, [rows, layout.length])
        pieces = [em(aten.slice.Tensor, row, 1, start, start + w) for start, w in zip(layout.starts, layout.widths)]
        return em(aten.cat.default, pieces, 1) if len(pieces) > 1 else pieces[0]


def quantize(em: Emitter, blocks: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Per-row absmax int8: (int8 values, fp32 scale per row), value ~= int8 * scale."""
    amax = em(aten.amax.default, em(aten.abs.default, blocks), [-1], True)
    scale = em(aten.clamp_min.default, em(aten.div.Tensor, amax, 127.0), 1e-30)
    q = em(aten.round.default, em(aten.div.Tensor, blocks, scale))
    q = em(aten.clamp_max.default, em(aten.clamp_min.default, q, -127.0), 127.0)
    return em(convert, q, torch.int8), scale


def dequantize(em: Emitter, q: fx.Node, scale: fx.Node) -> fx.Node:
    return em(aten.mul.Tensor, em(convert, q, torch.float32), scale)
