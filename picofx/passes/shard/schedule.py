"""The shard pass's backward graph, put in the order it should run in, for either backend.

Autograd leaves each bucket's gradient reduce-scatter waited right after it is issued, some of them
issued only at the end of the backward (a bucket's scatter follows autograd's order, not when its
gradient is complete), and each re-gather (reshard_after_forward) issued just before its first use.
Here the backward's nodes are listed again, bucket by bucket in the order the backward completes them:

    phase k: gather of the bucket `prefetch` phases ahead          (issued before this phase's compute)
             everything the k-th reduce-scatter needs, in the order autograd gave it
             wait of reduce-scatter k-1 (and, HSDP, its all-reduce across replicas issued)
             reduce-scatter k                                       (issued as soon as its gradient is whole)

so each reduce-scatter runs behind the next bucket's matmuls and at most one is in flight, as
FSDP2's reduce-scatter stream. A bucket's phase is the first reduce-scatter a node feeds; the
phases are ordered by how much of the graph each reduce-scatter needs. A collective's work holds
its input until its wait, so a later wait (and an earlier gather) can raise the step's peak: the cost
model's prediction of the backward's live bytes decides. While the peak is above autograd's order's,
each reduce-scatter in flight at the peak node is waited just before that node instead (one whose
wait is the peak node, at once), and each gather issued early that is live there goes back to where
autograd put it.
"""
from __future__ import annotations

import heapq
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from picofx.cost.liveness import Timeline
from picofx.errors import DistributedError
from picofx.parallel.mesh import measured_on_first_rank
from picofx.passes.shard.reduce import gradient_scatters

c10d = torch.ops._c10d_functional
autograd_c10d = torch.ops._c10d_functional_autograd
WAIT = c10d.wait_tensor.default
GATHERS = (c10d.all_gather_into_tensor.default, autograd_c10d.all_gather_into_tensor.default)
SCATTERS = (c10d.reduce_scatter_tensor.default, autograd_c10d.reduce_scatter_tensor.default)
ALL_REDUCE = c10d.all_reduce.default
COLLECTIVES = (WAIT, ALL_REDUCE, *GATHERS, *SCATTERS)
# after the partition no autograd runs: the graphs' collectives are the plain functional ones
PLAIN = {autograd_c10d.all_gather_into_tensor.default: c10d.all_gather_into_tensor.default,
         autograd_c10d.reduce_scatter_tensor.default: c10d.reduce_scatter_tensor.default}

FIRST, BODY, WAITS, ISSUE = range(4)  # where in its phase a node goes


def plain_collectives(gm: fx.GraphModule) -> int:
    """Replace the autograd variants of the functional collectives by the functional ones."""
    replaced = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in PLAIN:
            node.target = PLAIN[node.target]
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def waits_of(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target is WAIT]


def parameter_gathers(nodes: list, group: str | None) -> list[fx.Node]:
    """The all-gathers of `nodes` over the shard group (None: every one): the ones prefetching may
    move. Sequence and context parallelism's gathers of activations stay where autograd put them."""
    return [n for n in nodes
            if n.op == "call_function" and n.target in GATHERS and (group is None or n.args[2] == group)]


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen, pending = {node}, [node]
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg.op != "placeholder" and arg not in seen:
                seen.add(arg)
                pending.append(arg)
    return seen


