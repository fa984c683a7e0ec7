"""picofx train's "what to change" and `picofx doctor` on real short runs of the tiny model (eager):
--lr 1 is flagged with advice to lower it, a healthy run raises nothing, a slow dataset names the
data wait and advises workers, and a rank whose batches come late is named in what the run prints
and in picofx doctor, the other rank never."""
import contextlib
import importlib
import io
import os
import pathlib
import sys
import time

import pytest

from picofx.cli import main as picofx_main
from picofx.data.windows import Windows

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

FAST = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "32", "--log-every", "50"]


def train(argv: list) -> dict:
    return importlib.import_module("picofx.cli.train").main(argv)


def doctor(path, capsys) -> str:
    capsys.readouterr()
    assert picofx_main(["doctor", str(path)]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_a_far_too_high_learning_rate_is_flagged_within_fifty_steps(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    result = train([*FAST, "--steps", "50", "--lr", "1", "--metrics", str(metrics)])
    printed = capsys.readouterr().out
    assert "divergence" in [f.kind for f in result["findings"]], printed
    assert "what to change:" in printed and "lower the learning rate to" in printed
    assert "lower the learning rate to" in doctor(metrics, capsys)


@pytest.mark.slow
def test_a_healthy_run_raises_no_alarm(tmp_path, capsys):
    # the default batch and sequence (8 x 128): the healthy run
    result = train(["--backend", "eager", "--passes", "--steps", "200", "--save", str(tmp_path / "run")])
    assert result["findings"] == [] and "what to change" not in capsys.readouterr().out
    assert "no findings" in doctor(tmp_path / "run", capsys)  # the --save directory holds the records


def test_a_slow_dataset_names_the_data_wait_and_advises_workers(tmp_path, capsys, monkeypatch):
    read = Windows.__getitem__
    monkeypatch.setattr(Windows, "__getitem__", lambda self, start: time.sleep(0.01) or read(self, start))
    metrics = tmp_path / "m.jsonl"
    result = train([*FAST, "--steps", "12", "--data-workers", "0", "--metrics", str(metrics)])
    assert [f.kind for f in result["findings"]] == ["data_wait"]
    assert "--data-workers" in capsys.readouterr().out
    assert "--data-workers" in doctor(metrics, capsys)


def late_batches_on_rank_1(rank: int, world: int, metrics: str) -> str:
    """A run on 2 ranks where rank 1's batches come 0.3 s late; what rank 0 printed."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    batches = importlib.import_module("picofx.cli.train_data").Batches
    if rank == 1:
        hand_out = batches.next
        batches.next = lambda self: time.sleep(0.3) or hand_out(self)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train([*FAST, "--steps", "10", "--data-workers", "0", "--metrics", metrics])
    return printed.getvalue()


@pytest.mark.slow
def test_a_rank_with_late_batches_is_named_in_the_summary_and_by_the_doctor(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    printed = run_ranks(late_batches_on_rank_1, 2, str(metrics), timeout=300, collective_timeout=120)[0]
    assert "rank 1 is slow (data)" in printed and "rank 0 is slow" not in printed, printed
    report = doctor(metrics, capsys)
    assert "rank 1 is slow (data)" in report and "rank 0 is slow" not in report, report


def more_compute_on_rank_1(rank: int, world: int, metrics: str) -> list:
    """A run on 2 ranks where rank 1 computes 0.4 s of CPU time more each step; its findings."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    picofx = importlib.import_module("picofx")
    optimize = picofx.optimize

    def optimize_slower(*args, **kwargs):
        model = optimize(*args, **kwargs)
        step = model.forward_backward

        def spin_then_step(**batch):
            end = time.process_time() + 0.4  # CPU time, whatever else the machine runs
            while time.process_time() < end:
                pass
            return step(**batch)
        model.forward_backward = spin_then_step
        return model
    if rank == 1:
        picofx.optimize = optimize_slower
    with contextlib.redirect_stdout(io.StringIO()):
        result = train([*FAST, "--steps", "8", "--metrics", metrics])
    return [(f.evidence.get("rank"), f.evidence.get("cause")) for f in result["findings"] if f.kind == "straggler"]


@pytest.mark.slow
def test_a_rank_computing_longer_is_named_with_its_compute_and_no_other(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    found = run_ranks(more_compute_on_rank_1, 2, str(metrics), timeout=300, collective_timeout=120)[0]
    assert found == [(1, "compute")]
    report = doctor(metrics, capsys)  # the records hold each rank's figures: the doctor names it too
    assert "rank 1 is slow (compute)" in report and "rank 0 is slow" not in report, report
