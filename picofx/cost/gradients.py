"""The backward graph's gradients: which outputs are parameters' gradients, in the order the
backward makes them, and when each is ready. Read by the overlap pass, the planners and tools."""
from __future__ import annotations

import torch
from torch import fx


def gradients_in_order(gm: fx.GraphModule, input_names) -> list[tuple[int, fx.Node, str]]:
    """(output position, node, parameter name) of each parameter's tensor gradient output, in the
    order the backward produces them (the position of the node that computes it). Where the inputs
    are named, an input that is no parameter (a pipeline stage's activations, a float input) has
    no name, and its gradient is left alone, as DistributedDataParallel leaves it."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    outputs = gm.graph.output_node().args[0]
    grads = []
    for pos, node in enumerate(outputs):
        if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor):
            name = input_names[pos] if input_names is not None and pos < len(input_names) else f"input_{pos}"
            if name is not None:
                grads.append((pos, node, name))
    return sorted(grads, key=lambda g: (order[g[1]], g[0]))


def ready_times(gm: fx.GraphModule, nodes: list[fx.Node], cost_model) -> tuple[list[float], float]:
    """Predicted seconds after the backward starts at which each node's value exists, and the
    backward's total, from the cost model's per-node time."""
    elapsed, at = 0.0, {}
    for node in gm.graph.nodes:
        elapsed += cost_model.node_time(node)
        at[node] = elapsed
    return [at[n] for n in nodes], elapsed


def dtype_runs(grads: list[tuple[int, fx.Node, str]]) -> list[int]:
    """Indices after which the gradient dtype changes: buckets never mix dtypes."""
    dtypes = [g[1].meta["val"].dtype for g in grads]
    return [i for i in range(len(dtypes) - 1) if dtypes[i] != dtypes[i + 1]]
