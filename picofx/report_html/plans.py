"""The planner's section: a table of the plans (layout, memory, step, what limits each, the best
neighbouring change and what it gains) and bars of each plan's predicted step and memory.

A plan is `picofx plan --json`'s dict (or a planner Prediction, read through its `as_json`). Its
"suggestions" are, best first, objects or dicts with `change`, `addresses` (the bottleneck),
`step_seconds_gain` and `memory_bytes_gain` (positive: the change is faster, or needs less memory)
and optionally the neighbouring `layout`; plain strings are shown as they are."""
from __future__ import annotations

from html import escape

from picofx.report_html.sections import legend, para, section
from picofx.report_html.svg import bars


def decimal_bytes(n: float) -> str:
    """In the planner's units (GB = 1e9 bytes), small enough models still shown to three digits."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def seconds(s: float, digits: int = 4) -> str:
    unit, scale = next((u, k) for u, k in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)) if abs(s) >= k or u == "µs")
    return f"{s / scale:.{digits}g} {unit}"


def percent(share: float) -> str:
    return f"{share:.1%}" if abs(share) >= 1e-3 or share == 0 else f"{share * 100:.2g}%"


def plan_label(p: dict) -> str:
    cp = f" x cp{p['cp']}" if p.get("cp", 1) > 1 else ""
    dp = p["dp"] if "dp" in p else p["dp_replicate"] * p["dp_shard"]  # a Layout's asdict: its two dimensions
    text = (f"dp{dp}{' shard' if p.get('shard') else ''} x tp{p['tp']}"
            f"{' sp' if p.get('sequence_parallel') else ''} x pp{p['pp']}{cp}, {p['microbatches']} mb")
    checkpoint = {True: "full", False: "none", None: "none"}.get(p.get("checkpoint"), p.get("checkpoint"))  # old JSON: a bool
    checkpoint = {"none": "", "full": ", ckpt"}.get(checkpoint, f", {checkpoint} ckpt")
    return text + checkpoint + (f", {p['compress']}" if p.get("compress") else "")


def _field(item, name: str):
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def suggestion_text(s, plan: dict) -> str:
    """What to change and what it gains against `plan`: "8 micro-batches: step -1.2 s (-12%),
    memory +3.0 GB per GPU; addresses pipeline bubble"."""
    change = _field(s, "change")
    step_gain, memory_gain = _field(s, "step_seconds_gain"), _field(s, "memory_bytes_gain")
    if change is None or step_gain is None:  # a suggestion written as text
        return str(s if change is None else change)
    if not step_gain and not memory_gain:  # nothing helps: the text says so
        return str(change)
    share = -step_gain / plan["step_s"]
    gains = [f"step {'-' if step_gain > 0 else '+'}{seconds(abs(step_gain), 3)} "
             f"({share:+.{0 if abs(share) >= 0.01 else 1}%})"]
    if memory_gain:
        memory = f"memory {'-' if memory_gain > 0 else '+'}{decimal_bytes(abs(memory_gain))} per GPU"
        gains.insert(0 if not plan["fits"] else 1, memory)  # where the plan does not fit, memory comes first
    addresses = _field(s, "addresses")
    return f"{change}: {', '.join(gains)}" + (f"; addresses {addresses}" if addresses else "")


def suggestion_item(s, plan: dict) -> str:
    """One suggestion as HTML, its neighbouring layout shown on hover; a suggestion that gains
    nothing is quiet."""
    layout = _field(s, "layout")
    layout = layout if isinstance(layout, dict) else vars(layout) if hasattr(layout, "__dict__") else None
    tip = f' title="{escape(plan_label(layout))}"' if layout and {"dp", "dp_shard"} & set(layout) else ""
    gains = _field(s, "step_seconds_gain") or _field(s, "memory_bytes_gain") or isinstance(s, str)
    quiet = "" if gains else ' class="quiet"'
    return f"<span{tip}{quiet}>{escape(suggestion_text(s, plan))}</span>"


