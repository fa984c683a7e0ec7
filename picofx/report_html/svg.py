"""Three chart primitives drawn as inline SVG: a line chart, a Gantt chart and horizontal bars.

Colours come from CSS classes (page.py): a bar or a line takes a class such as "compute", "comm",
"exposed", "bubble", "forward", "backward", "fits", "nofit". Every text is escaped here.
"""
from __future__ import annotations

import math
from html import escape

WIDTH = 760
MARGIN = {"left": 92, "right": 16, "top": 12, "bottom": 40}
LABEL_HEIGHT = 12  # pixels of an 11px label's line


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int(math.ceil((high - first) / step)) + 1)]


def binary_ticks(low: float, high: float, count: int = 4) -> list[float]:
    """Ticks at round numbers of KiB, MiB or GiB."""
    unit = 1024 ** max(0, int(math.log(max(high, 1), 1024)))
    return [t * unit for t in nice_ticks(low / unit, high / unit, count)]


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg class="chart" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">'
            + "".join(body) + "</svg>")


def _text(x: float, y: float, text: str, anchor: str = "start", cls: str = "") -> str:
    css = f' class="{cls}"' if cls else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{css}>{escape(text)}</text>'


def _rect(x: float, y: float, w: float, h: float, cls: str, tip: str) -> str:
    return (f'<rect class="{cls}" x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.6):.2f}" height="{h:.2f}">'
            f"<title>{escape(tip)}</title></rect>")


