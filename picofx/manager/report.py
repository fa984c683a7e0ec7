"""What picofx did: one row per pass, then whatever the cost model and passes add."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from picofx.manager.passes import PassRecord


def _format_notes(notes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in notes.items()
                     if not isinstance(v, (dict, list)))


@dataclass
class Report:
    backend: str
    input_key: tuple
    capture_seconds: float = 0.0
    compile_seconds: float = 0.0
    records: list[PassRecord] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)  # e.g. "memory", "throughput": preformatted text

    def rows(self) -> list[list[str]]:
        rows = [["capture", "-", "forward", f"{self.capture_seconds * 1e3:.0f}", "-", ""]]
        for r in self.records:
            rows.append([r.name, r.stage.value, r.graph_role, f"{r.seconds * 1e3:.1f}",
                         f"{r.nodes_before} -> {r.nodes_after} (+{len(r.added)} -{len(r.removed)})",
                         _format_notes(r.notes)])
        rows.append([f"compile ({self.backend})", "-", "all", f"{self.compile_seconds * 1e3:.0f}", "-", ""])
        return rows

    def table(self) -> str:
        header = ["pass", "stage", "graph", "ms", "nodes", "notes"]
        rows = [header] + self.rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        for title, text in self.sections.items():
            lines += ["", f"{title}:", text]
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {"backend": self.backend, "capture_seconds": self.capture_seconds,
                "compile_seconds": self.compile_seconds, "sections": self.sections,
                "passes": [{"name": r.name, "stage": r.stage.value, "graph": r.graph_role, "seconds": r.seconds,
                            "nodes_before": r.nodes_before, "nodes_after": r.nodes_after,
                            "added": r.added, "removed": r.removed, "notes": r.notes} for r in self.records]}
