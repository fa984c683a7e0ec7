"""The runtime of pass shard: the model's parameters become DTensor shards, the graph takes their pieces.

After the forward passes recorded a ShardLayout, `apply_shard_layout` replaces every parameter it
names by an nn.Parameter holding a DTensor with Shard(0) placement on the shard dimension's
DeviceMesh, under the same name, holding this rank's chunk of the same values (DTensor's own
uneven chunks: the first ranks hold ceil(rows / N) rows). Each call feeds the graph
`param.to_local()` padded with zero rows to the layout's common row count, so autograd brings the
graph's shard gradient back to the parameter as a Shard(0) DTensor `.grad`: optimizers, gradient
clipping and torch.distributed.checkpoint then work on the model as after FSDP2's `fully_shard`.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from picofx.parallel.layouts import ShardLayout


@torch.no_grad()
def apply_shard_layout(layout: ShardLayout, model: nn.Module) -> None:
    """Make each of the layout's parameters a Shard(0) DTensor parameter (once: a parameter that is
    already one stays). Tied parameters (one tensor under several names) stay tied."""
    replaced: dict[int, nn.Parameter] = {}
    for entry in layout.entries:
        param = model.get_parameter(entry.name)
        if isinstance(param, DTensor) or id(param) in replaced:
            continue
        mesh = layout.dim.as_device_mesh(param.device.type)
        # src_data_rank=None: every rank takes its chunk of its own copy (no broadcast), as fully_shard does
        local = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        replaced[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
    if not replaced:
        return
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)]


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
    local piece, padded with zero rows to the layout's row count."""
    rows = {e.name: e.padded_rows for e in layout.entries}
    out = []
    for name, value in zip(names, values):
        if name in rows and isinstance(value, DTensor):
            value = value.to_local()
            if value.shape[0] < rows[name]:
                value = torch.cat([value, value.new_zeros((rows[name] - value.shape[0], *value.shape[1:]))])
        out.append(value)
    return out


def local_bytes(model: nn.Module) -> int:
    """Bytes this rank stores for the model's parameters (a DTensor's local shard only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total
