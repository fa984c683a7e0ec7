"""Live memory over a graph's execution order, with views and aliases resolved to storages.

A graph runs its nodes in order; a node allocates the storages of its outputs that are not
views of its inputs, and a storage is freed after the last node that reads it or any view of
it, unless a graph output refers to it. Aliasing comes from the nodes' fake values
(`meta["val"]`): a view's fake tensor shares its base's fake storage, so an output whose
storage is one of its inputs' storages allocates nothing. Graphs cut from one joint graph
(forward, backward) share fake values, so storage keys match across them; a node the
backward recomputes is still a fresh allocation, because it matches none of its own inputs.

The peak at a node is what is live while it runs: everything live before it plus its new
outputs (its inputs are still held), plus the kernel's scratch memory where the caller gives
it (`picofx.workspace` measures it for fused custom ops).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef


def storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage())


def tensor_values(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


@dataclass
class Schedule:
    """What one graph runs: values present at its start, nodes run in order, values returned."""

    inputs: list[fx.Node]
    steps: list[fx.Node]
    outputs: list  # nodes, or None where a graph returns None (a gradient that does not exist)


def schedule_of(gm: fx.GraphModule) -> Schedule:
    nodes = list(gm.graph.nodes)
    return Schedule([n for n in nodes if n.op == "placeholder"],
                    [n for n in nodes if n.op not in ("placeholder", "output")],
                    [a if isinstance(a, fx.Node) else None for a in pytree.tree_leaves(gm.graph.output_node().args)])


@dataclass
class Timeline:
    """Bytes live at each node of one graph, not counting storages that outlive the step
    anyway (parameters, buffers, inputs: the `resident` keys)."""

    nodes: list[fx.Node]
    live: list[int]  # bytes live while nodes[i] runs
    input_bytes: int  # counted (non-resident) input storages live at the start
    output_bytes: int  # counted storages the graph returns, live after it ends
    allocated_by: dict[str, int] = field(default_factory=dict)  # node name -> bytes it allocates

    @property
    def peak(self) -> int:
        return max(self.live, default=self.input_bytes)

    @property
    def peak_node(self) -> fx.Node | None:
        return self.nodes[self.live.index(self.peak)] if self.live else None


def timeline(graph: fx.GraphModule | Schedule, resident: set, frees_inputs: bool = True, held=(),
             workspace=None) -> Timeline:
    """Simulate a graph's execution. `resident`: storage keys that are never counted (parameters,
    buffers, the step's inputs). `frees_inputs`: the graph drops its inputs after their last
    use (boxed calling convention); otherwise they stay live until the graph returns. `held`:
    values the caller keeps alive throughout (the forward's outputs during the backward).
    `workspace(node)`: scratch bytes the node's kernel holds while it runs, beyond its outputs."""
    s = graph if isinstance(graph, Schedule) else schedule_of(graph)
    s = Schedule([*s.inputs, *held], s.steps, s.outputs)
    owner: dict[fx.Node, list[int]] = {}  # node -> ids of the storages its tensors live in
    size, counted, keys = [], [], []

    def new_storage(key, nbytes: int, is_counted: bool) -> int:
        keys.append(key)
        size.append(nbytes)
        counted.append(is_counted)
        return len(size) - 1

    by_key: dict = {}
    for node in s.inputs:
        ids = []
        for t in tensor_values(node.meta.get("val")):
            key = storage_key(t)
            if key not in by_key:
                by_key[key] = new_storage(key, t.untyped_storage().nbytes(), key not in resident)
            ids.append(by_key[key])
        owner[node] = ids
    input_ids = set(range(len(size)))
    allocates: list[list[int]] = []
    for node in s.steps:
        inputs = {keys[i]: i for arg in node.all_input_nodes for i in owner.get(arg, ())}
        ids, new = [], []
        for t in tensor_values(node.meta.get("val")):
            key = storage_key(t)
            if key in inputs:
                ids.append(inputs[key])
            else:
                inputs[key] = new_storage(key, t.untyped_storage().nbytes(), node.op != "get_attr")
                ids.append(inputs[key])
                new.append(inputs[key])
        owner[node] = ids
        allocates.append(new)

    last_use = [-1] * len(size)
    for k, node in enumerate(s.steps):
        for i in owner[node]:
            last_use[i] = k
        for arg in node.all_input_nodes:
            for i in owner.get(arg, ()):
                last_use[i] = k
    returned = {i for n in s.outputs if n is not None for i in owner.get(n, ())}
    kept = returned | {i for n in held for i in owner[n]} | (input_ids if not frees_inputs else set())
    frees_at: dict[int, list[int]] = {}
    for i, k in enumerate(last_use):
        if i not in kept:
            frees_at.setdefault(k, []).append(i)  # k == -1: an input nothing reads, freed at once

    live_now = sum(size[i] for i in input_ids if counted[i])
    input_bytes = live_now
    live_now -= sum(size[i] for i in frees_at.get(-1, ()) if counted[i])
    live, allocated_by = [], {}
    for k, node in enumerate(s.steps):
        allocated = sum(size[i] for i in allocates[k] if counted[i])
        allocated_by[node.name] = allocated
        live_now += allocated
        live.append(live_now + (workspace(node) if workspace else 0))
        live_now -= sum(size[i] for i in frees_at.get(k, ()) if counted[i])
    output_bytes = sum(size[i] for i in returned if counted[i])
    return Timeline(s.steps, live, input_bytes, output_bytes, allocated_by)
