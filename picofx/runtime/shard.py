"""The runtime of pass shard: the model's parameters become DTensor shards, the graph takes their pieces.

After the forward passes recorded a ShardLayout, `apply_shard_layout` replaces every parameter it
names by an nn.Parameter holding a DTensor with Shard(0) placement on the shard dimension's
DeviceMesh (HSDP: (Replicate(), Shard(0)) on the 2-D (dp_replicate, dp_shard) mesh), under the
same name, holding this rank's chunk of the same values (DTensor's own uneven chunks: the first
ranks hold ceil(rows / N) rows). Each call feeds the graph
`param.to_local()` padded with zero rows to the layout's common row count, so autograd brings the
graph's shard gradient back to the parameter as a Shard(0) DTensor `.grad`: optimizers, gradient
clipping and torch.distributed.checkpoint then work on the model as after FSDP2's `fully_shard`.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from picofx.parallel.layouts import ShardLayout
from picofx.runtime.shard_stages import hold_whole, whole_inputs


@torch.no_grad()
def apply_shard_layout(layout: ShardLayout, model: nn.Module) -> None:
    """Make each of the layout's parameters a Shard(0) DTensor parameter (once: a parameter that is
    already one stays). Tied parameters (one tensor under several names) stay tied. Stages 1 and 2
    also hold each whole for the graph (picofx.runtime.shard_stages)."""
    replaced: dict[int, nn.Parameter] = {}
    for entry in layout.entries:
        param = model.get_parameter(entry.name)
        if isinstance(param, DTensor) or id(param) in replaced:
            continue
        mesh = layout.mesh if layout.mesh is not None else layout.dim.as_device_mesh(param.device.type)
        placements = [Shard(0)] if layout.mesh is None else [Replicate(), Shard(0)]  # HSDP: replicas of the shards
        # src_data_rank=None: every rank takes its chunk of its own copy (no broadcast), as fully_shard does
        local = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
        replaced[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
    for module in model.modules() if replaced else ():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)]
    if layout.stage < 3:
        hold_whole(layout, model)


@contextlib.contextmanager
def whole_parameters(model: nn.Module):
    """A model an earlier step sharded, with whole parameters in place of its DTensors while a new
    step is captured (a recapture: new input shapes, eval mode): gathered (a collective over the
    shard ranks, which recapture together as they train together), then the DTensors put back."""
    sharded = {id(p): p for p in model.parameters() if isinstance(p, DTensor)}
    if not sharded:
        yield
        return
    whole = {key: nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad) for key, p in sharded.items()}
    swapped = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in sharded:
                module._parameters[name] = whole[id(param)]
                swapped.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def local_inputs(layout: ShardLayout, names: list, values: list) -> list:
    """The graph's inputs with each sharded parameter (by its slot's name in `names`) replaced by its
    local piece, padded with zero rows to the layout's row count (stages 1 and 2: its whole copy)."""
    if layout.stage < 3:
        return whole_inputs(layout, names, values)
    rows = {e.name: e.padded_rows for e in layout.entries}
    out = []
    for name, value in zip(names, values):
        if name in rows and isinstance(value, DTensor):
            value = value.to_local()
            if value.shape[0] < rows[name]:
                value = torch.cat([value, value.new_zeros((rows[name] - value.shape[0], *value.shape[1:]))])
        out.append(value)
    return out


def local_tensor_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_bytes(model: nn.Module) -> int:
    """Bytes this rank stores for the model's parameters (a DTensor's local shard only)."""
    return sum(local_tensor_bytes(p) for p in model.parameters())


def memory_per_rank(opt, *args, optimizer=None, **kwargs) -> dict:
    """This rank's predicted and measured peak of one sharded training step on the call's inputs
    (`opt` a sharded OptimizedModule, after a step was compiled for them): the cost model's peak
    of the step's partitioned graphs (its parameter inputs are the local shards) and
    `picofx.cost.memory.measure_peak` of one real forward and backward (run twice, a collective
    on every shard rank: call it on all of them). With `optimizer`, its state is added to both.
    The figures go into `opt.report` as the section "shard memory per rank" and are returned."""
    import torch.distributed as dist

    from picofx.cost.model import CostModel, optimizer_state_bytes
    from picofx.cost.units import format_bytes

    opt(*args, **kwargs)  # compiles the step for these inputs if it is not yet
    graphs = opt.graphs
    local = [p.to_local() if isinstance(p, DTensor) else p for p in opt.parameters()]
    state = (sum(local_tensor_bytes(v) for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)) if optimizer is not None and optimizer.state
             else optimizer_state_bytes(optimizer, local))
    device = local[0].device if local else torch.device("cpu")
    predicted = CostModel.for_backend(device, opt.report.backend).step_memory(graphs["forward"], graphs["backward"],
                                                                               state)
    measured = measured_peak(opt, args, kwargs) + state
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {"rank": rank, "predicted_peak": predicted.peak, "measured_peak": measured,
           "parameters": predicted.parameters, "gradients": predicted.gradients, "optimizer_state": state,
           "saved_activations": predicted.saved_activations}
    opt.report.sections["shard memory per rank"] = (
        f"rank {rank}: predicted peak {format_bytes(predicted.peak)} (parameter shards "
        f"{format_bytes(predicted.parameters)}, gradient shards and gathered layers at the backward peak, "
        f"saved activations {format_bytes(predicted.saved_activations)}, optimizer state {format_bytes(state)}), "
        f"measured peak {format_bytes(measured)} ({measured / max(predicted.peak, 1):.2f}x predicted)")
    return out


def measured_peak(opt, args: tuple, kwargs: dict) -> int:
    """Peak bytes of a forward and backward after a warm-up one, the local shards, buffers and
    inputs counted as resident; the gradients are left as they were. The least of three runs: the
    collectives' worker threads allocate scratch of their own, which some runs meet at the step's
    peak and others do not."""
    from picofx.cost.memory import measure_peak
    from picofx.runtime.measure import training_loss

    params = list(opt.parameters())
    kept = [p.grad for p in params]

    def run():
        for p in params:
            p.grad = None
        training_loss(opt(*args, **kwargs)).backward()

    try:
        run()
        for p in params:
            p.grad = None
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        return min(measure_peak(run, resident=(local, list(opt.buffers()), args, kwargs)) for _ in range(3))
    finally:
        for p, g in zip(params, kept):
            p.grad = g
