"""Bytes each kernel of a graph reads from and writes to memory (HBM on a GPU) when Inductor runs
the graph, from the same model of its fusion as the memory model (`inductor_fusion`: values in
registers, fused kernels, buffers a fused kernel keeps to itself).

A kernel reads each buffer it loads once (a view loads the view's bytes; a value it recomputes
in registers loads that value's inputs) and writes every value it materializes; a buffer it
writes and reads itself is not read back. An opaque op (a custom op Inductor calls as it is)
moves what its implementation moves (`picofx.cost.inductor.opaque_traffic`); attention and
other extern kernels read their inputs and write their outputs. Every byte is attributed to a
label of the node that moved it (`label(node)`: a fused pattern's name, a module path), so a
step's traffic splits into the parts a caller cares about and adds up to the whole.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import fx

from picofx.cost.inductor.fused_buffers import is_fallback
from picofx.cost.inductor.kernel_order import inductor_fusion
from picofx.cost.inductor.opaque_traffic import opaque_traffic
from picofx.cost.liveness import schedule_of, storage_key, tensor_values
from picofx.cost.model import is_alias


MATMUL_PACKETS = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm}


@dataclass
class KernelTraffic:
    """One kernel (for an opaque op, the kernels its implementation runs) of a graph."""

    members: list[str]  # node names, in the kernel's order
    read: int = 0
    written: int = 0
    kernels: int = 1
    by_label: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # label -> [read, written]

    @property
    def moved(self) -> int:
        return self.read + self.written


def _opaque(node: fx.Node) -> bool:
    return is_fallback(node) and node.target.namespace not in ("aten", "prims", "_c10d_functional")


def _val(value):
    return value.meta.get("val") if isinstance(value, fx.Node) else value


def _view_key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def decomposed(gm: fx.GraphModule, extra: dict | None = None) -> fx.GraphModule:
    """`gm` traced again through Inductor's decompositions (as CUDA gets them: matmuls, which the
    CPU's table may rewrite for small shapes, stay matmuls) and the `extra` ones (custom ops that
    CUDA decomposes), each node's `custom` meta carried to the nodes it decomposes into."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    with fx_traceback.preserve_node_meta(), detect_fake_mode(values) or nullcontext():
        table = {op: fn for op, fn in select_decomp_table().items() if getattr(op, "overloadpacket", None) not in MATMUL_PACKETS}
        table.update(extra or {})
        return make_fx(fx.Interpreter(gm).run, decomposition_table=table)(*values)


def graph_traffic(gm: fx.GraphModule, label=lambda node: "") -> list[KernelTraffic]:
    """The kernels Inductor runs `gm` as, each with the bytes it moves, in their order."""
    schedule, fusion = inductor_fusion(schedule_of(gm))
    in_registers, kernel_local = fusion.in_registers, fusion.kernel_local
    producer = {}  # storage -> the node whose kernel writes it
    for node in [*schedule.inputs, *schedule.steps]:
        if node.op == "placeholder" or not is_alias(node):
            for t in tensor_values(node.meta.get("val")):
                producer.setdefault(storage_key(t), node)
    groups: dict[int, list[fx.Node]] = defaultdict(list)
    for node in schedule.steps:
        groups[fusion.kernel_index.get(node, -1)].append(node)

    def loads(arg: fx.Node):
        """(tensor loaded, through which node) for a kernel reading `arg`."""
        if arg in in_registers:
            for source in arg.all_input_nodes:
                yield from loads(source)
        elif arg.op == "call_function" and is_alias(arg) and arg.all_input_nodes \
                and arg.all_input_nodes[0] in in_registers:
            yield from loads(arg.all_input_nodes[0])
        else:
            yield from tensor_values(arg.meta.get("val"))

    kernels = []
    for index in sorted(groups):
        members = groups[index]
        kernel = KernelTraffic([n.name for n in members], kernels=0)
        loaded: dict = defaultdict(dict)  # storage -> {view: bytes}
        for node in members:
            if node.op != "call_function":
                continue
            name = label(node)
            if _opaque(node):
                inner = opaque_traffic(node.target, *fx.node.map_arg((node.args, node.kwargs), _val))
                kernel.read, kernel.written = kernel.read + inner.read, kernel.written + inner.written
                kernel.by_label[name][0] += inner.read
                kernel.by_label[name][1] += inner.written
                kernel.kernels += inner.kernels
                continue
            if node in in_registers or is_alias(node):
                continue
            kernel.kernels = max(kernel.kernels, 1)
            inputs = {storage_key(t) for arg in node.all_input_nodes for t in tensor_values(arg.meta.get("val"))}
            if node not in kernel_local:
                wrote = sum(_nbytes(t) for t in tensor_values(node.meta.get("val")) if storage_key(t) not in inputs)
                kernel.written += wrote
                kernel.by_label[name][1] += wrote
            for arg in node.all_input_nodes:
                for t in loads(arg):
                    key = storage_key(t)
                    source = producer.get(key)
                    if source is not None and source in members and source.op != "placeholder":
                        continue  # written by this kernel: read from registers
                    views = loaded[key]
                    if _view_key(t) not in views:
                        room = t.untyped_storage().nbytes() - sum(views.values())
                        views[_view_key(t)] = size = max(0, min(_nbytes(t), room))
                        kernel.read += size
                        kernel.by_label[name][0] += size
        if kernel.moved or kernel.kernels:
            kernels.append(kernel)
    return kernels


def traffic_by_label(graphs, label=lambda node: "") -> dict[str, dict]:
    """{label: {"read": ..., "written": ..., "kernels": ...}} over `graphs` (a step's forward and
    backward): bytes as attributed node by node; each kernel counts once for every label among
    its members that moves bytes (a kernel fusing two patterns' nodes counts for both)."""
    totals: dict = defaultdict(lambda: {"read": 0, "written": 0, "kernels": 0})
    for gm in graphs:
        for kernel in graph_traffic(gm, label):
            for name, (read, written) in kernel.by_label.items():
                totals[name]["read"] += read
                totals[name]["written"] += written
                totals[name]["kernels"] += max(kernel.kernels, 1) if read or written else 0
    return dict(totals)