def suggestions_cell(plan: dict) -> str:
    """The best suggestion, the others folded under it."""
    found = list(plan.get("suggestions") or [])
    if not found:
        return '<td class="quiet">none given</td>'
    rest = "".join(f"<li>{suggestion_item(s, plan)}</li>" for s in found[1:])
    more = f'<details><summary>{len(found) - 1} more</summary><ul class="notes">{rest}</ul></details>' if rest else ""
    return f'<td class="suggestions">{suggestion_item(found[0], plan)}{more}</td>'


def plans_section(plans: dict | None, top: int = 12, unfit: int = 4) -> str:
    """`plans`: what `picofx plan --json` writes ({"plans": [...], "best": index}); the first `top`
    plans, and the first `unfit` of those after them that do not fit, with why."""
    if not plans or not plans.get("plans"):
        return ""
    every = [p.as_json() if hasattr(p, "as_json") else p for p in plans["plans"]]
    best = plans.get("best")
    chosen = list(range(min(top, len(every))))
    chosen += [i for i in range(len(chosen), len(every)) if not every[i]["fits"]][:unfit]
    shown = [every[i] for i in chosen]
    kind = {i: "best" if i == best else "fits" if p["fits"] else "nofit" for i, p in zip(chosen, shown)}
    head = ("<tr><th>#</th><th>layout</th><th>predicted memory/GPU</th><th>predicted step</th><th>predicted tokens/s"
            "</th><th>predicted MFU</th>"
            "<th>fits</th><th>bottleneck</th><th>best change: expected gain</th></tr>")
    rows = [head]
    for i, p in zip(chosen, shown):
        measured = f" (measured {seconds(p['measured_step_s'])})" if p.get("measured_step_s") else ""
        fits = "<td>yes</td>" if p["fits"] else f'<td class="why">no: {escape(p.get("reason", ""))}</td>'
        rows.append(f'<tr class="{kind[i]}"><td>{i}</td><td class="layout">{escape(plan_label(p))}</td>'
                    f'<td class="num">{decimal_bytes(p["memory_per_gpu"])}</td><td class="num">{seconds(p["step_s"])}'
                    f'{escape(measured)}</td><td class="num">{p["tokens_per_s"]:,.0f}</td><td class="num">'
                    f'{percent(p["mfu"])}</td>{fits}'
                    f'<td class="bottleneck">{escape(p.get("bottleneck", ""))}</td>{suggestions_cell(p)}</tr>')

    def chart(value: str, fmt, tip) -> str:
        return bars([{"label": f"#{i} {plan_label(p)}", "value": p[value], "tip": f"{plan_label(p)}: {tip(p)}",
                      "cls": kind[i]} for i, p in zip(chosen, shown)], value_fmt=fmt)

    step = chart("step_s", seconds, lambda p: f"{seconds(p['step_s'])}, {p.get('bottleneck', '')}")
    memory = chart("memory_per_gpu", decimal_bytes, lambda p: f"{decimal_bytes(p['memory_per_gpu'])} "
                   + ("fits" if p["fits"] else f"does not fit: {p.get('reason', '')}"))
    text = (f"{len(every)} layouts, {sum(p['fits'] for p in every)} fit; the first {min(top, len(every))} by "
            "predicted step" + (", then the first that do not fit" if len(shown) > top else "")
            + (f"; best: #{best} {plan_label(every[best])}" if best is not None else "; none fits") + ". "
            + ("The last column is each plan's best neighbouring change (one option changed) as the same model "
               "predicts it; hover over it for the layout it leads to." if any(_field(s, "layout") for p in shown
                                                             for s in p.get("suggestions") or []) else ""))
    keys = [(cls, words) for cls, words in (("best", "best"), ("fits", "fits"), ("nofit", "does not fit"))
            if cls in kind.values()]
    return section("plans", "Plans: predicted step, memory, bottleneck", para(text),
                   f'<table class="plans">{"".join(rows)}</table>', legend(*keys),
                   "<h3>Predicted step per plan</h3>", step, "<h3>Predicted memory per GPU</h3>", memory)
