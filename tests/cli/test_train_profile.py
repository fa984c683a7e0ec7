"""picofx train --profile N on the tiny model (eager): a trace per rank, where the time went in the
summary, the traced steps' breakdown in the --metrics lines and read back by picofx doctor, the
planner's prediction of the same layout beside the measurement, --calibrate's device profile read by
picofx.plan; on 2 gloo ranks each rank's breakdown with its communication, no extra collective in the
steps, and under --pp the stages' measured balance beside the cut's."""
import contextlib
import importlib
import io
import json
import os
import pathlib
import re
import sys

import pytest

from picofx.cli import main as picofx_main
from picofx.diagnose import read_run
from picofx.diagnose.breakdown import COMPONENTS

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_scenarios  # noqa: E402

FAST = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "32", "--log-every", "50"]


def train(argv: list) -> dict:
    return importlib.import_module("picofx.cli.train").main(argv)


@pytest.mark.slow  # about 15 s on an idle machine: the run, then the planner's capture for its prediction
def test_profile_traces_its_steps_says_where_the_time_went_and_the_doctor_reads_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    result = train([*FAST, "--steps", "6", "--profile", "2", "--metrics", "m.jsonl", "--report", "r.html"])
    printed = capsys.readouterr().out
    assert "where the time went (2 traced steps" in printed and "rank 0: " in printed, printed
    assert "unattributed" in printed and "predicted against measured" in printed, printed
    trace = json.loads((tmp_path / "profile" / "rank0.pt.trace.json").read_text())
    assert any(e.get("name") == "picofx.forward_backward" for e in trace["traceEvents"])
    traced = [r for r in read_run(tmp_path / "m.jsonl") if "breakdown" in r]
    assert [r["step"] for r in traced] == [4, 5]  # 2 steps waited (capture, compile), 1 warm-up
    for r in traced:
        (rank0,) = r["breakdown"]
        assert sum(rank0[k] for k in COMPONENTS) == pytest.approx(rank0["seconds"])
        assert rank0["seconds"] == pytest.approx(r["step_s"], rel=0.05)  # the loop's clock agrees with the trace's
    assert result["profile"][0]["mean"]["forward"] > 0
    page = (tmp_path / "r.html").read_text()
    assert "Measured step per rank" in page and "rank 0 measured" in page and ">predicted<" in page
    capsys.readouterr()
    assert picofx_main(["doctor", "m.jsonl"]) == 0
    assert "where the time went (2 traced steps)" in capsys.readouterr().out


def test_calibrate_needs_a_trace(capsys):
    with pytest.raises(SystemExit):
        train([*FAST, "--calibrate"])
    assert "--calibrate measures the rates from a trace: pass --profile N too" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_writes_the_device_profile_that_plan_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PICOFX_CACHE_DIR", str(tmp_path / "cache"))
    train([*FAST, "--steps", "5", "--profile", "2", "--calibrate"])
    assert "calibrated: compute" in capsys.readouterr().out
    import picofx
    from picofx.models.llama import CONFIGS

    said = []
    plans = picofx.plan(CONFIGS["tiny"], world=1, seq=32, global_batch=4, gpu="cpu", say=said.append)
    assert any("measured" in line and "--calibrate" in line for line in said), said
    assert plans.predictions[0].step_s > 0


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "gather", "gather_object", "broadcast",
               "broadcast_object_list", "reduce_scatter_tensor", "barrier", "send", "recv")
PROFILING = ("picofx.diagnose.profiler", "picofx.diagnose.breakdown", "picofx.cli.train_profile",
             "picofx.cli.train_compare")  # (the metrics' per-step gather is picofx.diagnose.stragglers')


