"""tensor_parallel's partitioned stage: Megatron's operators become torch's functional collectives.

At capture, `picofx.parallel.collectives`' operators (tp_reduce, tp_copy, tp_max, sp_gather,
sp_scatter) are whole nodes: their autograd formulas are what puts a collective in the backward.
Once the step is split into its forward and backward graphs, each is rewritten into the
collective it runs, with the issue and the wait as separate nodes a scheduler can move:

    tp_reduce(x)          w = wait_tensor(all_reduce(x, "sum", group))
    tp_max(x)             w = wait_tensor(all_reduce(x, "max", group))
    tp_copy(x)            x                   (its backward, a tp_reduce, is the backward graph's)
    sp_gather(x, d, n)    w = wait_tensor(all_gather_into_tensor(x, d first, n, group)), d back in place
    sp_scatter(x, d, n)   w = wait_tensor(reduce_scatter_tensor(x, d first, "sum", n, group)), d back

Then, as Megatron schedules them: in the backward, a collective of the input gradient of linears
(a column-parallel block's all-reduce, or sequence parallelism's reduce-scatter) is issued as
soon as the input-gradient matmuls made it, and those linears' weight-gradient matmuls, which
nothing before the collective needs, run after the issue (float8's `_scaled_mm` too); every wait,
with what is computed from its result alone (a float8 scale, gathered rows laid out), sits just
before the first node that reads it with something else, so the weight-gradient matmuls (and
whatever else comes before that reader) run while the collective travels. Float8's amax
all-reduces are batched and raised first (picofx.parallel.maxima). Inductor keeps that order (the
compiled step reorders only to sink waits and raise collectives without raising the peak:
picofx.runtime.compile).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import fx

import picofx.parallel.collectives  # noqa: F401  (registers the picofx operators)
from picofx.capture.vocabulary import COPY_PACKETS, MODULE_PATH_META, VIEW_OPS, viewed_source
from picofx.parallel.maxima import batch_input_maxima, merge_equal_maxima, raise_maxima

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
picofx_ops = torch.ops.picofx
ISSUES = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
MATMULS = (aten.mm.default, aten.addmm.default, aten._scaled_mm.default)
# A float8 operand's cast (picofx.passes.precision.float8_linear.to_float8): scaled, saturated, converted.
FLOAT8_CAST_STEPS = frozenset({aten.mul.Tensor, aten.clamp.default, aten._to_copy.default})
INHERITED_META = ("nn_module_stack", "fwd_nn_module_stack", MODULE_PATH_META, "stack_trace")


def lower_collectives(gm: fx.GraphModule, group: str, backward: bool) -> dict:
    """Rewrite the graph's picofx collectives (`backward`: and overlap the weight gradients);
    returns how many of each were lowered and how many of the tp group's collectives (`group`, by
    name) have a matmul before their wait."""
    graph = gm.graph
    lowered = Counter()
    for node in list(graph.nodes):
        rewrite = LOWERINGS.get(node.target)
        if rewrite is None:
            continue
        before = node.prev
        with graph.inserting_before(node):
            node.replace_all_uses_with(rewrite(graph, *node.args))
        added = before.next
        while added is not node:  # the collective's nodes come from the operator's module
            added.meta.update({k: node.meta[k] for k in INHERITED_META if k in node.meta})
            added = added.next
        graph.erase_node(node)
        lowered[node.target.__name__.split(".")[0]] += 1
    batched = batch_input_maxima(graph, group)  # float8's amaxes (picofx.parallel.maxima)
    merged = merge_equal_maxima(graph, group)
    raised = raise_maxima(graph, group)
    issues = [n for n in graph.nodes if n.target in ISSUES and n.args[-1] == group]  # async_overlap's too
    moved = sum(overlap_weight_gradients(graph, issue) for issue in issues) if backward else 0
    for issue in issues:
        sink_waits(issue)
    gm.recompile()
    return {"lowered": dict(lowered), "weight_gradients_moved": moved,
            "overlapped": sum(1 for issue in issues if matmul_before_wait(issue)),
            "maxima_batched": batched, "maxima_merged": merged, "maxima_raised": raised}


def call(graph: fx.Graph, target, *args) -> fx.Node:
    return graph.call_function(target, args)


def all_reduce(op: str):
    """tp_reduce's or tp_max's lowering."""
    def lower(graph: fx.Graph, x: fx.Node, group: str) -> fx.Node:
        return call(graph, c10d.wait_tensor.default, call(graph, c10d.all_reduce.default, x, op, group))
    return lower


def moved_dim(graph: fx.Graph, x: fx.Node, order: list[int]) -> fx.Node:
    """x permuted by `order`, contiguous (collectives work on dim 0, and views follow); a permute,
    since Inductor's graphs are decomposed already."""
    swapped = call(graph, aten.permute.default, x, order)
    return graph.call_function(aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format})


