"""Colours read as the page's CSS gives them: within a chart's legend no two entries share a colour,
each entry is drawn in the chart in its key's colour, and red marks only what is wrong."""
from __future__ import annotations

import pytest
from html_styles import DRAWN, StyledPage, reddish
from test_html_page import plans

from picofx.report_html import render, sections

PAGES = ["optimize_page", "overlap_dump_page", "dump_page", "plan_page", "train_page"]


def memory_page() -> str:
    curve = {"points": [(0.0, 100), (1.0, 900), (2.0, 400)], "backward_starts_ms": 1.0, "resident": 100,
             "peak": 900, "peak_at": "mm", "peak_phase": "forward"}
    return render(plans=plans(), losses=[3.0, 2.0]).replace("</body>", sections.memory_section(curve, 1000)
                                                             + "</body>")


def check_legends(page: StyledPage) -> int:
    """Asserts, for each section's legend (its colour keys), that the colours are distinct and each
    is the colour its entry is drawn in; returns how many sections have one."""
    legends = {}
    for key in page.find("span", "key"):
        legends.setdefault(key.section, []).append(key)
    for section, keys in legends.items():
        colours = {" ".join(sorted(k.classes - {"key"})): page.style_of(k, "background") for k in keys}
        assert None not in colours.values(), colours
        assert len(set(colours.values())) == len(colours), f"the legend of {section} repeats a colour: {colours}"
        drawn = [e for e in page.find(section=section) if e.tag in DRAWN]
        for cls, colour in colours.items():
            shapes = [e for e in drawn if cls in e.classes]
            assert shapes, f"the legend of {section}: {cls!r} is drawn nowhere"
            assert all(colour in (page.style_of(e, "fill"), page.style_of(e, "stroke")) for e in shapes), cls
    return len(legends)


@pytest.mark.parametrize("fixture", PAGES)
def test_each_legend_entry_has_its_own_colour_the_one_its_chart_draws(fixture, request):
    path = request.getfixturevalue(fixture)
    page = StyledPage(open(path[0] if isinstance(path, tuple) else path, encoding="utf-8").read())
    assert check_legends(page) >= 1


def test_the_memory_legend_tells_the_live_bytes_from_the_predicted_and_measured_peaks():
    page = StyledPage(memory_page())
    assert check_legends(page) == 2  # memory, plans
    assert {frozenset(k.classes) for k in page.find("span", "key", section="memory")} == \
        {frozenset({"key", c}) for c in ("memory", "predicted", "measured")}


def test_a_bottleneck_is_red_only_where_the_plan_does_not_fit():
    page = StyledPage(render(plans=plans()))
    cells = page.find("td", "bottleneck", section="plans")
    assert [c.ancestors[0].classes for c in cells] == [{"best"}, {"nofit"}]
    fitting, unfit = (page.style_of(c, "color", inherited=True) for c in cells)
    assert not reddish(fitting) and reddish(unfit), (fitting, unfit)
