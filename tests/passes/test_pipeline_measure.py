"""Pass `pipeline` with measure=True: units timed by running one micro-batch, a clock at each boundary."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from picofx.parallel.layouts import recorded
from picofx.capture.export import capture_call
from picofx.capture.vocabulary import SIGNATURE_META
from picofx.cost.model import CostModel
from picofx.manager import Context
from picofx.api import graph_inputs
from picofx.passes import Pipeline
from picofx.cost.balance import plan_for
from picofx.cost.chain import chain_units, state_per_parameter_byte
from picofx.passes.pipeline.pipeline import keep_loss_only
from picofx.runtime.unit_clock import measure_units

WIDE, NARROW = 2048, 16  # the wide block's matmuls do 128x the narrow blocks' work, forward and backward


class Block(nn.Module):
    def __init__(self, width: int, dim: int = 128):
        super().__init__()
        self.up, self.down = nn.Linear(dim, width), nn.Linear(width, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Chain(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.blocks = nn.ModuleList(Block(w) for w in widths)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _captured(widths, batch: int = 256):
    torch.manual_seed(0)
    model = Chain(widths)
    kwargs = {"x": torch.randn(batch, 128), "labels": torch.randn(batch, 128)}
    gm = capture_call(model, (), kwargs, nn.functional.mse_loss)
    return model, gm, graph_inputs(gm.meta[SIGNATURE_META], model, (), kwargs)


def _block_times(widths):
    model, gm, inputs = _captured(widths)
    keep_loss_only(gm)
    units, starts, main = chain_units(gm, CostModel(), "layers")
    times = measure_units(gm, inputs, main, starts)
    by_block: dict[str, float] = {}
    for unit, seconds in zip(units, times):
        block = ".".join(unit.label.split(".")[:2]) if unit.label.startswith("blocks.") else unit.label
        by_block[block] = by_block.get(block, 0.0) + seconds
    return model, by_block


@pytest.mark.parametrize("wide", [0, 2])
def test_the_clock_charges_each_block_its_own_forward_and_backward(wide):
    widths = [NARROW] * 4
    widths[wide] = WIDE
    model, times = _block_times(widths)
    heavy = times.pop(f"blocks.{wide}")
    assert all(seconds > 0 for seconds in times.values()), times
    assert heavy > 4 * max(times.values()), (heavy, times)
    assert all(p.grad is None for p in model.parameters())  # it ran on detached copies


def test_measured_cuts_keep_the_wide_block_whole_on_the_slowest_stage_and_are_optimal():
    model, gm, inputs = _captured([NARROW, NARROW, WIDE, NARROW])
    ctx = Context(model=model, example_inputs=inputs, device=torch.device("cpu"), cost_model=CostModel())
    result = Pipeline(stages=3, schedule="GPipe", microbatches=4, measure=True)(gm, ctx)
    layout = recorded(result.graphs[0]).pipeline
    assert result.notes["unit_times"] == "measured"
    plan, units = layout.plan, layout.units
    stage_of = {units[i].label: s.index for s in plan.stages for i in s.units}
    wide_stages = {index for label, index in stage_of.items() if label.startswith("blocks.2")}
    assert len(wide_stages) == 1, layout.table()  # never cut inside the wide block
    assert plan.stages[wide_stages.pop()] is max(plan.stages, key=lambda s: s.time), layout.table()
    # Which narrow neighbour shares the wide block's stage is decided by timing noise and the links'
    # cost, so the check is against every other cut on the measured times, not one expected cut:
    # the DP finds the least slowest stage, and refining it only lowers the step, so the plan's step
    # is at most that of the best cut whose slowest stage is least.
    args = dict(schedule="GPipe", microbatches=4, virtual=1, link=CostModel().device.intra_node_link,
                state_per_parameter_byte=state_per_parameter_byte(model))
    others = [plan_for(units, [0, a, b], **args) for a, b in itertools.combinations(range(1, len(units)), 2)]
    least = min(max(s.time for s in other.stages) for other in others)
    assert plan.step_time <= min(o.step_time for o in others if max(s.time for s in o.stages) == least) + 1e-12, \
        layout.table()


def test_measuring_a_model_on_the_meta_device_is_refused():
    model, gm, inputs = _captured([NARROW] * 3)
    ctx = Context(model=model, example_inputs=inputs, device=torch.device("meta"), cost_model=CostModel())
    with pytest.raises(ValueError, match="meta device.*measure=False"):
        Pipeline(stages=2, microbatches=2, measure=True)(gm, ctx)
