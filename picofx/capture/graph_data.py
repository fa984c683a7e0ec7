"""An FX graph's nodes as plain, picklable data and back: the on-disk caches store graphs this way.

A call target is stored by name (an ATen overload by its schema name, a Python function by module
and qualified name), never pickled, so a stored graph loads in any process with the same sources.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch
from torch import fx


@dataclasses.dataclass(frozen=True)
class NodeRef:
    name: str  # a node of the same graph


def target_ref(target):
    """`target` by name; a TypeError when it has none that resolves back to it (a lambda, a local)."""
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target._schema.name, target._overloadname)
    if not callable(target):
        return target  # placeholder, get_attr and output targets are strings
    ref = ("py", getattr(target, "__module__", None), getattr(target, "__qualname__", None))
    if None in ref or resolve_target(ref) is not target:
        raise TypeError(f"{target!r} cannot be named")
    return ref


def resolve_target(ref):
    if not isinstance(ref, tuple):
        return ref
    kind, first, second = ref
    if kind == "op":
        namespace, name = first.split("::")
        return getattr(getattr(getattr(torch.ops, namespace), name), second)
    value = importlib.import_module(first)
    for part in second.split("."):
        value = getattr(value, part)
    return value


def node_records(nodes, meta: Callable[[fx.Node], dict] = lambda node: {}) -> list[tuple]:
    """(op, name, target by name, (args, kwargs) with nodes as NodeRefs, meta(node)) per node."""
    return [(n.op, n.name, target_ref(n.target), fx.node.map_arg((n.args, n.kwargs), lambda a: NodeRef(a.name)),
             meta(n)) for n in nodes]


def add_nodes(graph: fx.Graph, records: list[tuple]) -> dict[str, fx.Node]:
    """The nodes of `records` appended to `graph`, with their meta; name -> node."""
    env = {}
    for op, name, target, (args, kwargs), meta in records:
        args, kwargs = fx.node.map_aggregate((args, kwargs), lambda a: env[a.name] if isinstance(a, NodeRef) else a)
        env[name] = graph.create_node(op, resolve_target(target), args, kwargs, name=name)
        env[name].meta.update(meta)
    return env
