"""picofx train's guards: a rank that stops answering stops the others within --collective-timeout
with one line naming it; a non-finite gradient stops the run (or is skipped) on every rank at the
same step, naming the first parameter whose gradient is not finite; --metrics and --tensorboard
write each step's figures."""
import importlib
import importlib.util
import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from picofx.api import OptimizedModule
from picofx.cli.train_args import parse_args
from picofx.cli.train_guards import group_timeout
from picofx.runtime.watchdog import PEER_GONE, Watchdog, beat_interval

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

FAST = ["--backend", "eager", "--passes", "--batch", "2", "--seq", "16", "--log-every", "1"]
FIRST, LATER = "decoder_layers.1.mlp.down_proj.weight", "final_proj.weight"  # in the model's order


def wait_for(condition, seconds: float) -> float:
    start = time.monotonic()
    while not condition() and time.monotonic() - start < seconds:
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_watchdog_names_a_rank_that_stopped_beating_within_the_timeout():
    store, hangs = dist.HashStore(), []
    record = (lambda line, speaks: hangs.append((line, speaks)))
    rank0 = Watchdog(store, 0, 3, 1.0, on_hang=record).start()
    rank1 = Watchdog(store, 1, 3, 1.0, on_hang=lambda *_: hangs.append("rank 1 stopped")).start()
    rank2 = Watchdog(store, 2, 3, 1.0, on_hang=lambda *_: hangs.append("rank 2 stopped")).start()
    rank0.at(7, "forward and backward (gradient all-reduces)")
    rank1.at(7, "optimizer step")
    rank2.stop()  # a rank whose run ended is not waited for
    time.sleep(2.5)  # more than the timeout: every rank that beats is left running
    assert hangs == []
    rank1.finished.set()  # rank 1 stops beating without ending its run, as a stopped process
    waited = wait_for(lambda: hangs, 5)
    assert 0.8 < waited < 1.0 + 2 * rank0.interval + 0.5, waited
    (line, speaks), = hangs
    assert speaks and line.startswith("picofx train: error: rank 1 stopped answering: no heartbeat for 1 s, last "
                                      "heard from in step 7's optimizer step; rank 0 was waiting in step 7's forward "
                                      "and backward (gradient all-reduces)"), line
    rank0.stop()


def test_a_collective_failing_while_a_peer_stopped_beating_is_told_as_that_peers_death():
    store, said, stopped = dist.HashStore(), [], []
    rank0 = Watchdog(store, 0, 3, 1.0, on_hang=lambda line, speaks: said.append((line, speaks))).start()
    rank1 = Watchdog(store, 1, 3, 1.0, on_hang=lambda *_, **__: said.append("rank 1 stopped")).start()
    rank2 = Watchdog(store, 2, 3, 1.0, on_hang=lambda *_, **__: said.append("rank 2 stopped")).start()
    rank0.at(5, "forward and backward (gradient all-reduces)")
    time.sleep(3 * rank0.interval)
    reset = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7084: Connection reset by "
                         "peer. This is typically caused by a remote process dying")
    rank0.stop_if_a_peer_died(ValueError("a bug of this rank's own"))  # not a collective's: raised as it is
    rank0.stop_if_a_peer_died(reset)  # every peer beats: the backend's error is raised as it is
    assert said == [] and not rank0.finished.is_set()
    rank2.stop_if_a_peer_died(reset)  # rank 2's collective failed too: it ends, and is not a dead rank
    rank2.finished.set()
    rank1.finished.set()  # rank 1 dies: no more beats
    rank0.stop_if_a_peer_died(RuntimeError("saving step 5 failed"), before_stop=lambda: stopped.append(True))
    assert said == [] and stopped == []  # no collective's error in it
    failed = RuntimeError("saving step 5 to run/step-5 failed on rank 0: peer gone")
    failed.__cause__ = reset
    rank0.stop_if_a_peer_died(failed, before_stop=lambda: stopped.append(True))
    (line, speaks), = said
    assert speaks and stopped == [True], said
    assert line.startswith("picofx train: error: rank 1 died: no heartbeat for ") and "rank 2" not in line, line
    assert rank0.finished.is_set() and "rank 1 stopped" not in said
    assert ("rank 0's collective in step 5's forward and backward (gradient all-reduces) failed with it (Read error "
            "[127.0.0.1]:7084: Connection reset by peer.)") in line, line
    rank2.stop()


