"""The runtime of pass tensor_parallel: the model's parameters become DTensors placed on the tp ranks.

After the forward passes recorded a TensorParallelLayout, `apply_tensor_parallel_layout` replaces
every parameter it names by an nn.Parameter holding a DTensor on the tp dimension's DeviceMesh:
Shard(0) for column-parallel weights and biases and vocabulary-parallel tables, Shard(1) for
row-parallel weights, Replicate() for the rest, under the same names, holding the same values.
The graph takes `param.to_local()` (a vocabulary tp does not divide: padded with zero rows to the
rows every rank's graph takes, as Megatron pads the table), so autograd brings each gradient back
with its parameter's placement: optimizers, gradient clipping and torch.distributed.checkpoint
work on the model as after DTensor's `parallelize_module`.

With pass shard on a second dimension (dp_shard x tp), `apply_sharded_tensor_parallel_layout`
makes each parameter a 2-D DTensor on the (dp_shard, tp) DeviceMesh, as FSDP2 over TP does: the
tp piece split again by rows over dp_shard; a row split on both dimensions is recorded as
_StridedShard on dp_shard (torch's "tp first, then dp" order), so `full_tensor()` is the model's.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from picofx.parallel.layouts import ShardLayout, TensorParallelLayout


def tied_split(layout: TensorParallelLayout, model: nn.Module) -> dict[int, int | None]:
    """Each parameter's split dimension by identity: a tied parameter (several names) takes the
    split one of its names has."""
    split: dict[int, int | None] = {}
    for entry in layout.entries:
        key = id(model.get_parameter(entry.name))
        if split.get(key) is None:
            split[key] = entry.split_dim
    return split


def replace_parameters(model: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)]


@torch.no_grad()
def apply_tensor_parallel_layout(layout: TensorParallelLayout, model: nn.Module) -> None:
    """Place each of the layout's parameters (once: a parameter that is a DTensor already stays);
    tied parameters (one tensor under several names) stay tied."""
    split = tied_split(layout, model)
    replaced: dict[int, nn.Parameter] = {}
    for entry in layout.entries:
        param = model.get_parameter(entry.name)
        if isinstance(param, DTensor) or id(param) in replaced:
            continue
        placement = Replicate() if split[id(param)] is None else Shard(split[id(param)])
        mesh = layout.dim.as_device_mesh(param.device.type)
        value = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
        replaced[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
    replace_parameters(model, replaced)


@torch.no_grad()
def sharded_tensor_parallel_mesh(mesh, shards: ShardLayout, placed: TensorParallelLayout):
    """The (dp_shard, tp) DeviceMesh the parameters of a sharded tensor-parallel step (or pipeline
    stage) live on; (dp_shard_cp, tp) where the shards span context parallel's ranks too."""
    if mesh is None or mesh.device_mesh is None or shards.dim.device_mesh is None or placed.dim.device_mesh is None \
            or mesh.size("tp") != placed.world:
        raise ValueError("Shard with TensorParallel places parameters on the run's 2-D mesh: pass "
                         "optimize(..., mesh=picofx.parallel.ParallelMesh.build(dp_shard=..., tp=...)) and leave "
                         "the passes' own meshes unset.")
    return mesh.placement_mesh(shards.dim, placed.dim)


def apply_sharded_tensor_parallel_layout(shards: ShardLayout, layout: TensorParallelLayout, model: nn.Module,
                                         mesh) -> None:
    """Make each parameter a DTensor on the 2-D (dp_shard, tp) DeviceMesh `mesh`: this rank's tp
    piece, cut into dp_shard row chunks, this rank's chunk. Placements: [Shard(0), Replicate()]
    (whole over tp), [Shard(0), Shard(1)] (a row-parallel weight), [_StridedShard(0, tp),
    Shard(0)] (split by rows over tp, then again over dp_shard)."""
    split = tied_split(layout, model)
    dp, tp = shards.dim, layout.dim
    replaced: dict[int, nn.Parameter] = {}
    for entry in layout.entries:
        param = model.get_parameter(entry.name)
        if isinstance(param, DTensor) or id(param) in replaced:
            continue
        axis = split[id(param)]
        piece = param.detach() if axis is None else param.detach().chunk(tp.size, dim=axis)[tp.rank]
        if piece.shape[0] % dp.size:
            raise NotImplementedError(f"Shard over TensorParallel: {entry.name}'s tensor-parallel piece has "
                                      f"{piece.shape[0]} rows, which dp_shard={dp.size} does not divide; give "
                                      "sizes the product of the two dimensions divides.")
        local = piece.chunk(dp.size, dim=0)[dp.rank].contiguous()
        placements = [Shard(0), Replicate()] if axis is None else [Shard(0), Shard(1)] if axis == 1 else \
            [_StridedShard(0, split_factor=tp.size), Shard(0)]
        value = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape,
                                   stride=param.stride())
        replaced[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
    replace_parameters(model, replaced)


def padded_pieces(layout: TensorParallelLayout, names: list, values: list) -> list:
    """The graph's inputs with each placed parameter (by its slot's name in `names`) as its local
    piece, padded with zeros along its split dimension to the size every rank's graph takes."""
    sizes = {e.name: (e.split_dim, e.local_size) for e in layout.entries if e.local_size is not None}
    out = []
    for name, value in zip(names, values):
        if isinstance(value, DTensor):
            value = value.to_local()
            axis, size = sizes.get(name, (None, None))
            if axis is not None and value.shape[axis] < size:
                missing = list(value.shape)
                missing[axis] = size - value.shape[axis]
                value = torch.cat([value, value.new_zeros(missing)], dim=axis)
        out.append(value)
    return out
