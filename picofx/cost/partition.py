"""The partition picofx runs: torch's `default_partition`, which honours `recompute` tags exactly.

It saves the untagged forward values the backward reads and recomputes the tagged ones in
backward, just before their first use. One difference: torch treats every op tagged
`nondeterministic_seeded` as random and, when such an op is recomputed, threads RNG state
between the graphs (which fails outside a fake mode and costs a state save per op). The
attention ops carry that tag for their dropout; with `dropout_p == 0` they are deterministic,
so here they are recomputed like any other op.

A pass may offer the partition backward nodes that read only parameters (the float8 casts of a
weight the backward makes again) by marking them IN_FORWARD: they then run in the forward and are
saved for the backward like any forward value, or recomputed in the backward where tagged so.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import fx
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition, must_recompute

from picofx.cost.liveness import Schedule

IN_FORWARD = "picofx_in_forward"  # node.meta key: a backward node the partition runs in the forward (module doc)


def is_dropout_free(node: fx.Node) -> bool:
    """An op tagged random only for its dropout, called with dropout_p == 0."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    return node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else 0.0) == 0.0


class _Deterministic:
    """Stands in for a dropout-free attention op while torch partitions (it has no `tags`)."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"deterministic_{op.__name__.replace('.', '_')}"

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)


def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
    """`default_partition(joint, joint_inputs, num_fwd_outputs=..., **kwargs)` (see module doc)."""
    move_into_forward(joint)
    swapped = [n for n in joint.graph.nodes if must_recompute(n) and is_dropout_free(n)]
    for node in swapped:
        node.target = _Deterministic(node.target)
    try:
        forward, backward = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    finally:
        for node in swapped:
            node.target = node.target.op
    for gm in (forward, backward):
        for node in gm.graph.nodes:
            if isinstance(node.target, _Deterministic):
                node.target = node.target.op
        gm.recompile()
    return forward, backward


def num_forward_outputs(joint: fx.GraphModule) -> int:
    """How many of the joint graph's outputs the forward returns (the rest are gradients, one per primal)."""
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    return len(joint.graph.output_node().args[0]) - len(primals)


def inductor_recomputes(joint: fx.GraphModule, num_fwd_outputs: int) -> frozenset:
    """The forward nodes Inductor's own min-cut partition recomputes in backward (cheap ops it
    fuses into the backward's kernels, so that their inputs are saved instead of them), found
    by running that partitioner on a copy of `joint`."""
    with warnings.catch_warnings():  # copying the graph's pytree specs trips torch's LeafSpec deprecation
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
        copied = fx.GraphModule(joint, copy.deepcopy(joint.graph))
    inputs = [n.meta.get("val") for n in joint.graph.nodes if n.op == "placeholder"]
    _, backward = min_cut_rematerialization_partition(copied, inputs, num_fwd_outputs=num_fwd_outputs)
    forward, by_name = forward_region(joint), {n.name: n for n in joint.graph.nodes}
    recomputed = {by_name[n.name] for n in backward.graph.nodes
                  if n.op == "call_function" and n.name in by_name and by_name[n.name] in forward
                  and by_name[n.name].target == n.target}
    # Not what it recomputes from a value the caller receives (the logits): that would save the
    # returned value for the backward, and a returned value the backward holds stays live longer.
    returned = {n for n in joint.graph.output_node().args[0][:num_fwd_outputs] if isinstance(n, fx.Node)}
    for node in joint.graph.nodes:
        if node in recomputed and any(a in returned for a in node.all_input_nodes):
            returned.add(node)
    return frozenset(recomputed - returned)


