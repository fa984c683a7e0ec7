"""Shard with float8 weights (precision's tensorwise recipe): each weight that only float8 linears
read is gathered in float8, one byte per element, as torchao's float8 all-gather for FSDP2 does.

In the forward graph, once per step, before the first gather (one collective for every such weight):

    amaxes = stack([shard_i.abs().amax() ...])                  # (W,) this rank's padded shards
    amaxes = wait_tensor(all_reduce(amaxes, "max", group))       # (W,) the whole weights' amaxes
    amaxes = wait_tensor(all_reduce(amaxes, "max", tp_group))    # beside tensor parallelism: over tp too
    scale_i = E4M3_MAX / amaxes[i]                               # as precision's float8_scale computes it

and per bucket (the buckets hold these weights apart from other parameters):

    flat = cat([cast(shard_i, scale_i).view(uint8).reshape(-1) ...])         # (M,) bytes
    bytes = wait_tensor(all_gather(flat, N, group))                          # (N * M,)
    weight8_i = bytes.view(N, M)[:, off_i:off_i + m_i].reshape(N * P_i, K).view(e4m3)[:rows_i]
    float8_linear(x, link_i, "tensorwise", weight8=weight8_i, weight_scale=scale_i)  # no second cast

Beside tensor parallelism a shard is one of the tp-local piece's rows, and the scale is still the whole
weight's (its amax the maximum over dp_shard and tp, the one TP's own float8 cast computes), so the
float8 linears keep their split and group: `float8_linear(x, link_i, "tensorwise", split, group,
weight8=..., weight_scale=...)`, and sequence parallelism's `float8_gathered_linears(shard, dtype, dim,
ranks, group, *links, weights8=..., weight_scales=...)`.

gloo gathers no float8 dtype, so the bytes travel as uint8. The weight's gradient reaches the shards
through link_i, an output of `ScatterGradients`: its forward moves nothing (a zero expanded to the
weight's shape, never read) and its backward is the bucket's one reduce-scatter, in the reduce dtype,
as the backward of the autograd all-gather of other buckets is.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from picofx.capture.vocabulary import FLOAT8_META, input_slot, is_parameter
from picofx.parallel.layouts import layouts_of

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GATHER = torch.ops._c10d_functional_autograd.all_gather_into_tensor.default
E4M3 = torch.float8_e4m3fn
FLOAT8_VIEWS = (aten.view.dtype, aten.detach.default)  # what reads the gathered bytes as float8 weights
SMALLEST_AMAX = 1e-12  # precision's float8_scale's floor: an all-zero weight gets a finite scale
GATHERED_WEIGHTS = 5  # float8_gathered_linears(shard, dtype, dim, ranks, group, *weights): its weights' index


def reads_as_weight(user: fx.Node, node: fx.Node) -> bool:
    """Whether float8 node `user` reads `node` as a weight only: float8_linear(x, w, recipe[, split,
    group]), or sequence parallelism's float8_gathered_linears (a dtype second, then its weights)."""
    args = user.args
    if not user.meta.get(FLOAT8_META) or user.kwargs or len(args) < 3:
        return False
    if isinstance(args[1], torch.dtype):
        return node in args[GATHERED_WEIGHTS:] and node not in args[:GATHERED_WEIGHTS]
    return len(args) in (3, 5) and args[1] is node and node not in (args[0], *args[2:])


def float8_weights(gm: fx.GraphModule) -> tuple[dict[fx.Node, list[fx.Node]], dict[str, str]]:
    """Each parameter placeholder read only as the weight of tensorwise float8 linears, with those
    linears; and, by name, why each other weight a float8 linear reads is gathered in its own dtype."""
    found, kept = {}, {}
    for node in gm.graph.nodes:
        if not is_parameter(node):
            continue
        linears = [u for u in node.users if reads_as_weight(u, node)]
        others = [u for u in node.users if u not in linears]
        recipes = {u.meta[FLOAT8_META] for u in linears} - {"tensorwise"}
        if linears and (recipes or others):
            kept[input_slot(node).target] = (f"recipe {sorted(recipes)[0]}: scales per row of the whole weight"
                                             if recipes else f"also read by {others[0].name}")
        elif linears:
            found[node] = linears
    return found, kept


