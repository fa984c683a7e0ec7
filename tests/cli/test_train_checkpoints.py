"""picofx train's periodic checkpoints: DIR/step-N every --save-every steps, written in the
background, complete only once marked, the oldest beyond --keep removed; --resume auto; SIGTERM
saves at the next step boundary on every rank; under torchrun a killed rank's job restarts from the
newest complete checkpoint. Every resumed run's losses equal the uninterrupted run's bit for bit."""
import concurrent.futures
import importlib
import os
import pathlib
import shutil
import signal
import sys

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


def test_saves_every_step_keep_the_newest_two_and_resume_from_either(tmp_path):
    root = str(tmp_path / "run")
    straight = train([*FAST, "--steps", "5"])["losses"]
    saved = train([*FAST, "--steps", "4", "--save", root, "--save-every", "1", "--keep", "2"])["losses"]
    assert saved == straight[:4] and len(set(straight)) == 5  # saving in the background changes nothing
    assert steps_in(root) == {3: True, 4: True}
    from_three = train([*FAST, "--steps", "4", "--resume", f"{root}/step-3"])["losses"]
    assert from_three == straight[3:4]
    auto = train([*FAST, "--steps", "5", "--save", root, "--keep", "2", "--resume", "auto"])["losses"]
    assert auto == straight[4:]
    assert steps_in(root) == {4: True, 5: True}


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
    straight = train([*RANKS_FAST, "--steps", "5"])
    original = sigterm_on_third_optimizer_step(rank)
    try:
        stopped = train([*RANKS_FAST, "--steps", "5", "--save", root, "--save-every", "4"])
    finally:
        torch.optim.AdamW.step = original
    complete = steps_in(root)
    resumed = train([*RANKS_FAST, "--steps", "5", "--save", root, "--save-every", "4", "--resume", "auto"])
    return {"straight": straight["losses"], "stopped": stopped, "complete": complete, "resumed": resumed["losses"]}


def test_sigterm_to_one_rank_saves_every_rank_at_the_next_step_and_resume_auto_goes_on(tmp_path):
    results = run_ranks(preempted_then_resumed, 2, str(tmp_path / "run"), timeout=300, collective_timeout=120)
    for rank, result in enumerate(results):
        assert result["stopped"]["preempted"] == 3, (rank, result)  # rank 0 got no signal: it stopped by agreement
        assert result["complete"] == {3: True}, result
        assert len(set(result["straight"])) == 5
        assert result["stopped"]["losses"] + result["resumed"] == result["straight"], (rank, result)
