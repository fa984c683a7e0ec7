"""One function per section of the page, each taking plain data and returning HTML ("" when there
is nothing to show, so the page leaves the section out)."""
from __future__ import annotations

from html import escape

from picofx.cost.units import format_bytes
from picofx.report_html.page import RUNS
from picofx.report_html.svg import binary_ticks, gantt, line_chart


def section(anchor: str, title: str, *parts: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(title)}</h2>' + "".join(parts) + "</section>"


def para(text: str, cls: str = "") -> str:
    css = f' class="{cls}"' if cls else ""
    return f"<p{css}>{escape(text)}</p>"


def legend(*entries: tuple[str, str]) -> str:
    return '<p class="legend">' + "".join(f'<span class="key {cls}"></span>{escape(text)} ' for cls, text in entries) \
        + "</p>"


def drawn(bars_: list[dict], *entries: tuple[str, str]) -> list[tuple[str, str]]:
    """The legend `entries` whose class some bar is drawn in."""
    used = {bar["cls"] for bar in bars_}
    return [entry for entry in entries if entry[0] in used]


def ms(value: float) -> str:
    return f"{value:.3g} ms"


def passes_section(report: dict, layouts: list[tuple[str, str]] = ()) -> str:
    """`report`: Report.to_dict() with each pass's "notes" as texts and its structured notes as
    "details" [(name, lines)] (Report.to_html makes it); `layouts`: (title, text) of the recorded layouts."""
    if not report or not (report.get("passes") or report.get("sections") or layouts):
        return ""
    rows = ["<tr><th>pass</th><th>stage</th><th>graph</th><th>ms</th><th>nodes before &rarr; after</th>"
            "<th>what it did</th></tr>"]
    for p in report.get("passes", []):
        changed = p["added"] or p["removed"] or p["nodes_before"] != p["nodes_after"]
        notes = f"<li>{escape(', '.join(p['notes']))}</li>" if p["notes"] else ""
        for key, lines in p.get("details", []):
            items = "".join(f"<li>{escape(line)}</li>" for line in lines)
            notes += f"<li><details><summary>{escape(key.replace('_', ' '))}</summary><ul>{items}</ul></details></li>"
        rows.append(f'<tr class="{"changed" if changed else "unchanged"}"><td>{escape(p["name"])}</td>'
                    f'<td>{escape(p["stage"])}</td><td>{escape(p["graph"])}</td><td class="num">'
                    f'{p["seconds"] * 1e3:.1f}</td><td class="num">{p["nodes_before"]} &rarr; {p["nodes_after"]} '
                    f'(+{len(p["added"])} &minus;{len(p["removed"])})</td><td><ul class="notes">{notes}</ul></td></tr>')
    summary = (f"backend {report.get('backend')}, capture {report.get('capture_seconds', 0):.2f} s, compile "
               f"{report.get('compile_seconds', 0):.2f} s, {report.get('recompilations', 0)} recompilations")
    extra = [(title, text) for title, text in (report.get("sections") or {}).items() if text] + list(layouts)
    blocks = "".join(f"<h3>{escape(title)}</h3><pre>{escape(text)}</pre>" for title, text in extra)
    table = f'<table class="passes">{"".join(rows)}</table>' if len(rows) > 1 else ""
    return section("passes", "Passes: what each changed and why", para(summary), table, blocks)


def memory_section(curve: dict | None, measured_peak: int | None = None) -> str:
    """`curve`: data.memory_curve's; `measured_peak`: bytes a real step reached, where known."""
    if not curve or not curve.get("points"):
        return ""
    marks = [{"y": curve["peak"], "label": f"predicted peak {format_bytes(curve['peak'])}", "cls": "predicted"}]
    if measured_peak:
        marks.append({"y": measured_peak, "label": f"measured peak {format_bytes(measured_peak)}", "cls": "measured"})
    end = curve["points"][-1][0]
    spans = [{"x0": curve["backward_starts_ms"], "x1": end, "label": "backward", "cls": "phase"}]
    chart = line_chart([{"name": "predicted live bytes", "points": curve["points"], "cls": "memory"}],
                       x_label="predicted time in the step (ms)", y_label="live memory",
                       x_fmt=lambda v: f"{v:.3g}", y_fmt=format_bytes, marks=marks, spans=spans, y_ticks=binary_ticks)
    text = (f"Predicted peak {format_bytes(curve['peak'])} in the {curve['peak_phase']} at {curve['peak_at']}; "
            f"predicted resident (parameters, buffers, inputs, optimizer state) {format_bytes(curve['resident'])}.")
    if measured_peak:
        error = curve["peak"] / measured_peak - 1
        off = "exact to 0.1%" if abs(error) < 5e-4 else f"{error:+.1%} off"
        text += f" Measured peak {format_bytes(measured_peak)}: the prediction is {off}."
    title = "Memory over the step: predicted against measured" if measured_peak else "Memory over the step (predicted)"
    return section("memory", title, para(text),
                   legend(("memory", "predicted live bytes"), ("predicted", "predicted peak"),
                          *((("measured", "measured peak"),) if measured_peak else ())), chart)


