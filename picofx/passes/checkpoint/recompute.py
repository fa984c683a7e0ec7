"""Save-or-recompute trade-offs of a joint graph's forward values, layer by layer.

The forward part of a joint graph is cut into segments: one per numbered layer (the first
`name.<int>` in a node's module path, e.g. `model.layers.3`) and one per run of nodes outside
layers. A value a segment hands to another segment is never recomputed (it is a checkpoint
boundary: saved when the backward needs it), so segments are independent.

Inside a segment, the choice of what to recompute is a minimum s-t cut (one per trade-off
price λ, in seconds per byte): every forward value v is a pair of vertices v_in -> v_out;

    source -> v_in   capacity recompute_time(v)   (cut when v is recomputed in backward)
    v_in -> v_out    capacity λ * bytes(v)         (cut when v is saved)
    u_out -> v_in    ∞ for each input u of v       (recomputing v needs u in backward)
    v_out -> sink    ∞ when the backward reads v

so a cut of least capacity is a recompute set of least `time + λ * saved bytes`. Views and
aliases cost nothing to recompute and are never saved themselves (their base is); a value
that cannot be recomputed (random, mutating, impure, a segment output) has an ∞ source edge.
Sweeping λ by the Eisner–Severance recursion finds exactly the vertices of the lower convex
hull of (saved bytes, recompute time): each solve either finds a new vertex or proves two known
ones adjacent, so a hull of k vertices costs 2k - 1 cuts. Identical layers share one sweep.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from collections.abc import Callable

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov
import torch
from torch import fx

from picofx.capture.vocabulary import layer_of_path, traced_module_path
from picofx.cost.model import is_alias
from picofx.cost.liveness import storage_bytes, tensor_values
from picofx.cost.partition import forward_region, is_dropout_free


@dataclass(frozen=True)
class Option:
    """One hull vertex of a segment: recompute these nodes, save the rest the backward needs."""

    recompute: frozenset  # node names
    saved_bytes: int  # the segment's own saved values (additive estimate)
    seconds: float  # predicted recompute time


@dataclass
class Segment:
    name: str
    nodes: list  # forward call_function nodes, in order
    options: list = field(default_factory=list)  # hull vertices, saved bytes decreasing


def layer_of(node: fx.Node) -> str | None:
    return layer_of_path(traced_module_path(node))


def forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """The joint graph's forward computation (call_function nodes), as the partitioner splits it."""
    region = forward_region(joint)
    return [n for n in joint.graph.nodes if n.op == "call_function" and n in region]


def segments(joint: fx.GraphModule) -> list[Segment]:
    out: list[Segment] = []
    last_layer = None
    for node in forward_nodes(joint):
        layer = layer_of(node)
        if layer is None:
            layer = f"after {last_layer}" if last_layer else "before layers"
        else:
            last_layer = layer
        if not out or out[-1].name != layer:
            out.append(Segment(layer, []))
        out[-1].nodes.append(node)
    return out


