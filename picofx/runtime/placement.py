"""The recorded layouts that place the model's parameters, each behind one protocol
(picofx.parallel.layouts.Placement): every rank checks it agrees on the layout, the model's
parameters are placed as it says, and each call's graph inputs become this rank's local pieces.
`picofx.optimize` (a step) and the pipeline runtime (a stage) loop over `placements(gm)`; a new
parallel layout adds its GraphLayouts field, a class here and its line in PLACEMENTS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from picofx.parallel.layouts import GraphLayouts, Placement, ShardLayout, TensorParallelLayout, recorded
from picofx.runtime.distributed import check_layout
from picofx.runtime.shard import apply_shard_layout, local_inputs
from picofx.runtime.shard_stages import hold_whole
from picofx.runtime.tensor_parallel import (apply_sharded_tensor_parallel_layout, apply_tensor_parallel_layout,
                                             padded_pieces, sharded_tensor_parallel_mesh)


@dataclass(frozen=True)
class ShardPlacement:
    """Pass shard: each parameter a dim-0 DTensor shard; the graph takes its padded local rows. Beside
    tensor parallelism (dp_shard x tp) the parameters become 2-D DTensors, as FSDP2 over TP places them."""

    layout: ShardLayout
    tensor_parallel: TensorParallelLayout | None = None

    def check(self) -> None:
        check_layout(self.layout)

    def place(self, model: nn.Module, mesh: Any) -> None:
        if self.tensor_parallel is None:
            apply_shard_layout(self.layout, model)
            return
        mesh_2d = sharded_tensor_parallel_mesh(mesh, self.layout, self.tensor_parallel)
        apply_sharded_tensor_parallel_layout(self.layout, self.tensor_parallel, model, mesh_2d)
        if self.layout.stage < 3:  # stages 1 and 2: the graph reads each tp piece whole over dp_shard
            hold_whole(self.layout, model)

    def local_inputs(self, names: list, values: list) -> list:
        return local_inputs(self.layout, names, values)


@dataclass(frozen=True)
class TensorParallelPlacement:
    """Pass tensor_parallel: each parameter a DTensor split (or whole) over the tp ranks; the graph
    takes its piece, padded where tp does not divide it. A parameter placed already (2-D, by shard) stays."""

    layout: TensorParallelLayout

    def check(self) -> None:
        check_layout(self.layout)

    def place(self, model: nn.Module, mesh: Any) -> None:
        apply_tensor_parallel_layout(self.layout, model)

    def local_inputs(self, names: list, values: list) -> list:
        return padded_pieces(self.layout, names, values)


# GraphLayouts field -> its placement, made from the recorded layout and the graph's others; placed in this order
PLACEMENTS = {
    "shards": lambda layout, others: ShardPlacement(layout, others.tensor_parallel),
    "tensor_parallel": lambda layout, others: TensorParallelPlacement(layout),
}


def placements(gm: fx.GraphModule) -> tuple[Placement, ...]:
    """The placements of the layouts recorded on `gm`, in PLACEMENTS' order (none: an empty tuple)."""
    found: GraphLayouts = recorded(gm)
    return tuple(make(getattr(found, field), found) for field, make in PLACEMENTS.items()
                 if getattr(found, field) is not None)


def place(found: tuple[Placement, ...], model: nn.Module, mesh: Any) -> None:
    """Every rank agrees on each layout (collectives), then the model's parameters are placed."""
    for placement in found:
        placement.check()
    for placement in found:
        placement.place(model, mesh)


def local_values(found: tuple[Placement, ...], names: list, values: list) -> list:
    """The graph's inputs (`names`: each slot's parameter name, or None) as this rank's local pieces."""
    for placement in found:
        values = placement.local_inputs(names, values)
    return values
