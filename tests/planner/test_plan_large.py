"""The planner at thousands of GPUs: a 405B-parameter Llama on 8,192 H100 is ranked a layout that
fits, at an MFU within what the published runs of 1,000 GPUs and more reach (tools/published_runs.py,
LARGE_RUNS and the rows of RUNS on 1,000 GPUs or more, all bf16), give or take the planner's 15%: its best
bf16 plan within that, a float8 plan within that times the gain the table's float8 rows reached."""
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


def float8_gain(tool) -> float:
    """The most the table's float8 rows gained over their bf16 twins (same model, GPUs, sequence, compile)."""
    same = lambda r: (r.model, r.gpus, r.seq, r.compiled)  # noqa: E731
    twins = [(f, b) for f in tool.RUNS for b in tool.RUNS
             if (f.layout.precision, b.layout.precision) == ("float8", "bf16") and same(f) == same(b)]
    return max(f.tokens_per_gpu / b.tokens_per_gpu for f, b in twins)


@pytest.mark.slow
def test_405b_on_8192_h100_is_ranked_a_layout_that_fits_at_the_large_runs_mfu(tool):
    large = [r for r in [*tool.RUNS, *tool.LARGE_RUNS] if r.gpus >= 1000]
    reached = [published_mfu(r) for r in large]
    assert len(large) >= 6 and 0.2 < min(reached) < max(reached) < 0.6
    assert all(r.layout.precision == "bf16" for r in large)
    _, plans = plan_run("llama3.1-405b", gpus=8192, gpu="h100", seq=8192, global_batch=2048)
    low, high = min(reached) / 1.15, max(reached) * 1.15
    bf16 = next(p for p in plans if p.fits and p.layout.precision == "bf16")
    assert low <= bf16.mfu <= high, (bf16.layout.describe(), bf16.mfu, reached)
    # MFU counts float8 matmuls against the bf16 peak: a float8 plan may gain what the table's float8 rows did
    best = next(p for p in plans if p.fits)
    gain = float8_gain(tool) if best.layout.precision != "bf16" else 1.0
    assert low <= best.mfu <= high * gain, (best.layout.describe(), best.mfu, reached, gain)
    assert any(p.layout.virtual_stages > 2 for p in plans[:20])  # the search interleaves deeper where it pays