def timeline_section(timeline: dict | None) -> str:
    """`timeline`: data.comm_timeline's."""
    if not timeline:
        return ""
    if timeline["world"] == 1:
        return section("timeline", "Compute and communication per rank (predicted)", para(
            f"One process: the passes placed {timeline['collectives']} collective"
            f"{'s' if timeline['collectives'] > 1 else ''}, carrying "
            f"{format_bytes(timeline['payload_bytes'])} per step, but over one rank they send nothing, so there is "
            "no communication to predict. Run the step under torchrun (or give Report.to_html world=N) for the "
            "timeline over its ranks."))
    compute = [{"start": s, "end": e, "cls": "compute", "tip": f"{phase} {ms(e - s)}", "text": phase}
               for s, e, phase in timeline["compute"]]
    compute += [{"start": s, "end": e, "cls": "exposed", "tip": f"exposed {ms(e - s)}: {why}"}
                for s, e, why in timeline["exposed"]]
    comm = [{"start": s, "end": e, "cls": "comm", "tip": f"{what} {ms(e - s)}"} for s, e, what in timeline["comm"]]
    chart = gantt([{"label": "rank compute", "bars": compute}, {"label": "rank comm", "bars": comm}],
                  x_label="predicted time (ms)", x_fmt=lambda v: f"{v:.3g}", end=timeline["step_ms"])
    hidden = timeline["comm_ms"] - timeline["exposed_ms"]
    text = (f"Each of {timeline['world']} ranks over {timeline['link']}: predicted step {ms(timeline['step_ms'])}, "
            f"predicted communication {ms(timeline['comm_ms'])} of which {ms(max(hidden, 0))} hides behind compute and "
            f"{ms(timeline['exposed_ms'])} is exposed (compute waits).")
    return section("timeline", "Compute and communication per rank (predicted)", para(text),
                   legend(*drawn(compute + comm, ("compute", "compute"), ("comm", "collective on the link"),
                                 ("exposed", "exposed: compute waits for a collective"))), chart)


def pipeline_section(schedule: dict | None) -> str:
    """`schedule`: data.pipeline_schedule's."""
    if not schedule:
        return ""
    rows = []
    for rank, tasks in enumerate(schedule["rows"]):
        bars_, clock = [], 0.0
        for start, end, kind, mb, stage in tasks:
            if start > clock + 1e-12:
                bars_.append({"start": clock, "end": start, "cls": "bubble", "tip": f"idle {ms(start - clock)}"})
            name = "forward" if kind == "F" else "backward"
            bars_.append({"start": start, "end": end, "cls": name, "text": f"{kind}{mb}",
                          "tip": f"stage {stage} {name} of micro-batch {mb}: {ms(end - start)}"})
            clock = end
        if schedule["step_ms"] > clock:
            bars_.append({"start": clock, "end": schedule["step_ms"], "cls": "bubble", "tip": "idle"})
        rows.append({"label": f"rank {rank}", "bars": bars_})
    chart = gantt(rows, x_label="predicted time (ms)", x_fmt=lambda v: f"{v:.3g}", end=schedule["step_ms"])
    text = (f"{schedule['schedule']}, {schedule['ranks']} ranks x {schedule['virtual']} stages each, "
            f"{schedule['microbatches']} micro-batches: predicted step {ms(schedule['step_ms'])}, predicted bubble "
            f"{schedule['bubble']:.0%} of rank time (the plan predicts {schedule['predicted_bubble']:.0%}).")
    return section("pipeline", "Pipeline schedule (predicted)", para(text),
                   legend(*drawn([bar for row in rows for bar in row["bars"]], ("forward", "forward (F<micro-batch>)"),
                                 ("backward", "backward (B<micro-batch>)"), ("bubble", "bubble: rank idle"))), chart)


SERIES = len(RUNS)  # distinct line colours (.run0 ...); more runs reuse them in order


def loss_section(losses: list[float] | dict[str, list[float]] | None, first_step: int = 1) -> str:
    """`losses`: per step from `first_step`, one run's, or several runs' by name (drawn side by side,
    one colour each)."""
    if not losses:
        return ""
    runs = losses if isinstance(losses, dict) else {"training loss": losses}
    series = [{"name": name, "points": [(first_step + i, float(v)) for i, v in enumerate(values)],
               "cls": f"loss run{k % SERIES}" if len(runs) > 1 else "loss"}
              for k, (name, values) in enumerate(runs.items())]
    chart = line_chart(series, x_label="step", y_label="loss", x_fmt=lambda v: f"{v:g}", y_fmt=lambda v: f"{v:.3g}",
                       from_zero=False)
    if len(runs) == 1:
        v = next(iter(runs.values()))
        steps = f"{len(v)} steps" if first_step == 1 else f"Steps {first_step} to {first_step + len(v) - 1}"
        return section("loss", "Loss over the training run",
                       para(f"{steps}: loss {v[0]:.4f} at the first, {v[-1]:.4f} at the last."), chart)
    rows = ["<tr><th>run</th><th>steps</th><th>first loss</th><th>last loss</th></tr>"] + [
        f'<tr><td><span class="key run{k % SERIES}"></span>{escape(name)}</td><td>{len(v)}</td><td>{v[0]:.4f}</td>'
        f"<td>{v[-1]:.4f}</td></tr>" for k, (name, v) in enumerate(runs.items())]
    return section("loss", "Loss over the training runs", f'<table class="plans">{"".join(rows)}</table>', chart)
