"""torchrun ... -m picofx train --layout auto: rank 0 plans, says which layout and why, every rank trains
with it, and the loss falls."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
RUN = ["--layout", "auto", "--backend", "eager", "--steps", "20", "--log-every", "5", "--seq", "32"]


def launch(ranks: int, *options: str, timeout: int, auto: bool = True) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "picofx", "train", *(RUN if auto else RUN[2:]), *options]
    env = {**os.environ, "PICOFX_CACHE": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def chosen_and_losses(out: str, ranks: int):
    choice = re.search(r"^layout auto: dp(\d+)( shard)? x tp(\d+)( sp)? x pp(\d+), (\d+) mb .*$", out, re.M)
    assert choice, out[-3000:]
    dp, tp, pp = int(choice[1]), int(choice[3]), int(choice[5])
    assert dp * tp * pp == ranks
    line = choice[0]
    assert "predicted step" in line and "per rank" in line and "bottleneck" in line and "runner-up" in line
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M)]
    return (dp, tp, pp), losses


@pytest.mark.slow
def test_two_ranks_train_with_the_plan_rank_0_chose_and_said_why():
    out = launch(2, "--batch", "8", timeout=420)
    _, losses = chosen_and_losses(out, 2)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    assert "picofx train: 2 ranks: " in out and "summary:" in out, out[-3000:]


@pytest.mark.slow
def test_four_ranks_train_with_the_plan_rank_0_chose():
    out = launch(4, "--batch", "8", timeout=600)
    _, losses = chosen_and_losses(out, 4)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_a_resumed_auto_run_keeps_the_saved_runs_layout(tmp_path):
    """--layout auto --resume takes the layout the saved run chose (a new plan could differ) and goes
    on bit for bit as that layout, given explicitly, trains straight through."""
    saved, more = str(tmp_path / "run"), ["--batch", "8", "--log-every", "1"]
    first = launch(2, *more, "--steps", "3", "--save", saved, timeout=420)
    (dp, tp, pp), before = chosen_and_losses(first, 2)
    resumed = launch(2, *more, "--steps", "6", "--resume", saved, timeout=420)
    said = re.search(r"^layout auto: resumed with the layout the saved run chose \((.*)\)$", resumed, re.M)
    assert said and not re.search(r"^layout auto: dp", resumed, re.M), resumed[-3000:]
    after = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", resumed, re.M)]
    explicit = said[1].split() + ["--batch", str(8 // dp), "--log-every", "1", "--steps", "6"]
    straight = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)",
                                             launch(2, *explicit, timeout=420, auto=False), re.M)]
    assert len(straight) == 6 and before + after == straight, (said[1], before, after, straight)
    assert (f"--dp {dp}" in said[1]) == (dp > 1) and (f"--tp {tp}" in said[1]) == (tp > 1)

def test_layout_auto_refuses_a_layout_given_with_it():
    from picofx.cli.train_args import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(["--layout", "auto", "--tp", "2"], environ={"RANK": "0", "WORLD_SIZE": "2"})
    assert stop.value.code == 2
    args = parse_args(["--layout", "auto"], environ={})  # one process: nothing to choose
    assert (args.world, args.dp, args.tp, args.pp) == (1, 1, 1, 1)
