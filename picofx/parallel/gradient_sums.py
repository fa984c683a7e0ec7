"""The data-parallel passes and context parallelism meet here: the sums over cp of the parameters'
gradients, which context_parallel puts in the forward graph (a tp_copy reading each parameter;
its backward, an all-reduce over cp) and which a data-parallel pass whose group spans cp (shard
over dp_shard x cp, overlap over dp_replicate x cp) finds and takes out, its own bucketed
collective then summing over cp. Shared by those passes, so no pass imports another's.
"""
from __future__ import annotations

import torch
from torch import fx

import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.tp_copy)
from picofx.capture.vocabulary import is_parameter

c10d = torch.ops._c10d_functional


def cp_group(mesh) -> str | None:
    """The name of the run's cp process group, None where the run has no cp dimension."""
    if mesh is None or mesh.size("cp") == 1 or mesh.device_mesh is None:
        return None
    return mesh.dim("cp").group_name


def forward_gradient_sums(gm: fx.GraphModule, mesh) -> list[fx.Node]:
    """The forward graph's sums of the parameters' gradients over cp (each a tp_copy reading a
    parameter), where every parameter read has one; [] where the run has no cp dimension or some
    parameter none. A data-parallel pass whose group then spans cp sums them itself."""
    group = cp_group(mesh)
    if group is None:
        return []
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.picofx.tp_copy.default and n.args[1] == group
              and is_parameter(n.args[0])]
    read = [n for n in gm.graph.nodes if is_parameter(n) and n.users]
    return copies if len(copies) == len(read) else []


def backward_gradient_sums(gm: fx.GraphModule, mesh, gradients: list[fx.Node]) -> list[fx.Node]:
    """The backward graph's all-reduces over cp of the parameters' `gradients` (each gradient the
    wait of one), where every one has one; else []."""
    group = cp_group(mesh)
    if group is None:
        return []
    sums = [g.args[0] for g in gradients if g.target is c10d.wait_tensor.default
            and g.args[0].target is c10d.all_reduce.default and g.args[0].args[2] == group and len(g.users) == 1]
    return sums if len(sums) == len(gradients) else []


def drop_gradient_sums(gm: fx.GraphModule, sums: list[fx.Node]) -> None:
    """Take `sums` (of forward_gradient_sums or backward_gradient_sums) out of the graph: what read
    a sum reads what it summed."""
    for node in sums:
        for done in [u for u in node.users if u.target is c10d.wait_tensor.default]:
            done.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(done)
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


def sum_parameter_gradients(graph: fx.Graph, group: str) -> int:
    """Each parameter read through tp_copy: its gradient, from this rank's tokens, summed over cp."""
    count = 0
    for node in list(graph.nodes):
        if is_parameter(node) and node.users:
            with graph.inserting_after(node):  # tensor_parallel may read it in a node among the inputs
                summed = graph.call_function(torch.ops.picofx.tp_copy.default, (node, group))
            summed.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not summed)
            count += 1
    return count
