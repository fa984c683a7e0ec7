"""picofx train's periodic checkpoints: DIR/step-N every --save-every steps, written in the
background, complete only once marked, the oldest beyond --keep removed; --resume auto; SIGTERM
saves at the next step boundary on every rank; under torchrun a killed rank's job restarts from the
newest complete checkpoint. Every resumed run's losses equal the uninterrupted run's bit for bit."""
import concurrent.futures
import importlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from picofx.runtime import checkpoints
from picofx.runtime.checkpoints import AsyncSaver, checkpoint_to_resume, newest_complete, prune, saved_steps

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "passes"))  # the rank harness, beside the pass tests
from spawn_ranks import run_ranks  # noqa: E402

FAST = ["--backend", "eager", "--passes", "--batch", "2", "--seq", "16", "--log-every", "1"]
RANKS_FAST = ["--backend", "eager", "--passes", "--batch", "4", "--seq", "16", "--log-every", "1",
              "--microbatches", "2", "--no-measure-cuts"]


def train(argv: list) -> dict:
    return importlib.import_module("picofx.cli.train").main(argv)


def steps_in(root) -> dict:
    return {step: checkpoints.is_complete(path) for step, path in saved_steps(root)}


def test_saves_every_step_keep_the_newest_two_and_a_resumed_run_goes_on_saving(tmp_path):
    root = str(tmp_path / "run")
    straight = train([*FAST, "--steps", "5"])["losses"]
    saved = train([*FAST, "--steps", "4", "--save", root, "--save-every", "1", "--keep", "2"])["losses"]
    assert saved == straight[:4] and len(set(straight)) == 5  # saving in the background changes nothing
    assert steps_in(root) == {3: True, 4: True}
    resumed = train([*FAST, "--steps", "5", "--save", root, "--save-every", "1", "--keep", "2",
                     "--resume", f"{root}/step-3"])["losses"]
    assert resumed == straight[3:]
    assert steps_in(root) == {4: True, 5: True}  # step-4 written again, complete again


def test_resume_auto_starts_fresh_without_a_checkpoint_and_refuses_without_save(tmp_path, capsys):
    from picofx.cli.train_args import parse_args

    assert parse_args([*FAST, "--resume", "auto", "--save", str(tmp_path / "new")], environ={}).resume is None
    for argv, message in [(["--resume", "auto"], "--resume auto: resumes from the newest checkpoint under --save "
                                                 "DIR: pass --save DIR too"),
                          (["--save-every", "2"], "--save-every 2: saves under --save DIR: pass --save DIR too")]:
        with pytest.raises(SystemExit) as exit_:
            parse_args([*FAST, *argv], environ={})
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def fake_checkpoint(root, step: int, complete: bool) -> pathlib.Path:
    path = checkpoints.step_directory(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"written")
    if complete:
        (path / checkpoints.COMPLETE).write_text(f"{step}\n")
    return path


def test_an_interrupted_write_is_never_loaded_and_pruning_keeps_what_is_complete(tmp_path):
    for step, complete in [(2, True), (4, True), (5, False), (6, True), (8, False)]:
        fake_checkpoint(tmp_path, step, complete)
    assert newest_complete(tmp_path) == checkpoints.step_directory(tmp_path, 6)
    assert checkpoint_to_resume("auto", str(tmp_path)) == str(tmp_path / "step-6")
    assert checkpoint_to_resume(str(tmp_path), None) == str(tmp_path / "step-6")
    with pytest.raises(ValueError, match="step-8: this checkpoint is incomplete"):
        checkpoint_to_resume(str(tmp_path / "step-8"), None)
    assert checkpoints.find_checkpoint(tmp_path / "step-8") == (None, checkpoints.INCOMPLETE)
    assert checkpoints.find_checkpoint(tmp_path / "nowhere") == (None, checkpoints.MISSING)
    assert checkpoints.find_checkpoint(tmp_path / "step-4") == (tmp_path / "step-4", None)
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-2", "step-5"]
    assert steps_in(tmp_path) == {4: True, 6: True, 8: False}  # the write in flight (8) is left alone


