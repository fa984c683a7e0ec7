"""What picofx did: one row per pass, then what the passes explain (per-layer checkpoint decisions,
fusion near-misses, memory); and the one-line notices picofx prints on the `picofx` logger.

`str(report)` fits in WIDTH columns; `report.table(wide=True)` has every note on one line, and
`report.to_json()` every number as it is.
"""
from __future__ import annotations

import json
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

from picofx.cost.units import format_bytes
from picofx.manager.passes import PassRecord

WIDTH = 100
BYTE_WORDS = ("bytes", "peak", "budget", "memory")  # an int note whose name (or parent's) has one is bytes
SECTION_NOTES = {"per_layer": " (values the backward reads, saved or recomputed; views are not listed)",
                 "memory": " (the step's predicted memory after the pass)"}


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (pytest and notebooks replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _install_notices() -> logging.Logger:
    """The `picofx` logger: INFO lines such as a recompilation, printed to stderr as `picofx: ...`.
    Set up when picofx is imported, so `logging.getLogger("picofx").setLevel(logging.WARNING)`
    afterwards silences them."""
    log = logging.getLogger("picofx")
    if not log.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("picofx: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return log


_NOTICES = _install_notices()


def notices() -> logging.Logger:
    return _NOTICES


def _is_bytes(name: str, parent: str = "") -> bool:
    return any(word in name or word in parent for word in BYTE_WORDS)


def format_value(name: str, value: Any, parent: str = "") -> str:
    if isinstance(value, int) and not isinstance(value, bool) and _is_bytes(name, parent):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def note_items(notes: dict[str, Any]) -> list[str]:
    """The scalar notes as `name=value`, bytes in KiB/MiB/GiB. Recomputed nodes that add no FLOPs
    are said to be views and free ops, so the two figures cannot be read as a contradiction."""
    items = []
    for key, value in notes.items():
        if isinstance(value, (dict, list)):
            continue
        if key == "added_flops" and value == 0 and notes.get("recomputed"):
            continue
        text = f"{key}={format_value(key, value)}"
        if key == "recomputed" and value and notes.get("added_flops") == 0:
            text += " views/free ops (0 FLOPs)"
        items.append(text)
    return items


def format_notes(notes: dict[str, Any]) -> str:
    return ", ".join(note_items(notes))


def pack(items: list[str], room: int) -> list[str]:
    """`items` joined by ", " into lines of at most `room` characters, breaking between items
    (and inside an item only when it alone is too long)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(item) + 3 <= room:
            lines[-1] += f", {item}"
        else:
            if lines:
                lines[-1] += ","
            lines += textwrap.wrap(item, room) or [""]
    return lines or [""]


def _near_miss(miss: dict) -> str:
    check = f" [{miss['check']}]" if miss.get("check") else ""
    return f"{miss.get('rule', '?')} at {miss.get('candidate', '?')}: {miss.get('reason', '')}{check}"


def _per_layer(layers: dict) -> list[str]:
    lines = []
    for layer, kinds in layers.items():
        saved, recomputed = kinds.get("saved", []), kinds.get("recomputed", [])
        lines.append(f"{layer}: saves {len(saved)}, recomputes {len(recomputed)}"
                     + (f": {', '.join(recomputed)}" if recomputed else ""))
    return lines


def explain_lines(key: str, value: Any) -> list[str]:
    """A structured note as lines: per-layer decisions, near-misses, or `name=value` pairs."""
    if key == "per_layer" and isinstance(value, dict):
        return _per_layer(value)
    if isinstance(value, list):
        return [_near_miss(v) if isinstance(v, dict) and "reason" in v else
                ", ".join(f"{k}={format_value(k, x)}" for k, x in v.items()) if isinstance(v, dict) else str(v)
                for v in value]
    return [", ".join(f"{k}={format_value(k, x, parent=key)}" for k, x in value.items())]


@dataclass
class Report:
    backend: str
    input_key: tuple
    capture_seconds: float = 0.0
    compile_seconds: float = 0.0
    records: list[PassRecord] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)  # e.g. "memory", "throughput": preformatted text
    recompilations: int = 0  # captures after the first (new input shapes, or train/eval)
    graphs: dict = field(default_factory=dict, repr=False, compare=False)  # the step's graphs, for to_html

    def rows(self) -> list[list[str]]:
        rows = [["capture", "-", "forward", f"{self.capture_seconds * 1e3:.0f}", "-", ""]]
        for r in self.records:
            rows.append([r.name, r.stage.value, r.graph_role, f"{r.seconds * 1e3:.1f}",
                         f"{r.nodes_before} -> {r.nodes_after} (+{len(r.added)} -{len(r.removed)})",
                         format_notes(r.notes)])
        rows.append([f"compile ({self.backend})", "-", "all", f"{self.compile_seconds * 1e3:.0f}", "-", ""])
        return rows

    def table(self, wide: bool = False) -> str:
        """The pass table and what the passes explain; lines fit in WIDTH columns unless `wide`."""
        header = ["pass", "stage", "graph", "ms", "nodes", "notes"]
        rows = [header] + self.rows()
        items = [[]] + [note_items(r.notes) for r in self.records] + [[]]  # per row after the header
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        indent = sum(widths) + 2 * len(widths)
        below = not wide and WIDTH - indent < 50  # too narrow beside the row: the notes go under it
        room = None if wide else WIDTH - 4 if below else WIDTH - indent
        lines = []
        for i, row in enumerate(rows):
            cells = "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  "
            notes = pack(items[i - 1], room) if room and i else [row[-1]]
            if below and i:
                lines += [cells] + ["    " + line for line in notes if line]
            else:
                lines += [cells + notes[0]] + [" " * indent + more for more in notes[1:]]
        lines.insert(1, "-" * min(max(len(line.rstrip()) for line in lines), WIDTH if not wide else 10**6))
        if self.recompilations:
            lines += ["", f"captured and compiled {self.recompilations + 1} times "
                          f"({self.recompilations} recompilations for new input shapes or train/eval)"]
        for r in self.records:
            for key, value in r.notes.items():
                if isinstance(value, (dict, list)) and not value:
                    lines += ["", f"{r.name}: {key.replace('_', ' ')}: none"]
                elif isinstance(value, (dict, list)):
                    lines += ["", f"{r.name}: {key.replace('_', ' ')}{SECTION_NOTES.get(key, '')}"]
                    for line in explain_lines(key, value):
                        lines += [f"  {line}"] if wide else textwrap.wrap(line, WIDTH, initial_indent="  ",
                                                                          subsequent_indent="      ")
        for title, text in self.sections.items():
            lines += ["", f"{title}:", text]
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {"backend": self.backend, "capture_seconds": self.capture_seconds,
                "compile_seconds": self.compile_seconds, "recompilations": self.recompilations,
                "sections": self.sections,
                "passes": [{"name": r.name, "stage": r.stage.value, "graph": r.graph_role, "seconds": r.seconds,
                            "nodes_before": r.nodes_before, "nodes_after": r.nodes_after,
                            "added": r.added, "removed": r.removed, "notes": r.notes} for r in self.records]}

    def to_json(self, indent: int | None = 2) -> str:
        """Everything in the report as JSON, numbers unformatted (bytes as ints)."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def to_html(self, path: str, **given) -> str:
        """Write one self-contained HTML page of this report to `path`: the passes, and from the
        step's graphs the predicted memory, timeline and pipeline schedule; `given` adds data
        (losses=, plans=, measured_peak=, ...: picofx.report_html.render's)."""
        from picofx.report_html import write_html

        shown = self.to_dict()
        for p in shown["passes"]:  # the notes as the table words them, for the page to escape and lay out
            notes = p["notes"]
            p.update(notes=note_items(notes), measured_peak=notes.get("measured_peak"),
                     details=[(key, explain_lines(key, value)) for key, value in notes.items()
                              if isinstance(value, (dict, list)) and value])
        return write_html(path, shown, **{"graphs": self.graphs, **given})
