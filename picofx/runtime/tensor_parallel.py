"""The runtime of pass tensor_parallel: the model's parameters become DTensors placed on the tp ranks.

After the forward passes recorded a TensorParallelLayout, `apply_tensor_parallel_layout` replaces
every parameter it names by an nn.Parameter holding a DTensor on the tp dimension's DeviceMesh:
Shard(0) for column-parallel weights and biases and vocabulary-parallel tables, Shard(1) for
row-parallel weights, Replicate() for the rest, under the same names, holding the same values.
The graph takes `param.to_local()`, so autograd brings each gradient back with its parameter's
placement: optimizers, gradient clipping and torch.distributed.checkpoint work on the model as
after DTensor's `parallelize_module`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from picofx.parallel.layouts import TensorParallelLayout


@torch.no_grad()
def apply_tensor_parallel_layout(layout: TensorParallelLayout, model: nn.Module) -> None:
    """Place each of the layout's parameters (once: a parameter that is a DTensor already stays);
    tied parameters (one tensor under several names) stay tied."""
    split: dict[int, int | None] = {}  # a tied parameter (several names) takes the split one of its names has
    for entry in layout.entries:
        key = id(model.get_parameter(entry.name))
        if split.get(key) is None:
            split[key] = entry.split_dim
    replaced: dict[int, nn.Parameter] = {}
    for entry in layout.entries:
        param = model.get_parameter(entry.name)
        if isinstance(param, DTensor) or id(param) in replaced:
            continue
        placement = Replicate() if split[id(param)] is None else Shard(split[id(param)])
        mesh = layout.dim.as_device_mesh(param.device.type)
        value = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
        replaced[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)]
