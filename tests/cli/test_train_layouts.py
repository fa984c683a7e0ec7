"""examples/train_llama.py on 2 gloo ranks, data parallel, pipelined and sharded: --save then --resume goes
on exactly as the run that did not stop, and a pipeline reports the whole model's FLOPs per token."""
import importlib
import math
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

FAST = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "16", "--log-every", "1",
        "--microbatches", "2", "--no-measure-cuts"]


def straight_then_saved_then_resumed(rank: int, world: int, layout: list, directory: str) -> dict:
    """On one rank of a group the harness made: 4 steps; 2 steps saved; 2 more resumed."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    train = importlib.import_module("picofx.cli.train")
    straight = train.main([*FAST, *layout, "--steps", "4"])
    first = train.main([*FAST, *layout, "--steps", "2", "--save", directory])
    resumed = train.main([*FAST, *layout, "--steps", "4", "--resume", directory])
    return {"straight": straight["losses"], "resumed": first["losses"] + resumed["losses"],
            "graph_flops_per_token": straight["throughput"].graph_flops_per_token}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp", "2"], ["--pp", "2"], ["--shard"], ["--tp", "2", "--sequence-parallel"],
                                    ["--dp", "2", "--compress", "int8:ef"], ["--shard", "--compress", "int8:ef"],
                                    ["--shard", "--compress", "topk:0.01", "--compress-warmup", "2"]],
                         ids=["dp", "pp", "shard", "tp", "dp-int8-error-feedback", "shard-int8-error-feedback",
                              "shard-topk-warmup-across-the-resume"])
def test_save_and_resume_continue_bit_for_bit(layout, tmp_path):
    results = run_ranks(straight_then_saved_then_resumed, 2, layout, str(tmp_path / "run"), timeout=400,
                        collective_timeout=120)
    for rank, result in enumerate(results):
        assert len(result["straight"]) == 4 and len(set(result["straight"])) == 4, result
        assert result["resumed"] == result["straight"], (rank, result)
    if layout[0] == "--pp":  # the whole model's FLOPs, as one process's graphs hold them
        single = importlib.import_module("picofx.cli.train").main([*FAST, "--steps", "1"])
        assert results[0]["graph_flops_per_token"] == pytest.approx(
            single["throughput"].graph_flops_per_token, rel=0.02)


def report_setup(rank: int, world: int) -> tuple:
    from picofx.runtime.distributed import first_failure

    return first_failure("capture failed here" if rank == 1 else None), first_failure(None)


def test_every_rank_learns_the_first_failure_and_that_none_failed():
    results = run_ranks(report_setup, 2, timeout=120, collective_timeout=30)
    assert results == [((1, "capture failed here"), None)] * 2


def hsdp_run(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    train = importlib.import_module("picofx.cli.train")
    result = train.main([*FAST, "--shard", "--dp-replicate", "2", "--steps", "2"])
    return {"losses": result["losses"]}


@pytest.mark.slow
def test_hsdp_trains_from_its_flags_on_four_ranks():
    """--shard --dp-replicate 2 on 4 ranks: 2 replicas, each sharded over 2 (the shard pass on
    dp_replicate x dp_shard), each rank on its own batch; that it equals one process is
    tests/test_composability.py's hsdp cell."""
    results = run_ranks(hsdp_run, 4, timeout=600, collective_timeout=180)
    for result in results:
        assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"]), result
    assert len({tuple(r["losses"]) for r in results}) == 4  # four replicas, four batches
