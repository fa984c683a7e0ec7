"""The shard pass's backward rewrites of its gradient exchange: the dtype each bucket is reduced in,
HSDP's all-reduce across replicas, the average, and what the report says of each reduction.

Each bucket's gradient arrives as autograd wrote it, `wait_tensor(reduce_scatter(flat, "sum", N))`.
With replicas (HSDP: shard within dp_shard, replicate across dp_replicate, as FSDP2 on a 2-D mesh),
the reduce-scattered shard is then summed over the replicas, each holding the same shard of another
batch: `wait_tensor(all_reduce(shard, "sum", replicas))`; the average divides by both group sizes
(gloo has no "avg").
"""
from __future__ import annotations

import torch
from torch import fx

from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import is_view
from picofx.manager import PassResult
from picofx.parallel.mesh import MeshDim

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
CAST = aten._to_copy.default
CASTS = (CAST, torch.ops.prims.convert_element_type.default)  # a dtype cast, before and after decomposition
SCATTER = (c10d.reduce_scatter_tensor.default, torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default)
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def gradient_scatters(gm: fx.GraphModule, group: str | None) -> list[fx.Node]:
    """The shard pass's gradient reduce-scatters: those over its group (None: every one). Other
    passes' reduce-scatters (context parallel's of the gathered keys' gradients, sequence
    parallelism's) are left alone."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SCATTER
            and (group is None or n.args[3] == group)]


def reduce_in(gm: fx.GraphModule, dtype: torch.dtype, group: str | None = None) -> PassResult:
    """Reduce-scatter each gradient in `dtype` instead of the dtype it was
    gathered in: the reduce-scatter reads the gradient before its cast down to the wire dtype (or a
    cast of it to `dtype`), and what waits for it is cast back to the dtype its readers expect."""
    recast = 0
    for node in gradient_scatters(gm, group):
        grad = node.args[0]
        before = grad.meta["val"].dtype
        source = grad.args[0] if grad.target in CASTS else None
        want = dtype
        if want == before:
            continue
        mode = fake_mode_of(gm)
        if source is not None and source.meta["val"].dtype == want:
            node.replace_input_with(grad, source)
        else:
            with gm.graph.inserting_before(node):
                up = gm.graph.call_function(CAST, (grad,), {"dtype": want})
            with mode:
                up.meta["val"] = grad.meta["val"].to(want)
            node.replace_input_with(grad, up)
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        for n in [node, *waits]:
            with mode:
                n.meta["val"] = n.meta["val"].to(want)
        for wait in waits:  # a cast reading it casts the reduced gradient itself (to the parameter's dtype)
            readers = [u for u in wait.users if u.target not in CASTS]
            if not readers:
                continue
            with gm.graph.inserting_after(wait):
                back = gm.graph.call_function(CAST, (wait,), {"dtype": before})
            for reader in readers:
                reader.replace_input_with(wait, back)
            with mode:
                back.meta["val"] = wait.meta["val"].to(before)
        recast += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(recast > 0, {"recast_reductions": recast})


def all_reduce_across(gm: fx.GraphModule, replicas: MeshDim, group: str | None = None) -> PassResult:
    """After each gradient reduce-scatter's wait, sum the shard over the replicas: the all-reduce is
    issued where the shard arrives, its wait read by what read the scatter's."""
    graph, mode = gm.graph, fake_mode_of(gm)
    summed = 0
    for scatter in gradient_scatters(gm, group):
        for wait in [u for u in scatter.users if u.target is c10d.wait_tensor.default]:
            readers = list(wait.users)
            with graph.inserting_after(wait):
                issued = graph.call_function(c10d.all_reduce.default, (wait, "sum", replicas.group_name))
            with graph.inserting_after(issued):
                done = graph.call_function(c10d.wait_tensor.default, (issued,))
            with mode:
                issued.meta["val"] = torch.empty_like(wait.meta["val"])
            done.meta["val"] = issued.meta["val"]
            for reader in readers:
                reader.replace_input_with(wait, done)
            summed += 1
    gm.recompile()
    return PassResult(summed > 0, {"replica_all_reduces": summed, "replicas": replicas.size})


def exchanged(node: fx.Node, replicas: int) -> tuple[fx.Node | None, int]:
    """The reduce-scatter a gradient output comes from (through views, casts and an all-reduce across
    `replicas`) and how many ranks' gradients it sums (None, 0: it comes from none)."""
    ranks = 1
    while True:
        while node.op == "call_function" and (is_view(node) or node.target in CASTS):
            node = node.args[0]  # through views and mixed precision's cast back to the parameter's dtype
        if node.target is not c10d.wait_tensor.default:
            return None, 0
        issued = node.args[0]
        if issued.target in SCATTER:
            return issued, ranks * issued.args[2]
        if issued.target is not c10d.all_reduce.default:
            return None, 0
        ranks *= replicas
        node = issued.args[0]


def average_gradients(gm: fx.GraphModule, replicas: int = 1, summed: int = 1) -> PassResult:
    """Divide each exchanged gradient output by the ranks it sums (`replicas` x the shard group's
    size where it is also summed across replicas): DDP's average. `summed` of the shard group's
    ranks hold parts of the same sequences (context parallel's), whose gradients add up: the
    average is over the others."""
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    averaged = 0
    for pos, node in enumerate(outputs):
        if not isinstance(node, fx.Node):
            continue
        scatter, ranks = exchanged(node, replicas)
        if scatter is None:
            continue
        with graph.inserting_before(output):
            outputs[pos] = graph.call_function(aten.div.Tensor, (node, ranks // summed))
        averaged += 1
    output.args = (outputs,)
    return PassResult(averaged > 0, {"averaged_gradients": averaged})


def describe_reductions(gm: fx.GraphModule, group: str | None = None) -> list[dict]:
    """Each gradient reduce-scatter of the backward: bytes it reduces over all ranks (its input),
    their dtype, the node it is issued after, the node its wait follows, and how many matmuls run
    while it is in flight."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    out = []
    for node in gradient_scatters(gm, group):
        grad = node.args[0].meta["val"]
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        waited = min(order[w] for w in waits) if waits else len(nodes) - 1
        out.append({"reduced_bytes": grad.numel() * grad.element_size(), "dtype": str(grad.dtype),
                    "issued_after": node.prev.name, "waited_after": nodes[waited - 1].name,
                    "matmuls_in_flight": sum(n.target in MATMULS for n in nodes[order[node]:waited])})
    return out