def sequence_collective(issue_target, *extra):
    """sp_gather's or sp_scatter's lowering: its dimension first, the collective, back in place."""
    def lower(graph: fx.Graph, x: fx.Node, dim: int, ranks: int, group: str) -> fx.Node:
        ndim = x.meta["val"].dim()
        first = [dim, *(d for d in range(ndim) if d != dim)]
        sent = moved_dim(graph, x, first)
        done = call(graph, c10d.wait_tensor.default, call(graph, issue_target, sent, *extra, ranks, group))
        return moved_dim(graph, done, sorted(range(ndim), key=first.__getitem__))
    return lower


LOWERINGS = {
    picofx_ops.tp_reduce.default: all_reduce("sum"),
    picofx_ops.tp_max.default: all_reduce("max"),
    picofx_ops.tp_copy.default: lambda graph, x, group: x,
    picofx_ops.sp_gather.default: sequence_collective(c10d.all_gather_into_tensor.default),
    picofx_ops.sp_scatter.default: sequence_collective(c10d.reduce_scatter_tensor.default, "sum"),
}


def waits_of(issue: fx.Node) -> list[fx.Node]:
    return [u for u in issue.users if u.target is c10d.wait_tensor.default]


def sink_waits(issue: fx.Node) -> None:
    """Each wait of `issue`, with the nodes computed from its result alone (a float8 scale, the
    gathered rows' layout), moved down to just before the first node that reads them: a wait sits
    just before the node that needs the collective's result with something else."""
    for wait in waits_of(issue):
        derived, node = {wait}, wait.next
        while node.op != "output":
            if node.op == "call_function" and node.target not in ISSUES and node.all_input_nodes and \
                    all(a in derived for a in node.all_input_nodes):
                derived.add(node)
            node = node.next
        for node in reversed([n for n in issue.graph.nodes if n in derived]):
            order = {n: i for i, n in enumerate(issue.graph.nodes)}
            first = min(node.users, key=order.__getitem__, default=None)
            if first is not None and first is not node.next:
                first.prepend(node)


def input_gradient_matmuls(issue: fx.Node) -> list[fx.Node]:
    """The matmuls whose outputs, summed (and viewed, or laid out for the collective), are what
    `issue` sends: the input-gradient matmuls of the linears that read one input."""
    found, frontier, seen = [], [issue.args[0]], set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target in MATMULS:
            found.append(node)
        elif node.target in VIEW_OPS or node.target in (aten.add.Tensor, aten._to_copy.default) or is_copy(node):
            frontier += node.all_input_nodes
    return found


def is_copy(node: fx.Node) -> bool:
    return getattr(node.target, "overloadpacket", None) in COPY_PACKETS


def gradient_operand(mm: fx.Node) -> fx.Node:
    """The output gradient an input-gradient matmul reads, through views (and a float8 cast's steps)."""
    if mm.target is not aten._scaled_mm.default:
        return viewed_source(mm.args[-2])
    node = mm.args[0]
    while node.op == "call_function" and (node.target in FLOAT8_CAST_STEPS or node.target in VIEW_OPS or is_copy(node)):
        node = node.args[0]
    return node


def weight_gradient_matmuls(inputs: list[fx.Node]) -> list[fx.Node]:
    """The other matmuls that read (through views, and in float8 through the casts of their operand)
    the output gradient an input-gradient matmul reads: the same linears' weight-gradient matmuls."""
    out = []
    float8 = any(mm.target is aten._scaled_mm.default for mm in inputs)
    for grad in {gradient_operand(mm) for mm in inputs}:
        frontier = [grad]
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user.target in VIEW_OPS or float8 and (is_copy(user) or user.target in FLOAT8_CAST_STEPS
                                                          and user.args[0] is node):
                    frontier.append(user)
                elif user.target in MATMULS and user not in inputs and user not in out:
                    out.append(user)
    return out


def overlap_weight_gradients(graph: fx.Graph, issue: fx.Node) -> int:
    """Move the weight-gradient matmuls of the linears whose input gradient `issue` sends, and what
    reads them, from before the issue to just after it. Returns how many matmuls moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    weights = [mm for mm in weight_gradient_matmuls(input_gradient_matmuls(issue)) if order[mm] < order[issue]]
    if not weights:
        return 0
    later, frontier = set(), list(weights)
    while frontier:  # the weight gradients and what reads them before the issue
        node = frontier.pop()
        if node not in later and order[node] < order[issue] and node.op != "output":
            later.add(node)
            frontier += list(node.users)
    if later & ancestors(issue):
        return 0
    point = issue
    for node in sorted(later, key=order.__getitem__):
        point.append(node)
        point = node
    return len(weights)


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen, frontier = set(), list(node.all_input_nodes)
    while frontier:
        n = frontier.pop()
        if n not in seen:
            seen.add(n)
            frontier += n.all_input_nodes
    return seen


def matmul_before_wait(issue: fx.Node) -> bool:
    """A matmul runs between `issue` and its first wait."""
    node, waits = issue.next, set(waits_of(issue))
    while node.op != "output" and node not in waits:
        if node.target in MATMULS:
            return True
        node = node.next
    return False