def local_amaxes(*shards: torch.Tensor) -> torch.Tensor:
    """(W,) fp32: each shard's largest magnitude (the zero padding changes none)."""
    return torch.stack([s.detach().abs().amax().to(torch.float32) for s in shards])


def scales_of(amaxes: torch.Tensor) -> torch.Tensor:
    """(W,) fp32 scales mapping each amax onto e4m3's largest value, computed in fp64 as precision's
    float8_scale does (the tests check the gathered weights bit for bit against its cast)."""
    return (torch.finfo(E4M3).max / amaxes.to(torch.float64).clamp(min=SMALLEST_AMAX)).to(torch.float32)


def float8_bytes(shard: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(numel,) uint8: the shard * scale, saturated to e4m3, as bytes (precision's to_float8)."""
    largest = torch.finfo(E4M3).max
    cast = (shard.detach().to(torch.float32) * scale).clamp(min=-largest, max=largest).to(E4M3)
    return cast.view(torch.uint8).reshape(-1)


class ScatterGradients(torch.autograd.Function):
    """Forward: each parameter's whole shape as a stand-in that moves and holds nothing. Backward: the
    whole gradients, zero-padded to the shards' rows and packed rank by rank, (N, M) -> (N * M,), cast
    to the reduce dtype and reduce-scattered (sum) in one collective: each rank gets its shards' sums."""

    @staticmethod
    def forward(ctx, world: int, group: str, rows: tuple, reduce_dtype, *shards):
        ctx.world, ctx.group, ctx.reduce_dtype = world, group, reduce_dtype
        ctx.shapes = [tuple(s.shape) for s in shards]
        ctx.dtype, ctx.device = shards[0].dtype, shards[0].device
        return tuple(s.new_zeros(()).expand(r, *s.shape[1:]) for s, r in zip(shards, rows))

    @staticmethod
    def backward(ctx, *grads):
        world, packed = ctx.world, []
        for grad, shape in zip(grads, ctx.shapes):
            whole = (world * shape[0], *shape[1:])
            if grad is None:
                grad = torch.zeros(whole, dtype=ctx.dtype, device=ctx.device)
            elif grad.shape[0] != whole[0]:
                grad = torch.cat([grad, grad.new_zeros((whole[0] - grad.shape[0], *shape[1:]))])
            packed.append(grad.reshape(world, -1))                                      # (N, m_i)
        flat = torch.cat(packed, dim=1).reshape(-1).to(ctx.reduce_dtype or ctx.dtype)   # (N * M,)
        mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", world, ctx.group)).to(ctx.dtype)
        out, offset = [], 0
        for shape in ctx.shapes:
            size = torch.Size(shape).numel()
            out.append(mine[offset:offset + size].view(shape))
            offset += size
        return (None, None, None, None, *out)


def scatter_gradients(world: int, group: str, rows: tuple, reduce_dtype, *shards):
    return ScatterGradients.apply(world, group, rows, reduce_dtype, *shards)


def scale_weights(graph: fx.Graph, weights: list[fx.Node], dim, before: fx.Node) -> dict[fx.Node, fx.Node]:
    """The whole weights' scales from one all-reduce (max) of the shards' amaxes, and one more over the
    tp ranks where tensor parallelism splits the weights, issued before `before`; returns each weight's
    scale node (a 0-d fp32 tensor)."""
    tp = layouts_of(graph.owning_module).tensor_parallel
    groups = [dim.group_name] + ([tp.dim.group_name] if tp is not None and tp.world > 1 else [])
    with graph.inserting_before(before):
        amaxes = graph.call_function(local_amaxes, tuple(weights))
        for group in groups:
            reduced = graph.call_function(c10d.all_reduce.default, (amaxes, "max", group))
            amaxes = graph.call_function(c10d.wait_tensor.default, (reduced,))
        scales = graph.call_function(scales_of, (amaxes,))
        return {w: graph.call_function(aten.select.int, (scales, 0, i)) for i, w in enumerate(weights)}


def issue_float8_gather(graph: fx.Graph, bucket: list, dim, before: fx.Node, scales: dict) -> fx.Node:
    """All-gather the bucket's shards cast to e4m3 with their whole weights' scales, as one byte tensor."""
    with graph.inserting_before(before):
        flat = [graph.call_function(float8_bytes, (node, scales[node])) for _, node, _ in bucket]
        flat = flat[0] if len(flat) == 1 else graph.call_function(aten.cat.default, (flat,))
        return graph.call_function(GATHER, (flat, dim.size, dim.group_name))


def is_float8(gather: fx.Node) -> bool:
    """Whether an all-gather carries float8 weights (as bytes)."""
    return gather.args[0].meta["val"].dtype == torch.uint8


def shard_casts(gather: fx.Node) -> list[fx.Node]:
    """What a float8 gather reads back to the shards and the scales (not included: the scales' all-reduce
    runs once a step), for the backward's re-gather to cast the shards again rather than keep their casts."""
    if not is_float8(gather):
        return []
    found, pending = [], list(gather.args[0].all_input_nodes)
    while pending:
        node = pending.pop()
        if node.op == "call_function" and node.target is not aten.select.int and node not in found:
            found.append(node)
            pending += node.all_input_nodes
    return found


def wait_and_unpack_float8(graph: fx.Graph, bucket: list, gathered: fx.Node, dim, scales: dict,
                           users: dict, reduce_dtype) -> None:
    """Wait for the bucket's bytes before its first use, view each whole weight in e4m3, and hand it
    with its scale and its gradient stand-in to the float8 linears that read the weight."""
    shards = [node for _, node, _ in bucket]
    sizes = [s.meta["val"].numel() for s in shards]
    with graph.inserting_before(bucket[0][0]):
        rows_of = tuple(shape[0] for *_, shape in bucket)
        links = graph.call_function(scatter_gradients, (dim.size, dim.group_name, rows_of, reduce_dtype, *shards))
        waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
        rows = graph.call_function(aten.view.default, (waited, [dim.size, sum(sizes)]))   # (N, M)
        offset = 0
        for k, ((_, node, shape), size) in enumerate(zip(bucket, sizes)):
            padded = node.meta["val"].shape[0]
            piece = graph.call_function(aten.slice.Tensor, (rows, 1, offset, offset + size))
            whole = graph.call_function(aten.reshape.default, (piece, [dim.size * padded, *shape[1:]]))
            whole = graph.call_function(aten.view.dtype, (whole, E4M3))
            if padded * dim.size != shape[0]:
                whole = graph.call_function(aten.slice.Tensor, (whole, 0, 0, shape[0]))
            link = graph.call_function(operator.getitem, (links, k))
            for linear in users[node]:
                hand_over(linear, node, link, whole, scales[node])
            offset += size


def hand_over(linear: fx.Node, weight: fx.Node, link: fx.Node, weight8: fx.Node, scale: fx.Node) -> None:
    """`linear` reads the gathered float8 weight and its scale, and `link` (the gradient's way back) where
    it read `weight`."""
    args = list(linear.args)
    if isinstance(args[1], torch.dtype):  # float8_gathered_linears: one float8 weight and scale per weight
        count = len(args) - GATHERED_WEIGHTS
        at = args.index(weight) - GATHERED_WEIGHTS
        given = {k: list(linear.kwargs.get(k, (None,) * count)) for k in ("weights8", "weight_scales")}
        given["weights8"][at], given["weight_scales"][at] = weight8, scale
        args[GATHERED_WEIGHTS + at] = link
        linear.args, linear.kwargs = tuple(args), {k: tuple(v) for k, v in given.items()}
        return
    args[1] = link
    linear.args, linear.kwargs = tuple(args), {"weight8": weight8, "weight_scale": scale}
