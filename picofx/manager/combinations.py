"""Which combinations of the parallel passes (and the passes and compressors that ride on them)
train equal to one process, and which are refused, and why: one table. `picofx.optimize` consults
it before anything is captured (`check_combination`), `picofx train` before any rank starts,
tests/test_composability.py trains every cell it says works, and docs/parallelism.md shows it
(`render_markdown`; `write_into("docs/parallelism.md")` regenerates it there).

A cell is a set of features. Some imply others: sequence parallelism is a tensor_parallel option
and async TP a sequence-parallel one, the ring a context_parallel method; a compressor compresses
a data-parallel exchange (overlap's, when the cell names no other); HSDP is the shard pass on a
mesh with dp_replicate and dp_shard (replicas of the sharded group, averaged by the shard pass
itself), so overlap with shard is HSDP. Shard's stages 1 and 2 (shard_stage1, shard_stage2) are
shard, in rows of their own beside tp (with and without sequence parallelism), pp and cp, with
HSDP, and on the 3-D meshes tp + pp, sp + pp, tp + cp and pp + cp; "shard" alone is stage 3. Each parallel feature spans 2 ranks of its mesh dimension,
so a cell's world is the product of its dimensions' sizes. float8 is the precision pass with
float8 linear layers (tensorwise, every layer the kernels take): it implies precision; Shard's
float8 gather has rows of its own beside tp (with and without sequence parallelism) and with each
compressor (float8_cells).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from picofx.compression import registry
from picofx.manager.passes import pass_name

PARALLEL = ("overlap", "shard", "hsdp", "tensor_parallel", "sequence_parallel", "async_tp", "pipeline",
            "context_parallel", "ring")
CODECS = registry.codec_kinds()  # one per exchange; sparse_rows pairs with one of them
COMPRESSION = (*CODECS, registry.ROWS)
COMPUTE = ("fuse", "precision", "checkpoint", "float8")  # float8: Precision(float8="tensorwise"), bf16 elsewhere
FEATURES = PARALLEL + COMPRESSION + COMPUTE
SHARD_STAGES = ("shard_stage1", "shard_stage2")  # Shard(stage=1 | 2); not paired with every feature (stage_cells)
NAMED_ORDER = PARALLEL[:2] + SHARD_STAGES + PARALLEL[2:] + COMPRESSION + COMPUTE
DATA_PARALLEL = ("overlap", "shard", "hsdp")
# the mesh dimensions each feature spans (2 ranks each), in ParallelMesh's order, cp last
SPANS = {"overlap": ("dp_replicate",), "shard": ("dp_shard",), "hsdp": ("dp_replicate", "dp_shard"),
         "tensor_parallel": ("tp",), "pipeline": ("pp",), "context_parallel": ("cp",), "ring": ("cp",)}
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# the spelling of each compression kind the cells run (its record's example)
COMPRESS_SPELLING = {**{c.kind: c.example for c in registry.CODECS}, registry.ROWS: registry.ROWS}


class CombinationError(ValueError):
    """The passes given together are a combination picofx refuses; the message names them, why, and
    what to run instead. Raised before anything is captured and before any rank waits."""


@dataclass(frozen=True)
class Refusal:
    features: frozenset  # every cell holding all of these is refused
    reason: str          # why, and what to do instead
    raised: str = ""     # a phrase of the error that refuses it, where that error is not this table's

    def message(self) -> str:
        return f"{' + '.join(sorted(self.features))}: {self.reason}"


def refusal(features: str, reason: str, raised: str = "") -> Refusal:
    return Refusal(frozenset(features.split()), reason, raised)


# The cells CI trains (the rest run with the slow tests): each parallel feature, each tensor-parallel
# form, a compressor of each kind of exchange, each compute pass once, on 2 ranks; the 4-rank pairs
# of the mesh's dimensions that picofx train's layouts use most.
CI_CELLS = ("overlap fuse", "shard checkpoint", "tensor_parallel precision", "async_tp", "sequence_parallel",
            "pipeline checkpoint", "overlap int8", "shard sparse_rows", "overlap powersgd", "fuse precision",
            "hsdp", "tensor_parallel pipeline", "overlap pipeline", "sequence_parallel context_parallel",
            "shard context_parallel", "tensor_parallel float8", "shard float8")
REFUSALS = (
    *(refusal(f"hsdp {kind}", "HSDP's all-reduce across the replicas is not compressed: shard over one "
              "dimension (no dp_replicate) to compress") for kind in COMPRESSION),
    *(refusal(f"shard {model} {codec}", f"Shard's compressed reduce-scatter beside {model} is not checked yet "
              "(Overlap's all-reduce is): drop the compressor, or replicate the data-parallel ranks (Overlap)")
      for model in ("tensor_parallel", "pipeline") for codec in COMPRESSION),
    refusal("overlap tensor_parallel topk", "top-k picks different entries on each tensor-parallel rank, so the "
            "parameters every tp rank holds whole (the norms) drift apart between them: compress with bf16, int8 "
            "or powersgd beside tensor_parallel"),
    refusal("hsdp tensor_parallel", "the shard pass runs HSDP without tp: shard without replicas (dp_shard x tp)"),
    refusal("hsdp pipeline", "the shard pass runs HSDP without pp: shard without replicas (pp x dp_shard)"),
    *(refusal(f"{stage} {kind}", "stages 1 and 2 reduce-scatter whole fp32 gradients outside the graph, "
              "uncompressed: drop the compressor or use stage 3", raised="is not supported")
      for stage in SHARD_STAGES for kind in COMPRESSION),
    *(refusal(f"{a} {b}", "an exchange sends its buckets in one codec: give one kind, or sparse_rows+KIND "
              "(the embedding's rows, the other buckets in KIND)", raised="at most 'sparse_rows+KIND'")
      for a, b in itertools.combinations(CODECS, 2)),
)


def closed(features) -> frozenset:
    """`features` with what they imply (see the module's docstring)."""
    out = set(features)
    if out & set(SHARD_STAGES):
        out.add("shard")
    if "float8" in out:  # an option of the precision pass
        out.add("precision")
    if "async_tp" in out:
        out.add("sequence_parallel")
    if "sequence_parallel" in out:
        out.add("tensor_parallel")
    if "ring" in out:
        out.add("context_parallel")
    if {"overlap", "shard"} <= out:  # replicas of a sharded group: the shard pass runs both
        out = (out - {"overlap"}) | {"hsdp"}
    if "hsdp" in out:
        out = (out - {"overlap"}) | {"shard"}
    if out & set(COMPRESSION) and not out & set(DATA_PARALLEL):
        out.add("overlap")
    return frozenset(out)


@dataclass(frozen=True)
class Cell:
    features: frozenset

    @property
    def named(self) -> tuple[str, ...]:
        """Its features in FEATURES order, HSDP named once (not also as overlap and shard)."""
        hidden = {"shard"} if "hsdp" in self.features or self.features & set(SHARD_STAGES) else set()
        hidden |= {"tensor_parallel"} if "sequence_parallel" in self.features else set()
        hidden |= {"sequence_parallel"} if "async_tp" in self.features else set()
        hidden |= {"context_parallel"} if "ring" in self.features else set()
        hidden |= {"precision"} if "float8" in self.features else set()
        return tuple(f for f in NAMED_ORDER if f in self.features and f not in hidden)

    @property
    def mesh(self) -> dict[str, int]:
        dims = {d for f in self.features for d in SPANS.get(f, ())}
        return {d: 2 for d in MESH_ORDER if d in dims}

    @property
    def world(self) -> int:
        return 2 ** len(self.mesh)

    @property
    def refusal(self) -> Refusal | None:
        return next((r for r in REFUSALS if r.features <= self.features), None)

    @property
    def works(self) -> bool:
        return self.refusal is None

    @property
    def compress(self) -> str | None:
        """The compress spelling of its exchange."""
        kinds = [COMPRESS_SPELLING[k] for k in ("sparse_rows", *COMPRESSION[:-1]) if k in self.features]
        return "+".join(kinds) or None

    @property
    def slow(self) -> bool:
        """Left to the slow tests, to keep CI within its time: every cell but CI_CELLS."""
        return self.features not in {closed(c.split()) for c in CI_CELLS}

    def describe(self) -> str:
        return " + ".join(self.named)

    def mesh_text(self) -> str:
        return " x ".join(f"{d} {n}" for d, n in self.mesh.items()) or "one process"


def pairs() -> list[Cell]:
    return [Cell(closed(p)) for p in itertools.combinations(FEATURES, 2)]


def layered() -> list[Cell]:
    """The 3-D and 4-D combinations: three and four of the mesh's dimensions at once (data parallel
    replicated or sharded, tensor parallel in each of its forms, pipeline, context parallel by each
    method: the ring beside plain tensor parallelism)."""
    dims = ("overlap", "shard", "tensor_parallel", "pipeline", "context_parallel")
    tp_forms = [("tensor_parallel",), ("sequence_parallel",), ("async_tp",)]
    out = []
    for size in (3, 4):
        for chosen in itertools.combinations(dims, size):
            rest = [d for d in chosen if d not in ("tensor_parallel", "context_parallel")]
            forms = [[*tp, *cp] for tp in (tp_forms if "tensor_parallel" in chosen else [()])
                     for cp in ([("context_parallel",), ("ring",)] if "context_parallel" in chosen else [()])
                     if not ("ring" in cp and tp not in ((), ("tensor_parallel",)))]
            out += [Cell(closed(rest + list(form))) for form in forms]
    return out


# beside Shard's stages 1 and 2: each other parallelism alone, then the 3-D layouts of the largest runs
STAGE_NEIGHBOURS = ((), ("tensor_parallel",), ("sequence_parallel",), ("pipeline",), ("context_parallel",),
                    ("hsdp",), ("tensor_parallel", "pipeline"), ("sequence_parallel", "pipeline"),
                    ("tensor_parallel", "context_parallel"), ("pipeline", "context_parallel"))


def stage_cells() -> list[Cell]:
    """Shard's stages 1 and 2 alone, beside each other parallelism (tp with and without sequence
    parallelism, pp, cp), with HSDP, and on the 8-rank meshes of tp + pp, sp + pp, tp + cp, pp + cp."""
    return [Cell(closed({stage, *other})) for stage in SHARD_STAGES for other in STAGE_NEIGHBOURS]


def float8_cells() -> list[Cell]:
    """Shard's float8 gather beside tensor parallelism (with and without sequence parallelism) and
    with each compressor of its reduce-scatter (HSDP with float8 is a pair)."""
    return [Cell(closed({"shard", "float8", other})) for other in ("tensor_parallel", "sequence_parallel",
                                                                     *COMPRESSION)]


def cells() -> list[Cell]:
    """Every distinct cell: the pairs, then the 3-D and 4-D combinations, then Shard's stages, then
    Shard's float8 gather beside other features, each once."""
    return list(dict.fromkeys(pairs() + layered() + stage_cells() + float8_cells()))


def features_of(passes, mesh=None) -> frozenset:
    """The features a list of passes (names or pass objects) asks for, on the run's `mesh` (a
    ParallelMesh, a DeviceMesh with picofx's dimension names, their sizes by name, or None)."""
    sizes = dict(mesh) if isinstance(mesh, dict) else dict(getattr(mesh, "sizes", ()) or ())  # a ParallelMesh
    if getattr(mesh, "mesh_dim_names", None):  # a DeviceMesh
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    out = {"hsdp"} if sizes.get("dp_replicate", 1) > 1 and sizes.get("dp_shard", 1) > 1 else set()
    for p in passes:
        name = pass_name(p)
        if name in FEATURES:
            out.add(name)
        if name == "shard" and not isinstance(p, str) and p.stage != 3:
            out.add(f"shard_stage{p.stage}")
        compress = None if isinstance(p, str) else getattr(p, "compress", None)
        if isinstance(compress, str):
            out |= {k for k in COMPRESSION if any(part.split(":")[0] == k for part in compress.split("+"))}
        if name == "tensor_parallel" and not isinstance(p, str) and getattr(p, "sequence_parallel", False):
            out.add("async_tp" if getattr(p, "async_overlap", False) else "sequence_parallel")
        if name == "context_parallel" and getattr(p, "method", None) == "ring":
            out.add("ring")
        if name == "precision" and getattr(p, "float8", None):
            out.add("float8")
    if "shard" not in out:
        out.discard("hsdp")
    return closed(out)


def refused(features) -> Refusal | None:
    """The table's refusal of these features together, or None."""
    return Cell(closed(features)).refusal


def check_combination(passes, mesh=None) -> None:
    """Raise CombinationError when the table refuses `passes` together on `mesh`."""
    found = refused(features_of(passes, mesh))
    if found is not None:
        raise CombinationError(f"passes {', '.join(pass_name(p) for p in passes)}: {found.message()}")


MARKERS = ("<!-- combinations table: begin -->", "<!-- combinations table: end -->")


def render_markdown() -> str:
    """The table as docs/parallelism.md shows it between MARKERS: one row per cell, each refusal's
    reason once, under the table, by letter."""
    reasons = list(dict.fromkeys(r.reason for r in REFUSALS))
    lines = ["| combination | ranks | mesh | status |", "|---|---|---|---|"]
    for cell in cells():
        if cell.works:
            status = "works" + (" (slow test)" if cell.slow else "")
        else:
            status = f"refused ({chr(ord('a') + reasons.index(cell.refusal.reason))})"
        lines.append(f"| `{cell.describe()}` | {cell.world} | {cell.mesh_text()} | {status} |")
    lines.append("")
    lines += [f"- ({chr(ord('a') + i)}) {reason}." for i, reason in enumerate(reasons)]
    return "\n".join(lines) + "\n"


def write_into(path: str) -> None:
    """Replace the table between MARKERS in the markdown file at `path` with render_markdown()."""
    from pathlib import Path

    text = Path(path).read_text()
    begin, end = MARKERS
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} block to fill")
    head, rest = text.split(begin, 1)
    Path(path).write_text(f"{head}{begin}\n{render_markdown()}{end}{rest.split(end, 1)[1]}")

