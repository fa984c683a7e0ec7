"""The spelling of `compress`, for Overlap and Shard alike, parsed once into a CompressSpec.

None (no compression), "bf16", "int8" (per-block int8; "int8:ef" adds error feedback), "topk:F"
(the fraction F of entries with the largest magnitude), "powersgd:R" (rank-R factors of matrix
gradients), or "sparse_rows" alone or before one of those with a "+" ("sparse_rows+int8"): the
embedding's gradient as (token id, row) pairs, the other buckets as named.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from picofx.compression import registry
from picofx.compression.dense import Dense
from picofx.compression.protocol import Codec

KINDS = registry.kinds_text()


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
    rows = parts[0] == registry.ROWS
    rest = parts[1:] if rows else parts
    if len(rest) > 1:
        raise ValueError(f"{owner}(compress={spec!r}): at most 'sparse_rows+KIND'; use one of {KINDS}")
    if not rest:
        return CompressSpec(True)
    return CompressSpec(rows, codec(rest[0], spec, owner))


def codec(kind: str, spec: str, owner: str) -> Codec:
    """The registered codec `kind` ("int8:ef") spells, its record's parse reading the argument."""
    name, colon, argument = kind.partition(":")
    for registered in registry.CODECS:  # read at each call: a codec registered later is found
        if registered.kind == name:
            try:
                made = registered.parse(argument if colon else None)
            except ValueError:
                made = None
            if made is not None:
                return made
    raise ValueError(f"{owner}(compress={spec!r}): {kind!r} is not a compressor; use one of {registry.kinds_text()}")
