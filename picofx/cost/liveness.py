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
it (`picofx.cost.inductor.workspace` measures it for fused custom ops).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef


WAIT = torch.ops._c10d_functional.wait_tensor.default
HOLD_INPUT_UNTIL_WAIT = (torch.ops._c10d_functional.all_gather_into_tensor.default,
                         torch.ops._c10d_functional.reduce_scatter_tensor.default,
                         torch.ops._c10d_functional_autograd.all_gather_into_tensor.default,
                         torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default)


def storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage())


def tensor_values(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # most nodes: one tensor (a simulation asks for every node's, often)
        return [value]
    if value is None:
        return []
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def value_storages(node: fx.Node) -> list[tuple]:
    """(storage key, storage bytes, dtype) of each tensor of the node's value."""
    return [(storage_key(t), t.untyped_storage().nbytes(), t.dtype) for t in tensor_values(node.meta.get("val"))]


class NodeFacts:
    """What a simulation reads of each node (its value's storages, its input nodes), computed on
    the first ask and kept: a planner simulates the same graph's nodes over and over. Valid while
    the nodes and their values stay as they were; the planner that simulates owns one."""

    def __init__(self):
        self._storages: dict[fx.Node, list[tuple]] = {}
        self._inputs: dict[fx.Node, list[fx.Node]] = {}
        self._memos: dict = {}

    def storages(self, node: fx.Node) -> list[tuple]:
        found = self._storages.get(node)
        if found is None:
            found = self._storages[node] = value_storages(node)
        return found

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        found = self._inputs.get(node)
        if found is None:
            found = self._inputs[node] = node.all_input_nodes
        return found

    def per_node(self, fn):
        """`fn(node)` (a node's scratch bytes), each node's answer kept here."""
        memo = self._memos.setdefault(fn, {})

        def kept(node: fx.Node):
            if node not in memo:
                memo[node] = fn(node)
            return memo[node]

        return kept


class FreshFacts:
    """The same questions as `NodeFacts`, answered from the nodes every time (one-off simulations)."""

    @staticmethod
    def storages(node: fx.Node) -> list[tuple]:
        return value_storages(node)

    @staticmethod
    def inputs(node: fx.Node) -> list[fx.Node]:
        return node.all_input_nodes

    @staticmethod
    def per_node(fn):
        return fn


def storage_bytes(node: fx.Node) -> int:
    """Bytes of the storages the node's value lives in (a view counts its whole base)."""
    return sum(t.untyped_storage().nbytes() for t in tensor_values(node.meta.get("val")))


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


@dataclass
class Storages:
    """The storages one graph touches, indexed by id, and what the simulation knows of each."""

    size: list[int] = field(default_factory=list)
    dtype: list = field(default_factory=list)
    counted: list[bool] = field(default_factory=list)
    last_use: list[int] = field(default_factory=list)  # step after which it is freed (-1: at once)
    kept: set[int] = field(default_factory=set)  # never freed during the graph
    kernel_local: set[int] = field(default_factory=set)  # not counted: buffers a fused kernel drops
    inputs: set[int] = field(default_factory=set)
    input_of: dict = field(default_factory=dict)  # input storage id -> the input node it came with
    allocates: list[list[int]] = field(default_factory=list)  # per step, the storages it creates
    reads: list[set[int]] = field(default_factory=list)  # per step, the storages its kernel reads
    runs_at: list[int] = field(default_factory=list)  # per step, the step at which its kernel ends

    def add(self, size: int, dtype, counted: bool) -> int:
        self.size.append(size)
        self.dtype.append(dtype)
        self.counted.append(counted)
        return len(self.size) - 1


@dataclass(frozen=True)
class Fusion:
    """How a fusing compiler (Inductor) runs a schedule; see `picofx.cost.inductor.fused_buffers`."""

    in_registers: frozenset = frozenset()  # values never written to memory
    in_place: frozenset = frozenset()  # nodes whose kernel may write into a dying input
    kernel_end: dict = field(default_factory=dict)  # member of a fused kernel -> its last member
    reuse: object = None  # reuse(storages, steps, fusion): lets outputs take over buffers that died
    kernel_index: dict = field(default_factory=dict)  # step -> number of the kernel it runs in
    kernel_local: frozenset = frozenset()  # values a fused kernel writes and reads itself: no buffer
    read_elements: dict = field(default_factory=dict)  # (loop step, input) -> elements its index covers
    copies: dict = field(default_factory=dict)  # step -> readers that each get a copy of its value


def timeline(graph: fx.GraphModule | Schedule, resident: set, frees_inputs: bool = True, held=(),
             workspace=None, fusion: Fusion | None = None, facts=None) -> Timeline:
    """Simulate a graph's execution. `resident`: storage keys that are never counted (parameters,
    buffers, the step's inputs). `frees_inputs`: the graph drops its inputs after their last
    use (boxed calling convention); otherwise they stay live until the graph returns. `held`:
    values the caller keeps alive throughout (the forward's outputs during the backward).
    `workspace(node)`: scratch bytes the node's kernel holds while it runs, beyond its outputs.
    `fusion`: the graph runs as a fusing compiler's kernels (values in registers, fused kernels
    whose inputs live until they end, buffers reused). `facts`: a `NodeFacts` kept across
    simulations of one graph."""
    s = graph if isinstance(graph, Schedule) else schedule_of(graph)
    s = Schedule([*s.inputs, *held], s.steps, s.outputs)
    fusion = fusion or Fusion()
    facts = facts or FreshFacts()
    st, owner = _storages(s, resident, fusion.in_registers, fusion.kernel_local, facts)
    if fusion.in_registers or fusion.kernel_end:
        st.reads, st.runs_at = _kernel_reads(s.steps, fusion.in_registers, owner, st.allocates, fusion.kernel_end,
                                             facts)
    else:  # graph order: each step reads its inputs' storages as it runs
        st.reads = [{i for arg in facts.inputs(node) for i in owner.get(arg, ())} for node in s.steps]
        st.runs_at = list(range(len(s.steps)))
    copy_read_by = _add_copies(st, s.steps, owner, fusion.copies)
    st.last_use = [-1] * len(st.size)
    for k, node in enumerate(s.steps):
        for i in owner[node]:
            st.last_use[i] = max(st.last_use[i], k)
        for i in st.reads[k]:
            st.last_use[i] = max(st.last_use[i], st.runs_at[k])
    for i, k in copy_read_by.items():
        st.last_use[i] = st.runs_at[k]
    step_of = {node: k for k, node in enumerate(s.steps)}
    for k, node in enumerate(s.steps):  # c10d's work holds a gather's or reduce-scatter's input until its wait
        if node.target is WAIT and node.args[0] in step_of and node.args[0].target in HOLD_INPUT_UNTIL_WAIT:
            for i in st.reads[step_of[node.args[0]]]:
                st.last_use[i] = max(st.last_use[i], st.runs_at[k])
    returned = {i for n in s.outputs if n is not None for i in owner.get(n, ())}
    st.kept = returned | {i for n in held for i in owner[n]} | (st.inputs if not frees_inputs else set())
    input_bytes = sum(st.size[i] for i in st.inputs if st.counted[i])
    output_bytes = sum(st.size[i] for i in returned if st.counted[i])
    if fusion.reuse is not None:
        fusion.reuse(st, s.steps, fusion)
    live, allocated_by = live_bytes(st, s.steps, workspace)
    return Timeline(s.steps, live, input_bytes, output_bytes, allocated_by)


def _storages(s: Schedule, resident: set, in_registers, kernel_local,
              facts) -> tuple[Storages, dict[fx.Node, list[int]]]:
    st = Storages()
    owner: dict[fx.Node, list[int]] = {}  # node -> ids of the storages its tensors live in
    keys = []

    def new_storage(key, nbytes: int, dtype, is_counted: bool) -> int:
        keys.append(key)
        return st.add(nbytes, dtype, is_counted)

    by_key: dict = {}
    for node in s.inputs:
        ids = []
        for key, nbytes, dtype in facts.storages(node):
            if key not in by_key:
                by_key[key] = new_storage(key, nbytes, dtype, key not in resident)
                st.input_of[by_key[key]] = node
            ids.append(by_key[key])
        owner[node] = ids
    st.inputs = set(range(len(st.size)))
    for node in s.steps:
        values = facts.storages(node)
        inputs = {keys[i]: i for arg in facts.inputs(node) for i in owner.get(arg, ())} if values else {}
        ids, new = [], []
        for key, nbytes, dtype in values:
            if key not in inputs:
                inputs[key] = new_storage(key, nbytes, dtype, node.op != "get_attr" and node not in in_registers
                                          and node not in kernel_local)
                new.append(inputs[key])
                if node in kernel_local:
                    st.kernel_local.add(inputs[key])
            ids.append(inputs[key])
        owner[node] = ids
        st.allocates.append(new)
    return st, owner


def _add_copies(st: Storages, steps, owner, copies: dict) -> dict[int, int]:
    """Storages for the copies `Fusion.copies` names: each is allocated with the value it copies
    and lives until its reader runs. Returns, per copy, its reader's step."""
    index = {node: k for k, node in enumerate(steps)}
    read_by = {}
    for node, readers in copies.items():
        k = index[node]
        for i in owner[node]:
            for reader in readers:
                copy = st.add(st.size[i], st.dtype[i], st.counted[i])
                st.allocates[k].append(copy)
                read_by[copy] = index[reader]
    return read_by


def live_bytes(st: Storages, steps, workspace, counted=None, size=None) -> tuple[list[int], dict[str, int]]:
    """Bytes live while each step runs, and the bytes each step allocates. `counted`, `size`:
    which storages to count and their bytes, if not `st.counted` and `st.size`."""
    counted, size = counted or st.counted, size or st.size
    frees_at: dict[int, list[int]] = {}
    for i, k in enumerate(st.last_use):
        if i not in st.kept and counted[i]:
            frees_at.setdefault(k, []).append(i)  # k == -1: an input nothing reads, freed at once
    live_now = sum(size[i] for i in st.inputs if counted[i])
    live_now -= sum(size[i] for i in frees_at.get(-1, ()))
    live, allocated_by = [], {}
    for k, node in enumerate(steps):
        allocated = sum(size[i] for i in st.allocates[k] if counted[i])
        allocated_by[node.name] = allocated
        live_now += allocated
        live.append(live_now + (workspace(node) if workspace else 0))
        live_now -= sum(size[i] for i in frees_at.get(k, ()))
    return live, allocated_by


def _kernel_reads(steps, in_registers, owner, allocates, kernel_end, facts) -> tuple[list[set[int]], list[int]]:
    """Per step, the storages its kernel reads and the step at which that kernel ends. A value
    kept in registers (or a view of one) is computed inside the kernels of its readers, so its
    own inputs are read there, when the last of those runs."""
    index = {node: k for k, node in enumerate(steps)}
    deferred = set()
    for k, node in enumerate(steps):
        if node in in_registers or (not allocates[k] and any(a in deferred for a in facts.inputs(node))):
            deferred.add(node)
    runs_at = [index[kernel_end[node]] if node in kernel_end else k for k, node in enumerate(steps)]
    for k in reversed(range(len(steps))):
        if steps[k] in deferred:
            runs_at[k] = max((runs_at[index[u]] for u in steps[k].users if u in index), default=k)
    reads: list[set[int]] = []
    for node in steps:
        ids = set()
        for arg in facts.inputs(node):
            ids.update(reads[index[arg]] if arg in deferred else owner.get(arg, ()))
        reads.append(ids)
    return reads, runs_at
