"""picofx plan on a terminal says what it is doing while it works (a capture of a large model takes
a while), and is silent in a pipe; --measure-top N measures N plans."""
from __future__ import annotations

import io
import re

import pytest

from picofx.cli import main
from picofx.planner import costs

TINY = ["plan", "llama-tiny", "--gpus", "4", "--gpu", "h100", "--seq", "32", "--global-batch", "8"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_each_step_is_told_before_it_runs_with_the_time_so_far(monkeypatch, capsys):
    monkeypatch.setattr(costs, "CAPTURED", {})  # captured afresh, not by an earlier test
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(TINY) == 0
    layouts = int(re.search(r"; (\d+) layouts,", capsys.readouterr().out).group(1))
    told = terminal.getvalue().splitlines()
    assert all(re.match(r"^\[ *[\d.]+ s\] ", line) for line in told)
    assert [re.sub(r"^\[ *[\d.]+ s\] ", "", line) for line in told] == [
        "capturing the step with 1 decoder layer on fake tensors (32 tokens) ...",
        "capturing the step with 2 decoder layers on fake tensors (32 tokens) ...",
        "predicting every layout ...",
        f"predicting the neighbours of {layouts:,} layouts for their suggestions ..."]


def test_in_a_pipe_nothing_but_the_results_is_printed(capsys):
    assert main(TINY) == 0
    assert capsys.readouterr().err == ""


def test_measure_top_measures_that_many_plans(monkeypatch, capsys):
    asked = []

    def measure(predictions, run, top, steps=8):  # stands in for the gloo ranks: what matters is `top`
        asked.append(top)
        chosen = [p for p in predictions if p.fits][:top]
        for p in chosen:
            p.measured_step_s = p.step_s
        return chosen

    monkeypatch.setattr("picofx.cli.plan.measure", measure)
    assert main([*TINY, "--measure", "--measure-top", "2"]) == 0
    table = capsys.readouterr().out.split("predicted s")[1]
    assert asked == [2] and len(re.findall(r"^dp\d", table, re.M)) == 2
    with pytest.raises(SystemExit):
        main([*TINY, "--measure", "--measure-top", "0"])
