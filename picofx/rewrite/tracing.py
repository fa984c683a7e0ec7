"""Trace plain functions to ATen graphs exactly as `picofx.capture.export` traces models, many at once.

Rules' patterns and replacements are traced with torch.export and the same decompositions as
capture, so a pattern has the very nodes capture produces from the same code. An export has a
fixed cost far above a small function's own, so `trace_all` traces many functions in one export
and cuts the graph into one graph per function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from picofx.capture.export import aten_decompositions, quiet_export


@dataclass
class Traced:
    graph: fx.Graph
    inputs: dict[fx.Node, str]  # placeholder -> input name
    out_spec: pytree.TreeSpec

    def outputs(self) -> list:
        """The traced function's outputs as nodes (None where it returned None), flattened."""
        flat = list(self.graph.output_node().args[0])
        return pytree.tree_leaves(pytree.tree_unflatten(flat, self.out_spec), is_leaf=lambda x: x is None)


class _Calls(nn.Module):
    """Calls each function on its slice of the tensors; returns every call's flattened outputs."""

    def __init__(self, calls: Sequence[tuple[Callable, Mapping[str, Any]]], out_specs: list):
        super().__init__()
        self.calls = [(fn, [k for k, v in kw.items() if isinstance(v, torch.Tensor)],
                       {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)}) for fn, kw in calls]
        self.out_specs = out_specs  # filled by forward: (spec, number of outputs) per call

    def forward(self, *tensors):
        outputs, start = [], 0
        self.out_specs.clear()
        for fn, names, constants in self.calls:
            mine = tensors[start:start + len(names)]
            start += len(names)
            flat, spec = pytree.tree_flatten(fn(**dict(zip(names, mine)), **constants))
            outputs += flat
            self.out_specs.append((spec, len(flat)))
        return tuple(outputs)


def trace_all(calls: Sequence[tuple[Callable, Mapping[str, Any]]]) -> list[Traced | Exception]:
    """Each `fn(**kwargs)` as an ATen graph: tensors (real, or fake of one fake mode) become
    placeholders named after their keyword, everything else is a constant of the trace. All in
    one export when they all trace; a call that does not trace gives its exception in its place."""
    out_specs: list = []
    module = _Calls(calls, out_specs)
    tensors = [kw[name] for (_, kw), (_, names, _) in zip(calls, module.calls) for name in names]
    try:
        with quiet_export():
            ep = torch.export.export(module, tuple(tensors), strict=False).run_decompositions(aten_decompositions())
    except Exception as error:  # find out which: trace them one by one
        return [error] if len(calls) == 1 else [trace_all([call])[0] for call in calls]
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    placeholders = iter([n for n in graph.nodes if n.op == "placeholder"])
    outputs = iter(graph.output_node().args[0])
    traced = []
    for (_, names, _), (spec, count) in zip(module.calls, out_specs):
        traced.append(_extract(graph, [next(placeholders) for _ in names], names,
                               [next(outputs) for _ in range(count)], spec))
    return traced


def _extract(graph: fx.Graph, placeholders: list[fx.Node], names: list[str], outputs: list,
             spec: pytree.TreeSpec) -> Traced:
    """The part of `graph` that computes `outputs` from `placeholders`, as a graph of its own."""
    needed, stack = set(), [o for o in outputs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    if any(n.op == "placeholder" and n not in placeholders for n in needed):
        raise AssertionError("trace_all: a traced function read another function's inputs")
    sub = fx.Graph()
    env, inputs = {}, {}
    for node, name in zip(placeholders, names):
        env[node] = sub.placeholder(name)
        env[node].meta = dict(node.meta)
        inputs[env[node]] = name
    for node in graph.nodes:
        if node in needed and node.op == "call_function":
            env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return Traced(sub, inputs, spec)


def call_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def normalized_args(node: fx.Node) -> list:
    """The node's arguments in schema order, defaults filled in (positional args for non-ATen calls)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return [*node.args, *node.kwargs.values()]
    values = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in node.kwargs:
            values.append(node.kwargs[arg.name])
        elif not arg.kwarg_only and i < len(node.args):
            values.append(node.args[i])
        else:
            values.append(arg.default_value if arg.has_default_value() else None)
    return values


def argument_names(node: fx.Node) -> list[str]:
    if not isinstance(node.target, torch._ops.OpOverload):
        return [f"arg{i}" for i in range(len(node.args) + len(node.kwargs))]
    return [arg.name for arg in node.target._schema.arguments]


def set_normalized_args(node: fx.Node, values: list) -> None:
    if not isinstance(node.target, torch._ops.OpOverload):
        node.args, node.kwargs = tuple(values), {}
        return
    args, kwargs = [], {}
    for arg, value in zip(node.target._schema.arguments, values):
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    node.args, node.kwargs = tuple(args), kwargs
