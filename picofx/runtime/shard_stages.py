"""The runtime of Shard's stages 1 and 2 (ZeRO-1 and ZeRO-2): whole parameters in the graph, sharded
optimizer state, gradients reduce-scattered outside it.

The model's parameters are Shard(0) DTensors, as in stage 3 (`apply_shard_layout`), so
`torch.optim` keeps its state per shard, `clip_grad_norm_` and DCP see DTensors under the model's
own names. The graph, unlike stage 3's, takes each parameter whole: a plain leaf tensor per
parameter (`Whole.tensor`), filled by one all-gather of every stale shard when a call first reads
it after the shards changed (an optimizer step bumps the parameter's version), then kept across
micro-batches. Autograd accumulates each micro-batch's gradient into that leaf's `.grad`; at the
end of a backward (`queue_callback`) the whole gradients are reduce-scattered in one flat
collective per process group, divided by the group's size (gloo has no average; beside cp, by
dp_shard's: the cp ranks' gradients add up) and added to the
DTensor parameter's `.grad` shard, the whole gradients freed:

- stage 1 reduce-scatters once per step: only after a backward outside `no_sync()` (or with
  `set_requires_gradient_sync(True)`), and under a pipeline once after the schedule's last
  micro-batch (`reduce_after`), so the whole gradients accumulate in between (Megatron's
  distributed optimizer);
- stage 2 reduce-scatters after every backward, into the sharded fp32 `.grad` (DeepSpeed's
  ZeRO-2): the accumulated gradient occupies a shard, not the whole model, at the price of one
  reduce-scatter per micro-batch.

Beside tensor parallelism the DTensors are 2-D (dp_shard, tp) and a whole leaf is this rank's tp
piece, gathered over dp_shard; with HSDP they are replicated over dp_replicate and each
reduce-scattered shard is all-reduced across the replicas. Stage 1's accumulated whole gradients are dropped when the
parameter's `.grad` is zeroed or dropped (`Whole.mark`), so zero_grad reaches them.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from picofx.parallel.layouts import ShardEntry, ShardLayout


@dataclass
class Accumulation:
    """One model's gradient synchronisation for stages 1 and 2: `sync` (False under no_sync),
    `deferred` (a pipeline's schedule runs: stage 1 waits for its end) and the parameters held whole."""

    sync: bool = True
    deferred: bool = False
    queued: bool = False
    held: list = field(default_factory=list)  # weak references to the Whole records, in registration order

    def wholes(self) -> list["Whole"]:
        return [w for ref in self.held if (w := ref()) is not None]

    def arrived(self, whole: weakref.ref, _tensor: torch.Tensor) -> None:
        """A whole gradient was accumulated: reduce at the end of this backward (once per backward);
        stage 1 marks its parameter's `.grad`, which zero_grad then reaches (`Whole.mark`)."""
        if (held := whole()) is not None and held.stage == 1:
            held.mark()
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)

    def after_backward(self) -> None:
        self.queued = False
        reduce_scatter([w for w in self.wholes() if w.stage == 2 or (self.sync and not self.deferred)])


@dataclass(eq=False)
class Whole:
    """One sharded parameter held whole for the graph: its DTensor (weakly: WHOLES is keyed by it),
    the whole leaf the graph reads and the parameter version it was gathered at (None: never)."""

    held: weakref.ref
    entry: ShardEntry
    stage: int
    group: object
    world: int
    averaged: int  # the ranks the gradient is averaged over: of `world`, those holding other sequences
    tensor: torch.Tensor
    replicas: object = None  # HSDP: the MeshDim whose ranks hold the same shard (all-reduced, averaged)
    version: int | None = None
    marker: tuple | None = None  # (weakly) the parameter's `.grad` and its version when the whole gradient grew

    @property
    def param(self) -> nn.Parameter:
        return self.held()

    def mark(self) -> None:
        """Stage 1's whole gradient lives outside the DTensor `.grad` that `optimizer.zero_grad()`
        clears: give the parameter a `.grad` (zeros, until the reduce-scatter adds to it) and note it,
        so that a zero_grad in between (set to None, or zeroed in place) is seen (`cleared`)."""
        param = self.param
        if param.grad is None:
            param.grad = DTensor.from_local(torch.zeros_like(param.to_local()), param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape, stride=param.stride())
        self.marker = (weakref.ref(param.grad), param.grad._version)

    def cleared(self) -> bool:
        """Whether the parameter's gradient was zeroed or dropped since the whole gradient last grew."""
        if self.marker is None or self.tensor.grad is None:
            return False
        grad = self.param.grad
        return grad is None or self.marker[0]() is not grad or grad._version != self.marker[1]


OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Accumulation
WHOLES = WeakIdKeyDictionary()  # DTensor parameter -> its Whole (a parameter lives as long as its record)