def test_a_save_is_marked_complete_only_after_its_write_finished(tmp_path, monkeypatch):
    """The marker waits for async_save's future: while it is unresolved the newest complete
    checkpoint is the previous one; a failed write is never marked and fails the next wait."""
    writes = []

    def pending_save(state, checkpoint_id, **kwargs):
        future = concurrent.futures.Future()
        writes.append((pathlib.Path(checkpoint_id), future))
        return future

    monkeypatch.setattr(checkpoints.dcp, "async_save", pending_save)
    fake_checkpoint(tmp_path, 1, True)
    saver = AsyncSaver(tmp_path, keep=1)
    saver.save({"x": torch.ones(2)}, 2)
    assert newest_complete(tmp_path).name == "step-1" and not checkpoints.is_complete(writes[0][0])
    writes[0][1].set_result(None)
    saver.wait()
    assert newest_complete(tmp_path).name == "step-2" and steps_in(tmp_path) == {2: True}  # step-1 pruned after
    saver.save({"x": torch.ones(2)}, 3)
    writes[1][1].set_exception(OSError("disk full"))
    with pytest.raises(RuntimeError, match="saving step 3 to .*step-3 failed on rank 0: disk full"):
        saver.wait()
    assert newest_complete(tmp_path).name == "step-2" and steps_in(tmp_path) == {2: True, 3: False}


def test_a_background_save_holds_the_state_as_it_was_when_save_returned(tmp_path):
    """The step after a save changes the parameters in place while the write goes on; each
    checkpoint holds its own step's values (the copy's buffers are reused from one save to the next)."""
    import torch.distributed.checkpoint as dcp

    from picofx.cli import train_state

    weight = torch.arange(200_000, dtype=torch.float32)
    saver = AsyncSaver(tmp_path)
    for step in (1, 2):
        saver.save({"weight": weight, "note": f"step {step}"}, step)
        weight.mul_(-1)  # before the write can have finished
    saver.wait()
    for step, sign in ((1, 1), (2, -1)):
        loaded = {"weight": torch.zeros_like(weight), "note": ""}
        with train_state.single_process_quiet():
            dcp.load(loaded, checkpoint_id=str(checkpoints.step_directory(tmp_path, step)), no_dist=True)
        assert torch.equal(loaded["weight"], sign * torch.arange(200_000, dtype=torch.float32)), step
        assert loaded["note"] == f"step {step}"


def sigterm_on_third_optimizer_step(rank: int) -> None:
    """Rank 1 alone gets SIGTERM during its third step (as a scheduler would send it to one node)."""
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    return original


