"""Which values of a graph Inductor never writes to memory, for the cost model's liveness.

Inductor fuses chains of pointwise ops, and pointwise ops feeding a reduction, into one
kernel: an intermediate that only such kernels read lives in registers. The rule here follows
Inductor's lowering: a pointwise node's value is not materialized when every reader is a
pointwise op, a reduction, or a view read only by those, and the graph does not return it.
Everything else (matmuls, attention, custom ops, values saved for the backward or returned)
gets a buffer. Inductor also writes a pointwise value to a buffer when recomputing it in every
reader would cost too much (`torch._inductor.ir.StorageBox.should_realize_on_reuse`,
`has_exceeded_max_reads`): it has several readers and loads more than `realize_reads_threshold`
buffers (4) or, on CPU, calls exp, log, sigmoid or tanh; or it loads more than
`realize_acc_reads_threshold` buffers (8; 12 on CPU), thresholds read from Inductor's config
(`picofx.cost.inductor.switches`). Such a buffer still
disappears when every reader ends up in its fused kernel (`picofx.cost.inductor.kernel_order`). How the
kernels that write buffers are fused and ordered, and how their buffers are reused:
`picofx.cost.inductor.kernel_order`, `picofx.cost.inductor.buffer_reuse`.
"""
from __future__ import annotations

import torch
from torch import fx

from picofx.cost.inductor.switches import InductorSwitches
from picofx.cost.liveness import Schedule
from picofx.capture.vocabulary import VIEW_OPS

aten = torch.ops.aten

REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
              aten.amin.default, aten.var.correction, aten.prod.dim_int, aten.max.dim, aten.min.dim,
              aten.any.dim, aten.all.dim, aten.argmax.default, aten.argmin.default}
# Constant tensors (Inductor computes their values where read) and readers that load their inputs
# elementwise, directly or by index, so they fuse like pointwise ops: a scatter's output buffer
# starts as a copy of its first input, written by the same kernel.
FACTORIES = {aten.full.default, aten.zeros.default, aten.ones.default, aten.full_like.default,
             aten.zeros_like.default, aten.ones_like.default, aten.scalar_tensor.default, aten.arange.start,
             aten.arange.default, aten.arange.start_step, torch.ops.prims.iota.default}
INDEXED_READERS = {aten.gather.default, aten.index.Tensor, aten.scatter_add.default, aten.scatter.src,
                   aten.scatter.value, aten.scatter_reduce.two, aten.index_put.default, aten.where.self}
INDEXED_LOADS = {aten.gather.default, aten.index.Tensor}  # indirect loads inside a loop kernel
ELEMENTWISE = {aten.slice_scatter.default, aten.select_scatter.default, aten.constant_pad_nd.default}
VIEWS = VIEW_OPS


def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags and isinstance(node.meta.get("val"), torch.Tensor))


def is_elementwise(node: fx.Node) -> bool:
    """A pointwise op, or one Inductor lowers to the same kind of loop (masked loads) though ATen
    does not tag it pointwise: it inlines into its readers and its inputs inline into it."""
    return is_pointwise(node) or (node.op == "call_function" and node.target in ELEMENTWISE
                                  and isinstance(node.meta.get("val"), torch.Tensor))


def is_fallback(node: fx.Node) -> bool:
    """Inductor calls the op as it is (attention, custom ops): the op allocates its own outputs."""
    from torch._inductor.lowering import fallbacks, lowerings

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target in fallbacks or (target.namespace not in ("aten", "prims") and target not in lowerings)


def is_loop_kernel(node: fx.Node, in_registers) -> bool:
    """A step Inductor runs as a loop kernel of its own (unless inlined: `in_registers`)."""
    if node.op != "call_function" or node in in_registers:
        return False
    return (is_elementwise(node) or node.target in REDUCTIONS or node.target in FACTORIES
            or node.target in INDEXED_LOADS)


def _computed_where_read(node: fx.Node) -> bool:
    return is_elementwise(node) or (node.op == "call_function" and node.target in FACTORIES)


HEAVY_ON_CPU = {aten.exp, aten.log, aten.log10, aten.log1p, aten.log2, aten.sigmoid, aten.tanh}


class _Inlined:
    """What the code Inductor inlines for a value loads and calls, through the values it inlines."""

    def __init__(self, switches: InductorSwitches):
        self.switches = switches
        self.loads: dict[fx.Node, frozenset] = {}
        self.calls: dict[fx.Node, frozenset] = {}

    def add(self, node: fx.Node, inlined: set) -> None:
        loads, calls = set(), {getattr(node.target, "overloadpacket", node.target)}
        for arg in node.all_input_nodes:
            while arg.target in VIEWS and arg.args and isinstance(arg.args[0], fx.Node):
                arg = arg.args[0]
            if arg in inlined:
                loads |= self.loads[arg]
                calls |= self.calls[arg]
            elif arg.op != "get_attr":
                loads.add(arg)
        self.loads[node], self.calls[node] = frozenset(loads), frozenset(calls)

    def realized(self, node: fx.Node, readers: int) -> bool:
        val = node.meta["val"] if isinstance(node.meta.get("val"), torch.Tensor) else None
        cpu = val is not None and val.device.type == "cpu"
        loads = len(self.loads[node])
        if loads > self.switches.max_reads(cpu):
            return True
        heavy = cpu and bool(self.calls[node] & HEAVY_ON_CPU)
        return readers > 1 and (loads > self.switches.realize_reads_threshold or heavy)


def unmaterialized(schedule: Schedule, switches: InductorSwitches | None = None) -> set[fx.Node]:
    """The pointwise steps whose values stay inside fused kernels. Readers are the users among
    the schedule's own steps (a schedule may run nodes of a larger joint graph). `switches`:
    Inductor's thresholds (default: its config now)."""
    steps = set(schedule.steps)
    returned = {n for n in schedule.outputs if n is not None}

    def fusable_reader(node: fx.Node) -> bool:
        if node in returned:
            return False
        if is_elementwise(node) or node.target in REDUCTIONS or node.target in INDEXED_READERS:
            return True
        return node.target in VIEWS and all(fusable_reader(u) for u in node.users if u in steps)

    inlined, code = set(), _Inlined(switches or InductorSwitches.current())
    for node in schedule.steps:
        readers = [u for u in node.users if u in steps]
        if _computed_where_read(node) and node not in returned and readers and all(map(fusable_reader, readers)):
            code.add(node, inlined)
            if not code.realized(node, len(node.users)):
                inlined.add(node)
    return inlined


def in_place_candidates(schedule: Schedule, switches: InductorSwitches | None = None) -> set[fx.Node]:
    """The pointwise steps: Inductor's kernel for one may write into an input buffer it reads at the
    same index (ops that move elements, like a transposing copy or a scatter, cannot); none when
    Inductor's `inplace_buffers` is off."""
    if not (switches or InductorSwitches.current()).inplace_buffers:
        return set()
    return {node for node in schedule.steps if is_pointwise(node)}