def replica_chain(wait: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The all-reduce across replicas (HSDP) that reads a reduce-scatter's wait, and its own wait."""
    for user in wait.users:
        if user.target is ALL_REDUCE and waits_of(user):
            return user, waits_of(user)[0]
    return None


def schedule_backward(gm: fx.GraphModule, prefetch: int, timeline: Callable[[fx.GraphModule], Timeline] | None,
                      agree: "Agreement | None" = None, group: str | None = None) -> dict:
    """Reorder the backward graph as the module doc says; `timeline`: the cost model's live bytes
    of a backward graph (None: no memory check); `agree`: the numbers one rank chose, on every rank
    whose collectives interleave with this one's (None: one process). Ranks must issue their
    collectives in one order, so the memory guard's choice, which each rank's own shapes and cost
    model could make differently, is taken from one rank. `group`: the shard group, whose
    reduce-scatters are the buckets' (None: every reduce-scatter). Returns what it did, for the
    pass's notes."""
    graph = gm.graph
    scatters = [n for n in gradient_scatters(gm, group) if waits_of(n)]
    if not scatters:
        return {}
    mutating = [n.name for n in graph.nodes if n.op == "call_function" and n.target not in COLLECTIVES
                and n.is_impure()]
    if mutating:  # an in-place write orders its readers by more than the graph's edges: keep autograd's order
        return {"scatters": len(scatters), "kept_autograd_order": f"the graph writes in place ({mutating[0]})"}
    original = list(graph.nodes)
    before = timeline(gm).peak if timeline is not None else None
    needs = {s: ancestors(s) for s in scatters}
    scatters.sort(key=lambda s: len(needs[s]))
    late: dict = dict.fromkeys(scatters[:-1])  # the last one has no bucket after it to hide behind
    early = set(parameter_gathers(original, group)) if prefetch else set()
    for _ in range(4 * len(original)):
        place(graph, original, scatters, needs, late, early, prefetch)
        gm.recompile()
        line = timeline(gm) if timeline is not None else None
        if line is None or line.peak <= before or not (late or early):
            break
        # in flight at the peak only because of this order: a wait moves to just before the peak
        # node, a gather back to where autograd put it; a reduce-scatter whose wait is the peak node
        # (its input lives up to it) is waited at once, as autograd had it
        blamed = in_flight_at(gm, set(late) | early, line.peak_node, original)
        waited_at_peak = {s for s in late if waits_of(s)[0] is line.peak_node}
        if not (blamed or waited_at_peak):
            late, early = {}, set()
        late = {s: at for s, at in late.items() if s not in waited_at_peak}
        late.update(dict.fromkeys(blamed & set(late), line.peak_node))
        early -= blamed
    else:
        late, early = {}, set()
    if agree is not None:
        late, early = agreed_choice(original, scatters, late, early, agree, agree.same_graphs)
    place(graph, original, scatters, needs, late, early, prefetch)
    gm.recompile()
    line = timeline(gm) if timeline is not None else None
    return {"scatters": len(scatters), "waited_after_next_bucket": sum(v is None for v in late.values()),
            "waited_before_the_peak": sum(v is not None for v in late.values()), "prefetched_gathers": len(early),
            "predicted_backward_peak": {"before": before, "after": line.peak if line is not None else None}}


@dataclass(frozen=True)
class Agreement:
    """The first rank's numbers on every rank whose backward collectives interleave with this one's:
    along each of `dims` in turn. `same_graphs`: those ranks' backward graphs are the same node for
    node; a shard group spanning context parallel's ranks is not (each rank's attention is its own
    part of the sequence), and there only the collectives are the same."""

    dims: tuple
    same_graphs: bool = True

    def __call__(self, values: list[float]) -> list[float]:
        for dim in self.dims:
            values = measured_on_first_rank(lambda chosen=values: chosen, len(values), dim)
        return values


def agreement(layout, mesh) -> Agreement | None:
    """Along the shard dimension, the replicas' (HSDP) and tensor parallelism's."""
    if layout is None:
        return None
    dims = [layout.dim, *([layout.replicas] if layout.replicas is not None else []),
            *([mesh.dim("tp")] if mesh is not None and mesh.size("tp") > 1 else [])]
    dims = [d for d in dims if d.size > 1 and d.group is not None]
    if len(dims) < 2 and layout.summed == 1:  # one group of equal graphs: its ranks' orders did not diverge in practice
        return None
    return Agreement(tuple(dims), same_graphs=layout.summed == 1)


NOT_LATE, AFTER_NEXT_BUCKET = -1.0, -2.0


def agreed_choice(original: list, scatters: list, late: dict, early: set, agree, exact: bool = True
                  ) -> tuple[dict, set]:
    """`late` and `early` as the first rank chose them, as positions in autograd's order. The graph
    itself must be the same on every rank (`exact`), or at least its collectives: their sequence
    travels with the choice."""
    index = {n: i for i, n in enumerate(original)}
    gathers = [n for n in original if n.op == "call_function" and n.target in GATHERS]
    compared = original if exact else [n for n in original if n.op == "call_function" and n.target in COLLECTIVES]
    shape = float(zlib.crc32(" ".join(str(n.target) for n in compared).encode()))
    if not exact:  # a node's place differs between the ranks: a wait due before the peak node is waited at once
        late = {s: at for s, at in late.items() if at is None}
    mine = [shape] + [NOT_LATE if s not in late else AFTER_NEXT_BUCKET if late[s] is None else float(index[late[s]])
                      for s in scatters] + [float(g in early) for g in gathers]
    chosen = agree(mine)
    if chosen[0] != shape:
        raise DistributedError("shard: this rank's backward graph differs from the first rank's, so their "
                               "collectives cannot be put in one order; every rank must capture the same "
                               "model with the same passes and input shapes.")
    late = {s: None if code == AFTER_NEXT_BUCKET else original[int(code)]
            for s, code in zip(scatters, chosen[1:]) if code != NOT_LATE}
    early = {g for g, flag in zip(gathers, chosen[1 + len(scatters):]) if flag}
    return late, early


def place(graph: fx.Graph, original: list, scatters: list, needs: dict, late: dict, early: set, prefetch: int) -> None:
    """List the graph's nodes again by (phase, place in phase, autograd's order), dependencies first.
    `late`: the reduce-scatters waited later, each before the next one's issue (None) or before a node."""
    index = {n: i for i, n in enumerate(original)}
    phase_of = {}
    for k in reversed(range(len(scatters))):
        phase_of.update(dict.fromkeys(needs[scatters[k]], k))
    key: dict[fx.Node, tuple] = {}
    following = len(scatters)  # a node no reduce-scatter needs runs with the phase of what follows it
    for node in reversed(original):
        if node in phase_of:
            following = phase_of[node]
        key[node] = (phase_of.get(node, following), BODY, index[node])
    for gather in sorted(early, key=index.__getitem__):  # ancestors they share: the same key on every rank
        ahead = max(0, key[gather][0] - prefetch)
        for node in ancestors(gather):  # the shards' flattening and cast travel with it
            key[node] = (ahead, FIRST, index[node])
    for k, scatter in enumerate(scatters):
        key[scatter] = (k, ISSUE, index[scatter])
        wait = waits_of(scatter)[0]
        if scatter not in late:
            key[wait] = (k, ISSUE, index[wait])
        elif late[scatter] is None:
            key[wait] = (k + 1, WAITS, index[wait])
        else:  # just before the node it may not be in flight at
            key[wait] = (*key[late[scatter]][:2], key[late[scatter]][2] - 0.5)
        chain = replica_chain(wait)
        if chain is not None:  # issued with the wait it reads, waited a phase later
            key[chain[0]] = (*key[wait][:2], key[wait][2] + 0.25)
            key[chain[1]] = (key[wait][0] + 1, WAITS, index[chain[1]])
    output = graph.output_node()
    for node in list_schedule([n for n in original if n.op not in ("placeholder", "output")], key):
        output.prepend(node)


def list_schedule(nodes: list, key: dict) -> list:
    """`nodes` in dependency order, the smallest key first among those whose inputs are placed."""
    inside = set(nodes)
    missing = {n: sum(1 for a in n.all_input_nodes if a in inside) for n in nodes}
    ready = [(key[n], i, n) for i, n in enumerate(nodes) if missing[n] == 0]
    position = {n: i for i, n in enumerate(nodes)}
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, node = heapq.heappop(ready)
        out.append(node)
        for user in node.users:
            if user in inside:
                missing[user] -= 1
                if missing[user] == 0:
                    heapq.heappush(ready, (key[user], position[user], user))
    return out


def in_flight_at(gm: fx.GraphModule, moved: set, at: fx.Node | None, original: list) -> set:
    """The collectives of `moved` in flight at node `at` now that were not in autograd's order:
    issued before it and waited after it."""
    now = {n: i for i, n in enumerate(gm.graph.nodes)}
    then = {n: i for i, n in enumerate(original)}

    def spans(order, collective):
        return order[collective] < order.get(at, -1) < order[waits_of(collective)[0]]

    return {c for c in moved if spans(now, c) and not spans(then, c)}
