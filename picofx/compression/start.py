"""Start: the first synced steps of a lossy codec (PowerSGD) sent as int8 instead.

AdamW's first updates move every entry by about the learning rate in the direction of its
gradient's sign, and its second moment is built from those first gradients. A rank-R gradient has
the wrong sign, or none, in much of each matrix then, and error feedback returns what it left out
only over the following steps, after AdamW has moved on: on the tiny reference LLaMA, PowerSGD at
rank 4 from the first step ends 1.5x the uncompressed loss after 200 steps, after two whole
first steps (torch's start_powerSGD_iter=2) 1.3x. int8 keeps every entry's sign and size to half a
quantization step at a quarter of fp32's bytes, and two int8 steps do as well as two whole ones.
(Priming Q from the start's averaged gradient, without communicating, measured no better: 1.37x
and 1.31x with it, 1.30x and 1.33x without, on two data seeds; Q is left to warm up by itself.)
"""
from __future__ import annotations

from dataclasses import dataclass

from picofx.compression.int8 import Int8
from picofx.compression.protocol import Codec

START_STEPS = 2  # two int8 steps: as many as torch's hook must send whole, at half of one's bytes


@dataclass(frozen=True)
class Start(Int8):
    """Int8 (without error feedback) as the first steps of `after`: its label says so."""

    after: Codec | None = None

    @property
    def label(self) -> str:
        return f"int8 (start of {self.after.label})"


def start_of(codec: Codec, steps: int) -> tuple[Codec | None, int]:
    """The codec of a lossy `codec`'s first `steps` synced steps and their number ((None, 0): none)."""
    if not codec.starts or steps == 0:
        return None, 0
    return Start(after=codec), steps
