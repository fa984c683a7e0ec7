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
  reduce-scatter per micro-batch. Under accumulation (no_sync, a pipeline's schedule) it is issued
  asynchronously and runs behind the next micro-batch (`InFlight`): completed at the end of the next
  backward, before that one's is issued, and always before a synced backward (or the schedule) ends,
  so the `.grad` shards are complete when the optimizer or clip_grad_norm_ read them. A step whose
  backwards all ran unsynced leaves the last one in flight: every optimizer's `step()` completes the
  in-flight reduce-scatters of its parameters first (`complete_before_step`), so none leaks past the
  step, which reads every micro-batch's gradient (FSDP2 too returns no collective in flight and
  raises nothing there); a `clip_grad_norm_` before that step still misses the last micro-batch.

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
from torch.optim.optimizer import register_optimizer_step_pre_hook
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
    in_flight: list = field(default_factory=list)  # stage 2: the last backward's reduce-scatters, not waited yet

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
        """Stage 2: complete the previous backward's reduce-scatters, issue this one's (waited at once
        when this backward synchronises). Stage 1: reduce-scatter when it synchronises."""
        self.queued = False
        self.finish()
        synced = self.sync and not self.deferred
        wholes = self.wholes()
        reduce_scatter([w for w in wholes if w.stage == 1 and synced])
        self.in_flight = issue([w for w in wholes if w.stage == 2])
        if synced:
            self.finish()

    def finish(self) -> None:
        flights, self.in_flight = self.in_flight, []
        for flight in flights:
            flight.complete()


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
        self.marker = zero_grad_of(self.param)

    def cleared(self) -> bool:
        """Whether the parameter's gradient was zeroed or dropped since the whole gradient last grew."""
        if self.marker is None or self.tensor.grad is None:
            return False
        grad = self.param.grad
        return grad is None or self.marker[0]() is not grad or grad._version != self.marker[1]


OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Accumulation
WHOLES = WeakIdKeyDictionary()  # DTensor parameter -> its Whole (a parameter lives as long as its record)
STEP_HOOK: list = []  # the handle of complete_before_step, registered with the first stage-2 parameter


def complete_before_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """Before any optimizer's step: complete stage 2's reduce-scatters still in flight for its
    parameters (a step after unsynced backwards only), so the step reads whole `.grad` shards."""
    pending = [owner for owner in OWNERS.values() if owner.in_flight]
    if not pending:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for owner in pending:
        if any(id(w.param) in stepped for flight in owner.in_flight for w in flight.wholes):
            owner.finish()


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
    if layout.stage == 2 and not STEP_HOOK:  # one hook for every optimizer of the process
        STEP_HOOK.append(register_optimizer_step_pre_hook(complete_before_step))
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
    """Reduce-scatter the accumulated whole gradients of `wholes` into their `.grad` shards, waiting."""
    for flight in issue(wholes):
        flight.complete()


@torch.no_grad()
def issue(wholes: list) -> list["InFlight"]:
    """Start one asynchronous reduce-scatter per group of the whole gradients of `wholes` (those that
    hold one) and free them: the flat buffer sent is a copy, so the next micro-batch accumulates into
    fresh whole `.grad`s while it is in flight. Each parameter gets a `.grad` shard (zeros) now, noted,
    so that a zero_grad before the completion drops what this backward accumulated (`InFlight`)."""
    flights = []
    for group in by_group([w for w in wholes if w.tensor.grad is not None]).values():
        world = group[0].world
        blocks = [padded(w.tensor.grad, world * w.entry.padded_rows).reshape(world, -1) for w in group]
        flat = torch.cat(blocks, dim=1).reshape(-1)  # rank-major: rank r's rows of every parameter together
        mine = flat.new_empty(flat.numel() // world)
        work = dist.reduce_scatter_single(mine, flat, group=group[0].group, async_op=True)
        grads = []
        for w in group:
            w.tensor.grad, w.marker = None, None
            grads.append(zero_grad_of(w.param))
        flights.append(InFlight(group, [b.shape[1] for b in blocks], flat, mine, work, grads))
    return flights


@dataclass(eq=False)
class InFlight:
    """One group's reduce-scatter under way: the wholes, each one's width in the flat buffer, the
    buffer sent (kept alive until the wait), this rank's reduced rows, the collective's Work, and
    each parameter's `.grad` shard (weakly) with its version when issued."""

    wholes: list
    widths: list
    flat: torch.Tensor
    mine: torch.Tensor
    work: object
    grads: list

    @torch.no_grad()
    def complete(self) -> None:
        """Wait, all-reduce across the replicas (HSDP), average and add each rank's rows to its
        parameter's `.grad` shard, unless that was zeroed or dropped since the issue."""
        self.work.wait()
        self.flat = None
        first, mine = self.wholes[0], self.mine
        if first.replicas is not None:  # HSDP: the other replicas' sums of the same shard
            dist.all_reduce(mine, group=first.replicas.group)
        mine /= first.averaged * (first.replicas.size if first.replicas is not None else 1)
        offset = 0
        for w, width, (ref, version) in zip(self.wholes, self.widths, self.grads):
            shard = mine[offset:offset + width].view(w.entry.padded_rows, *w.entry.shape[1:])
            offset += width
            grad = w.param.grad
            if grad is not None and grad is ref() and grad._version == version:
                grad.to_local().add_(shard[:w.param.to_local().shape[0]])


def zero_grad_of(param: nn.Parameter) -> tuple:
    """The parameter's DTensor `.grad` (zeros if it had none), weakly, and its version."""
    if param.grad is None:
        param.grad = DTensor.from_local(torch.zeros_like(param.to_local()), param.device_mesh, param.placements,
                                        run_check=False, shape=param.shape, stride=param.stride())
    return weakref.ref(param.grad), param.grad._version


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
    if not owner.deferred:
        owner.finish()  # stage 2: the last micro-batch's reduce-scatters
        if owner.sync:
            reduce_scatter(owner.wholes())
