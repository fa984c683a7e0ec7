"""The cost terms `picofx plan --measure` calibrates on a CPU: per-op overhead per call, AdamW's and
DTensor's per-parameter-tensor costs, the slowest of the ranks measuring at once, a machine slowed
down after its calibration; and which layouts are measured (their passes: test_recipe.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from picofx.cost.device import cpu
from picofx.models.llama import CONFIGS
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import Layout, Run, predict
from picofx.parallel.launch import run_ranks
from picofx.planner.measure import at_load, lockstep_seconds, measurable

INSTANT = float("inf")


def overhead_only(**overheads):
    """A device whose compute, memory and links take no time: only the per-op and per-tensor costs count."""
    return dataclasses.replace(cpu(1), peak_flops={torch.float32: INSTANT}, memory_bandwidth=INSTANT,
                               link_bandwidth=INSTANT, link_latency=0.0, network_bandwidth=INSTANT,
                               network_latency=0.0, **{"op_overhead": 0.0, **overheads})


def costs(layers: int, layer_ops: int = 30, rest_ops: int = 10) -> ModelCosts:
    config = dataclasses.replace(CONFIGS["tiny"], num_hidden_layers=layers)
    return ModelCosts(config, 64, 0.0, 0.0, 1, 0.0, 0.0, 1, 1, 10_000, 1.0, layer_ops, rest_ops, 9, 3)


def step(model: ModelCosts, layout: Layout, gpus: int = 4, **overheads) -> float:
    return predict(Run(model, overhead_only(**overheads), gpus, gpus, 8), layout).step_s


def test_each_call_pays_every_op_of_its_layers_and_the_rest():
    layout = Layout(dp=4, tp=1, pp=1)
    assert step(costs(2), layout, op_overhead=1e-3) == pytest.approx((2 * 30 + 10) * 1e-3)
    assert step(costs(4), layout, op_overhead=1e-3) == pytest.approx((4 * 30 + 10) * 1e-3)
    two_calls = dataclasses.replace(layout, microbatches=2)  # gradient accumulation: a call per micro-batch
    assert step(costs(2), two_calls, op_overhead=1e-3) == pytest.approx(2 * (2 * 30 + 10) * 1e-3)


def test_the_optimizer_pays_per_parameter_tensor_and_more_for_dtensors():
    per_tensor = {"optimizer_tensor_overhead": 1e-3, "dtensor_parameter_overhead": 4e-3}
    assert step(costs(2), Layout(dp=4, tp=1, pp=1), **per_tensor) == pytest.approx((2 * 9 + 3) * 1e-3)
    assert step(costs(4), Layout(dp=4, tp=1, pp=1), **per_tensor) == pytest.approx((4 * 9 + 3) * 1e-3)
    for dtensors in (Layout(dp=4, tp=1, pp=1, shard=True), Layout(dp=2, tp=2, pp=1)):
        assert step(costs(2), dtensors, **per_tensor) == pytest.approx((2 * 9 + 3) * 5e-3)


def sleep_by_rank(rank: int, world: int) -> float:
    import time

    return lockstep_seconds(lambda: time.sleep(0.02 * rank), repeats=3)


def test_ranks_measured_at_once_each_take_the_slowest_ranks_time():
    fast, slow = run_ranks(sleep_by_rank, 2, timeout=120)
    assert fast == slow >= 0.02  # rank 0 sleeps not at all; both report rank 1's 20 ms


def test_every_layout_but_a_checkpointed_one_is_measured():
    assert measurable(Layout(dp=2, tp=2, pp=1, shard=True)) is None
    assert measurable(Layout(dp=1, tp=2, pp=2, microbatches=2)) is None
    assert measurable(Layout(dp=4, tp=1, pp=1, checkpoint=True)) is not None


def test_a_plan_is_predicted_again_as_much_slower_as_the_probe_ran():
    calibrated = dataclasses.replace(cpu(1), op_overhead=1e-5, optimizer_tensor_overhead=2e-5,
                                     dtensor_parameter_overhead=3e-4)
    busier = at_load(calibrated, 2.0)
    assert (busier.op_overhead, busier.optimizer_tensor_overhead, busier.dtensor_parameter_overhead) \
        == pytest.approx((2e-5, 4e-5, 6e-4))
    assert busier.peak_flops[torch.float32] == pytest.approx(calibrated.peak_flops[torch.float32] / 2)
    assert busier.memory_bandwidth == pytest.approx(calibrated.memory_bandwidth / 2)
    overheads = overhead_only(op_overhead=1e-5, optimizer_tensor_overhead=2e-5, dtensor_parameter_overhead=3e-4)
    for layout in (Layout(dp=4, tp=1, pp=1, microbatches=2), Layout(dp=2, tp=2, pp=1, shard=True)):
        slow, fast = (predict(Run(costs(2), device, 4, 4, 8), layout).step_s
                      for device in (at_load(overheads, 2.0), overheads))
        assert slow == pytest.approx(2 * fast)


def test_the_model_costs_count_a_layers_ops_and_parameter_tensors():
    from picofx.cost.model import CostModel
    from picofx.planner.costs import model_costs

    tiny = model_costs(CONFIGS["tiny"], 16, CostModel(cpu(1)), ("fuse",))
    assert tiny.layer_tensors == 9  # q, k, v, o, gate, up, down and the two norms
    assert tiny.rest_tensors == 3  # embedding, final norm, head
    assert tiny.layer_ops > tiny.rest_ops > 0
