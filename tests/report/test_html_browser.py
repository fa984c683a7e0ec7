"""Each kind of page loaded in headless Chromium (Debian's `chromium`): no console message (the pages
run no script, so any message is an error), no request made by the page (read from Chromium's
net log: requests whose isolation key is the file:// page), the rendered text, and charts of
positive size with something drawn in each. Skipped, with the reason, where Chromium is absent."""
from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH (Debian: apt-get install chromium); "
                                                         "the HTML pages are checked without a browser only")
DRAWN = {"rect", "polyline", "line", "path", "circle"}
SCAFFOLD = {"axis", "grid", "lane"}  # drawn in every chart, data or not


class Charts(HTMLParser):
    """The rendered DOM's text and, per <svg>, its width, height, viewBox and drawn elements."""

    def __init__(self):
        super().__init__()
        self.charts, self.text, self.inside = [], [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg":
            self.charts.append({"width": float(attrs.get("width", 0)), "height": float(attrs.get("height", 0)),
                                "viewBox": attrs.get("viewbox", ""), "drawn": 0})
        elif tag in DRAWN and self.charts and not set(attrs.get("class", "").split()) & SCAFFOLD:
            self.charts[-1]["drawn"] += 1
        self.inside = tag == "style" or self.inside and tag != "body"

    def handle_endtag(self, tag):
        self.inside = False if tag == "style" else self.inside

    def handle_data(self, data):
        if not self.inside:
            self.text.append(data)


def load(page: str, tmp_path: Path) -> tuple[Charts, str, list[str]]:
    """(the rendered DOM parsed, Chromium's log, the URLs the page requested)."""
    net_log = tmp_path / "net.json"
    run = subprocess.run(headless(tmp_path) + ["--enable-logging=stderr", "--v=0", f"--log-net-log={net_log}",
                                               "--dump-dom", Path(page).resolve().as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = Charts()
    dom.feed(run.stdout)
    events = json.loads(net_log.read_text()).get("events", []) if net_log.exists() else []
    requested = [e["params"]["url"] for e in events if "url" in e.get("params", {})
                 and str(e["params"].get("network_isolation_key", "")).startswith("file://")]
    return dom, run.stderr, requested


def headless(tmp_path: Path) -> list[str]:
    return [BROWSER, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}",
            "--no-first-run", "--disable-extensions"]


def check(page: str, tmp_path: Path, expected: list[str], charts: int) -> Charts:
    shot = tmp_path / "page.png"
    subprocess.run(headless(tmp_path) + ["--hide-scrollbars", "--window-size=1100,1600", f"--screenshot={shot}",
                                         Path(page).resolve().as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000  # text and charts were painted
    dom, log, requested = load(page, tmp_path)
    console = [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line
               or "Failed to load" in line]
    assert console == [] and requested == []
    text = " ".join(" ".join(dom.text).split())
    for words in expected:
        assert words in text, f"{words!r} not in the rendered text"
    assert len(dom.charts) == charts
    for chart in dom.charts:
        assert chart["width"] > 0 and chart["height"] > 0 and chart["viewBox"].startswith("0 0 ")
        assert chart["drawn"] > 0, chart
    return dom


def test_the_checks_see_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><img src="http://127.0.0.1:9/x.png"><script>throw new Error("boom")</script>'
                   "</body></html>")
    _, log, requested = load(str(bad), tmp_path)
    assert "Uncaught Error: boom" in log and requested == ["http://127.0.0.1:9/x.png"]


def test_the_report_of_an_optimize_run_with_overlap(optimize_page, tmp_path):
    check(optimize_page, tmp_path, ["Passes: what each changed and why", "checkpoint", "overlap",
                                    "Memory over the step", "predicted peak", "Compute and communication per rank",
                                    "is exposed"], charts=2)


def test_the_plan_page(plan_page, tmp_path):
    check(plan_page, tmp_path, ["picofx plan llama-tiny", "Plans: predicted step, memory, bottleneck", "bottleneck",
                                "Predicted step per plan", "Predicted memory per GPU"], charts=2)


def test_the_dump_page_of_a_pipeline(dump_page, tmp_path):
    check(dump_page, tmp_path, ["picofx dump llama-tiny", "pipeline", "Pipeline schedule", "1F1B", "bubble",
                                "rank 0", "rank 1", "F0", "B3"], charts=1)


def test_the_page_of_a_training_run(train_page, tmp_path):
    path, losses = train_page
    check(path, tmp_path, ["picofx train", "Loss over the training run", f"{len(losses)} steps",
                           f"{losses[-1]:.4f}", "Memory over the step"], charts=2)


def test_a_page_of_several_runs_losses(tmp_path):
    from picofx.report_html import write_html

    runs = {"none": [5.5, 3.0, 1.0], "int8:ef": [5.5, 3.1, 1.0], "powersgd:4": [5.5, 3.6, 1.4]}
    page = write_html(str(tmp_path / "runs.html"), losses=runs, title="picofx: gradient compression")
    check(page, tmp_path, ["Loss over the training runs", "powersgd:4 3 5.5000 1.4000", "int8:ef"], charts=1)
