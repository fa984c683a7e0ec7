"""MFU and FLOPs per token of picofx train, for one process, data-parallel, tensor-parallel and
pipelined runs: the whole model's FLOPs over the peak of every rank, a CPU's peak measured."""
import pytest
import torch

import picofx
from picofx.cli import train_metrics
from picofx.cli.train_args import parse_args
from picofx.cli.train_layout import run_layout
from picofx.planner.layouts import Layout
from picofx.cli.train_metrics import (Peak, captured_flops_per_token, model_flops_utilization,
                                      oversubscribed, palm_flops_per_token, rank_peak, throughput)
from picofx.models import zoo

FLOPS_PER_TOKEN = 0.95e6
PEAK = 80e9


def reference_mfu(layout: Layout, replica_batch_tokens: int, step_seconds: float) -> float:
    """Written out from the definition: the FLOPs the whole run does in a step (every replica's batch
    through the whole model) over what every rank could have done in that time."""
    done = FLOPS_PER_TOKEN * replica_batch_tokens * layout.dp
    possible = PEAK * layout.gpus * step_seconds
    return done / possible


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2), Layout(pp=2), Layout(dp=2, pp=2), Layout(dp=3, pp=4),
                                    Layout(tp=2), Layout(dp=2, tp=2), Layout(dp=2, tp=2, pp=2)])
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


@pytest.mark.parametrize("argv, world", [([], 2), (["--pp", "2"], 4), (["--tp", "2"], 2), (["--tp", "2", "--shard"], 4),
                                         (["--tp", "2", "--pp", "2"], 4), (["--tp", "2", "--pp", "2", "--shard"], 8)])
def test_the_layout_of_a_launch_counts_every_rank_it_uses(argv, world):
    args = parse_args(argv, environ={"RANK": "0", "WORLD_SIZE": str(world)})
    assert run_layout(args).gpus == world


def test_mfu_under_tensor_parallelism_divides_by_every_ranks_peak():
    """Two tensor-parallel ranks run one batch: the model's FLOPs at the replica's tokens/s over
    twice one rank's (here fake) peak."""
    z = zoo.build("llama-tiny", batch=2, seq=16)
    opt = picofx.optimize(z.model, z.example_inputs, [], backend="eager", loss_fn=z.loss_fn)
    peak = Peak(1e9, torch.float32, "measured", "a fake")
    layout = Layout(tp=2)
    measured = throughput(z.model, opt, 1000.0, seq=16, tokens_per_call=32, device="cpu", layout=layout,
                          total=lambda x: 2 * x, peak=lambda *_: peak)
    assert measured.mfu == palm_flops_per_token(z.model, 16) * 1000.0 / (2 * 1e9)
    assert "MFU" in measured.line(layout) and "1 GFLOP/s per rank x 2 ranks (a fake)" in measured.line(layout)


def test_a_cpu_peak_is_measured_at_the_steps_dtype_and_averaged_over_the_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path))  # none measured yet
    asked = []
    monkeypatch.setattr(train_metrics, "matmul_flops", lambda dtype, device, **_: asked.append(dtype) or 50e9)
    peak = rank_peak("cpu", torch.bfloat16, Layout(dp=2), total=lambda x: x + 30e9)  # the other rank: 30e9
    assert asked == [torch.bfloat16] and peak.flops == 40e9 and peak.kind == "measured"
    assert rank_peak("cpu", torch.float32, Layout()).flops == 50e9  # one process: no collective


def test_the_matmul_benchmark_measures_at_the_threads_torch_uses():
    assert 1e6 < train_metrics.matmul_flops(torch.float32, "cpu", size=64, repeats=1) < 1e14


@pytest.mark.parametrize("ranks, threads, cores, warned", [(2, 2, 2, True), (2, 1, 2, False), (1, 4, 2, True),
                                                           (1, 2, 2, False), (4, 1, 2, True)])
def test_more_threads_than_cores_is_said(ranks, threads, cores, warned):
    warning = oversubscribed(ranks, threads, cores)
    assert (warning is not None) == warned
    if warned:
        fix = f"OMP_NUM_THREADS={cores // ranks}" if ranks <= cores else f"at most {cores} ranks"
        assert f"than the {cores} cores" in warning and fix in warning


def layer_matmul_flops_per_token(c) -> int:
    """A decoder layer's projections, forward and backward (6 per weight), written out from the config."""
    head = c.hidden_size // c.num_attention_heads
    attention = c.hidden_size * head * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    return 6 * (attention + 3 * c.hidden_size * c.intermediate_size)


@pytest.mark.parametrize("tied", [False, True])
def test_an_embedding_lookup_is_not_counted_as_a_matmul_but_a_tied_head_is(tied):
    """The reference LLaMA and a Hugging Face Llama of its shape do the same matmuls, tied or not:
    the layers' projections, the output head (V x H) and attention; the embedding's lookup none."""
    pytest.importorskip("transformers")
    seq = 16
    reference = zoo.build("llama-tiny", seq=seq).model
    hf = zoo.build("hf-llama-tiny", seq=seq, tie_word_embeddings=tied).model
    c = reference.config
    expected = (c.num_hidden_layers * layer_matmul_flops_per_token(c) + 6 * c.vocab_size * c.hidden_size
                + 12 * c.num_hidden_layers * c.hidden_size * seq)
    assert palm_flops_per_token(reference, seq) == expected
    assert palm_flops_per_token(hf, seq) == expected
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
