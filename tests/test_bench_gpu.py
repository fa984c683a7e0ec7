"""tools/bench_gpu.py: its FLOP count (the MFU's numerator) against torch's flop counter, and on a
GPU the contenders' training against eager."""
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import bench_gpu  # noqa: E402
import picofx.capture.flops  # noqa: E402,F401  counts CPU attention


def test_training_flops_match_the_flop_counter():
    batch, seq = 2, 32
    model = bench_gpu.hf_model("tiny", seq)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    config, tokens = model.config, batch * seq
    # The counter counts the attention of every key (the causal mask's skipped half included) and
    # the scores the backward recomputes; MFU counts neither.
    one_scores_product = 2 * tokens * config.num_hidden_layers * seq * config.hidden_size
    masked_half, recomputed = 3 * one_scores_product, one_scores_product
    assert counter.get_total_flops() == bench_gpu.training_flops(config, tokens, seq) + masked_half + recomputed


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_contenders_train_like_eager_on_cuda(tmp_path):
    r = bench_gpu.main(["--shape", "tiny", "--batch", "2", "--seq", "128", "--warmup", "1", "--steps", "2",
                        "--contenders", "eager,torch.compile,picofx", "--no-planner", "--json", str(tmp_path / "r.json")])
    for name, c in r["contenders"].items():
        assert "error" not in c, f"{name}: {c['error']}"
        # bf16 matmuls and attention under autocast, in another order per contender
        assert c["loss_vs_eager"] < 2e-2, name
        assert c["peak_bytes"] > 0 and c["mfu"] > 0



def test_profile_writes_a_trace_per_contender_and_times_each_kind_of_work(tmp_path, capsys):
    r = bench_gpu.main(["--device", "cpu", "--shape", "tiny", "--batch", "1", "--seq", "16", "--warmup", "1",
                        "--steps", "1", "--contenders", "eager", "--no-planner", "--profile", "1",
                        "--json", str(tmp_path / "r.json")])
    profiled = r["profile"]["eager"]
    assert Path(profiled["trace"]).stat().st_size > 0 and profiled["steps"] == 1
    assert profiled["by_kind"]["matmul"] > 0 and profiled["sdpa"]
    assert "sdpa backends" in capsys.readouterr().out
