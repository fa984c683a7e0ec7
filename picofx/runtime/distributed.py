"""Data-parallel runtime: the first-step layout check, gradient accumulation, agreeing on failures.

Timeouts: every collective here and in the compiled step runs on the process group, so a rank
that dies or stops mid-step surfaces on the others as an error after the group's timeout
(`torch.distributed.init_process_group(timeout=timedelta(...))`; torch's default is 10 minutes
for gloo and NCCL). Tests set it to seconds. A rank that raises before a collective (a layout
mismatch, a capture error) raises the same error on every rank where the cause is shared.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import DTensor

from picofx.errors import DistributedError
from picofx.manager.passes import SyncMode
from picofx.parallel.layouts import BucketLayout, ShardLayout, TensorParallelLayout, recorded
from picofx.runtime.shard_stages import set_gradient_sync

def launched_world(environ) -> int | None:
    """How many processes torchrun started (its WORLD_SIZE in `environ`, a mapping such as
    os.environ), or None where this process was not started by torchrun."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return int(environ["WORLD_SIZE"])
    return None


def first_failure(message: str | None, group=None) -> tuple[int, str] | None:
    """Every rank of `group` says how its setup ended: None (it succeeded) or its error message.
    All of them get the lowest failing rank and its message, or None where every rank succeeded,
    so that one rank prints the error once and every rank stops. A collective: give `group` a
    timeout of its own (`dist.new_group(timeout=...)`) so that a rank stuck elsewhere surfaces
    as an error here instead of a wait."""
    said: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, message, group=group)
    return next(((rank, text) for rank, text in enumerate(said) if text is not None), None)


def check_layout(layout: BucketLayout | ShardLayout | TensorParallelLayout) -> None:
    """All ranks gather each other's layout (gradient buckets or parameter shards); on any mismatch
    every rank raises, naming the first differing parameter (e.g. one frozen on one rank only, or
    different passes)."""
    mine = layout.digest()
    # the MeshDim holds process groups, which do not pickle; first_difference reads neither it nor the state
    plain = dataclasses.replace(layout, dim=None, **({"state": None} if isinstance(layout, (BucketLayout, ShardLayout))
                                                     else {}), **({"replicas": None, "mesh": None}
                                                                  if isinstance(layout, ShardLayout) else {}))
    for dim in (layout.dim, *([layout.replicas] if getattr(layout, "replicas", None) else [])):
        gathered: list = [None] * dim.size
        dist.all_gather_object(gathered, (mine, plain), group=dim.group)
        compare_layouts(layout, mine, gathered, dim.rank)


def compare_layouts(layout, mine: str, gathered: list, me: int) -> None:
    what, collectives = (("gradient bucket", "all-reduces") if isinstance(layout, BucketLayout)
                         else ("tensor-parallel", "all-reduces") if isinstance(layout, TensorParallelLayout)
                         else ("parameter shard", "all-gathers and reduce-scatters"))
    for rank, (digest, theirs) in enumerate(gathered):
        if digest != mine:
            raise DistributedError(
                f"rank {me}: the {what} layout differs from rank {rank}'s, so their {collectives} "
                f"would not match; {layout.first_difference(theirs, rank)}. Every rank must optimize the "
                f"same model with the same trainable parameters, passes and cost model.")


def check_layouts(graphs: dict) -> None:
    """Check the layouts of every graph a distributed pass rewrote (none: nothing to do)."""
    for gm in graphs.values():
        for layout in (recorded(gm).shards, recorded(gm).buckets, recorded(gm).tensor_parallel):
            if layout is not None:
                check_layout(layout)


def compression_state(graphs: dict, shards: ShardLayout | None = None):
    """The gradient compressors' state (picofx.compression.CompressionState) the graphs
    update, or the sharded step's (`shards`, its ShardLayout), or None where no bucket keeps any."""
    states = [recorded(gm).buckets.state for gm in graphs.values() if recorded(gm).buckets is not None]
    states += [shards.state] if shards is not None else []
    return next((s for s in states if s is not None and s.tensors), None)


