"""Float8 weight casts as a save-or-recompute choice of the checkpoint pass.

A float8 linear's backward casts its weight again (the amax of the high-precision weight, the
scale, the saturated cast, the transposed copy a GEMM takes), as torchao's does. In the joint
graph those nodes sit in the backward and read only parameters, so the partition never weighs
them: the backward always recomputes them, and the plan never counted that time.

`offer_float8_weight_casts` marks them IN_FORWARD (picofx.cost.partition): the partition runs
them at the end of the forward, so they are forward values the backward reads, and the pass's
min-cut prices them like any other: saving the float8 weight costs its bytes (1 per element)
from the forward to the backward; recomputing it costs the cast's kernels (reading the bf16 or
fp32 weight again for its amax and for the cast), which Inductor cannot fuse into the GEMM, so
they are never priced as free. A recomputed one is tagged as every recomputed value is and runs
in the backward as before; a saved one runs in the forward. Either way the same ops compute the
same values, so the loss and gradients do not change.
"""
from __future__ import annotations

import torch
from torch import fx

from picofx.cost.model import is_alias
from picofx.cost.partition import IN_FORWARD, forward_region

FLOAT8_BYTES = 1


def _is_float8(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return getattr(val, "dtype", None) is not None and val.dtype.itemsize == FLOAT8_BYTES and val.is_floating_point()


def _plain_aten(node: fx.Node) -> bool:
    """A pure ATen or prims op (Inductor's graphs cast with prims.convert_element_type): no collective
    (a weight gathered again for the backward stays there), nothing mutated, nothing random."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")
            and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags)


def weight_cast_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """The backward's plain ATen nodes that compute a float8 value from the graph's primal inputs
    alone (with the nodes that read only such values, and everything they are computed from), in
    graph order."""
    forward = forward_region(joint)
    primals = {n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")}
    parameter_only = set()
    for node in joint.graph.nodes:
        if (node.op == "call_function" and node not in forward and _plain_aten(node) and node.all_input_nodes
                and all(a in primals or a in parameter_only for a in node.all_input_nodes)):
            parameter_only.add(node)
    chosen = {n for n in parameter_only if _is_float8(n)}
    for node in joint.graph.nodes:  # what reads the float8 casts (views, the transposed copy)
        if node in parameter_only and any(a in chosen for a in node.all_input_nodes):
            chosen.add(node)
    stack = list(chosen)
    while stack:  # and what they are computed from: the amax, the scale
        for a in stack.pop().all_input_nodes:
            if a in parameter_only and a not in chosen:
                chosen.add(a)
                stack.append(a)
    return [n for n in joint.graph.nodes if n in chosen]


def offer_float8_weight_casts(joint: fx.GraphModule) -> int:
    """Mark the backward's float8 weight casts IN_FORWARD (module doc); how many nodes it marked."""
    nodes = weight_cast_nodes(joint)
    for node in nodes:
        node.meta[IN_FORWARD] = True
    return len(nodes)


def float8_weight_notes(joint: fx.GraphModule, forward_outputs, recompute) -> dict:
    """{"float8_weights": the float8 weight casts (their storages, not views of them) a plan saves
    (the forward returns them or a view of them) and those it recomputes, by node name, and the bytes
    saved}; {} without float8 weight casts."""
    casts = [n for n in joint.graph.nodes if n.meta.get(IN_FORWARD) and _is_float8(n) and not is_alias(n)]
    if not casts:
        return {}
    returned = set(forward_outputs)

    def is_saved(node: fx.Node) -> bool:
        return node in returned or any(is_alias(u) and is_saved(u) for u in node.users if u.meta.get(IN_FORWARD))

    saved = [n for n in casts if is_saved(n)]
    return {"float8_weights": {"saved": [n.name for n in saved],
                               "recomputed": [n.name for n in casts if n in recompute and n not in saved],
                               "saved_bytes": sum(n.meta["val"].numel() * FLOAT8_BYTES for n in saved)}}