def preempted_then_resumed(rank: int, world: int, root: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    from picofx.cli.train_state import resume_disagreement

    alike, unlike = resume_disagreement(root, None), resume_disagreement(f"{root}/step-4" if rank else None, None)
    straight = train([*RANKS_FAST, "--steps", "5"])
    original = sigterm_on_third_optimizer_step(rank)
    try:
        stopped = train([*RANKS_FAST, "--steps", "5", "--save", root, "--save-every", "4"])
    finally:
        torch.optim.AdamW.step = original
    complete = steps_in(root)
    resumed = train([*RANKS_FAST, "--steps", "5", "--save", root, "--save-every", "4", "--resume", "auto"])
    return {"straight": straight["losses"], "stopped": stopped, "complete": complete, "resumed": resumed["losses"],
            "alike": alike, "unlike": unlike}


def test_sigterm_to_one_rank_saves_every_rank_at_the_next_step_and_resume_auto_goes_on(tmp_path):
    """Each rank's run returns only once the checkpoint is marked complete, so every rank's --resume
    auto finds it; ranks that found different checkpoints stop before loading, naming each one's."""
    results = run_ranks(preempted_then_resumed, 2, str(tmp_path / "run"), timeout=300, collective_timeout=120)
    for rank, result in enumerate(results):
        assert result["alike"] is None
        assert re.fullmatch(r"--resume: the ranks found different checkpoints to continue from \(rank 0: a fresh "
                            r"start, rank 1: .*run/step-4\); .*", result["unlike"]), result["unlike"]
        assert result["stopped"]["preempted"] == 3, (rank, result)  # rank 0 got no signal: it stopped by agreement
        assert result["complete"] == {3: True}, result  # on rank 1 too: the marker is written before a save ends
        assert len(set(result["straight"])) == 5
        assert result["stopped"]["losses"] + result["resumed"] == result["straight"], (rank, result)


LAYOUTS = {"dp": ["--dp", "2"], "shard": ["--shard"], "tp": ["--tp", "2", "--sequence-parallel"], "pp": ["--pp", "2"],
           "dp-int8-error-feedback": ["--dp", "2", "--compress", "int8:ef"],
           "shard-int8-error-feedback": ["--shard", "--compress", "int8:ef"]}


def every_layout_saved_in_the_background(rank: int, world: int, root: str) -> dict:
    """Per layout: 4 steps straight; 4 steps saving every 2 in the background; on from step-2."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    results = {}
    for name, layout in LAYOUTS.items():
        directory = f"{root}/{name}"
        straight = train([*RANKS_FAST, *layout, "--steps", "4"])["losses"]
        saved = train([*RANKS_FAST, *layout, "--steps", "4", "--save", directory, "--save-every", "2"])["losses"]
        resumed = train([*RANKS_FAST, *layout, "--steps", "4", "--resume", f"{directory}/step-2"])["losses"]
        results[name] = {"straight": straight, "saved": saved, "resumed": resumed, "complete": steps_in(directory)}
    return results


@pytest.mark.slow
def test_every_layout_resumes_from_a_periodic_background_save_bit_for_bit(tmp_path):
    results = run_ranks(every_layout_saved_in_the_background, 2, str(tmp_path), timeout=900, collective_timeout=120)
    for rank, by_layout in enumerate(results):
        for name, result in by_layout.items():
            straight = result["straight"]
            assert len(set(straight)) == 4 and result["complete"] == {2: True, 4: True}, (rank, name, result)
            assert result["saved"] == straight and result["resumed"] == straight[2:], (rank, name, result)


TORCHRUN_RUN = [*RANKS_FAST, "--dp", "2", "--steps", "24"]


def torchrun(*options: str, restarts: int = 0) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={restarts}", "-m", "picofx", "train", *TORCHRUN_RUN, *options]
    env = {**os.environ, "PICOFX_CACHE": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def finished(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun did not finish in {timeout}s:\n{stop(process)[-3000:]}") from None
    return process.returncode, out


def stop(process: subprocess.Popen) -> str:
    """Kill what is left of a job (its own session: torchrun and the ranks it started); its output."""
    if process.returncode is not None:
        return ""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    return process.communicate()[0]


def losses_by_step(metrics: pathlib.Path) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in map(json.loads, metrics.read_text().splitlines())]


def wait_for(condition, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"never came: {condition.__doc__} ({stop(process)[-3000:]})")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    metrics = tmp_path_factory.mktemp("uninterrupted") / "metrics.jsonl"
    code, out = finished(torchrun("--metrics", str(metrics)), timeout=400)
    assert code == 0, out[-3000:]
    by_step = dict(losses_by_step(metrics))
    assert sorted(by_step) == list(range(1, 25)) and len(set(by_step.values())) == 24
    return by_step


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_from_the_newest_complete_checkpoint(tmp_path, uninterrupted):
    import psutil

    root, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    job = torchrun("--save", str(root), "--save-every", "2", "--resume", "auto", "--metrics", str(metrics), restarts=1)

    def two_checkpoints():
        """two complete checkpoints"""
        return len([p for _, p in saved_steps(root) if checkpoints.is_complete(p)]) >= 2
    try:
        wait_for(two_checkpoints, job)
        ranks = [p for p in psutil.Process(job.pid).children() if p.environ().get("RANK") == "1"]  # not its workers
        assert len(ranks) == 1, ranks
        ranks[0].send_signal(signal.SIGKILL)
        code, out = finished(job, timeout=400)
    finally:
        stop(job)
    assert code == 0, out[-3000:]
    resumed_at = [int(step) for step in re.findall(r"resumed from \S+/step-(\d+) at step", out)]
    assert len(resumed_at) == 1 and 4 <= resumed_at[0] < 24, out[-3000:]
    logged = losses_by_step(metrics)  # the first attempt's steps, then the restart's from the checkpoint on
    assert [step for step, _ in logged].count(resumed_at[0] + 1) >= 1 and logged[-1][0] == 24
    assert all(loss == uninterrupted[step] for step, loss in logged), logged


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_every_rank_and_the_same_command_goes_on(tmp_path, uninterrupted):
    root, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    options = ("--save", str(root), "--save-every", "100", "--resume", "auto", "--metrics", str(metrics))
    job = torchrun(*options)

    def three_steps():
        """three steps logged"""
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= 3
    try:
        wait_for(three_steps, job)
        job.send_signal(signal.SIGTERM)  # the agent sends it on to its ranks
        _, out = finished(job, timeout=120)
    finally:
        stop(job)
    complete = [step for step, complete in steps_in(root).items() if complete]
    assert len(complete) == 1, out[-3000:]
    stopped = complete[0]
    assert 3 <= stopped < 24 and f"stopped by SIGTERM after step {stopped}" in out, out[-3000:]
    code, out = finished(torchrun(*options), timeout=400)
    assert code == 0 and f"resumed from {root}/step-{stopped} at step {stopped}" in out, out[-3000:]
    logged = losses_by_step(metrics)  # the stopped run's steps, then the resumed run's (appended)
    assert [step for step, _ in logged] == list(range(1, 25)), logged
    assert all(loss == uninterrupted[step] for step, loss in logged), logged
    logged = losses_by_step(metrics)
    assert [step for step, _ in logged] == list(range(1, 25)), logged
    assert all(loss == uninterrupted[step] for step, loss in logged), logged
