"""The recorded layouts that place parameters, behind one protocol: optimize and the pipeline's stages
loop over what a graph records instead of naming shards and tensor parallelism."""
import ast
import dataclasses
import pathlib

import torch
from torch import fx

from picofx.parallel.layouts import GraphLayouts, ShardLayout, TensorParallelLayout, layouts_of
from picofx.runtime import placement
from picofx.runtime.placement import PLACEMENTS, ShardPlacement, TensorParallelPlacement, local_values, placements

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYOUT_RUNTIMES = {"apply_shard_layout", "apply_tensor_parallel_layout", "apply_sharded_tensor_parallel_layout",
                   "local_inputs", "padded_pieces", "sharded_tensor_parallel_mesh"}


def test_the_step_and_the_stages_name_no_layouts_runtime():
    for path in ("picofx/api.py", "picofx/runtime/pipeline.py"):
        tree = ast.parse((ROOT / path).read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not named & LAYOUT_RUNTIMES, (path, named & LAYOUT_RUNTIMES)


def test_each_placing_layout_is_a_graph_layout_with_the_protocol():
    fields = {f.name for f in dataclasses.fields(GraphLayouts)}
    assert set(PLACEMENTS) <= fields
    for kind in (ShardPlacement, TensorParallelPlacement):
        assert all(callable(getattr(kind, method)) for method in ("check", "place", "local_inputs"))


def test_the_placements_of_a_graph_are_those_it_recorded_in_order(monkeypatch):
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert placements(gm) == ()
    assert local_values((), ["w", None], [1, 2]) == [1, 2]
    shards, placed = ShardLayout(dim=None), TensorParallelLayout(dim=None)
    layouts_of(gm).tensor_parallel = placed
    assert placements(gm) == (TensorParallelPlacement(placed),)
    layouts_of(gm).shards = shards  # dp_shard x tp: shard places the 2-D DTensors, tensor parallel finds them placed
    assert placements(gm) == (ShardPlacement(shards, placed), TensorParallelPlacement(placed))
    calls = []
    monkeypatch.setattr(placement, "local_inputs", lambda layout, names, values: calls.append("shard") or values)
    monkeypatch.setattr(placement, "padded_pieces", lambda layout, names, values: calls.append("tp") or values)
    assert local_values(placements(gm), ["w"], [1]) == [1] and calls == ["shard", "tp"]
