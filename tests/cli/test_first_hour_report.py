"""A new user's first hour, the run's HTML report (issue 48): titled by the model trained, "predicted"
beside every prediction, written when SIGTERM stops the run, and covering every step across a resume."""
import html
import importlib
import os
import re
import signal
from types import SimpleNamespace

import torch

from picofx.cost.balance import Unit, plan_for
from picofx.cost.device import Link
from picofx.report_html import render, sections
from picofx.report_html.data import pipeline_schedule

FAST = ["--backend", "eager", "--passes", "--batch", "2", "--seq", "16", "--log-every", "1"]


def text_of(page: str) -> str:
    page = re.sub(r"<style>.*?</style>|<svg.*?</svg>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_every_prediction_on_the_page_says_it_is_predicted():
    units = [Unit(f"layers.{i}", 1e-3, 1000, 1000, 100) for i in range(4)]
    plan = plan_for(units, [0, 2], schedule="1F1B", microbatches=4, virtual=1, link=Link("test", 1e12, 0.0),
                    state_per_parameter_byte=16)
    timeline = {"world": 2, "link": "test link", "compute": [(0.0, 2.0, "forward")],
                "comm": [(1.0, 3.0, "all_reduce g")], "exposed": [(2.0, 3.0, "waits for g")], "step_ms": 3.0,
                "exposed_ms": 1.0, "comm_ms": 2.0, "collectives": 1, "payload_bytes": 4096}
    curve = {"points": [(0.0, 100.0), (1.0, 300.0)], "backward_starts_ms": 0.5, "resident": 100, "peak": 300,
             "peak_at": "mm", "peak_phase": "backward"}
    plan_row = dict(dp=2, tp=1, pp=1, shard=False, microbatches=1, schedule="1F1B", checkpoint=False, compress=None,
                    tokens_per_s=1e5, mfu=0.4, suggestions=[], measured_step_s=None, memory_per_gpu=4e9, step_s=1.0,
                    fits=True, reason="", bottleneck="compute")
    page = render(pipeline=SimpleNamespace(plan=plan, stages=2, virtual=1), plans={"plans": [plan_row], "best": 0})
    page += sections.timeline_section(timeline) + sections.memory_section(curve)
    text = text_of(page)
    for figure in ("step", "bubble", "communication"):  # a figure's number follows its name
        found = re.findall(rf"(\w+) {figure} [\d.]+ ?(?:ms|%)", text)
        assert found and set(found) == {"predicted"}, (figure, found, text)
    assert "predicted resident (parameters, buffers, inputs, optimizer state) 100 B" in text
    assert all(f"predicted {what}" in text for what in ("memory/GPU", "step", "tokens/s", "MFU"))
    assert "Compute and communication per rank (predicted)" in text and "Pipeline schedule (predicted)" in text


def test_the_report_names_the_model_it_trained():
    from picofx.cli.train_report import model_name

    assert model_name(SimpleNamespace(model="HuggingFaceTB/SmolLM2-135M", size="tiny")) == "HuggingFaceTB/SmolLM2-135M"
    assert model_name(SimpleNamespace(model=None, size="tiny")) == "reference LLaMA tiny"


def sigterm_at_optimizer_step(monkeypatch, at: int) -> None:
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def test_a_report_is_written_on_sigterm_and_after_a_resume_covers_the_whole_run(tmp_path, monkeypatch):
    train = importlib.import_module("picofx.cli.train").main
    root, first, second = str(tmp_path / "run"), tmp_path / "first.html", tmp_path / "second.html"
    with monkeypatch.context() as patched:
        sigterm_at_optimizer_step(patched, 2)
        stopped = train([*FAST, "--steps", "4", "--save", root, "--report", str(first)])
    assert stopped["preempted"] == 2
    page = text_of(first.read_text())
    assert "picofx train: reference LLaMA tiny" in page and "tiny model" not in page
    assert f"stopped by SIGTERM after step 2, saved to {root}/step-2" in page
    assert f"2 steps: loss {stopped['losses'][0]:.4f} at the first, {stopped['losses'][1]:.4f} at the last" in page

    resumed = train([*FAST, "--steps", "4", "--save", root, "--resume", "auto", "--report", str(second)])
    assert len(resumed["losses"]) == 2  # this session's steps 3 and 4
    page = text_of(second.read_text())
    assert "resumed at step 2" in page
    assert f"4 steps: loss {stopped['losses'][0]:.4f} at the first, {resumed['losses'][-1]:.4f} at the last" in page


def test_a_report_without_save_records_the_sigterm_that_stopped_the_run(tmp_path, monkeypatch, capsys):
    train = importlib.import_module("picofx.cli.train").main
    report = tmp_path / "run.html"
    sigterm_at_optimizer_step(monkeypatch, 2)
    stopped = train([*FAST, "--steps", "4", "--report", str(report)])
    assert stopped["preempted"] == 2 and len(stopped["losses"]) == 2
    assert "stopped by SIGTERM after step 2, nothing saved (no --save)" in text_of(report.read_text())
    assert "nothing saved (pass --save DIR" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is given back
