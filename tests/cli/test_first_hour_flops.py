"""FLOPs per token and MFU under every dimension (issue 48): `picofx train` under --dp 2, --tp 2,
--cp 2 and --pp 2 reports the whole model's FLOPs per token by 6N + 12LHT (as one process does), a
captured-graph figure that is the whole job's (not one rank's part) within 10% of one process's, and
MFU = FLOPs/token x the run's tokens/s / (ranks x one rank's peak)."""
import importlib
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

FAST = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "16", "--log-every", "1", "--steps", "1",
        "--microbatches", "2", "--no-measure-cuts"]
LAYOUTS = {"dp": ["--dp", "2"], "tp": ["--tp", "2"], "cp": ["--cp", "2"], "pp": ["--pp", "2"]}


def figures(result: dict) -> dict:
    measured = result["throughput"]
    return {"palm": measured.palm_flops_per_token, "graph": measured.graph_flops_per_token, "mfu": measured.mfu,
            "peak": measured.peak.flops, "replica_tokens_per_s": result["tokens_per_s"]}


def one_step_each(rank: int, world: int, layouts: list) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    train = importlib.import_module("picofx.cli.train")
    return {name: figures(train.main([*FAST, *LAYOUTS[name]])) for name in layouts}


def check_layouts(layouts: list) -> None:
    one = figures(importlib.import_module("picofx.cli.train").main(FAST))
    ranks = run_ranks(one_step_each, 2, layouts, timeout=900, collective_timeout=300)
    for name in layouts:
        for rank in ranks:
            got = rank[name]
            assert got["palm"] == one["palm"], name
            assert got["graph"] == pytest.approx(one["graph"], rel=0.10), (name, got["graph"], one["graph"])
            replicas = 2 if name == "dp" else 1
            assert got["mfu"] == pytest.approx(got["palm"] * got["replica_tokens_per_s"] * replicas / (2 * got["peak"]),
                                               rel=1e-9), name


def test_the_metric_functions_count_the_whole_job_under_each_dimension():
    """One process's graphs hold F FLOPs for a call of T tokens. Each layout's ranks hold their part:
    --dp 2 the whole on T tokens each; --tp 2 half the matmuls each, the norms whole (a little over F
    in all); --cp 2 half of every sequence each; --pp 2 a stage each on one micro-batch of T/2. The
    whole job's FLOPs per token is F/T for every one, and MFU divides by both ranks' peak."""
    from picofx.cli.train_metrics import captured_flops_per_token, model_flops_utilization
    from picofx.planner.layouts import Layout

    whole, tokens, norms = 1e9, 64, 1e6
    parts = {"dp": ([whole, whole], tokens), "tp": ([(whole - norms) / 2 + norms] * 2, tokens),
             "cp": ([whole / 2, whole / 2], tokens), "pp": ([0.6 * whole / 2, 0.4 * whole / 2], tokens // 2)}
    for name, (ranks, per_call) in parts.items():
        options = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, name: 2}
        layout = Layout(**options)
        assert layout.gpus == 2, name
        found = captured_flops_per_token(ranks[0], per_call, layout, total=lambda x, ranks=ranks: sum(ranks))
        assert found == pytest.approx(whole / tokens, rel=0.10 if name == "tp" else 1e-12), name
        replicas = 2 if name == "dp" else 1
        assert model_flops_utilization(6e6, 1000.0, 1e12, layout) == pytest.approx(6e6 * 1000.0 * replicas / 2e12)


@pytest.mark.slow  # one spawned group for the four layouts: about 2 minutes on 2 busy cores
def test_the_flops_per_token_and_mfu_under_every_dimension_are_the_whole_jobs():
    check_layouts(list(LAYOUTS))
