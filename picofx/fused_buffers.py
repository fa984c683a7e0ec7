"""Which values of a graph Inductor never writes to memory, for the cost model's liveness.

Inductor fuses chains of pointwise ops, and pointwise ops feeding a reduction, into one
kernel: an intermediate that only such kernels read lives in registers. The rule here follows
Inductor's lowering: a pointwise node's value is not materialized when every reader is a
pointwise op, a reduction, or a view read only by those, and the graph does not return it.
Everything else (matmuls, attention, custom ops, values saved for the backward or returned)
gets a buffer. Inductor may still realize a value read by many kernels when recomputing it
would be costly; those cases make the prediction low by that buffer, which the accuracy tool
(`tools/memory_accuracy.py --backend inductor`) measures. How the kernels that do write
buffers are fused and ordered, and how their buffers are reused: `picofx.kernel_order`,
`picofx.buffer_reuse`.
"""
from __future__ import annotations

import torch
from torch import fx

from picofx.liveness import Schedule

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
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
         aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
         aten.alias.default}


def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags and isinstance(node.meta.get("val"), torch.Tensor))


def is_fallback(node: fx.Node) -> bool:
    """Inductor calls the op as it is (attention, custom ops): the op allocates its own outputs."""
    from torch._inductor.lowering import fallbacks, lowerings

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target in fallbacks or (target.namespace not in ("aten", "prims") and target not in lowerings)


def _computed_where_read(node: fx.Node) -> bool:
    return is_pointwise(node) or (node.op == "call_function" and node.target in FACTORIES)


def unmaterialized(schedule: Schedule) -> set[fx.Node]:
    """The pointwise steps whose values stay inside fused kernels. Readers are the users among
    the schedule's own steps (a schedule may run nodes of a larger joint graph)."""
    steps = set(schedule.steps)
    returned = {n for n in schedule.outputs if n is not None}

    def fusable_reader(node: fx.Node) -> bool:
        if node in returned:
            return False
        if is_pointwise(node) or node.target in REDUCTIONS or node.target in INDEXED_READERS:
            return True
        return node.target in VIEWS and all(fusable_reader(u) for u in node.users if u in steps)

    return {node for node in schedule.steps
            if _computed_where_read(node) and node not in returned and any(u in steps for u in node.users)
            and all(fusable_reader(u) for u in node.users if u in steps)}


def in_place_candidates(schedule: Schedule) -> set[fx.Node]:
    """The pointwise steps: Inductor's kernel for one may write into an input buffer it reads at the
    same index (ops that move elements, like a transposing copy or a scatter, cannot)."""
    return {node for node in schedule.steps if is_pointwise(node)}
