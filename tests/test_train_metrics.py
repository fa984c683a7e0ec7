"""MFU and FLOPs per token of examples/train_llama.py, for one process, data parallel and pipelined
runs: the whole model's FLOPs over the peak of every rank."""
import pytest

from picofx.cli.train_metrics import Layout, captured_flops_per_token, model_flops_utilization

FLOPS_PER_TOKEN = 0.95e6
PEAK = 80e9


def reference_mfu(layout: Layout, replica_batch_tokens: int, step_seconds: float) -> float:
    """Written out from the definition: the FLOPs the whole run does in a step (every replica's batch
    through the whole model) over what every rank could have done in that time."""
    done = FLOPS_PER_TOKEN * replica_batch_tokens * layout.dp
    possible = PEAK * layout.ranks * step_seconds
    return done / possible


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2), Layout(pp=2), Layout(dp=2, pp=2), Layout(dp=3, pp=4)])
def test_mfu_is_the_whole_runs_flops_over_every_ranks_peak(layout):
    tokens, seconds = 8 * 128, 0.37
    mfu = model_flops_utilization(FLOPS_PER_TOKEN, tokens / seconds, PEAK, layout)
    assert mfu == pytest.approx(reference_mfu(layout, tokens, seconds), rel=1e-12)


def test_a_pipeline_at_half_the_speed_uses_a_quarter_of_what_one_process_does():
    single = model_flops_utilization(FLOPS_PER_TOKEN, 10_000, PEAK, Layout())
    assert model_flops_utilization(FLOPS_PER_TOKEN, 5_000, PEAK, Layout(pp=2)) == pytest.approx(single / 4)
    # replicas at one process's speed each: the same MFU
    assert model_flops_utilization(FLOPS_PER_TOKEN, 10_000, PEAK, Layout(dp=4)) == pytest.approx(single)


def test_captured_flops_are_summed_over_the_stages_and_counted_once_per_replica():
    stage_flops = {0: 3.0e9, 1: 5.0e9}  # one micro-batch through each stage
    micro_tokens = 2 * 128
    whole = sum(stage_flops.values()) / micro_tokens
    layout = Layout(pp=2)
    assert captured_flops_per_token(stage_flops[0], micro_tokens, layout, total=lambda _: 8.0e9) == whole
    replicated = Layout(dp=2, pp=2)  # the all-reduce sums both replicas' copies of each stage
    assert captured_flops_per_token(stage_flops[1], micro_tokens, replicated, total=lambda _: 16.0e9) == whole
    assert captured_flops_per_token(8.0e9, 4 * 128, Layout(dp=2)) == 8.0e9 / (4 * 128)
