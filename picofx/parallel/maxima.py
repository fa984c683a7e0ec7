"""The tp group's max all-reduces scheduled: float8's amaxes of split operands (lower.py's step).

A float8 cast scales its operand by the amax of the whole tensor; where the operand is split over
the tp ranks, that amax is an all-reduce (max) of each rank's, written where the cast is
(picofx.passes.precision.float8_linear), so that as traced it is issued and waited at once.
After lowering, two moves:

- The maxima known from the graph's inputs alone (the weights' amaxes; in the backward also those
  of saved activations) are computed at the start of the graph and reduced in one all-reduce of
  their concatenation, as Shard reduces its float8 weights' scales. They are upcast to one dtype
  for it: a maximum is exact in any wider dtype, and so is the cast back.

      amaxes = cat([amax_1.view(-1), ..., amax_n.view(-1)])     # (W,) at the start
      reduced = wait_tensor(all_reduce(amaxes, "max", group))    # sunk to the first scale's cast
      amax_i = reduced[o_i:o_i + w_i].view(shape_i)

- Every other max all-reduce (an activation's or a gradient's amax) is issued as soon as its amax
  can be computed: raised, with the views and reductions only it reads, to just after its input.

lower.py then sinks each wait, with what is computed from its result alone (the scale), to the
node that reads it with something else (the cast), so the casts and matmuls in between run while
the maximum travels.
"""
from __future__ import annotations

import functools

import torch
from torch import fx
from torch._guards import detect_fake_mode

from picofx.capture.vocabulary import COPY_PACKETS, VIEW_OPS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# What computes an amax from a tensor: its views, casts and copies, abs, the reduction.
AMAX_STEPS = VIEW_OPS | {aten.abs.default, aten.amax.default, aten._to_copy.default}
INPUTS = ("placeholder", "get_attr")


def max_reductions(graph: fx.Graph, group: str) -> list[fx.Node]:
    return [n for n in graph.nodes if n.target is c10d.all_reduce.default and n.args[1] == "max"
            and n.args[2] == group]


def amax_steps(issue: fx.Node) -> list[fx.Node] | None:
    """The nodes computing `issue`'s input from graph inputs, when all are AMAX_STEPS and only views
    among them are read by other nodes (else None)."""
    found, frontier = set(), [issue.args[0]]
    while frontier:
        node = frontier.pop()
        if node.op in INPUTS or node in found:
            continue
        if node.op != "call_function" or not (node.target in AMAX_STEPS or
                                              getattr(node.target, "overloadpacket", None) in COPY_PACKETS):
            return None
        found.add(node)
        frontier += node.all_input_nodes
    # a copy or cast another node reads too (a float8 cast's) would be held from the start to that node
    shared = [n for n in found if n.target not in VIEW_OPS and any(u not in found and u is not issue for u in n.users)]
    return None if shared else list(found)


def first_computation(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op not in INPUTS)


def batch_input_maxima(graph: fx.Graph, group: str) -> int:
    """Reduce the maxima computed from graph inputs alone in one all-reduce at the start; returns how many."""
    early = [(issue, steps) for issue in max_reductions(graph, group)
             if (steps := amax_steps(issue)) is not None and "val" in issue.args[0].meta]
    if not early:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = first_computation(graph)
    for node in sorted({s for _, steps in early for s in steps}, key=order.__getitem__):
        if node is not start:
            start.prepend(node)
    amaxes = [issue.args[0] for issue, _ in early]
    vals = [a.meta["val"] for a in amaxes]
    dtype = functools.reduce(torch.promote_types, [v.dtype for v in vals])
    with graph.inserting_before(start):
        flat = [graph.call_function(aten.view.default, (a, [-1])) for a in amaxes]
        flat = [f if v.dtype == dtype else graph.call_function(aten._to_copy.default, (f,), {"dtype": dtype})
                for f, v in zip(flat, vals)]
        stacked = flat[0] if len(flat) == 1 else graph.call_function(aten.cat.default, (flat,))
        reduced = graph.call_function(c10d.wait_tensor.default, (
            graph.call_function(c10d.all_reduce.default, (stacked, "max", group)),))
        offset = 0
        for (issue, _), val in zip(early, vals):
            piece = graph.call_function(aten.slice.Tensor, (reduced, 0, offset, offset + val.numel()))
            offset += val.numel()
            piece = graph.call_function(aten.view.default, (piece, list(val.shape)))
            if val.dtype != dtype:
                piece = graph.call_function(aten._to_copy.default, (piece,), {"dtype": val.dtype})
            for wait in [u for u in issue.users if u.target is c10d.wait_tensor.default]:
                wait.replace_all_uses_with(piece)
                graph.erase_node(wait)
            graph.erase_node(issue)
    set_values(graph, start, vals[0])
    return len(early)


