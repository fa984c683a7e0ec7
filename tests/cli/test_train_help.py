"""Every example in `picofx train --help` runs, read out of the help text: the one-process ones for
2 steps with --backend eager (the checkpoint one also under its own backend, Inductor, whose
memory plan differs), the torchrun ones under torchrun (slow)."""
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from picofx.cli import train
from picofx.cli.train_args import parse_args
from picofx.cli.train_parser import build_parser

STEPS = ["--steps", "2", "--backend", "eager"]  # the last of a repeated option wins
EIGHT_RANKS = "8 ranks, each capturing and compiling its step, take many minutes on the 2 cores CI has"


def help_examples() -> list[list[str]]:
    """The example command lines of the help text, comments left out, as argument lists."""
    text = build_parser(train.__doc__).format_help()
    return [shlex.split(line.partition("#")[0]) for line in text.splitlines()
            if re.match(r" {4}(picofx train|torchrun)\b", line)]


def one_process_examples() -> list[list[str]]:
    return [example[2:] for example in help_examples() if example[:2] == ["picofx", "train"]]


def torchrun_examples() -> list[tuple[int, list[str]]]:
    """(ranks, the options after `-m picofx train`) of each torchrun example."""
    found = []
    for example in help_examples():
        if example[0] == "torchrun":
            assert example[1] == "--nproc-per-node" and example[3:6] == ["-m", "picofx", "train"], example
            found.append((int(example[2]), example[6:]))
    return found


def test_the_help_has_its_examples_with_their_comments_in_one_column():
    text = build_parser(train.__doc__).format_help()
    lines = [line for line in text.splitlines() if re.match(r" {4}(picofx train|torchrun)\b", line)]
    assert len(one_process_examples()) >= 5 and len(torchrun_examples()) >= 8
    assert len({line.index("#") for line in lines if "#" in line and line.startswith("    picofx")}) == 1
    assert len({line.index("#") for line in lines if "#" in line and line.startswith("    torchrun")}) == 1
    assert text.startswith("usage: picofx train ")


def test_every_torchrun_example_is_a_layout_its_ranks_run():
    for ranks, options in torchrun_examples():
        args = parse_args(options, environ={"RANK": "0", "WORLD_SIZE": str(ranks)})
        assert args.world == ranks, options


def test_every_one_process_example_runs(tmp_path, monkeypatch):
    """In order, in a directory of their own: --save's example writes what --resume's reads."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("Notes on training small language models on a laptop.\n" * 400)
    for options in one_process_examples():
        steps = ["--steps", "3"] if "--resume" in options else []  # on from the 2 steps --save's example saved
        result = train.main([*options, *STEPS, *steps])
        assert len(result["losses"]) == (1 if steps else 2), options


@pytest.mark.slow
def test_the_checkpoint_example_runs_under_its_own_backend():
    """Its budget is a fraction of the step's peak; under Inductor, which fuses what eager keeps,
    the peak and what recomputation can take off it differ from eager's."""
    (options,) = [o for o in one_process_examples() if "--memory-budget" in o]
    result = train.main([*options, "--steps", "1"])
    assert len(result["losses"]) == 1


def torchrun(ranks: int, options: list[str], timeout: float) -> tuple[int, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "picofx", "train", *options]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started, nothing else
        raise AssertionError(f"{options} still running after {timeout} s:\n{proc.communicate()[0][-3000:]}")
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize("ranks, options", torchrun_examples(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else f"{v} ranks")
def test_every_torchrun_example_runs(ranks, options):
    if ranks > 4:
        pytest.skip(EIGHT_RANKS)
    code, out = torchrun(ranks, [*options, *STEPS], timeout=420)
    assert code == 0, out[-4000:]
    assert f"GFLOP/s per rank x {ranks} ranks" in out, out[-4000:]  # MFU over every rank's peak