def note_compression_errors(records: list, graphs: dict) -> None:
    """Give each compressed bucket in the "compression" notes of the overlap and shard passes its
    last step's `relative_error` (what this rank's compressor left out, CompressionState.errors)."""
    for gm in graphs.values():
        for pass_name, layout in (("overlap", recorded(gm).buckets), ("shard", recorded(gm).shards)):
            if layout is None or layout.state is None:
                continue
            errors, first = layout.state.errors(), {}
            for entry in layout.entries:
                first.setdefault(entry.bucket, entry.name)
            for bucket in (b for r in records if r.name == pass_name for b in r.notes.get("compression", [])):
                if first.get(bucket["bucket"]) in errors:
                    bucket["relative_error"] = round(errors[first[bucket["bucket"]]], 6)


class GradientSync:
    """DDP's gradient accumulation for a compiled step. Under `no_sync()` the backward runs a
    variant without all-reduce and autograd accumulates each rank's own gradients in `.grad`.
    The first call after it runs a third variant: it moves the accumulated `.grad` into the
    graph's pending buffers (and sets `.grad` to None), and each bucket all-reduces
    pending + this backward's gradients, so `.grad` ends as the average over ranks of the sum
    over micro-batches: DDP's result, with one all-reduce per bucket. Shard's stages 1 and 2 of
    `model` are told too (picofx.runtime.shard_stages: stage 1 reduce-scatters after a synced
    backward only)."""

    def __init__(self, model: nn.Module | None = None):
        self.enabled = True
        self.accumulated = False
        self.warmed = 0  # synced steps run uncompressed so far (a compressor's warm-up)
        self.model = model

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled
        if self.model is not None:
            set_gradient_sync(self.model, enabled)

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.enabled
        self.set_enabled(False)
        try:
            yield
        finally:
            self.set_enabled(previous)

    def mode(self, graphs: dict | None = None, shards: ShardLayout | None = None) -> SyncMode:
        """How the next backward syncs: "local" (no_sync), "sync_accumulated", "sync_uncompressed"
        (the first synced steps of a compressor with `warmup`, all-reduced whole, as torch's
        PowerSGD hook starts), or "sync". A sharded step (`shards`, its layout) reduce-scatters
        under no_sync too, so only its warm-up makes a variant."""
        buckets = [recorded(gm).buckets for gm in (graphs or {}).values() if recorded(gm).buckets is not None]
        if buckets and not self.enabled:
            return SyncMode.LOCAL
        if buckets and self.accumulated:
            return SyncMode.SYNC_ACCUMULATED
        warmup = max([b.warmup for b in buckets] + [shards.warmup if shards is not None else 0])
        return SyncMode.SYNC_UNCOMPRESSED if self.warmed < warmup else SyncMode.SYNC

    def before_call(self, mode: SyncMode, graphs: dict, model: nn.Module) -> None:
        if mode is SyncMode.SYNC_UNCOMPRESSED:
            self.warmed += 1
        elif mode is SyncMode.LOCAL:
            self.accumulated = True
        elif mode is SyncMode.SYNC_ACCUMULATED:
            for gm in graphs.values():
                layout = recorded(gm).buckets
                if layout is not None:
                    load_pending(layout, gm, model)
            self.accumulated = False


@torch.no_grad()
def load_pending(layout: BucketLayout, gm: fx.GraphModule, model: nn.Module) -> None:
    """Copy each parameter's accumulated `.grad` into its bucket's pending buffer, then clear it:
    the synced backward adds the buffer to its own gradients before the all-reduce."""
    for name, entries in zip(layout.pending, layout.buckets()):
        buffer = getattr(gm, name)
        offset = 0
        for e in entries:
            numel = int(torch.Size(e.shape).numel())
            param = model.get_parameter(e.name)
            if param.grad is None:
                buffer[offset:offset + numel].zero_()
            else:  # a tensor-parallel parameter's gradient is a DTensor: the bucket holds this rank's piece
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                buffer[offset:offset + numel].copy_(grad.reshape(-1))
                param.grad = None
            offset += numel
