"""tensor_parallel's async_overlap: sequence parallelism's collectives overlapped with their matmuls.

Partitioned stage (forward and backward graphs final). Each `picofx.sp_gather` read by token-row
matmuls (`mm(view(gathered, [tokens, features]), w)`) and each `picofx.sp_scatter` of matmuls'
output (`view(mm(a, w))`, or a sum of them in the backward) is split by batch rows into chunks,
each its own functional collective, so that one chunk's communication runs under another's matmul:

    g0 = all_gather(x[0:b]); g1 = all_gather(x[b:2b])     # both issued
    y0 = mm(wait(g0), w)                                  # while g1 travels
    y1 = mm(wait(g1), w)
    y = cat(y0, y1)                                       # the rows of mm(gather(x), w)

    s0 = reduce_scatter(mm(a[rows 0], w))                 # issued
    s1 = reduce_scatter(mm(a[rows 1], w))                 # this matmul runs while s0 travels
    out = cat(wait(s0), wait(s1))

Batch rows are independent in both (the sequence is what is gathered and scattered), so the
result is the same sums as the whole collective. Inductor keeps the order: the compiled step
raises collectives and sinks waits (picofx.runtime.compile.COMM_OVERLAP).
"""
from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def overlap_sequence_parallel(gm: fx.GraphModule, chunks: int = 2) -> dict:
    """Rewrite the graph's chunkable gathers and scatters; returns how many of each."""
    graph = gm.graph
    gathers = [n for n in graph.nodes if n.target is torch.ops.picofx.sp_gather.default and row_matmuls(n)]
    scatters = [n for n in graph.nodes if n.target is torch.ops.picofx.sp_scatter.default and matmul_terms(n)]
    done = {"gathers": 0, "scatters": 0}
    for node in gathers:
        done["gathers"] += chunked_gather(graph, node, chunks)
    for node in scatters:
        done["scatters"] += chunked_scatter(graph, node, chunks)
    gm.recompile()
    return done