def accumulation_of(model: nn.Module) -> Accumulation:
    if model not in OWNERS:
        OWNERS[model] = Accumulation()
    return OWNERS[model]


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether stage 1 reduce-scatters at the end of the next backwards (False: they accumulate whole)."""
    accumulation_of(model).sync = enabled


def hold_whole(layout: ShardLayout, model: nn.Module) -> None:
    """After the layout's parameters became DTensors: a whole leaf for each (once), whose gradient
    arrivals the model's Accumulation reduces."""
    owner = accumulation_of(model)
    for entry in layout.entries:
        param = model.get_parameter(entry.name)
        if param in WHOLES:
            continue
        tensor = torch.empty(entry.shape, dtype=param.dtype, device=param.device, requires_grad=param.requires_grad)
        whole = Whole(weakref.ref(param), entry, layout.stage, layout.dim.group, layout.dim.size,
                      layout.dim.size // layout.summed, tensor, layout.replicas)
        if param.requires_grad:
            tensor.register_post_accumulate_grad_hook(functools.partial(owner.arrived, weakref.ref(whole)))
        WHOLES[param] = whole
        owner.held.append(weakref.ref(whole))


def whole_inputs(layout: ShardLayout, names: list, values: list) -> list:
    """The graph's inputs with each of the layout's parameters replaced by its whole leaf, the stale
    ones all-gathered first (one collective)."""
    sharded = {e.name for e in layout.entries}
    wholes = [WHOLES.get(v) if n in sharded and isinstance(v, DTensor) else None for n, v in zip(names, values)]
    for w in (w for w in wholes if w is not None and w.cleared()):  # zero_grad since: drop what accumulated
        w.tensor.grad, w.marker = None, None
    gather([w for w in dict.fromkeys(w for w in wholes if w is not None) if w.version != w.param._version])
    return [w.tensor if w is not None else v for w, v in zip(wholes, values)]


def by_group(wholes: list) -> dict:
    out: dict = {}
    for w in wholes:
        out.setdefault((id(w.group), w.tensor.dtype), []).append(w)
    return out


@torch.no_grad()
def gather(wholes: list) -> None:
    """All-gather the shards of `wholes` into their whole leaves: per group, one flat collective of
    every rank's padded shards, rank r's at r * M: `gathered.view(N, M)[:, off:off + m]` is one
    parameter's padded rows, rank-major."""
    for group in by_group(wholes).values():
        world = group[0].world
        pieces = [padded(w.param.to_local(), w.entry.padded_rows).reshape(-1) for w in group]
        flat = torch.cat(pieces)
        out = flat.new_empty(world * flat.numel())
        dist.all_gather_single(out, flat, group=group[0].group)
        rows, offset = out.view(world, flat.numel()), 0
        for w, piece in zip(group, pieces):
            part = rows[:, offset:offset + piece.numel()].reshape(world * w.entry.padded_rows, *w.entry.shape[1:])
            w.tensor.copy_(part[:w.entry.shape[0]])
            offset += piece.numel()
            w.version = w.param._version


@torch.no_grad()
def reduce_scatter(wholes: list) -> None:
    """Reduce-scatter the accumulated whole gradients of `wholes` (those that hold one; HSDP: then
    all-reduce across the replicas), average them over the ranks and add each rank's rows to its
    DTensor parameter's `.grad`; the whole ones freed."""
    for group in by_group([w for w in wholes if w.tensor.grad is not None]).values():
        world = group[0].world
        blocks = [padded(w.tensor.grad, world * w.entry.padded_rows).reshape(world, -1) for w in group]
        flat = torch.cat(blocks, dim=1).reshape(-1)  # rank-major: rank r's rows of every parameter together
        mine = flat.new_empty(flat.numel() // world)
        dist.reduce_scatter_single(mine, flat, group=group[0].group)
        replicas = group[0].replicas
        if replicas is not None:  # HSDP: the other replicas' sums of the same shard
            dist.all_reduce(mine, group=replicas.group)
        mine /= group[0].averaged * (replicas.size if replicas is not None else 1)
        offset = 0
        for w, block in zip(group, blocks):
            shard = mine[offset:offset + block.shape[1]].view(w.entry.padded_rows, *w.entry.shape[1:])
            offset += block.shape[1]
            add_to_grad(w.param, shard[:w.param.to_local().shape[0]])
            w.tensor.grad, w.marker = None, None


def add_to_grad(param: nn.Parameter, rows: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = DTensor.from_local(rows.clone(), param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    else:
        param.grad.to_local().add_(rows)


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


@contextlib.contextmanager
def reduce_after(model: nn.Module):
    """A pipeline's schedule: stage 1's whole gradients accumulate over its micro-batches and are
    reduce-scattered once at its end (unless under no_sync); stage 2 reduces after each backward."""
    owner = accumulation_of(model)
    previous, owner.deferred = owner.deferred, True
    try:
        yield
    finally:
        owner.deferred = previous
    if owner.sync and not owner.deferred:
        reduce_scatter(owner.wholes())
