"""The shard pass's backward schedule on graphs built by hand: the ranks' agreement on one order, an
order that does not depend on how a set of nodes iterates (ranks issuing their collectives in
different orders hang), and the memory guard's answer to a peak at a reduce-scatter's own wait."""
from __future__ import annotations

import pytest
import torch


def test_every_rank_places_its_backward_by_the_first_ranks_choice():
    """The memory guard may choose differently on each rank (their shapes and cost models differ);
    the choice that travels is the first rank's, and a rank whose graph differs stops."""
    from torch import fx

    from picofx.errors import DistributedError
    from picofx.passes.shard.schedule import agreed_choice

    c10d = torch.ops._c10d_functional
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "0"))
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
    second = graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "0"))
    graph.output((first, gather, second))
    nodes, scatters = list(graph.nodes), [first, second]
    sent = []
    assert agreed_choice(nodes, scatters, {first: None}, {gather}, lambda v: sent.append(v) or v) == \
        ({first: None}, {gather})
    assert agreed_choice(nodes, scatters, {first: gather}, set(), lambda v: sent[0]) == ({first: None}, {gather})
    with pytest.raises(DistributedError, match="backward graph differs from the first rank's"):
        agreed_choice(nodes, scatters, {}, set(), lambda v: [v[0] + 1, *v[1:]])


def test_ranks_whose_graphs_differ_off_the_collectives_agree_on_the_collectives_alone():
    """A shard group spanning context parallel's ranks: their attention nodes differ. Only the
    collectives' sequence is compared, and a wait due before a peak node (whose place differs
    between the ranks) is waited at once."""
    from torch import fx

    from picofx.errors import DistributedError
    from picofx.passes.shard.schedule import agreed_choice

    c10d = torch.ops._c10d_functional

    def graph_with(extra: int):
        graph = fx.Graph()
        x = graph.placeholder("x")
        first = graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 4, "0"))
        for _ in range(extra):  # this rank's own part of the attention
            x = graph.call_function(torch.ops.aten.neg.default, (x,))
        second = graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 4, "0"))
        graph.output((first, second))
        nodes = list(graph.nodes)
        return nodes, [first, second], nodes[2]

    mine, scatters, peak = graph_with(1)
    theirs, their_scatters, _ = graph_with(3)
    sent = []
    agreed_choice(theirs, their_scatters, {their_scatters[0]: None}, set(), lambda v: sent.append(v) or v, exact=False)
    assert agreed_choice(mine, scatters, {scatters[0]: peak}, set(), lambda v: sent[0], exact=False) == \
        ({scatters[0]: None}, set())
    assert agreed_choice(mine, scatters, {scatters[0]: peak}, set(), lambda v: v, exact=False) == ({}, set())
    with pytest.raises(DistributedError, match="backward graph differs"):
        agreed_choice(mine, scatters, {}, set(), lambda v: sent[0], exact=True)


def test_prefetched_gathers_sharing_an_ancestor_are_placed_alike_whatever_the_sets_order():
    """Two parameter gathers of different phases read one node: its place must not depend on which
    gather a set yields first (a set of nodes iterates by their ids, which differ between ranks,
    and ranks issuing their collectives in different orders hang). Only the shard group's gathers
    move: sequence parallelism's gather of activations stays where autograd put it."""
    from torch import fx

    from picofx.passes.shard.schedule import ancestors, parameter_gathers, place

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten

    def backward(early_first: bool) -> list[str]:
        graph = fx.Graph()
        x = graph.placeholder("x")
        shared = graph.call_function(aten.neg.default, (x,))
        activations = graph.call_function(c10d.wait_tensor.default, (
            graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "tp")),))
        y, scatters, gathers = activations, [], []
        for k in range(3):
            gathered = graph.call_function(c10d.all_gather_into_tensor.default, (shared, 2, "dp"))
            gathers.append(gathered)
            y = graph.call_function(aten.add.Tensor, (y, graph.call_function(c10d.wait_tensor.default, (gathered,))))
            scatters.append(graph.call_function(c10d.reduce_scatter_tensor.default, (y, "sum", 2, "dp")))
        graph.output([graph.call_function(c10d.wait_tensor.default, (s,)) for s in scatters])
        original = list(graph.nodes)
        assert parameter_gathers(original, "dp") == gathers
        early = [gathers[0], gathers[2]] if early_first else [gathers[2], gathers[0]]
        place(graph, original, scatters, {s: ancestors(s) for s in scatters}, {}, early, prefetch=1)
        return [n.name for n in graph.nodes]

    assert backward(True) == backward(False)


def test_a_reduce_scatter_waited_at_the_peak_waits_at_once_and_the_others_stay_behind_the_next_bucket():
    """The memory guard, where the predicted peak is a late reduce-scatter's own wait (its input lives
    up to it): that one is waited at once, the others still wait behind the next bucket's matmuls.
    Inductor's graphs of the reference LLaMA met this, and every wait went back to its scatter."""
    from types import SimpleNamespace

    from torch import fx

    from picofx.passes.shard.schedule import schedule_backward, waits_of

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    y, scatters, waits = x, [], []
    for _ in range(3):  # autograd's order: each bucket's scatter waited at once
        y = graph.call_function(aten.mm.default, (y, w))
        scatters.append(graph.call_function(c10d.reduce_scatter_tensor.default, (y, "sum", 2, "0")))
        waits.append(graph.call_function(c10d.wait_tensor.default, (scatters[-1],)))
    graph.output(waits)
    gm = fx.GraphModule(torch.nn.Module(), graph)

    def timeline(gm):  # the first bucket's gradient is the large one: the longer in flight, the higher the peak
        nodes = list(gm.graph.nodes)
        return SimpleNamespace(peak=nodes.index(waits[0]) - nodes.index(scatters[0]), peak_node=waits[0])

    notes = schedule_backward(gm, 0, timeline)
    assert notes["waited_after_next_bucket"] == 1 and notes["waited_before_the_peak"] == 0, notes
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index(waits[0]) == order.index(scatters[0]) + 1, order  # waited at once
    next_matmul = scatters[2].args[0]
    assert order.index(scatters[1]) < order.index(next_matmul) < order.index(waits[1]), order  # behind the next bucket