def batch_chunks(node: fx.Node, chunks: int) -> list[tuple[int, int]] | None:
    """[start, end) batch rows of each chunk of a (batch, sequence, ...) collective, or None."""
    batch = node.args[0].meta["val"].shape[0]
    if node.args[1] != 1 or batch < 2:
        return None
    count = min(chunks, batch)
    edges = [batch * i // count for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def row_matmuls(gather: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(view, mm) pairs where the gathered tokens, flattened, are the left side of a matmul."""
    pairs, shape = [], gather.meta["val"].shape
    flat = [shape[0] * shape[1], piece_features(gather)]
    for view in gather.users:
        if view.target in VIEWS and list(view.args[1]) == flat:
            pairs += [(view, mm) for mm in view.users if mm.target is aten.mm.default and mm.args[0] is view]
    return pairs


def matmul_terms(scatter: fx.Node) -> list[fx.Node] | None:
    """The matmuls whose (viewed) outputs sum to what is scattered, when that is all it is."""
    terms, frontier = [], [scatter.args[0]]
    while frontier:
        node = frontier.pop()
        if len(node.users) != 1:
            return None
        if node.target is aten.add.Tensor and all(isinstance(a, fx.Node) for a in node.args):
            frontier += list(node.args)
        elif (node.target in VIEWS and node.args[0].target is aten.mm.default and len(node.args[0].users) == 1
              and node.meta["val"].shape == scatter.args[0].meta["val"].shape):
            terms.append(node)
        else:
            return None
    return terms


def chunked_gather(graph: fx.Graph, gather: fx.Node, chunks: int) -> int:
    x, _, ranks, group = gather.args
    spans = batch_chunks(gather, chunks)
    if spans is None:
        return 0
    pairs = row_matmuls(gather)
    tokens, ndim = gather.meta["val"].shape[1], gather.meta["val"].dim()
    order = {n: i for i, n in enumerate(graph.nodes)}
    for _, mm in pairs:  # the matmuls' weights, read at the gather now
        for weight in mm.args[1:]:
            hoist(weight, gather, order)
    with graph.inserting_before(gather):
        issued = [call(graph, c10d.all_gather_into_tensor.default, swap_first_two(graph, rows(graph, x, a, b), ndim),
                       ranks, group) for a, b in spans]
        outputs, pieces = {mm: [] for _, mm in pairs}, []
        for (a, b), sent in zip(spans, issued):  # each chunk's wait just before its matmuls
            piece = swap_first_two(graph, call(graph, c10d.wait_tensor.default, sent), ndim)
            pieces.append(piece)
            flat = call(graph, aten.view.default, piece, [(b - a) * tokens, piece_features(gather)])
            for _, mm in pairs:
                outputs[mm].append(call(graph, aten.mm.default, flat, *mm.args[1:]))
        whole = call(graph, aten.cat.default, pieces, 0)
    for mm, parts in outputs.items():
        with graph.inserting_before(mm):
            mm.replace_all_uses_with(call(graph, aten.cat.default, parts, 0))
    gather.replace_all_uses_with(whole)
    erase_unused([mm for _, mm in pairs] + [view for view, _ in pairs] + [gather])
    return 1


def chunked_scatter(graph: fx.Graph, scatter: fx.Node, chunks: int) -> int:
    y, _, ranks, group = scatter.args
    spans = batch_chunks(scatter, chunks)
    if spans is None:
        return 0
    terms = matmul_terms(scatter)
    shape = list(y.meta["val"].shape)
    waits = []
    with graph.inserting_before(scatter):
        for a, b in spans:
            total = None
            for view in terms:
                mm = view.args[0]
                left = mm.args[0]
                start, end = a * shape[1], b * shape[1]  # the mm's rows are (batch, sequence) flattened
                part = call(graph, aten.mm.default, call(graph, aten.slice.Tensor, left, 0, start, end), *mm.args[1:])
                part = call(graph, aten.view.default, part, [b - a, *shape[1:]])
                total = part if total is None else call(graph, aten.add.Tensor, total, part)
            rows_first = swap_first_two(graph, total, len(shape))
            waits.append(call(graph, c10d.reduce_scatter_tensor.default, rows_first, "sum", ranks, group))
        parts = [swap_first_two(graph, call(graph, c10d.wait_tensor.default, s), len(shape)) for s in waits]
        scatter.replace_all_uses_with(call(graph, aten.cat.default, parts, 0))
    replaced, frontier = [scatter], [scatter.args[0]]  # the whole sum and its matmuls, now unread
    while frontier:
        node = frontier.pop(0)
        replaced.append(node)
        frontier += list(node.args) if node.target is aten.add.Tensor else []
    replaced += [view.args[0] for view in terms]
    erase_unused(replaced)
    return 1


def call(graph: fx.Graph, target, *args) -> fx.Node:
    return graph.call_function(target, args)


def hoist(node, point: fx.Node, order: dict) -> None:
    """Move `node`, and what it reads from after `point`, to just before `point`."""
    if isinstance(node, fx.Node) and order[node] > order[point]:
        for source in node.all_input_nodes:
            hoist(source, point, order)
        point.prepend(node)
        order[node] = order[point] - 0.5


def erase_unused(nodes: list[fx.Node]) -> None:
    """Erase those of `nodes` nothing reads any more, readers before what they read."""
    for node in nodes:
        if not node.users:
            node.graph.erase_node(node)


def rows(graph: fx.Graph, x: fx.Node, start: int, end: int) -> fx.Node:
    return call(graph, aten.slice.Tensor, x, 0, start, end)


def swap_first_two(graph: fx.Graph, x: fx.Node, ndim: int) -> fx.Node:
    """x contiguous with its first two dimensions swapped, (batch, sequence) <-> (sequence, batch):
    collectives work on dim 0. A permute: under Inductor the graph is decomposed."""
    swapped = call(graph, aten.permute.default, x, [1, 0, *range(2, ndim)])
    return graph.call_function(aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format})


def piece_features(gather: fx.Node) -> int:
    shape = gather.meta["val"].shape
    return int(torch.Size(shape[2:]).numel())
