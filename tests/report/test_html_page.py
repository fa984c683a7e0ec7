"""The HTML page without a browser: self-contained, every section present when its data is and
absent when not, text escaped, and the pipeline schedule's simulation keeping its dependencies."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from picofx.cost.balance import Unit, plan_for
from picofx.cost.device import Link
from picofx.cost.units import format_bytes
from picofx.models import zoo
from picofx.report_html import render, sections
from picofx.report_html.data import pipeline_schedule
from picofx.report_html.svg import MARGIN, line_chart

HOSTILE = '<script>alert("x")</script> & <b>'


def pipeline(schedule: str, microbatches: int = 4, stages: int = 2):
    units = [Unit(f"layers.{i}", 1e-3, 1000, 1000, 100) for i in range(4)]
    bounds = [i * 4 // stages for i in range(stages)]
    plan = plan_for(units, bounds, schedule=schedule, microbatches=microbatches, virtual=1,
                    link=Link("test", 1e12, 0.0), state_per_parameter_byte=16)
    return SimpleNamespace(plan=plan, stages=stages, virtual=1)


def plans() -> dict:
    common = dict(dp=2, tp=1, pp=1, shard=False, microbatches=1, schedule="1F1B", checkpoint=False, compress=None,
                  tokens_per_s=1e5, mfu=0.4, suggestions=[f"try {HOSTILE}"], measured_step_s=None)
    return {"plans": [{**common, "memory_per_gpu": 40e9, "step_s": 1.0, "fits": True, "reason": "",
                       "bottleneck": "compute"},
                      {**common, "shard": True, "memory_per_gpu": 90e9, "step_s": 0.9, "fits": False,
                       "reason": f"memory {HOSTILE}", "bottleneck": "memory"}], "best": 0}


def report() -> dict:
    return {"backend": "eager", "capture_seconds": 0.1, "compile_seconds": 0.2, "recompilations": 0,
            "sections": {"note": HOSTILE},
            "passes": [{"name": "fuse", "stage": "forward", "graph": "forward", "seconds": 0.01, "nodes_before": 10,
                        "nodes_after": 8, "added": ["a"], "removed": ["b", "c", "d"], "notes": [f"why={HOSTILE}"],
                        "details": [("near_misses", [HOSTILE])]}]}


def full_page() -> str:
    return render(report(), pipeline=pipeline("1F1B"), plans=plans(), losses=[3.0, 2.0, 1.5], title=HOSTILE)


def assert_self_contained(page: str) -> None:
    lowered = page.lower()
    for loaded in ("<script", "@import", "src=", "url(", "<link", "<img", "<iframe", "http:", "https:"):
        assert loaded not in lowered, loaded
    assert all(href.startswith("#") for href in re.findall(r'href="([^"]*)"', page))


def test_every_section_is_present_when_its_data_is_and_the_page_loads_nothing():
    page = full_page()
    assert_self_contained(page)
    for anchor in ("passes", "pipeline", "plans", "loss"):
        assert f'<section id="{anchor}">' in page
    assert page.count("<svg") == 4  # the pipeline Gantt, two plan bar charts, the loss curve


def test_text_is_escaped_everywhere():
    page = full_page()
    assert HOSTILE not in page and "alert(&quot;x&quot;)" in page
    assert page.count("&lt;script&gt;") >= 5  # title, note, details, section text, plan reason and suggestion


def test_sections_without_data_are_left_out():
    only_loss = render(losses=[2.0, 1.0])
    assert '<section id="loss">' in only_loss
    assert not any(f'<section id="{a}">' in only_loss for a in ("passes", "memory", "timeline", "pipeline", "plans"))
    assert "Nothing to show" in render()



def test_several_runs_losses_are_drawn_side_by_side_each_in_its_own_colour():
    runs = {"none": [3.0, 2.0, 1.0], "int8:ef": [3.0, 2.1, 1.1], "topk:0.01": [3.0, 2.5, 2.0]}
    page = render(losses=runs)
    assert page.count('<polyline class="line loss run') == 3 and page.count('class="key run') == 3
    assert "Loss over the training runs" in page and "<td>topk:0.01</td><td>3</td><td>3.0000</td><td>2.0000</td>" \
        in page.replace('<span class="key run2"></span>', "")
    assert all(f".line.run{k} {{" in page for k in range(3))  # every colour used is styled

def test_plans_that_do_not_fit_are_listed_with_why_and_drawn_in_red():
    page = render(plans=plans())
    assert 'class="nofit"' in page and "memory &lt;script&gt;" in page and 'class="best"' in page


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_the_pipeline_schedule_keeps_its_dependencies_and_the_plans_bubble(schedule):
    layout = pipeline(schedule, microbatches=4)
    found = pipeline_schedule(layout)
    when = {(kind, stage, mb): (start, end) for row in found["rows"] for start, end, kind, mb, stage in row}
    assert len(when) == 2 * 2 * 4
    for row in found["rows"]:
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(row, row[1:]))  # a rank runs one task at a time
    for mb in range(4):
        assert when[("F", 0, mb)][1] <= when[("F", 1, mb)][0] + 1e-12
        assert when[("B", 1, mb)][1] <= when[("B", 0, mb)][0] + 1e-12
        assert when[("F", 1, mb)][1] <= when[("B", 1, mb)][0] + 1e-12
    assert found["bubble"] == pytest.approx(layout.plan.bubble, abs=0.02)
    if schedule == "1F1B":  # the last stage runs each micro-batch's backward before the next forward
        kinds = [kind for _, _, kind, _, _ in found["rows"][1]]
        assert kinds == ["F", "B"] * 4


def test_an_optimize_run_with_overlap_has_its_passes_memory_and_exposed_communication(optimize_page):
    page = open(optimize_page, encoding="utf-8").read()
    assert_self_contained(page)
    for anchor in ("passes", "memory", "timeline"):
        assert f'<section id="{anchor}">' in page
    assert "optimize &lt;tiny&gt; &amp; overlap" in page
    assert 'class="exposed"' in page and "Each of 8 ranks" in page
    assert "gradient buckets (overlap)" in page


def test_a_one_process_dump_with_overlap_says_it_sends_nothing_instead_of_predicting_other_ranks(overlap_dump_page):
    page = open(overlap_dump_page, encoding="utf-8").read()
    timeline = page[page.index('<section id="timeline">'):]
    timeline = timeline[:timeline.index("</section>")]
    gradients = sum(p.numel() * p.element_size() for p in zoo.build("llama-tiny").model.parameters())
    assert f"carrying {format_bytes(gradients)} per step, but over one rank they send nothing" in timeline
    assert "<svg" not in timeline and "8 ranks" not in page and "assumed" not in page


def test_a_loss_curve_fills_the_chart_height():
    losses = [5.6038, 5.49, 5.51, 5.4538]
    chart = line_chart([{"name": "loss", "points": list(enumerate(losses)), "cls": "loss"}], x_label="step",
                       y_label="loss", from_zero=False, height=280)
    ys = [float(point.split(",")[1]) for point in re.search(r'<polyline[^>]* points="([^"]+)"', chart)[1].split()]
    assert max(ys) - min(ys) >= 0.8 * (280 - MARGIN["top"] - MARGIN["bottom"])


def test_no_line_crosses_the_label_of_a_peak_close_to_another():
    marks = [{"y": 1.47e6, "label": "predicted peak", "cls": "predicted"},
             {"y": 1.53e6, "label": "measured peak", "cls": "measured"}]
    chart = line_chart([{"name": "live", "points": [(0, 0.5e6), (1, 1.47e6)], "cls": "memory"}], x_label="ms",
                       y_label="bytes", marks=marks)
    lines = [float(y) for y in re.findall(r'<line class="mark [^"]*" x1="[^"]*" y1="([^"]*)"', chart)]
    labels = [float(y) for y in re.findall(r'<text x="[^"]*" y="([^"]*)"[^>]*class="note (?:predicted|measured)"',
                                          chart)]
    assert len(lines) == len(labels) == 2 and lines[0] - lines[1] < 12  # close: one label's height apart
    for baseline in labels:  # an 11px label covers from about 9px above its baseline to 2px below
        assert not any(baseline - 9 < y < baseline + 2 for y in lines), (baseline, lines)


def test_the_memory_chart_draws_the_measured_peak_beside_the_predicted_one():
    curve = {"points": [(0.0, 100), (1.0, 900), (2.0, 400)], "backward_starts_ms": 1.0, "resident": 100,
             "peak": 900, "peak_at": "mm <x>", "peak_phase": "forward"}
    page = sections.memory_section(curve, measured_peak=1000)
    assert "predicted against measured" in page and "-10.0% off" in page and "mm &lt;x&gt;" in page
    assert 'class="mark measured"' in page and 'class="mark predicted"' in page
    assert "against measured" not in sections.memory_section(curve)
