"""The plan table of `picofx plan --html`: each plan's best neighbouring change with its expected gain
(the others folded under it), as the planner's Predictions carry them and as their JSON does; layouts
told apart; small models' figures readable."""
from __future__ import annotations

import dataclasses
import json
import re

from picofx.planner.layouts import Layout, Prediction
from picofx.planner.suggest import NONE_HELPS, Suggestion
from picofx.report_html import render


def prediction(layout: Layout, *, step_s: float = 4.0, memory: float = 40e9, fits: bool = True, mfu: float = 0.4,
               suggestions=()) -> Prediction:
    return Prediction(layout, int(memory), {}, step_s, {}, 1e5, mfu, fits, "" if fits else "memory: too much",
                      "pipeline bubble" if fits else "memory: does not fit", list(suggestions))


PIPELINED = Layout(dp=2, tp=1, pp=4, microbatches=4)
MORE_MICROBATCHES = dataclasses.replace(PIPELINED, microbatches=8)
SHARDED = dataclasses.replace(PIPELINED, shard=True)
SUGGESTED = [Suggestion("8 micro-batches", "pipeline bubble", 0.6, -2e9, MORE_MICROBATCHES),
             Suggestion("sharded data parallel", "exposed dp communication", 0.2, 5e9, SHARDED)]


def page_of(predictions: list[Prediction], best: int | None = 0) -> str:
    """The page of `predictions` as `picofx plan --html` writes it: from the plans' JSON."""
    plans = [{**p.as_json(), "suggestions": [dataclasses.asdict(s) for s in p.suggestions]} for p in predictions]
    return render(plans=json.loads(json.dumps({"plans": plans, "best": best})))


def cells(page: str) -> list[str]:
    return re.findall(r'<td class="(?:suggestions|quiet)">(.*?)</td>', page)


def test_each_plan_shows_its_best_change_with_its_gain_and_the_others_folded_under_it():
    plans = [prediction(PIPELINED, suggestions=SUGGESTED),
             prediction(MORE_MICROBATCHES, step_s=3.5,
                        suggestions=[Suggestion(NONE_HELPS, "pipeline bubble", 0.0, 0.0)])]
    best, none_helps = cells(page_of(plans))
    shown, folded = best.split("<details>")
    assert "8 micro-batches: step -600 ms (-15%), memory +2.0 GB per GPU; addresses pipeline bubble" in shown
    assert 'title="dp2 x tp1 x pp4, 8 mb"' in shown  # the layout it leads to, on hover
    assert "<summary>1 more</summary>" in folded
    assert "sharded data parallel: step -200 ms (-5%), memory -5.0 GB per GPU; addresses exposed dp communication" \
        in folded
    assert none_helps == '<span class="quiet">no neighbouring change helps</span>'


def test_predictions_given_as_they_are_show_as_their_json_does():
    plan = prediction(PIPELINED, suggestions=SUGGESTED)
    assert cells(render(plans={"plans": [plan], "best": 0})) == cells(page_of([plan]))


def test_a_plan_that_does_not_fit_shows_what_makes_it_fit():
    fitting = Suggestion("checkpointing every layer", "memory: does not fit", -0.8, 12e9, SHARDED)
    page = page_of([prediction(PIPELINED, memory=90e9, fits=False, suggestions=[fitting])], best=None)
    assert cells(page) == ['<span title="dp2 shard x tp1 x pp4, 4 mb">checkpointing every layer: memory -12.0 GB per '
                           "GPU, step +800 ms (+20%); addresses memory: does not fit</span>"]  # memory first


def test_a_plan_without_suggestions_says_so():
    assert cells(page_of([prediction(PIPELINED)])) == ["none given"]


def test_layouts_that_differ_only_in_sequence_parallelism_are_told_apart():
    page = page_of([prediction(Layout(dp=2, tp=2, pp=1)), prediction(Layout(dp=2, tp=2, pp=1, sequence_parallel=True))])
    assert page.count("dp2 x tp2 sp x pp1, 1 mb") == 5  # the table, and each chart's bar label and tip
    assert ">dp2 x tp2 x pp1, 1 mb</td>" in page


def test_a_small_models_memory_step_and_mfu_keep_their_digits():
    tiny = Suggestion("tp 1", "tensor-parallel communication", 2.65e-5, -1e6, Layout(dp=4, tp=1, pp=1))
    page = page_of([prediction(PIPELINED, step_s=5.283e-4, memory=31.4e6, mfu=2.7e-5, suggestions=[tiny])])
    assert "31.4 MB" in page and "528.3 µs" in page and "0.0027%" in page and "step -26.5 µs (-5%)" in page
    assert "0.0 GB" not in page and "0.0%" not in page
