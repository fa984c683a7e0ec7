"""Suggestions: every plan names its neighbouring layouts that help, best first, with the gains the
planner's own predictions of the two layouts give and the bottleneck each addresses, or says that none helps."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.planner import plan_run
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import BOTTLENECKS, DOES_NOT_FIT, Layout, Run, plan_layouts, predict
from picofx.planner.models import model_config, parameter_count
from picofx.planner.suggest import NONE_HELPS, Planned, Suggestion, suggest


@pytest.fixture(scope="module")
def tiny():
    return plan_run("llama-tiny", gpus=4, gpu="h100", seq=32, global_batch=8)


def suggested(run: Run) -> list:
    """plan_run's ranking and suggestions, for a Run made here."""
    predictions = plan_layouts(run)
    planned = Planned(predictions)
    for p in predictions:
        p.suggestions = suggest(p, planned)
    return predictions


def compute_bound(gpus: int = 4, global_batch: int = 16, memory: int | None = None) -> Run:
    """A run whose layers take milliseconds: the per-op overheads are small beside them."""
    config = model_config("llama-tiny")
    costs = ModelCosts(config, 32, 1e-3, 2e-3, 4 * 10**8, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6)
    gpu = devices()["h100"] if memory is None else dataclasses.replace(devices()["h100"], memory_capacity=memory)
    return Run(costs, gpu, gpus, gpus, global_batch)


def test_every_plan_has_a_suggestion_or_says_none_helps(tiny):
    _, predictions = tiny
    for p in predictions:
        assert p.suggestions and all(isinstance(s, Suggestion) for s in p.suggestions), p.layout
        if p.suggestions[0].change == NONE_HELPS:
            assert len(p.suggestions) == 1 and p.suggestions[0].layout is None
        else:
            assert all(s.addresses in {*BOTTLENECKS.values(), DOES_NOT_FIT} for s in p.suggestions)
    assert any(p.suggestions[0].layout is not None for p in predictions)


def test_a_suggestions_gains_are_the_difference_of_the_two_predictions_best_first(tiny):
    run, predictions = tiny
    for p in predictions:
        for s in p.suggestions:
            if s.layout is None:
                continue
            other = predict(run, s.layout)
            assert s.step_seconds_gain == pytest.approx(p.step_s - other.step_s)
            assert s.memory_bytes_gain == p.memory_per_gpu - other.memory_per_gpu
            assert other.fits and other.step_s < p.step_s
        gains = [s.step_seconds_gain for s in p.suggestions]
        assert gains == sorted(gains, reverse=True)


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
