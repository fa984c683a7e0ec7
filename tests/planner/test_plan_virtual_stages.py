"""Pipeline stages per rank in the search: 1, 2 and the counts that split a rank's layers evenly (Llama 3's
126 layers as 16 ranks x 8 chunks, the embedding and head filling two), each deeper count tried while the
one before it saved 1% of the step and the plan could still be the fastest; suggestions name the next count;
published layouts pass the one rule."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import Layout, Run, predict
from picofx.planner.models import model_config, parameter_count
from picofx.planner.pipeline import pipeline_refusal, virtual_stage_counts
from picofx.planner.recipe import refusal
from picofx.planner.search import DEEPER_GAIN, deeper_interleaving
from picofx.planner.suggest import Neighbourhood


def synthetic(link_latency: float) -> Run:
    """16 layers of llama-tiny's width with costs in milliseconds on 8 H100, 8 sequences a step, sends
    taking `link_latency` each."""
    config = dataclasses.replace(model_config("llama-tiny"), num_hidden_layers=16)
    costs = ModelCosts(config, 64, 1e-3, 2e-3, 4 * 10**8, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6)
    return Run(costs, dataclasses.replace(devices()["h100"], link_latency=link_latency), 8, 8, 8)


def test_the_counts_split_a_ranks_layers_with_the_embedding_and_head_in_chunks_of_their_own():
    assert virtual_stage_counts(126, 16) == [1, 2, 4, 8]  # Llama 3 405B: 128 chunks of one layer's place
    assert virtual_stage_counts(32, 8) == [1, 2, 4] and virtual_stage_counts(80, 8) == [1, 2, 5, 10]
    assert virtual_stage_counts(32, 1) == [1]
    assert pipeline_refusal(126, 16, 8) is None
    assert "exceeds the 126 layers and the embedding and head (128 chunks)" in pipeline_refusal(126, 16, 9)


PIPELINE = Layout(4, 1, 2, microbatches=2)  # 8 layers a rank: 1, 2, 4 or 8 stages per rank


def deeper(run: Run, *others: Layout) -> dict:
    """Stages per rank -> the plan of PIPELINE deeper_interleaving predicts beside 1 and 2 (and `others`)."""
    given = [predict(run, layout) for layout in (PIPELINE, dataclasses.replace(PIPELINE, virtual_stages=2), *others)]
    return {p.layout.virtual_stages: p for p in deeper_interleaving(run, given)}


def test_more_stages_per_rank_are_planned_while_the_bubble_pays_for_their_sends():
    run = synthetic(devices()["h100"].link_latency)
    found = deeper(run)
    assert set(found) == {4, 8} and found[8].step_s < found[4].step_s
    assert found[8].time["bubble"] < found[4].time["bubble"] / 1.9  # (pp - 1) / v micro-batches
    assert Neighbourhood(run).suggest(found[4])[0].change == "interleaved 1F1B, 8 stages per rank"


def test_a_count_saving_less_than_one_percent_on_the_one_below_it_is_the_last_tried():
    run = synthetic(2e-3)  # 2 ms a send: 2 stages per rank save 1% or more, 4 do not
    one, two = (predict(run, dataclasses.replace(PIPELINE, virtual_stages=v)) for v in (1, 2))
    found = deeper(run)
    assert two.step_s <= one.step_s * (1 - DEEPER_GAIN) and set(found) == {4}
    assert found[4].step_s > two.step_s * (1 - DEEPER_GAIN)


def test_a_plan_whose_step_less_its_bubble_is_slower_than_the_fastest_is_not_deepened():
    run = synthetic(devices()["h100"].link_latency)
    assert deeper(run, Layout(8, 1, 1)) == {}  # data parallel alone is faster than any interleaving can make it


def test_every_published_layout_passes_the_one_rule(import_tool):
    """Llama 3's 16 micro-batches on 16 ranks of 8 stages among them: torch runs them (the micro-batch rule)."""
    tool = import_tool("published_runs")
    for run in [*tool.RUNS, *tool.LARGE_RUNS]:
        config = run.model if not isinstance(run.model, str) else model_config(run.model)
        assert pipeline_refusal(config.num_hidden_layers, run.layout.pp, run.layout.virtual_stages) is None, run.name
        assert refusal(run.layout) is None, (run.name, refusal(run.layout))