def is_multi_output(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def can_recompute(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or (torch.Tag.nondeterministic_seeded in target.tags and not is_dropout_free(node)):
        return False
    return not node.is_impure(impure_random=False) and all(isinstance(t, torch.Tensor) for t in _leaves(node))


def _leaves(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def tradeoff(segment: Segment, needed: set, forward: set, seconds: Callable[[fx.Node], float]) -> list[Option]:
    """The lower convex hull of (saved bytes, recompute seconds) for one segment (module doc).
    `needed`: forward nodes the backward reads; `forward`: all forward nodes."""
    members = set(segment.nodes)
    graph = nx.DiGraph()
    save_bytes, cost = {}, {}
    for v in segment.nodes:
        getitem = v.target is operator.getitem
        boundary = any(u in forward and u not in members for u in v.users)
        recomputable = can_recompute(v) and not boundary
        cost[v] = 0.0 if (getitem or is_alias(v)) else seconds(v)
        if recomputable:
            graph.add_edge("source", (v, "in"), capacity=cost[v])
        else:
            graph.add_edge("source", (v, "in"))
        if is_multi_output(v) or (is_alias(v) and not getitem and recomputable):
            graph.add_edge((v, "in"), (v, "out"))  # saved through its base or its getitems
        else:
            save_bytes[v] = storage_bytes(v)
            graph.add_edge((v, "in"), (v, "out"), capacity=save_bytes[v])
        for u in v.all_input_nodes:
            if u in members:
                graph.add_edge((u, "out"), (v, "in"))
        if v in needed:
            graph.add_edge((v, "out"), "sink")
    if "sink" not in graph:
        return [Option(frozenset(), 0, 0.0)]

    def solve(price: float) -> Option:
        # every priced capacity is set again here, and minimum_cut leaves its graph as it was
        for v, b in save_bytes.items():
            graph[(v, "in")][(v, "out")]["capacity"] = price * b
        # any maximum flow leaves the same source side (the least minimum cut); Boykov-Kolmogorov
        # finds one in half the time of the default preflow-push on these small graphs
        _, (reachable, _) = nx.minimum_cut(graph, "source", "sink", flow_func=boykov_kolmogorov)
        recompute = {v for v in segment.nodes if (v, "in") not in reachable}
        recompute = _required(recompute, needed, members)
        saved = {v for v in segment.nodes if (v, "in") in reachable and (v, "out") not in reachable}
        return Option(frozenset(v.name for v in recompute), sum(save_bytes.get(v, 0) for v in saved),
                      sum(cost[v] for v in segment.nodes if v in recompute))  # in graph order: one sum per set

    total_bytes = sum(save_bytes.values()) or 1
    positive = [c for c in cost.values() if c > 0]
    low = solve(min(positive, default=1.0) / total_bytes * 1e-3)
    high = solve((sum(positive) + 1.0) * 1e3 / max(min((b for b in save_bytes.values() if b), default=1), 1))
    hull = [low]
    _refine(low, high, solve, hull)
    hull.append(high)
    unique = []
    for option in hull:
        if not unique or option.saved_bytes < unique[-1].saved_bytes:
            unique.append(option)
    return unique


def _refine(a: Option, b: Option, solve, hull: list) -> None:
    """Append the hull vertices strictly between a (more bytes) and b (more time), in order."""
    if a.saved_bytes <= b.saved_bytes:
        return
    price = max(b.seconds - a.seconds, 0.0) / (a.saved_bytes - b.saved_bytes)
    c = solve(price)
    line = a.seconds + price * a.saved_bytes
    if c.seconds + price * c.saved_bytes < line * (1 - 1e-9) - 1e-15 and b.saved_bytes < c.saved_bytes < a.saved_bytes:
        _refine(a, c, solve, hull)
        hull.append(c)
        _refine(c, b, solve, hull)


def _required(recompute: set, needed: set, members: set) -> set:
    """The part of a recompute set the backward actually runs: recomputed values it reads,
    and what those are recomputed from, transitively."""
    required, stack = set(), [v for v in needed if v in recompute]
    while stack:
        v = stack.pop()
        if v in required:
            continue
        required.add(v)
        stack.extend(u for u in v.all_input_nodes if u in members and u in recompute)
    return required


def signature(segment: Segment) -> tuple:
    """Equal for segments that compute the same thing on the same shapes (identical layers)."""
    index = {n: i for i, n in enumerate(segment.nodes)}
    rows = []
    for n in segment.nodes:
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensor_values(n.meta.get("val")))
        args = tuple(index.get(a, "ext") for a in n.all_input_nodes)
        users = tuple(sorted(index.get(u, -1) for u in n.users))
        rows.append((str(n.target), shapes, args, users))
    return tuple(rows)


def analyze(joint: fx.GraphModule, seconds: Callable[[fx.Node], float]) -> list[Segment]:
    """Segments of the joint graph's forward, each with its hull of options."""
    forward = forward_nodes(joint)
    forward_set = set(forward)
    needed = {n for n in forward if any(u not in forward_set for u in n.users if u.op != "output")}
    done: dict[tuple, tuple[Segment, list[Option]]] = {}
    segs = segments(joint)
    for seg in segs:
        key = signature(seg)
        if key in done:
            first, options = done[key]
            rename = {a.name: b.name for a, b in zip(first.nodes, seg.nodes)}
            seg.options = [Option(frozenset(rename[n] for n in o.recompute), o.saved_bytes, o.seconds)
                           for o in options]
        else:
            seg.options = tradeoff(seg, needed, forward_set, seconds)
            done[key] = (seg, seg.options)
    return segs
