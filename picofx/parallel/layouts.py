"""What the distributed passes decide and the runtime applies, as types.

A pass records its decision on the graph it rewrote, `layouts_of(gm).buckets = BucketLayout(...)`;
the runtime reads the same field. One `GraphLayouts` per graph, under one meta key.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import fx

LAYOUTS_META = "picofx_layouts"  # gm.meta: the graph's GraphLayouts


def first_differing_entry(mine: tuple, theirs: tuple, rank: int, describe, held: str) -> str:
    """The first entry (a parameter) where this rank's layout and rank `rank`'s differ, in words;
    `held` says what a parameter only one side has is there ("has a gradient", "is sharded")."""
    for a, b in zip(mine, theirs):
        if a != b:
            return f"first differing parameter: {a.name} {describe(a)} here, {b.name} {describe(b)} on rank {rank}"
    longer = mine if len(mine) > len(theirs) else theirs
    extra = longer[min(len(mine), len(theirs))]
    where = "here" if longer is mine else f"on rank {rank}"
    return f"first differing parameter: {extra.name} {held} {where} only"


@dataclass(frozen=True)
class LayoutEntry:
    name: str  # parameter name (input_<i> where the graph's inputs are not named)
    shape: tuple
    dtype: str
    bucket: int


@dataclass(frozen=True)
class BucketLayout:
    """The gradient buckets a backward all-reduces: what every rank's backward must agree on."""

    dim: Any = field(compare=False)  # picofx.parallel.mesh.MeshDim the buckets are reduced over
    compress: str | None = None
    entries: tuple[LayoutEntry, ...] = ()
    pending: tuple[str, ...] = ()  # graph attributes holding accumulated gradients, per bucket
    codecs: tuple[str, ...] = ()  # per bucket, how it travels ("none", "int8", "sparse_rows", ...)
    state: Any = field(default=None, compare=False)  # picofx.compression.CompressionState the graph updates
    warmup: int = 0  # the first synced steps that run a variant without lossy compression

    @property
    def world(self) -> int:
        return self.dim.size

    def digest(self) -> str:
        text = repr((self.world, self.compress, self.warmup, self.entries, self.codecs))
        return hashlib.sha256(text.encode()).hexdigest()

    def buckets(self) -> list[list[LayoutEntry]]:
        out: list[list[LayoutEntry]] = []
        for e in self.entries:
            if e.bucket == len(out):
                out.append([])
            out[e.bucket].append(e)
        return out

    def first_difference(self, theirs: "BucketLayout", rank: int) -> str:
        if self.compress != theirs.compress:
            return f"compress={self.compress!r} here, {theirs.compress!r} on rank {rank}"
        if self.warmup != theirs.warmup:  # the ranks would switch to the compressed step at different steps
            return f"warmup={self.warmup} here, {theirs.warmup} on rank {rank}"
        if self.codecs != theirs.codecs and self.entries == theirs.entries:
            return f"bucket compressors {list(self.codecs)} here, {list(theirs.codecs)} on rank {rank}"
        return first_differing_entry(self.entries, theirs.entries, rank,
                                     lambda e: f"{e.dtype}{list(e.shape)} in bucket {e.bucket}", "has a gradient")


@dataclass(frozen=True)
class ShardEntry:
    name: str              # the model's parameter name
    shape: tuple           # the whole parameter's shape
    padded_rows: int       # rows of every rank's shard as the graph takes it (ceil(rows / ranks))
    dtype: str
    bucket: int            # the all-gather it travels in
    requires_grad: bool
    local_rows: int = field(default=0, compare=False)  # this rank's own rows (DTensor's uneven chunks)


@dataclass(frozen=True)
class ShardLayout:
    """The parameters a sharded step takes as dim-0 shards and gathers: what every rank's graph
    must agree on."""

    dim: Any = field(compare=False)  # picofx.parallel.mesh.MeshDim the parameters are sharded over
    reshard_after_forward: bool = True
    entries: tuple[ShardEntry, ...] = ()
    gather_dtype: str | None = None  # mixed precision: the dtype parameters are gathered and reduced in
    compress: str | None = None  # how gradients are reduce-scattered (Shard's compress)
    state: Any = field(default=None, compare=False)  # picofx.compression.CompressionState the backward updates
    warmup: int = 0  # Shard's warmup: the first steps run a variant without lossy compression
    replicas: Any = field(default=None, compare=False)  # HSDP: the MeshDim the shards are replicated over
    mesh: Any = field(default=None, compare=False)  # HSDP: the 2-D (dp_replicate, dp_shard) DeviceMesh
    summed: int = 1  # ranks of `dim` holding other tokens of the same sequences (cp): their gradients add up
    stage: int = 3  # Shard's stage: 1, 2 (the graph takes whole parameters; picofx.runtime.shard_stages) or 3

    @property
    def world(self) -> int:
        return self.dim.size

    def digest(self) -> str:
        shared = [(e.name, e.shape, e.padded_rows, e.dtype, e.bucket, e.requires_grad) for e in self.entries]
        text = repr((self.world, self.summed, self.replicas.size if self.replicas else 1, self.reshard_after_forward,
                     self.gather_dtype, self.compress, self.warmup, self.stage, shared))  # local_rows differ by rank
        return hashlib.sha256(text.encode()).hexdigest()

    def first_difference(self, theirs: "ShardLayout", rank: int) -> str:
        if self.stage != theirs.stage:
            return f"Shard(stage={self.stage}) here, stage={theirs.stage} on rank {rank}"
        if self.gather_dtype != theirs.gather_dtype:
            return f"mixed precision gathers in {self.gather_dtype} here, {theirs.gather_dtype} on rank {rank}"
        if self.compress != theirs.compress:
            return f"compress={self.compress!r} here, {theirs.compress!r} on rank {rank}"
        if self.warmup != theirs.warmup:
            return f"warmup={self.warmup} here, {theirs.warmup} on rank {rank}"
        if self.reshard_after_forward != theirs.reshard_after_forward:
            return (f"reshard_after_forward={self.reshard_after_forward} here, "
                    f"{theirs.reshard_after_forward} on rank {rank}")
        return first_differing_entry(self.entries, theirs.entries, rank, describe_shard, "is sharded")


