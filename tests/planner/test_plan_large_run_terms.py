"""What the planner gets right at the scale of Llama 3 405B (docs/PLANNER_ACCURACY.md, runs of 1,000
GPUs and more): the slowest pipeline rank of a cost-balanced cut, where the head takes the place of
layers on the last stage, and shard stage 2's per-micro-batch reduce-scatters running on while the
rank computes the next micro-batches."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.cost.shard import Layer
from picofx.planner import plan_run
from picofx.planner.layouts import Layout, predict
from picofx.planner.pipeline import busiest_rank
from picofx.planner.sharding import sharded_step

LINK = devices()["h100"].network_link(1)


def test_a_balanced_cut_gives_the_heads_rank_fewer_layers():
    # Llama 3 405B on 16 ranks: 126 layers and a head of 0.7 layer: 8 layers on the busiest rank, no head
    assert busiest_rank(126, 16, 0.7) == (8, False, 8)
    # Megatron's even cut: 8 layers and the head on the last rank
    assert busiest_rank(126, 16, 0.7, even_stages=True) == (8, True, 8)
    # 4 layers on 2 ranks, a head as slow as 2.5 layers: 3 layers and 1 layer + the head (3.5), the busiest
    assert busiest_rank(4, 2, 2.5) == (1, True, 3)
    assert busiest_rank(32, 1, 0.5) == (32, True, 32)


def test_a_pipeline_is_timed_on_its_busiest_rank_not_on_every_layer_share_and_the_head():
    run, _ = plan_run("llama-tiny", gpus=4, gpu="h100", seq=32, global_batch=8)  # test_plan_interleaved's capture
    three = dataclasses.replace(run.costs.config, num_hidden_layers=3)  # 2 + 1 layers, the head beside the 1
    run = dataclasses.replace(run, costs=dataclasses.replace(run.costs, config=three))
    layout = Layout(2, 1, 2, microbatches=4)
    balanced = predict(run, layout)
    even = predict(dataclasses.replace(run, even_stages=True), layout)
    assert balanced.time["compute"] < even.time["compute"]
    assert balanced.memory == even.memory  # the first rank holds the most layers either way


@pytest.mark.parametrize("parameters", [20_000_000, 60_000_000])
def test_stage_2_reduce_scatters_run_on_behind_the_next_micro_batches(parameters):
    """4 micro-batches of 4 layers, 1 ms forward and 1 ms backward each. Alone each micro-batch's
    reduce-scatters would leave their tail exposed; behind the next micro-batches' work only the last
    tail is (20M parameters a layer), or what the link cannot finish by the step's end (60M)."""
    layers = [Layer(f"l{i}", parameters, 1e-3, 1e-3) for i in range(4)]
    one, step = sharded_step(2, layers, 64, LINK, 1), sharded_step(2, layers, 64, LINK, 4)
    reduce = (step.communication_s - one.communication_s) / 3  # one micro-batch's reduce-scatters
    window = 4 * 8e-3 - 4e-3  # from the first backward to the step's end
    assert 0 < one.exposed_s and step.exposed_s < 4 * one.exposed_s
    if 4 * reduce <= window:
        assert step.exposed_s == pytest.approx(one.exposed_s)
    else:
        assert 4 * reduce - window <= step.exposed_s <= 4 * reduce - window + one.exposed_s
    # a longer step (a pipeline's bubble) hides as much or more, never less than the last tail
    longer = sharded_step(2, layers, 64, LINK, 4, step_compute_s=10 * 4 * 8e-3)
    assert one.exposed_s == pytest.approx(longer.exposed_s) and longer.exposed_s <= step.exposed_s
