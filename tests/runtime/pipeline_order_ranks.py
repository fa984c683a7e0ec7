"""What each of 2 gloo ranks runs for tests/runtime/test_pipeline_order.py: a stage's backward graph
holding a dp_shard reduce-scatter and gather, in one order on rank 0 and, in a second case, the other on
rank 1 (the fault that stopped shard + sequence parallelism + pipeline runs); the order check's error."""
from __future__ import annotations

import torch
from torch import fx

from picofx.errors import DistributedError
from picofx.parallel import ParallelMesh
from picofx.runtime.pipeline_order import check_same_order

c10d = torch.ops._c10d_functional


def backward_graph(group: str, scatter_first: bool) -> fx.GraphModule:
    graph = fx.Graph()
    grad, shard = graph.placeholder("grad"), graph.placeholder("shard")
    issue = [lambda: graph.call_function(c10d.reduce_scatter_tensor.default, (grad, "sum", 2, group)),
             lambda: graph.call_function(c10d.all_gather_into_tensor.default, (shard, 2, group))]
    nodes = [make() for make in (issue if scatter_first else issue[::-1])]
    graph.output(tuple(graph.call_function(c10d.wait_tensor.default, (n,)) for n in nodes))
    return fx.GraphModule(torch.nn.Module(), graph)


def check(rank: int, world: int) -> dict:
    """The check's error (None: it passed) where both ranks' orders agree, and where rank 1's differs."""
    mesh = ParallelMesh.build(dp_shard=2)
    group = mesh.dim("dp_shard").group_name
    out = {}
    for case, swap in (("same", False), ("swapped", True)):
        try:
            check_same_order(0, {"backward": backward_graph(group, scatter_first=not (swap and rank == 1))}, mesh)
            out[case] = None
        except DistributedError as e:
            out[case] = str(e)
    return out
