"""picofx train --profile N --calibrate on 4 gloo ranks with two mesh dimensions (dp_shard 2 x tp 2,
the tiny model): each traced collective named by its group's dimension, each dimension's link fitted
apart and said in the summary, and the device profile's in-node link (every rank in one machine)
combined from both, which picofx plan then reads."""
import contextlib
import importlib
import io
import json
import os
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

# seq 64: tp's activation all-reduces (4 x 64 x 64 fp32) are 64 KiB, large enough to time the bandwidth
TWO_DIMENSIONS = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "64", "--log-every", "50", "--shard",
                  "--tp", "2", "--steps", "4", "--profile", "2", "--calibrate"]


def calibrated_on_two_dimensions(rank: int, world: int, folder: str) -> tuple:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), PICOFX_CACHE_DIR=os.path.join(folder, "cache"))
    os.chdir(folder)  # the traces: ./profile
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = importlib.import_module("picofx.cli.train").main(TWO_DIMENSIONS)
    return printed.getvalue(), result["profile"]


@pytest.mark.slow  # 4 spawned ranks: 2 to 4 minutes on a loaded 2-core machine
def test_calibrate_fits_each_mesh_dimensions_link_on_four_ranks(tmp_path, monkeypatch):
    printed, figures = run_ranks(calibrated_on_two_dimensions, 4, str(tmp_path), timeout=900,
                                 collective_timeout=300)[0]
    for rank, mine in enumerate(figures):  # every rank's collectives named by its groups' threads
        groups = [c["group"] for c in mine["collectives"]]
        assert mine["mesh"] == {"dp_shard": 2, "tp": 2} and {"dp_shard", "tp"} <= set(groups), (rank, groups)
    said = re.search(r"links per mesh dimension: dp_shard ([0-9.e+-]+) GB/s, \d+ us per ring step \(from \d+ traced "
                     r"[a-z -]+\); tp ([0-9.e+-]+) GB/s, \d+ us per ring step \(from \d+ traced all-reduces\); "
                     r"in-node link from dp_shard and tp: ([0-9.e+-]+) GB/s", printed)
    assert said, printed
    dp, tp, node = (float(g) for g in said.groups())
    assert min(dp, tp) * 0.99 <= node <= max(dp, tp) * 1.01  # the two links combined
    stored = json.loads(next(pathlib.Path(tmp_path, "cache", "devices").iterdir()).read_text())
    dims = stored["communication"]
    assert {dims["dp_shard"]["level"], dims["tp"]["level"]} == {"node"}
    assert stored["device"]["link_bandwidth"] == pytest.approx(node * 1e9, rel=1e-2)
    assert stored["device"]["network_bandwidth"] == stored["device"]["link_bandwidth"]  # one machine
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path / "cache"))
    from picofx.planner.device_profile import read_device_profile

    device, how = read_device_profile(4)  # what picofx plan on this machine prices 4-rank layouts with
    assert device.intra_node_link.bandwidth == stored["device"]["link_bandwidth"] and "--calibrate" in how
    assert "dp_shard" in device.link_name and "tp" in device.link_name
