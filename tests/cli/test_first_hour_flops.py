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


@pytest.mark.slow  # one spawned group for the four layouts: about 2 minutes on 2 busy cores
def test_the_flops_per_token_and_mfu_under_every_dimension_are_the_whole_jobs():
    check_layouts(list(LAYOUTS))