class Axes:
    """Maps data to pixels inside the margins, and draws the axes with their ticks."""

    def __init__(self, width: int, height: int, x_range: tuple, y_range: tuple, left: int = MARGIN["left"]):
        self.left, self.top = left, MARGIN["top"]
        self.right, self.bottom = width - MARGIN["right"], height - MARGIN["bottom"]
        self.x0, self.x1 = x_range[0], x_range[1] if x_range[1] > x_range[0] else x_range[0] + 1
        self.y0, self.y1 = y_range[0], y_range[1] if y_range[1] > y_range[0] else y_range[0] + 1

    def x(self, value: float) -> float:
        return self.left + (value - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def y(self, value: float) -> float:
        return self.bottom - (value - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)

    def x_axis(self, label: str, fmt) -> list[str]:
        out = [f'<line class="axis" x1="{self.left}" y1="{self.bottom}" x2="{self.right}" y2="{self.bottom}"/>']
        for t in nice_ticks(self.x0, self.x1):
            if self.x0 <= t <= self.x1:
                out.append(_text(self.x(t), self.bottom + 14, fmt(t), "middle", "tick"))
        return out + [_text((self.left + self.right) / 2, self.bottom + 32, label, "middle", "label")]

    def y_axis(self, label: str, fmt, ticks=nice_ticks) -> list[str]:
        out = [f'<line class="axis" x1="{self.left}" y1="{self.top}" x2="{self.left}" y2="{self.bottom}"/>']
        for t in ticks(self.y0, self.y1, 4):
            if self.y0 <= t <= self.y1:
                out.append(f'<line class="grid" x1="{self.left}" y1="{self.y(t):.1f}" x2="{self.right}" '
                           f'y2="{self.y(t):.1f}"/>')
                out.append(_text(self.left - 6, self.y(t) + 4, fmt(t), "end", "tick"))
        return out + [_text(12, (self.top + self.bottom) / 2, label, "middle", "label vertical")]


def line_chart(series: list[dict], *, x_label: str, y_label: str, x_fmt=str, y_fmt=str, marks: list[dict] = (),
               spans: list[dict] = (), height: int = 280, from_zero: bool = True, y_ticks=nice_ticks) -> str:
    """`series`: {"name", "points": [(x, y)], "cls"}; `marks`: horizontal lines {"y", "label", "cls"};
    `spans`: shaded x ranges {"x0", "x1", "label", "cls"}."""
    xs = [x for s in series for x, _ in s["points"]] or [0.0]
    ys = [y for s in series for _, y in s["points"]] + [m["y"] for m in marks] or [0.0]
    pad = 0.05 * ((max(ys) - min(ys)) or abs(max(ys)) or 1)  # of the data's range: the data fills the height
    low, high = (0, max(ys) * 1.08 if max(ys) > 0 else 1) if from_zero else (min(ys) - pad, max(ys) + pad)
    ax = Axes(WIDTH, height, (min(xs), max(xs)), (low, high))
    body = []
    for span in spans:
        body.append(_rect(ax.x(span["x0"]), ax.top, ax.x(span["x1"]) - ax.x(span["x0"]), ax.bottom - ax.top,
                          span["cls"], span["label"]))
        body.append(_text(ax.x(span["x0"]) + 4, ax.top + 12, span["label"], "start", "note"))
    body += ax.y_axis(y_label, y_fmt, y_ticks) + ax.x_axis(x_label, x_fmt)
    lines = [ax.y(mark["y"]) for mark in marks]
    for k, (mark, y) in enumerate(zip(marks, lines)):  # labels side by side, so that close lines do not overwrite them
        body.append(f'<line class="mark {mark["cls"]}" x1="{ax.left}" y1="{y:.1f}" x2="{ax.right}" '
                    f'y2="{y:.1f}"><title>{escape(mark["label"])}</title></line>')
        crowded = any(y - LABEL_HEIGHT <= other < y or other == y and j < k for j, other in enumerate(lines) if j != k)
        label_y = y + LABEL_HEIGHT if crowded else y - 4  # below its line where another line runs just above it
        body.append(_text(ax.right - 4 - 190 * k, label_y, mark["label"], "end", f"note {mark['cls']}"))
    for s in series:
        path = " ".join(f"{ax.x(x):.1f},{ax.y(y):.1f}" for x, y in s["points"])
        body.append(f'<polyline class="line {s["cls"]}" points="{path}"><title>{escape(s["name"])}</title></polyline>')
    return _svg(WIDTH, height, body, y_label + " against " + x_label)


def gantt(rows: list[dict], *, x_label: str, x_fmt=str, end: float | None = None, row_height: int = 26) -> str:
    """`rows`: {"label", "bars": [{"start", "end", "cls", "tip", "text"?}]}; one lane per row."""
    ends = [b["end"] for r in rows for b in r["bars"]] + [end or 0.0]
    height = MARGIN["top"] + MARGIN["bottom"] + row_height * len(rows)
    left = max(MARGIN["left"], 8 + 7 * max((len(r["label"]) for r in rows), default=0))
    ax = Axes(WIDTH, height, (0.0, max(ends)), (0, len(rows)), left=left)
    body = []
    for i, row in enumerate(rows):
        y = ax.top + i * row_height
        body.append(_text(ax.left - 6, y + row_height * 0.65, row["label"], "end", "tick"))
        body.append(f'<rect class="lane" x="{ax.left}" y="{y + 2}" width="{ax.right - ax.left}" '
                    f'height="{row_height - 4}"/>')
        for bar in row["bars"]:
            x0, x1 = ax.x(bar["start"]), ax.x(bar["end"])
            body.append(_rect(x0, y + 3, x1 - x0, row_height - 6, bar["cls"], bar["tip"]))
            if bar.get("text") and x1 - x0 > 7 * len(bar["text"]) + 4:
                body.append(_text((x0 + x1) / 2, y + row_height * 0.65, bar["text"], "middle", "inbar"))
    body += ax.x_axis(x_label, x_fmt)
    return _svg(WIDTH, height, body, "timeline: " + x_label)


def bars(items: list[dict], *, value_fmt=str, bar_height: int = 20) -> str:
    """Horizontal bars `items`: {"label", "value", "cls", "tip"}; the value is written after each bar."""
    height = MARGIN["top"] + 8 + bar_height * len(items)
    left = max(MARGIN["left"], 8 + 7 * max((len(i["label"]) for i in items), default=0))
    top = max((i["value"] for i in items), default=1) or 1
    room = WIDTH - left - 90
    body = []
    for k, item in enumerate(items):
        y = MARGIN["top"] + k * bar_height
        body.append(_text(left - 6, y + bar_height * 0.7, item["label"], "end", "tick"))
        width = room * max(item["value"], 0) / top
        body.append(_rect(left, y + 2, width, bar_height - 4, item["cls"], item["tip"]))
        body.append(_text(left + width + 6, y + bar_height * 0.7, value_fmt(item["value"]), "start", "tick"))
    return _svg(WIDTH, height, body, "bars")
