"""Gradient compression as a planner option: which compressors a layout's replicas may use, the bytes
each rank sends per step, the seconds on the link and the compute the compressor adds.

The bytes are the compressors' own (picofx.compression, as the overlap pass runs them): each one's
`wire_bytes(shapes, itemsize, world)` over the gradients one rank holds (those of the first pipeline
stage, split by tensor parallelism as pass `tensor_parallel` splits them), and for "sparse_rows" the
overlap pass's rule: the embedding goes as (token id, row) pairs only where that is fewer bytes than
the table, and never for gradients accumulated over micro-batches (a dense table then). The link time
is that of an all-reduce taking as long as the bytes sent, as the pass times its buckets. The
compute: quantizing, casting and scattering are memory-bound passes over the gradient, charged at
the device's memory bandwidth, by each codec's own traffic figure (its record: picofx.compression.registry).

Sharded data parallel (`scatter_exchange`): the compressor replaces each bucket's gradient
reduce-scatter as Shard(compress=...) runs it: bf16 and int8 in their reduce-scatter form, top-k and
PowerSGD on the whole gradients (each rank keeps its slice), the embedding as rows where they are
fewer bytes than its reduce-scatter; the shard prediction takes the bytes as bytes per parameter of
its per-layer reduce-scatters.

Lossy kinds (those whose record says so: "topk:F", "powersgd:R") change what the model learns: they
are planned only when asked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from picofx.compression import Dense, SparseRows, parse_compress, registry
from picofx.cost.comm import all_reduce_seconds, all_reduce_size_sending, reduce_scatter_bytes

FP32 = 4


def default_kinds() -> tuple[str, ...]:
    """The registered codecs that are not lossy, and the embedding as rows."""
    return (*(c.kind for c in registry.CODECS if not c.lossy), registry.ROWS)


DEFAULT_KINDS = default_kinds()


def kinds_to_consider(asked=None, *, on_cpu: bool = False) -> tuple[str, ...]:
    """The compressor names to plan: `asked` (a name, "a,b", or a collection of names; None: the
    kinds whose records are not lossy (default_kinds()), none on a CPU, whose ranks run the plans themselves
    with --measure and --layout auto and whose compressor costs are not calibrated). Validated
    with the spelling Overlap(compress=...) takes."""
    if asked is None:
        return () if on_cpu else default_kinds()
    if isinstance(asked, str):
        asked = [k.strip() for k in asked.split(",")]
    kinds = tuple(dict.fromkeys(k for k in asked if k and k != "none"))
    for kind in kinds:
        parse_compress(kind)  # raises ValueError naming the kinds it takes
    return kinds


def gradient_shapes(config, tp: int, pp: int) -> tuple[tuple, list[tuple]]:
    """One rank's gradients of the first pipeline stage (the whole model without a pipeline): the
    embedding's, then the others. Tensor parallel splits q, k, v, gate and up by rows, o and down
    by columns, the embedding and head by vocabulary; norms stay whole."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    layer = [(h // tp, h), (kv // tp, h), (kv // tp, h), (h, h // tp),
             (inter // tp, h), (inter // tp, h), (h, inter // tp), (h,), (h,)]
    layers = -(-config.num_hidden_layers // pp)
    others = layer * layers
    if pp == 1:
        others += [(h,), (-(-vocab // tp), h)]  # final norm, head
    return (-(-vocab // tp), h), others


@dataclass(frozen=True)
class Exchange:
    """One step's gradient exchange of a replica: what each rank sends and what it costs."""

    kind: str | None
    wire_bytes: int          # each rank sends per step
    fp32_ring_bytes: int     # an fp32 ring all-reduce of the same gradients
    link_s: float            # on the link
    compute_s: float         # the compressor's passes over the gradient
    rows: str                # how the embedding goes: "rows", "dense (...)" or "" (not asked)


def exchange(config, layout, tokens: int, device, link) -> Exchange:
    """The gradient exchange of `layout` (replicated, dp > 1) with `layout.compress`; `tokens`:
    each rank's tokens per micro-batch (the embedding's rows)."""
    spec, dense = parse_compress(layout.compress), Dense()
    world = layout.dp
    table, others = gradient_shapes(config, layout.tp, layout.pp)
    table_numel = math.prod(table)
    rows, rows_bytes = embedding_as_rows(config, layout, tokens) if spec.rows else ("", 0)
    shapes = others if rows == "rows" else [table, *others]
    wire = spec.other.wire_bytes(shapes, FP32, world) + (rows_bytes if rows == "rows" else 0)
    fp32 = dense.wire_bytes([table, *others], FP32, world)
    link_s = all_reduce_seconds(all_reduce_size_sending(wire, world), world, link)
    traffic = spec.other.traffic_per_element * sum(math.prod(s) for s in shapes)
    if rows == "rows":  # a zero table, every rank's rows added into it
        traffic += table_numel * FP32 + world * tokens * (2 * table[1] * FP32 + 4)
    return Exchange(layout.compress, int(wire), fp32, link_s, traffic / device.memory_bandwidth, rows)


@dataclass(frozen=True)
class ScatterExchange:
    """One backward's gradient reduce-scatter of a sharded layout, with `kind`: what each rank sends."""

    kind: str | None
    wire_bytes: int                  # each rank sends per backward
    fp32_reduce_scatter_bytes: int   # an fp32 reduce-scatter of the same gradients
    compute_s: float                 # the compressor's passes over the gradient
    rows: str                        # how the embedding goes: "rows", "dense (...)" or "" (not asked)

    @property
    def bytes_per_parameter(self) -> float:
        """The fp32 reduce-scatter's 4 bytes per parameter, scaled by what the compressor sends."""
        return FP32 * self.wire_bytes / self.fp32_reduce_scatter_bytes if self.fp32_reduce_scatter_bytes else FP32


def scatter_exchange(config, layout, tokens: int, device) -> ScatterExchange:
    """The gradient reduce-scatter of sharded `layout` (dp > 1) with `layout.compress`; `tokens`: each
    rank's tokens per micro-batch (the embedding's rows)."""
    spec, world = parse_compress(layout.compress), layout.dp
    table, others = gradient_shapes(config, layout.tp, layout.pp)
    fp32 = Dense().wire_bytes([table, *others], FP32, world, scatter=True)
    rows = ""
    if spec.rows:
        rows_bytes = SparseRows().wire_bytes(tokens, table[1], FP32, world)
        table_bytes = reduce_scatter_bytes(world * -(-table[0] // world) * table[1] * FP32, world)
        rows = "rows" if rows_bytes < table_bytes else \
            f"dense (as rows {rows_bytes / 1e6:.1f} MB per rank, its reduce-scatter {table_bytes / 1e6:.1f} MB)"
    shapes = others if rows == "rows" else [table, *others]
    wire = spec.other.wire_bytes(shapes, FP32, world, scatter=True) + (rows_bytes if rows == "rows" else 0)
    traffic = spec.other.traffic_per_element * sum(math.prod(s) for s in shapes)
    if rows == "rows":  # a zero slice of the table, every rank's rows added into it
        traffic += math.prod(table) // world * FP32 + world * tokens * (2 * table[1] * FP32 + 4)
    return ScatterExchange(layout.compress, int(wire), fp32, traffic / device.memory_bandwidth, rows)


def embedding_as_rows(config, layout, tokens: int) -> tuple[str, int]:
    """How sparse_rows sends the embedding's gradient ("rows", or "dense (why)") and the bytes
    each rank would send as rows, by pass overlap's rule (picofx.compression.rows_or_dense)."""
    table = gradient_shapes(config, layout.tp, layout.pp)[0]
    rows_bytes = SparseRows().wire_bytes(tokens, table[1], FP32, layout.dp)
    dense_table = Dense().wire_bytes([table], FP32, layout.dp)
    if layout.microbatches > 1:
        return "dense (gradients accumulated over micro-batches are a dense table)", rows_bytes
    if rows_bytes >= dense_table:
        return f"dense (as rows {rows_bytes / 1e6:.1f} MB per rank, the table {dense_table / 1e6:.1f} MB)", rows_bytes
    return "rows", rows_bytes