def forward_region(joint: fx.GraphModule) -> set:
    """Nodes the partitioner puts in the forward: all but tangents up to the last node AOT
    tagged forward (or, in a graph without tags, all that do not depend on a tangent), and the
    backward's nodes a pass marked IN_FORWARD."""
    nodes = list(joint.graph.nodes)
    marked = {n for n in nodes if n.meta.get(IN_FORWARD)}
    if any("partitioner_tag" in n.meta for n in nodes):
        last = max(i for i, n in enumerate(nodes) if (n.meta.get("partitioner_tag") == "is_forward" and n not in marked)
                   or (n.op == "placeholder" and n.name.startswith("primals")))
        return {n for n in nodes[:last + 1] if not _is_tangent(n)} | marked
    backward: set = set()
    for n in nodes:
        if _is_tangent(n) or n.op == "output" or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return set(nodes) - backward


def move_into_forward(joint: fx.GraphModule) -> None:
    """Place the nodes marked IN_FORWARD (they read parameters only) right after the forward's last
    node, tagged forward, so that torch's partition runs them there (or recomputes them in the
    backward where they are tagged for recompute)."""
    marked = [n for n in joint.graph.nodes if n.meta.get(IN_FORWARD)]
    if not marked:
        return
    region = forward_region(joint)
    anchor = [n for n in joint.graph.nodes if n in region and n.meta.get("partitioner_tag") != "is_backward"
              and not n.meta.get(IN_FORWARD)][-1]
    for node in marked:
        anchor.append(node)
        anchor = node
        node.meta["partitioner_tag"] = "is_forward"
        node.meta.pop("autograd_backward", None)
    joint.recompile()


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith("tangents")


def predict_partition(joint: fx.GraphModule, recompute: set, num_fwd_outputs: int,
                      forward: set | None = None) -> tuple[Schedule, Schedule]:
    """What `partition` makes of `joint` with the nodes in `recompute` tagged (and any tags
    already there), as schedules, without building graphs: the forward runs what its outputs
    and the saved values need; the backward starts from the saved values and tangents,
    recomputes tagged values (and multi-output ops, which are never saved) and runs each node
    after the ancestors it still lacks, as torch's reordering to mimic autograd does."""
    forward = forward_region(joint) if forward is None else forward
    nodes = list(joint.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    outputs = list(joint.graph.output_node().args[0])
    fw_outputs = [n for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)]
    bw_outputs = [n if isinstance(n, fx.Node) else None for n in outputs[num_fwd_outputs:]]

    saved, tangents, in_backward = {}, {}, set()
    stack = [n for n in bw_outputs if n is not None]
    while stack:
        n = stack.pop()
        if n in in_backward or n in saved or n in tangents:
            continue
        if n.op == "placeholder":
            (saved if n in forward else tangents)[n] = None
        elif n in forward and not (n in recompute or must_recompute(n) or isinstance(n.meta.get("val"), (tuple, list))):
            saved[n] = None
        else:
            in_backward.add(n)
            stack.extend(n.all_input_nodes)

    needed_fw, stack = set(), [*fw_outputs, *saved]
    while stack:
        n = stack.pop()
        if n not in needed_fw and n.op != "placeholder":
            needed_fw.add(n)
            stack.extend(n.all_input_nodes)
    fw_schedule = Schedule([n for n in nodes if n.op == "placeholder" and n in forward],
                           sorted(needed_fw, key=order.get), [*fw_outputs, *saved])

    backward_order = sorted(in_backward, key=order.get)
    first = min((order[u] for t in tangents for u in t.users if u in in_backward), default=None)
    steps, done = [], set()
    for n in backward_order if first is None else [n for n in backward_order if order[n] >= first]:
        if n in done:
            continue
        missing, stack = set(), [n]
        while stack:
            m = stack.pop()
            if m in done or m in missing or m not in in_backward:
                continue
            missing.add(m)
            stack.extend(m.all_input_nodes)
        for m in sorted(missing, key=order.get):
            steps.append(m)
            done.add(m)
    bw_inputs = sorted(saved, key=order.get) + sorted(tangents, key=order.get)
    return fw_schedule, Schedule(bw_inputs, steps, bw_outputs)
