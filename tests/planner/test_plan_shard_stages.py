"""Shard stages in the planner (picofx.planner.sharding): what each sends per step and keeps per
rank, the search trying each, and suggestions naming the stage where it pays."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.cost.shard import Layer
from picofx.planner import plan_run
from picofx.planner.layouts import Layout, predict, valid
from picofx.planner.search import enumerate_layouts
from picofx.planner.sharding import sharded_step
from picofx.planner.suggest import Neighbourhood

LAYERS = [Layer(f"l{i}", 1_000_000, 1e-3, 2e-3) for i in range(4)]
LINK = devices()["h100"].network_link(1)


@pytest.mark.parametrize("stage, gathers, reduces", [(1, 1, 1), (2, 1, 4), (3, 8, 4)])
def test_each_stage_sends_its_collectives_per_step(stage, gathers, reduces):
    """4 micro-batches: stage 1 one gather and one reduce-scatter a step; stage 2 one gather, a
    reduce-scatter per micro-batch; stage 3 (resharding after the forward) two gathers and a reduce-scatter each."""
    one = sharded_step(stage, LAYERS, 8, LINK, 1, hidden=False, reshard_after_forward=True)
    gather = sharded_step(1, LAYERS, 8, LINK, 1, hidden=False).communication_s - \
        sharded_step(2, LAYERS, 8, LINK, 2, hidden=False).communication_s + \
        sharded_step(2, LAYERS, 8, LINK, 1, hidden=False).communication_s
    reduce = one.communication_s - gather * (2 if stage == 3 else 1) if stage == 3 else \
        sharded_step(1, LAYERS, 8, LINK, 1, hidden=False).communication_s - gather
    step = sharded_step(stage, LAYERS, 8, LINK, 4, hidden=False, reshard_after_forward=True)
    assert step.communication_s == pytest.approx(gathers * gather + reduces * reduce)


def test_stage_3_without_resharding_gathers_once_per_micro_batch():
    again = sharded_step(3, LAYERS, 8, LINK, 4, hidden=False, reshard_after_forward=True).communication_s
    kept = sharded_step(3, LAYERS, 8, LINK, 4, hidden=False, reshard_after_forward=False).communication_s
    assert kept < again


def test_each_stage_keeps_what_it_does_not_shard():
    layers = LAYERS * 4
    s1, s2, s3 = (sharded_step(stage, layers, 8, LINK, 4) for stage in (1, 2, 3))
    parameters = sum(layer.parameters for layer in layers)
    assert s1.state_bytes == 8 * parameters + 8 * parameters / 8  # fp32 parameters and gradients whole
    assert s2.state_bytes == s3.state_bytes == 16 * parameters / 8
    assert s2.gathered_bytes >= 2 * parameters > s3.gathered_bytes  # the stage's bf16 parameters kept


@pytest.fixture(scope="module")
def tiny_run():
    run, _ = plan_run("llama-tiny", gpus=16, gpu="h100", seq=32, global_batch=64)
    return run


def test_the_search_tries_each_stage_and_interleaves_pipelines_only(tiny_run):
    layouts = enumerate_layouts(tiny_run)
    assert {layout.shard_stage for layout in layouts if layout.shard} == {1, 2, 3}
    assert all(layout.pp > 1 for layout in layouts if layout.virtual_stages > 1)
    assert valid(tiny_run, Layout(16, 1, 1, virtual_stages=2)) == "virtual_stages without a pipeline (pp 1)"


def test_with_many_micro_batches_a_lower_stage_pays_and_is_suggested(tiny_run):
    layout = Layout(16, 1, 1, shard=True, microbatches=4)
    stage3 = predict(tiny_run, layout)
    stage1 = predict(tiny_run, dataclasses.replace(layout, shard_stage=1))
    assert stage1.time["data_parallel_exposed"] < stage3.time["data_parallel_exposed"] / 4
    changes = [s.change for s in Neighbourhood(tiny_run).suggest(stage3)]
    assert any(change.startswith("shard stage") for change in changes), changes