def poison(names_by_rank: dict, at_step: int):
    """Make the gradient of each named parameter NaN after `at_step`'s backward (after its all-reduce, so
    only the ranks named hold it), as a real divergence would land in one tensor."""
    original, calls = OptimizedModule.forward_backward, {"n": 0}

    def forward_backward(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        calls["n"] += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, p in self.named_parameters():
            if calls["n"] == at_step and name in names_by_rank.get(rank, ()):
                p.grad.view(-1)[0] = float("nan")
        calls.setdefault("weights", []).append([p.detach().clone() for p in self.parameters()])
        return loss
    OptimizedModule.forward_backward = forward_backward
    return calls


def test_a_non_finite_gradient_stops_the_run_naming_the_step_and_the_first_parameter(capsys, monkeypatch):
    monkeypatch.setattr(OptimizedModule, "forward_backward", OptimizedModule.forward_backward)
    poison({0: [LATER, FIRST]}, at_step=2)
    train = importlib.import_module("picofx.cli.train")
    with pytest.raises(SystemExit) as stopped:
        train.main([*FAST, "--steps", "4"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert stopped.value.code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"picofx train: error: step 2: the loss is ") and \
        f"the gradient of {FIRST} is not finite (the first parameter whose is)" in lines[0], lines[0]
    assert not multiprocessing.active_children(), "a stopped run left its DataLoader workers running"


def test_skip_nonfinite_leaves_the_step_out_and_counts_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(OptimizedModule, "forward_backward", OptimizedModule.forward_backward)
    calls = poison({0: [FIRST]}, at_step=2)
    train = importlib.import_module("picofx.cli.train")
    result = train.main([*FAST, "--steps", "4", "--skip-nonfinite", "--metrics", str(tmp_path / "m.jsonl")])
    assert result["skipped"] == [2] and "skipped 1 step with a non-finite loss or gradient" in capsys.readouterr().out
    weights = calls["weights"]  # after each step's backward: step 2's update was not made, the others were
    for before, after, changed in ((0, 1, True), (1, 2, False), (2, 3, True)):
        assert any(not torch.equal(a, b) for a, b in zip(weights[before], weights[after])) == changed
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [entry["grad_norm"] is None for entry in lines] == [False, True, False, False]  # NaN is written null


def nonfinite_on_two_ranks(rank: int, world: int) -> dict:
    """Data parallel: rank 1's gradient holds the first NaN, rank 0's a later one; both skip, then stop."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    train = importlib.import_module("picofx.cli.train")
    poison({1: [FIRST]}, at_step=2)
    skipped = train.main([*FAST, "--steps", "3", "--skip-nonfinite"])["skipped"]
    poison({0: [LATER], 1: [FIRST]}, at_step=2)
    try:
        train.main([*FAST, "--steps", "3"])
    except SystemExit as e:
        return {"skipped": skipped, "exit": e.code}
    return {"skipped": skipped, "exit": None}


def test_every_rank_skips_or_stops_at_the_same_step(capfd):
    results = run_ranks(nonfinite_on_two_ranks, 2, timeout=300, collective_timeout=120)
    assert results == [{"skipped": [2], "exit": 1}] * 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("picofx train: error")]
    assert len(errors) == 1 and f"step 2: the loss is" in errors[0] and f"the gradient of {FIRST}" in errors[0], errors


@pytest.mark.slow
def test_a_diverging_run_under_torchrun_ends_with_one_line_and_status_1(tmp_path):
    """No patching: a learning rate of 1e38 makes step 2's gradients overflow on both ranks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "picofx",
               "train", *FAST, "--steps", "6", "--lr", "1e38"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started, nothing else
        raise AssertionError(f"still running after 240 s: a hang; killed:\n{proc.communicate()[0][-3000:]}")
    errors = [line for line in out.splitlines() if line.startswith("picofx train: error")]
    assert proc.returncode != 0 and "exitcode  : 1" in out and out.count("Traceback") <= 1, out  # torchrun's own
    assert len(errors) == 1 and errors[0].startswith("picofx train: error: step 2: the loss is "), out[-3000:]
    assert "the gradient of embedding.weight is not finite" in errors[0], errors  # the first in the model's order


def test_metrics_are_one_json_line_per_step(tmp_path):
    train = importlib.import_module("picofx.cli.train")
    result = train.main([*FAST, "--steps", "3", "--lr", "1e-3", "--metrics", str(tmp_path / "run" / "m.jsonl")])
    lines = [json.loads(line) for line in (tmp_path / "run" / "m.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in lines] == [1, 2, 3]
    assert [entry["loss"] for entry in lines] == result["losses"]
    assert [entry["lr"] for entry in lines] == pytest.approx([1e-3 * (s + 1) / 20 for s in range(3)])  # warm-up
    for entry in lines:
        assert entry["grad_norm"] > 0 and entry["tokens_per_s"] > 0 and 0 < entry["mfu"] < 1, entry
        assert entry["peak_memory_bytes"] > 10 * 2**20, entry


@pytest.mark.parametrize("argv, message", [
    (["--collective-timeout", "0"], "--collective-timeout: must be a positive number of seconds, got 0"),
    (["--collective-timeout", "soon"], "--collective-timeout: 'soon' is not a number of seconds"),
    (["--metrics", "{tmp}"], "--metrics {tmp}: not a file that can be written"),
])
def test_bad_guard_options_are_usage_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as refused:
        parse_args([a.format(tmp=tmp_path) for a in argv], environ={})
    assert refused.value.code == 2 and message.format(tmp=tmp_path) in capsys.readouterr().err


def test_the_process_group_outlasts_the_watchdog_so_its_line_comes_first():
    args = parse_args([], environ={})
    assert args.collective_timeout == 300
    assert group_timeout(args.collective_timeout).total_seconds() >= 300 + beat_interval(300) + 5


def test_tensorboard_without_the_package_is_a_usage_error(capsys, tmp_path):
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(SystemExit) as refused:
        parse_args(["--tensorboard", str(tmp_path)], environ={})
    assert refused.value.code == 2 and "pip install tensorboard" in capsys.readouterr().err


def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = importlib.import_module("picofx.cli.train")
    result = train.main([*FAST, "--steps", "2", "--tensorboard", str(tmp_path)])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx(result["losses"]) and len(events.Scalars("train/mfu")) == 2


def rank_of(pid: int) -> int | None:
    try:
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)


def children(pid: int) -> list[int]:
    found = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_stopped_rank_stops_the_others_within_the_timeout_under_torchrun(tmp_path):
    timeout = 6
    metrics = tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "picofx",
               "train", *FAST, "--log-every", "1000", "--steps", "100000", "--collective-timeout", str(timeout),
               "--metrics", str(metrics)]
    with open(tmp_path / "err.txt", "w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 240)
        time.sleep(3 * beat_interval(timeout))  # rank 1 has said it trains (a rank is seen as of its last beat)
        ranks = {rank_of(pid): pid for pid in children(proc.pid)}
        assert set(ranks) == {0, 1}, (ranks, proc.poll(), (tmp_path / "err.txt").read_text()[-3000:])
        os.kill(ranks[1], signal.SIGSTOP)  # rank 1 stops answering mid-run
        stopped = time.monotonic()
        rank0_took = wait_for(lambda: not alive(ranks[0]), timeout + 30)
        proc.wait(timeout=90)  # torchrun ends the job: its other worker is killed
        took = time.monotonic() - stopped
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started, nothing else
        except ProcessLookupError:  # all of them ended
            pass
    err = (tmp_path / "err.txt").read_text()
    assert rank0_took < timeout + 5, (rank0_took, err[-3000:])
    assert proc.returncode != 0 and took < timeout + 60, (took, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("picofx train: error")]
    assert len(lines) == 1 and lines[0].startswith("picofx train: error: rank 1 stopped answering: no heartbeat for "
                                                   f"{timeout} s, last heard from in step "), err[-3000:]
    assert "rank 0 was waiting in step" in lines[0] and "(gradient all-reduces)" in lines[0], lines[0]


@pytest.mark.slow
def test_a_killed_rank_ends_the_others_with_one_line_naming_it_under_torchrun(tmp_path):
    """SIGKILL: the others' collectives fail at once (gloo's connection reset or closed), and each says which
    rank died instead of gloo's traceback (--save: torchrun's SIGTERM to them waits for the next step)."""
    metrics = tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "picofx",
               "train", *FAST, "--log-every", "1000", "--steps", "100000", "--collective-timeout", "20",
               "--metrics", str(metrics), "--save", str(tmp_path / "run"), "--save-every", "1000"]
    with open(tmp_path / "err.txt", "w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 240)
        ranks = {rank_of(pid): pid for pid in children(proc.pid)}
        assert set(ranks) == {0, 1}, (ranks, proc.poll(), (tmp_path / "err.txt").read_text()[-3000:])
        os.kill(ranks[1], signal.SIGKILL)
        proc.wait(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started, nothing else
        except ProcessLookupError:
            pass
    err = (tmp_path / "err.txt").read_text()
    lines = [line for line in err.splitlines() if "picofx train: error" in line]
    assert proc.returncode != 0 and err.count("Traceback") <= 1, err[-3000:]  # torchrun's own
    assert len(lines) == 1 and "picofx train: error: rank 1 died: no heartbeat for " in lines[0], err[-3000:]
    assert "rank 0's collective in step " in lines[0], lines[0]
    assert any(said in lines[0] for said in PEER_GONE), lines[0]  # gloo's words differ with what it was doing
    assert "exitcode  : 1 " in err, err[-3000:]  # rank 0 stopped itself, with status 1