def profiled_data_parallel(rank: int, world: int, folder: str) -> tuple:
    """2 replicas (pass overlap's all-reduce in the backward), 2 traced steps; what rank 0 printed,
    the collectives the profiling code called (by name), and the run's figures."""
    import sys

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), PICOFX_CACHE_DIR=os.path.join(folder, "cache"))
    called, originals = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith(PROFILING):
                called.append(name)
            return originals[name](*args, **kwargs)
        return call
    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            result = train([*FAST, "--dp", "2", "--steps", "6", "--profile", "2", "--save", folder, "--calibrate"])
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return printed.getvalue(), called, result["profile"]


def profiled_pipeline(rank: int, world: int, folder: str) -> str:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train([*FAST, "--pp", "2", "--steps", "5", "--profile", "2", "--save", folder, "--no-measure-cuts"])
    return printed.getvalue()


@pytest.mark.slow
def test_every_rank_is_traced_with_its_communication_and_pipeline_stages_are_balanced(tmp_path, capsys):
    dp, pp = str(tmp_path / "dp"), str(tmp_path / "pp")
    out = run_scenarios([(profiled_data_parallel, dp), (profiled_pipeline, pp)], 2, timeout=600,
                        collective_timeout=180)
    printed, _, figures = out["profiled_data_parallel"][0]
    # the profiling code's one collective: the gather after the last step
    assert [o[1] for o in out["profiled_data_parallel"]] == [["gather_object"]] * 2
    assert {"rank0.pt.trace.json", "rank1.pt.trace.json"} <= set(os.listdir(os.path.join(dp, "profile")))
    assert "rank 0: " in printed and "rank 1: " in printed, printed
    for rank in figures:
        assert rank["mean"]["comm_in_flight"] > 0 and rank["mean"]["exposed_comm"] > 0
    # --calibrate: the link from the traced all-reduces (the gradient buckets', the gradient norm's)
    assert re.search(r"dp link [0-9.e+-]+ GB/s, \d+ us per ring step \(from \d+ traced all-reduces\)", printed), printed
    stored = json.loads(next(pathlib.Path(dp, "cache", "devices").iterdir()).read_text())
    assert stored["device"]["link_bandwidth"] == stored["communication"]["dp"]["link"]["bandwidth"]
    capsys.readouterr()
    assert picofx_main(["doctor", dp]) == 0
    report = capsys.readouterr().out
    assert "rank 1: " in report.split("where the time went")[1], report
    staged = out["profiled_pipeline"][0]
    assert "pipeline stages 0/1: measured shares of forward + backward" in staged, staged


@pytest.mark.slow  # a process of its own, signalled mid-window: ~20 s on an idle machine
def test_sigterm_in_the_traced_window_still_writes_the_profile_and_the_doctor_reads_it(tmp_path):
    import signal
    import subprocess
    import time

    metrics = tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "picofx", "train", *FAST, "--steps", "400", "--profile", "300",
               "--metrics", str(metrics), "--report", str(tmp_path / "r.html")]
    job = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[2])})
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 6):  # 3 steps into the window
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)
        out = job.communicate(timeout=240)[0]
    finally:
        job.kill()
    assert job.returncode == 0, out[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+), nothing saved", out)
    assert stopped and 6 <= int(stopped.group(1)) < 400, out[-3000:]
    traced = int(re.search(r"where the time went \((\d+) traced steps", out).group(1))
    assert traced == int(stopped.group(1)) - 3, out[-3000:]  # every step from the window's first to the stop
    assert (tmp_path / "profile" / "rank0.pt.trace.json").is_file()
    rows = [r for r in read_run(metrics) if "breakdown" in r]
    assert len(rows) == traced and all(r["breakdown"][0]["seconds"] > 0 for r in rows)
    page = (tmp_path / "r.html").read_text()
    assert "Measured step per rank" in page and "stopped by SIGTERM" in page
    doctor = subprocess.run([sys.executable, "-m", "picofx", "doctor", str(metrics)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[2])}, timeout=120)
    assert doctor.returncode == 0 and f"where the time went ({traced} traced steps)" in doctor.stdout, doctor.stdout
