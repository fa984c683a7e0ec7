"""The planner at thousands of GPUs: a 405B-parameter Llama on 8,192 H100 is ranked a layout that
fits, at an MFU within what the published runs of 1,000 GPUs and more reach (tools/published_runs.py,
LARGE_RUNS and the rows of RUNS on 1,000 GPUs or more), give or take the planner's 15%."""
from __future__ import annotations

import pytest
import torch

from picofx.cost.gpus import GPUS
from picofx.planner import plan_run
from picofx.planner.models import model_config, parameter_count


def published_mfu(run) -> float:
    """The run's MFU as the planner counts FLOPs: 6 x the matmuls' parameters + 12 L h T per token."""
    if run.mfu:
        return run.mfu
    config = run.model if not isinstance(run.model, str) else model_config(run.model)
    matmuls = parameter_count(config) - config.vocab_size * config.hidden_size
    per_token = 6 * matmuls + 12 * config.num_hidden_layers * config.hidden_size * run.seq
    return run.tokens_per_gpu * per_token / GPUS[run.gpu].flops_per_second(torch.bfloat16)


@pytest.fixture(scope="module")
def tool(import_tool):
    return import_tool("published_runs")


@pytest.mark.slow
def test_405b_on_8192_h100_is_ranked_a_layout_that_fits_at_the_large_runs_mfu(tool):
    large = [r for r in [*tool.RUNS, *tool.LARGE_RUNS] if r.gpus >= 1000]
    reached = [published_mfu(r) for r in large]
    assert len(large) >= 6 and 0.2 < min(reached) < max(reached) < 0.6
    _, plans = plan_run("llama3.1-405b", gpus=8192, gpu="h100", seq=8192, global_batch=2048)
    best = next(p for p in plans if p.fits)
    assert min(reached) / 1.15 <= best.mfu <= max(reached) * 1.15, (best.layout.describe(), best.mfu, reached)
