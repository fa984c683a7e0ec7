"""Suggestions: every plan names its neighbouring layouts that help, best first, with the gains the
planner's own predictions of the two layouts give and the bottleneck each addresses, or says that none helps."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.planner import plan_run
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import BOTTLENECKS, DOES_NOT_FIT, Checkpointing, Layout, Run, predict
from picofx.planner.search import plan_layouts
from picofx.planner.models import model_config, parameter_count
from picofx.planner.suggest import NONE_HELPS, Neighbourhood, Suggestion, with_suggestions


@pytest.fixture(scope="module")
def tiny_on_cpu():
    return plan_run("llama-tiny", gpus=4, gpu="cpu", seq=32, global_batch=8)


def suggested(run: Run) -> list:
    """plan_run's ranking and suggestions, for a Run made here."""
    return with_suggestions(run, plan_layouts(run))


def compute_bound(gpus: int = 4, global_batch: int = 16, memory: int | None = None) -> Run:
    """A run whose layers take milliseconds: the per-op overheads are small beside them."""
    config = model_config("llama-tiny")
    costs = ModelCosts(config, 32, 1e-3, 2e-3, 4 * 10**8, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6)
    gpu = devices()["h100"] if memory is None else dataclasses.replace(devices()["h100"], memory_capacity=memory)
    return Run(costs, gpu, gpus, gpus, global_batch)


def every_row_is_told_what_helps(run, predictions) -> None:
    """Each plan has suggestions, best first, each gain that of predicting its neighbour directly, or
    the one NONE_HELPS; some plan is told a change."""
    for p in predictions:
        assert sum(p.time.values()) == pytest.approx(p.step_s)  # the terms a suggestion's bottleneck is read from
        assert p.suggestions and all(isinstance(s, Suggestion) for s in p.suggestions), p.layout
        if p.suggestions[0].change == NONE_HELPS:
            assert len(p.suggestions) == 1 and p.suggestions[0].layout is None
            continue
        for s in p.suggestions:
            assert s.addresses in {*BOTTLENECKS.values(), DOES_NOT_FIT}
            other = predict(run, s.layout)
            assert s.step_seconds_gain == pytest.approx(p.step_s - other.step_s)
            assert s.memory_bytes_gain == p.memory_per_gpu - other.memory_per_gpu
            assert other.fits and (other.step_s < p.step_s or not p.fits)
        gains = [s.step_seconds_gain for s in p.suggestions]
        assert gains == sorted(gains, reverse=True)
    assert any(p.suggestions[0].layout is not None for p in predictions)


def test_every_plan_of_a_tiny_model_on_cpu_ranks_is_told_what_helps(tiny_on_cpu):
    every_row_is_told_what_helps(*tiny_on_cpu)


def test_every_plan_of_llama2_7b_on_8_h100_is_told_what_helps(llama2_7b_on_8_h100):
    every_row_is_told_what_helps(*llama2_7b_on_8_h100)


@pytest.mark.slow
def test_every_plan_of_llama2_70b_on_64_h100_is_told_what_helps(llama2_70b_on_64_h100):
    every_row_is_told_what_helps(*llama2_70b_on_64_h100)


def test_a_neighbour_is_one_option_away_and_predicted_even_where_the_ranking_left_it_out():
    run = compute_bound()
    lone = predict(run, Layout(2, 1, 2, microbatches=2))
    found = dict(Neighbourhood(run).neighbours(lone.layout))
    assert found["4 micro-batches"].layout == Layout(2, 1, 2, microbatches=4)
    assert found["full checkpointing (every layer)"].layout == Layout(2, 1, 2, microbatches=2, checkpoint="full")
    assert found["selective checkpointing"].layout == Layout(2, 1, 2, microbatches=2, checkpoint="selective")
    assert found["sharded data parallel"].layout == Layout(2, 1, 2, shard=True, microbatches=2)
    pp1 = next(p for what, p in found.items() if what.startswith("pp 1"))
    tp2 = next(p for what, p in found.items() if what.startswith("tp 2"))
    assert (pp1.layout.dp, pp1.layout.pp) == (4, 1) and (tp2.layout.dp, tp2.layout.tp, tp2.layout.pp) == (1, 2, 2)
    assert "1 micro-batch" not in found  # fewer micro-batches than stages: not a layout the run can have
    assert all(p.layout != lone.layout for p in found.values())


def test_a_checkpointed_plan_is_told_what_dropping_it_gains():
    predictions = suggested(compute_bound())
    p = next(p for p in predictions if p.layout == Layout(4, 1, 1, checkpoint=Checkpointing.FULL) and p.fits)
    drop = next(s for s in p.suggestions if s.change == "no checkpointing")
    assert drop.addresses == "recompute" and drop.memory_bytes_gain < 0 < drop.step_seconds_gain


def test_more_micro_batches_address_the_pipeline_bubble():
    predictions = suggested(compute_bound())
    p = next(p for p in predictions if p.layout == Layout(2, 1, 2, microbatches=2))
    more = next(s for s in p.suggestions if s.change == "4 micro-batches")
    assert more.addresses == "pipeline bubble" and more.layout == Layout(2, 1, 2, microbatches=4)
    assert more.step_seconds_gain > 0


def test_a_plan_that_does_not_fit_is_told_the_neighbours_that_fit_fastest_first():
    everything = suggested(compute_bound())
    memory = sorted(p.memory_per_gpu for p in everything)[len(everything) // 2]  # half the plans fit
    predictions = suggested(compute_bound(memory=memory))
    too_big = [p for p in predictions if not p.fits]
    assert too_big and any(p.fits for p in predictions)
    helped = 0
    for p in too_big:
        if p.suggestions[0].layout is None:
            continue
        helped += 1
        assert all(s.addresses == DOES_NOT_FIT and s.memory_bytes_gain > 0 for s in p.suggestions)
        steps = [p.step_s - s.step_seconds_gain for s in p.suggestions]
        assert steps == sorted(steps)
    assert helped
