"""Pipeline stages per rank in the search: 1, 2 and the counts that split a rank's layers evenly (Llama 3's
126 layers as 16 ranks x 8 chunks, the embedding and head filling two), each deeper count tried while the
one before it saved 1% of the step; suggestions name the next count either way; published layouts pass the one rule."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import Run
from picofx.planner.models import model_config, parameter_count
from picofx.planner.pipeline import pipeline_refusal, virtual_stage_counts
from picofx.planner.recipe import refusal
from picofx.planner.search import DEEPER_GAIN, plan_layouts
from picofx.planner.suggest import Neighbourhood


def synthetic(link_latency: float) -> Run:
    """16 layers of llama-tiny's width with costs in milliseconds on 8 H100, 8 sequences a step."""
    config = dataclasses.replace(model_config("llama-tiny"), num_hidden_layers=16)
    costs = ModelCosts(config, 64, 1e-3, 2e-3, 4 * 10**8, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6)
    return Run(costs, dataclasses.replace(devices()["h100"], link_latency=link_latency), 8, 8, 8)


def test_the_counts_split_a_ranks_layers_with_the_embedding_and_head_in_chunks_of_their_own():
    assert virtual_stage_counts(126, 16) == [1, 2, 4, 8]  # Llama 3 405B: 128 chunks of one layer's place
    assert virtual_stage_counts(32, 8) == [1, 2, 4] and virtual_stage_counts(80, 8) == [1, 2, 5, 10]
    assert virtual_stage_counts(32, 1) == [1]
    assert pipeline_refusal(126, 16, 8) is None
    assert "exceeds the 126 layers and the embedding and head (128 chunks)" in pipeline_refusal(126, 16, 9)


def deep(plans, v):
    return [p for p in plans if p.layout.virtual_stages == v]


@pytest.fixture(scope="module")
def nvlink():
    run = synthetic(devices()["h100"].link_latency)
    return run, plan_layouts(run)


def test_more_stages_per_rank_are_planned_where_the_bubble_pays_for_their_sends(nvlink):
    run, plans = nvlink
    assert deep(plans, 4) and deep(plans, 8)
    best = next(p for p in plans if p.fits and p.layout.pp == 2)
    assert best.layout.virtual_stages == 8, best.layout.describe()


def test_a_count_saving_less_than_one_percent_on_the_one_below_it_is_the_last_tried(nvlink):
    slow_sends = synthetic(10e-3)  # 10 ms a send
    for run, plans in [nvlink, (slow_sends, plan_layouts(slow_sends))]:
        predicted = {p.layout: p for p in plans}
        for plan in [*deep(plans, 4), *deep(plans, 8)]:
            counts = virtual_stage_counts(run.costs.layers, plan.layout.pp)
            i = counts.index(plan.layout.virtual_stages)
            below, lower = (predicted[dataclasses.replace(plan.layout, virtual_stages=v, schedule="1F1B")]
                            for v in (counts[i - 1], counts[i - 2]))
            assert not lower.fits or below.step_s <= lower.step_s * (1 - DEEPER_GAIN), plan.layout.describe()
    stopped = [p for p in deep(plans, 2) if p.fits and dataclasses.replace(p.layout, virtual_stages=4) not in predicted]
    assert stopped and len(deep(plans, 8)) < len(deep(nvlink[1], 8))


def test_a_deeper_interleaving_is_suggested_where_it_pays(nvlink):
    run, plans = nvlink
    two = next(p for p in deep(plans, 2) if p.fits and p.layout.pp == 2)
    changes = [s.change for s in Neighbourhood(run).suggest(two)]
    assert "interleaved 1F1B, 4 stages per rank" in changes, changes


def test_every_published_layout_passes_the_one_rule(import_tool):
    """Llama 3's 16 micro-batches on 16 ranks of 8 stages among them: torch runs them (the micro-batch rule)."""
    tool = import_tool("published_runs")
    for run in [*tool.RUNS, *tool.LARGE_RUNS]:
        config = run.model if not isinstance(run.model, str) else model_config(run.model)
        assert pipeline_refusal(config.num_hidden_layers, run.layout.pp, run.layout.virtual_stages) is None, run.name
        assert refusal(run.layout) is None, (run.name, refusal(run.layout))
