"""A pipeline stage's ranks compare the collectives their compiled graphs issue before the first
micro-batch (picofx/runtime/pipeline_order.py): the same order passes, another order on a peer is
an error naming the stage, the dimension and the first collective where they part, not a hang."""
from __future__ import annotations

import pipeline_order_ranks
from picofx.parallel.launch import run_ranks
from picofx.runtime.pipeline_order import first_difference, issued


def test_the_sequence_names_each_collective_by_its_dimension_and_finds_where_two_part():
    graph = pipeline_order_ranks.backward_graph("group-7", scatter_first=True)
    assert issued(graph, {"group-7": "dp_shard"}) == ["reduce_scatter_tensor@dp_shard", "all_gather_into_tensor@dp_shard"]
    assert issued(graph, {}) == ["reduce_scatter_tensor@other", "all_gather_into_tensor@other"]
    mine = {"backward": issued(graph, {"group-7": "dp_shard"})}
    assert first_difference(mine, dict(mine)) is None
    theirs = {"backward": mine["backward"][::-1]}
    assert first_difference(mine, theirs) == ("the backward graph's collective 1 is reduce_scatter_tensor@dp_shard "
                                              "here, all_gather_into_tensor@dp_shard there")
    assert "collective 3 is nothing more here" in first_difference(mine, {"backward": mine["backward"] + ["x"]})


def test_peers_issuing_another_order_stop_with_an_error_instead_of_waiting_for_ever():
    ranks = run_ranks(pipeline_order_ranks.check, 2, timeout=120, collective_timeout=30)
    assert [r["same"] for r in ranks] == [None, None]
    swapped = [r["swapped"] for r in ranks]
    assert all(e and "pipeline stage 0: dp_shard rank" in e and "would wait for ever" in e for e in swapped), swapped
