"""A layout as `picofx plan --layout` spells it: the plan's own fields, "key=value" comma-separated,
as `--json` writes them: "dp=128,shard=true,tp=1,pp=1,microbatches=1,checkpoint=selective"
(cp: context-parallel ranks, "dp=1,shard=true,cp=8,checkpoint=full"; precision=bf16|float8|float8_rowwise;
shard_stage=1|2|3, which implies shard=true: "shard=true" alone is stage 3; virtual_stages=N: N pipeline
stages per rank, interleaved 1F1B). The data-parallel ranks are spelled dp=N with shard=true|false, or as
their two dimensions, "dp_replicate=2,dp_shard=4" (HSDP); async_tp=true|false, cp_method=allgather|ring.

Left out, tp, pp and cp are 1 and dp makes up the GPUs; every other field takes Layout's default.
`layout_spec` writes every field of a Layout in this spelling (what a checkpoint records)."""
from __future__ import annotations

import dataclasses

from picofx.cost.balance import SINGLE_STAGE_SCHEDULES
from picofx.planner.compress import kinds_to_consider
from picofx.planner.layouts import CP_METHODS, INTERLEAVED, LAYOUT_NAMES, PRECISIONS, Checkpointing, Layout

WHOLE = ("dp", "dp_replicate", "dp_shard", "tp", "pp", "microbatches", "cp", "shard_stage", "virtual_stages")
YES_NO = ("shard", "sequence_parallel", "async_tp")
TRUE, FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")
FIELDS = list(LAYOUT_NAMES)


def parse_value(key: str, text: str):
    """The value of field `key`, or ValueError naming the values it takes."""
    text = text.strip()
    if key in WHOLE:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{key}={text!r}: a whole number of at least 1")
        return int(text)
    if key in YES_NO:
        if text.lower() not in TRUE + FALSE:
            raise ValueError(f"{key}={text!r}: true or false")
        return text.lower() in TRUE
    if key == "checkpoint":
        lowered = text.lower()
        return Checkpointing.of(lowered in TRUE if lowered in TRUE + FALSE else lowered)
    if key == "schedule":
        if text not in (*SINGLE_STAGE_SCHEDULES, INTERLEAVED):
            raise ValueError(f"schedule={text!r}: the planner predicts {', '.join(SINGLE_STAGE_SCHEDULES)} and "
                             f"{INTERLEAVED} (with virtual_stages=N)")
        return text
    if key == "cp_method":
        if text not in CP_METHODS:
            raise ValueError(f"cp_method={text!r}: one of {', '.join(CP_METHODS)}")
        return text
    if key == "precision":
        if text not in PRECISIONS:
            raise ValueError(f"precision={text!r}: one of {', '.join(PRECISIONS)}")
        return text
    kinds = kinds_to_consider(text)  # compress: the spelling Overlap(compress=...) takes, or none
    if len(kinds) > 1:
        raise ValueError(f"compress={text!r}: one compressor per layout")
    return kinds[0] if kinds else None


def parse_layout(spec: str, gpus: int | None = None) -> Layout:
    """The Layout `spec` spells; `gpus`: what dp makes up where the spec leaves it out (else 1).
    ValueError names the fields and values it takes."""
    given = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise ValueError(f"--layout: {item!r} is not key=value (e.g. \"dp=8,shard=true,tp=1,pp=1\")")
        if key not in FIELDS:
            raise ValueError(f"--layout: unknown field {key!r}; the fields are {', '.join(FIELDS)}")
        if key in given:
            raise ValueError(f"--layout: {key} given twice")
        try:
            given[key] = parse_value(key, text)
        except ValueError as e:
            raise ValueError(f"--layout: {e}") from None
    if "shard_stage" in given:
        if given.setdefault("shard", True) is False:
            raise ValueError("--layout: shard_stage with shard=false; leave shard out or set it true")
    if given.get("dp_shard", 1) > 1 and given.setdefault("shard", True) is False:
        raise ValueError("--layout: dp_shard over 1 with shard=false; leave shard out or set it true")
    if "dp" in given and {"dp_replicate", "dp_shard"} & set(given):
        raise ValueError("--layout: dp with dp_replicate or dp_shard: give dp (and shard) or the two dimensions")
    tp, pp, cp = given.setdefault("tp", 1), given.setdefault("pp", 1), given.setdefault("cp", 1)
    if not {"dp_replicate", "dp_shard"} & set(given):
        given.setdefault("dp", max(1, (gpus or 1) // (tp * pp * cp)))
    try:
        return Layout(**given)
    except ValueError as e:
        raise ValueError(f"--layout: {e}") from None


def layout_spec(layout: Layout) -> str:
    """Every field of `layout` as --layout spells it; parse_layout reads it back (a planned schedule)."""
    def text(value) -> str:
        return str(value).lower() if isinstance(value, bool) else "none" if value is None else str(value)

    return ",".join(f"{f.name}={text(getattr(layout, f.name))}" for f in dataclasses.fields(Layout)
                    if layout.shard or f.name != "shard_stage")  # a stage implies shard
