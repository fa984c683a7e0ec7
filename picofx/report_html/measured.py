"""The page's measured step (`picofx train --profile --report`): each rank's traced step laid out part by
part (picofx.diagnose.breakdown's components, their means over the traced steps), beside the
planner's prediction of the same layout."""
from __future__ import annotations

from picofx.report_html.sections import drawn, legend, ms, para, section
from picofx.report_html.svg import gantt

# component -> (colour class, legend text), in the order a step's parts are drawn
PARTS = {"data": ("measured", "data wait"), "forward": ("forward", "forward"), "backward": ("backward", "backward"),
         "optimizer": ("fits", "optimizer"), "checkpoint": ("loss", "checkpoint"),
         "exposed_comm": ("exposed", "exposed communication"), "idle": ("bubble", "idle or unattributed"),
         "unattributed": ("bubble", "idle or unattributed")}
PREDICTED = {"compute": ("compute", "predicted compute (forward + backward)"), "optimizer": ("fits", "optimizer"),
             "exposed_comm": ("exposed", "exposed communication")}


def lane(label: str, figures: dict, parts: dict) -> dict:
    bars, at = [], 0.0
    for key, (cls, text) in parts.items():
        seconds = figures.get(key, 0.0)
        if seconds > 0:
            bars.append({"start": at * 1e3, "end": (at + seconds) * 1e3, "cls": cls,
                         "tip": f"{text} {ms(seconds * 1e3)}", "text": key})
            at += seconds
    return {"label": label, "bars": bars}


def measured_section(measured: dict | None) -> str:
    """`measured`: {"ranks": [each rank's mean breakdown], "predicted": {compute, optimizer, exposed_comm,
    step} in seconds, or None}."""
    if not measured or not measured.get("ranks"):
        return ""
    rows = [lane(f"rank {r} measured", mean, PARTS) for r, mean in enumerate(measured["ranks"]) if mean]
    predicted = measured.get("predicted")
    if predicted:
        rows.append(lane("predicted", predicted, PREDICTED))
    chart = gantt(rows, x_label="time in a step (ms)", x_fmt=lambda v: f"{v:.3g}")
    hidden = [mean.get("hidden_comm", 0.0) for mean in measured["ranks"] if mean]
    text = (f"The traced steps' mean on each of {len(rows) - bool(predicted)} rank(s), part by part (the parts do not "
            f"overlap and add up to the step); communication hidden behind compute, not drawn: "
            f"{', '.join(ms(h * 1e3) for h in hidden)}.")
    if predicted:
        text += f" The planner predicted a step of {ms(predicted['step'] * 1e3)} for this layout."
    entries = {cls: text for cls, text in [*PARTS.values(), *(PREDICTED.values() if predicted else [])]}
    return section("measured", "Measured step per rank", para(text),
                   legend(*drawn([b for r in rows for b in r["bars"]], *entries.items())), chart)
