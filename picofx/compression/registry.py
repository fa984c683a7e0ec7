"""The codecs `compress` names, one line each. A codec's record (its spelling, whether it is lossy,
its traffic figure) sits beside its class (picofx.compression.protocol.Codec says what it holds);
parsing, the planner's pricing and the combination table read them from here. Adding a codec is
its module, its line here and its test (docs/ARCHITECTURE.md).

sparse_rows is no codec of a bucket but the embedding's form beside one ("sparse_rows+int8"):
parse.py spells it.
"""
from __future__ import annotations

import re

from picofx.compression.dense import Dense
from picofx.compression.int8 import Int8
from picofx.compression.powersgd import PowerSGD
from picofx.compression.protocol import Codec
from picofx.compression.topk import TopK

CODECS: tuple[type[Codec], ...] = (Dense, Int8, TopK, PowerSGD)  # in the order help and tables list them
ROWS = "sparse_rows"


def codec_kinds() -> tuple[str, ...]:
    return tuple(c.kind for c in CODECS)


def kinds_text() -> str:
    """Every spelling `compress` takes, for errors and help."""
    return ", ".join(["None", *(c.spelling for c in CODECS), f'"{ROWS}"', f'"{ROWS}+KIND"'])


def spellings(lossy: bool | None = None) -> list[str]:
    """The codecs' spellings, bare ("topk:F"), for help texts; only the lossy ones or the others
    when `lossy` says."""
    return [s for c in CODECS if lossy in (None, c.lossy) for s in re.findall(r'"([^"]+)"', c.spelling)]
