"""The spelling of `compress`, for Overlap and Shard alike, parsed once into a CompressSpec.

None (no compression), "bf16", "int8" (per-block int8; "int8:ef" adds error feedback), "topk:F"
(the fraction F of entries with the largest magnitude), "powersgd:R" (rank-R factors of matrix
gradients), or "sparse_rows" alone or before one of those with a "+" ("sparse_rows+int8"): the
embedding's gradient as (token id, row) pairs, the other buckets as named.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from picofx.compression.dense import Dense
from picofx.compression.int8 import Int8
from picofx.compression.powersgd import PowerSGD
from picofx.compression.protocol import Codec
from picofx.compression.topk import TopK

KINDS = ('None, "bf16", "int8", "int8:ef", "topk:F" (0 < F < 1), "powersgd:R" (R >= 1), "sparse_rows", '
         '"sparse_rows+KIND"')


@dataclass(frozen=True)
class CompressSpec:
    """`compress` parsed: whether the embedding goes as rows, and the other buckets' codec."""

    rows: bool
    other: Codec = field(default_factory=Dense)


def parse_compress(spec: str | None, owner: str = "Overlap") -> CompressSpec:
    """`spec` as a CompressSpec; a ValueError names `owner`'s option and the kinds it takes."""
    if spec is None:
        return CompressSpec(False)
    if not isinstance(spec, str):
        raise ValueError(f"{owner}(compress={spec!r}): a string, one of {KINDS}")
    parts = spec.split("+")
    rows = parts[0] == "sparse_rows"
    rest = parts[1:] if rows else parts
    if len(rest) > 1:
        raise ValueError(f"{owner}(compress={spec!r}): at most 'sparse_rows+KIND'; use one of {KINDS}")
    if not rest:
        return CompressSpec(True)
    return CompressSpec(rows, codec(rest[0], spec, owner))


def codec(kind: str, spec: str, owner: str) -> Codec:
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
    raise ValueError(f"{owner}(compress={spec!r}): {kind!r} is not a compressor; use one of {KINDS}")