def set_values(graph: fx.Graph, until: fx.Node, example) -> None:
    """Fake values for the nodes just added before `until` (their inputs have values)."""
    mode = detect_fake_mode([example])
    if mode is None:
        return
    node = until.prev
    while node.op not in INPUTS and "val" not in node.meta:
        node = node.prev
    node = node.next
    with mode:
        while node is not until:
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
            node.meta["val"] = (args[0].clone() if node.target in (c10d.all_reduce.default, c10d.wait_tensor.default)
                                else node.target(*args, **kwargs))
            node = node.next


def raise_maxima(graph: fx.Graph, group: str) -> int:
    """Move each max all-reduce, with the views and amax steps only it reads, to just after its inputs."""
    raised = 0
    for issue in max_reductions(graph, group):
        steps, frontier = [], [issue.args[0]]
        while frontier:  # the nodes computing the amax that nothing else reads, and any view
            node = frontier.pop()
            if node.op == "call_function" and node not in steps and node.target in AMAX_STEPS and (
                    node.target in VIEW_OPS or all(u is issue or u in steps for u in node.users)):
                steps.append(node)
                frontier += node.all_input_nodes
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted(steps, key=order.__getitem__) + [issue]:
            if place_after_inputs(graph, node):
                raised += node is issue
    return raised


def place_after_inputs(graph: fx.Graph, node: fx.Node) -> bool:
    """Move `node` to just after the last of its inputs (after the graph's inputs); whether it moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [n for n in node.all_input_nodes if n.op not in INPUTS]
    last = max(inputs, key=order.__getitem__) if inputs else first_computation(graph).prev
    if last.next is node or order[last] > order[node]:
        return False
    last.append(node)
    return True


# Views that only lay a tensor's elements out anew: the maximum over all of them is the same.
RELAYOUTS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
                       aten.transpose.int, aten.permute.default, aten.alias.default})


def whole_amax_of(issue: fx.Node) -> tuple | None:
    """(tensor, dtype) when `issue` reduces the amax over every element of that tensor, seen
    through re-layouts and casts (a gradient and its transpose give the same key), else None."""
    amax = issue.args[0]
    if amax.target is not aten.amax.default or (len(amax.args) > 1 and list(amax.args[1])) or amax.kwargs:
        return None
    node = amax.args[0]
    if node.target is not aten.abs.default:
        return None
    node = node.args[0]
    while node.op == "call_function" and (node.target in RELAYOUTS or widens(node)):
        node = node.args[0]
    return node, amax.meta["val"].dtype if "val" in amax.meta else None


def widens(node: fx.Node) -> bool:
    """A cast to a dtype that holds every value of its input's (the maximum is the same)."""
    if node.target is not aten._to_copy.default or set(node.kwargs) - {"dtype"}:
        return False
    if "val" not in node.meta or "val" not in node.args[0].meta:
        return False
    before, after = node.args[0].meta["val"].dtype, node.meta["val"].dtype
    return before.is_floating_point and torch.promote_types(before, after) == after


def merge_equal_maxima(graph: fx.Graph, group: str) -> int:
    """One all-reduce where several reduce the amax of the same tensor (a float8 gradient's, for
    the input and the weight gradient); returns how many were dropped."""
    first, dropped = {}, 0
    for issue in max_reductions(graph, group):
        key = whole_amax_of(issue)
        if key is None or key[1] is None:
            continue
        if key not in first:
            first[key] = issue
            continue
        kept = [u for u in first[key].users if u.target is c10d.wait_tensor.default]
        waits = [u for u in issue.users if u.target is c10d.wait_tensor.default]
        if len(kept) != 1 or len(waits) != len(issue.users):
            continue
        for wait in waits:
            wait.replace_all_uses_with(kept[0])
            graph.erase_node(wait)
        dead = [issue]
        while dead:
            node = dead.pop()
            if node.op == "call_function" and not node.users:
                dead += node.all_input_nodes
                graph.erase_node(node)
        dropped += 1
    return dropped
