"""The shard pass's high-precision gather of a bucket: its shards as one flat tensor, cast to the
wire dtype where mixed precision asks, all-gathered with autograd (whose backward is the bucket's
reduce-scatter), and each whole parameter cut out of what arrives; and what one bucket moves.
"""
from __future__ import annotations

import torch
from torch import fx

from picofx.capture.vocabulary import input_slot
from picofx.parallel.mesh import MeshDim

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER = torch.ops._c10d_functional_autograd.all_gather_into_tensor.default
CAST = aten._to_copy.default


def issue_gather(graph: fx.Graph, bucket: list, dim: MeshDim, before: fx.Node, wire) -> fx.Node:
    """All-gather the bucket's padded shards as one flat tensor, issued before node `before`:

        flat = cat([shard.reshape(-1) for shard in bucket])     # (M,), M = the shards' numel
        flat = flat.to(wire)                                    # mixed precision only
        gathered = all_gather(flat, N, group)                   # (N * M,): rank r's shards at r * M
    """
    shards = [node for _, node, _ in bucket]
    with graph.inserting_before(before):
        flat = shards[0] if len(shards) == 1 else graph.call_function(
            aten.cat.default, ([graph.call_function(aten.reshape.default, (s, [-1])) for s in shards],))
        if wire is not None and shards[0].meta["val"].dtype != wire and shards[0].meta["val"].is_floating_point():
            flat = graph.call_function(CAST, (flat,), {"dtype": wire})
        return graph.call_function(GATHER, (flat, dim.size, dim.group_name))


def wait_and_unpack(graph: fx.Graph, bucket: list, gathered: fx.Node, dim: MeshDim) -> None:
    """Wait for the bucket's gather before its first use and cut each whole parameter out of it,
    `rows = gathered.view(N, M); whole_i = rows[:, off_i:off_i + m_i].reshape(N * P_i, ...)[:rows_i]`;
    the parameters' readers read those instead."""
    shards = [node for _, node, _ in bucket]
    with graph.inserting_before(bucket[0][0]):
        waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
        if gathered.args[0].target is CAST:  # gathered in the wire dtype: the whole bucket back to the parameters'
            # one cast of the bucket: the backward's gradient buffer is cast down in one place, which
            # reduce_in removes when gradients are reduced in the parameters' dtype
            waited = graph.call_function(CAST, (waited,), {"dtype": shards[0].meta["val"].dtype})
        if len(shards) > 1:
            rows = graph.call_function(aten.view.default,
                                       (waited, [dim.size, sum(s.meta["val"].numel() for s in shards)]))
        offset, wholes = 0, []
        for (_, node, shape), shard in zip(bucket, (s.meta["val"] for s in shards)):
            whole = waited
            if len(shards) > 1:
                piece = graph.call_function(aten.slice.Tensor, (rows, 1, offset, offset + shard.numel()))
                whole = graph.call_function(aten.reshape.default,
                                            (piece, [dim.size * shard.shape[0], *shard.shape[1:]]))
                offset += shard.numel()
            if shard.shape[0] * dim.size != shape[0]:
                whole = graph.call_function(aten.slice.Tensor, (whole, 0, 0, shape[0]))
            wholes.append(whole)
    flat = gathered.args[0]
    own = {gathered, flat, *flat.all_input_nodes}  # the nodes that read the shards themselves
    own |= {a for n in flat.all_input_nodes for a in n.all_input_nodes} if flat.target is CAST else set()
    for node, whole in zip(shards, wholes):
        for user in [u for u in node.users if u not in own]:
            user.replace_input_with(node, whole)


def describe_bucket(bucket: list, issued: fx.Node, world: int, wire, reduce, trainable: set) -> dict:
    """What one bucket moves: its parameters, the bytes gathered (and, if any requires a gradient,
    reduce-scattered) over all ranks in the wire dtypes, where the gather is issued and awaited."""
    names = [input_slot(node).target for _, node, _ in bucket]
    numel = sum(node.meta["val"].numel() for _, node, _ in bucket) * world
    own = bucket[0][1].meta["val"].element_size()
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return {"parameters": shown, "count": len(names),
            "gathered_bytes": numel * (wire.itemsize if wire else own),
            "reduced_bytes": numel * (reduce.itemsize if reduce else own) if trainable & set(names) else 0,
            "issued_before": issued.name, "awaited_before": bucket[0][0].name}