def describe_shard(e: ShardEntry) -> str:
    return (f"{e.dtype}{list(e.shape)} ({'trainable' if e.requires_grad else 'frozen'}, "
            f"{e.padded_rows} rows per rank, bucket {e.bucket})")


@dataclass(frozen=True)
class StageSignature:
    """What a pipeline stage graph's placeholders and outputs are."""

    index: int
    num_stages: int
    inputs: list           # InputSlot (parameter, buffer, constant) or the name of a carried value
    outputs: list[str]     # names of the carried values it returns (the last stage: the loss)


@dataclass
class PipelineLayout:
    """Where the pipeline pass cut the step and how its stages run."""

    stages: int                      # pipeline ranks
    virtual: int                     # stages per rank
    schedule: str                    # a torch.distributed.pipelining schedule's name
    microbatches: int
    mesh_spec: Any                   # what the pass was given: None, a ProcessGroup or a DeviceMesh
    units: list                      # picofx.cost.balance.Unit, in order
    plan: Any                        # picofx.cost.balance.PipelinePlan
    tied: dict[str, list[int]] = field(default_factory=dict)  # parameter -> stages that read it

    @property
    def total_stages(self) -> int:
        return self.stages * self.virtual

    def table(self) -> str:
        return self.plan.table(self.units)


@dataclass(frozen=True)
class TensorParallelEntry:
    name: str             # the model's parameter name
    style: str            # "colwise", "rowwise", "vocab" or "replicate"
    split_dim: int | None  # the dimension split across the ranks (None: whole on every rank)
    shape: tuple          # the whole parameter's shape
    why: str = field(default="", compare=False, repr=False)  # the plan's reason
    local_size: int | None = None  # the split dimension's size in every rank's graph (padded where tp does not divide)


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a tensor-parallel step splits each parameter over the tp ranks."""

    dim: Any = field(compare=False)  # picofx.parallel.mesh.MeshDim of the tp ranks
    entries: tuple[TensorParallelEntry, ...] = ()
    sequence_parallel: bool = False  # the residual stream (and what a pipeline stage sends) in sequence shards

    @property
    def world(self) -> int:
        return self.dim.size

    def digest(self) -> str:
        return hashlib.sha256(repr((self.world, self.entries)).encode()).hexdigest()

    def table(self) -> str:
        width = max((len(e.name) for e in self.entries), default=0)
        return "\n".join(f"{e.name.ljust(width)}  {e.style:9s}  {e.why}" for e in self.entries)

    def first_difference(self, theirs: "TensorParallelLayout", rank: int) -> str:
        return first_differing_entry(self.entries, theirs.entries, rank, lambda e: e.style, "is placed")


class Placement(Protocol):
    """What a recorded layout that places the model's parameters does at run time (implemented beside
    its runtime, picofx.runtime.placement): `check` that every rank recorded the same (a collective),
    `place` the model's parameters as it says (on the run's ParallelMesh), and give the graph's
    `local_inputs` for a call (`names`: each input slot's parameter name, or None)."""

    def check(self) -> None: ...

    def place(self, model: Any, mesh: Any) -> None: ...

    def local_inputs(self, names: list, values: list) -> list: ...


@dataclass
class GraphLayouts:
    """Every layout recorded on one graph; None where no pass decided one."""

    buckets: BucketLayout | None = None      # pass overlap: the backward's gradient all-reduce
    stage: StageSignature | None = None      # pass pipeline: this graph is one stage
    pipeline: PipelineLayout | None = None   # pass pipeline: the whole cut
    shards: ShardLayout | None = None        # pass shard: the parameters taken as shards and gathered
    tensor_parallel: TensorParallelLayout | None = None  # pass tensor_parallel: each parameter's split


def layouts_of(gm: fx.GraphModule) -> GraphLayouts:
    """The graph's layouts, made empty on first use."""
    return gm.meta.setdefault(LAYOUTS_META, GraphLayouts())


def recorded(gm: fx.GraphModule) -> GraphLayouts:
    """The graph's layouts without adding any (an empty one where none was recorded)."""
    return gm.meta.get(LAYOUTS_META) or GraphLayouts()
