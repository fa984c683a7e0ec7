"""Pass `pipeline` with measure=True: units timed by running one micro-batch, a clock at each boundary."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from picofx.parallel.layouts import recorded
from picofx.capture.export import capture_call
from picofx.capture.vocabulary import SIGNATURE_META
from picofx.cost.model import CostModel
from picofx.manager import Context
from picofx.optimize import graph_inputs
from picofx.passes import Pipeline
from picofx.cost.chain import chain_units
from picofx.passes.pipeline import keep_loss_only
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


def test_measured_cuts_leave_the_wide_block_alone_on_its_stage():
    model, gm, inputs = _captured([NARROW, NARROW, WIDE, NARROW])
    ctx = Context(model=model, example_inputs=inputs, device=torch.device("cpu"), cost_model=CostModel())
    result = Pipeline(stages=3, schedule="GPipe", microbatches=4, measure=True)(gm, ctx)
    layout = recorded(result.graphs[0]).pipeline
    assert result.notes["unit_times"] == "measured"
    firsts = [layout.units[c].label for c in layout.plan.cuts]
    assert firsts[0].startswith("blocks.2") and not firsts[1].startswith("blocks.2"), firsts
    slowest = max(layout.plan.stages, key=lambda s: s.time)
    assert layout.units[slowest.units.start].label.startswith("blocks.2")


def test_measuring_a_model_on_the_meta_device_is_refused():
    model, gm, inputs = _captured([NARROW] * 3)
    ctx = Context(model=model, example_inputs=inputs, device=torch.device("meta"), cost_model=CostModel())
    with pytest.raises(ValueError, match="meta device.*measure=False"):
        Pipeline(stages=2, microbatches=2, measure=True)(gm, ctx)
