"""Every detector over one run's records, and the "what to change" block that says what they found."""
from __future__ import annotations

from picofx.diagnose.breakdown import exposed_communication
from picofx.diagnose.dynamics import dynamics
from picofx.diagnose.finding import Finding
from picofx.diagnose.resources import data_wait, memory_headroom
from picofx.diagnose.stragglers import stragglers


def diagnose(records: list[dict]) -> list[Finding]:
    """The findings of a run's per-step records (sorted by step), most certain first; none for a
    healthy run."""
    records = [r for r in records if isinstance(r.get("step"), int)]
    if not records:
        return []
    device = str(records[-1].get("device", "cpu"))
    found = [*dynamics(records), data_wait(records), memory_headroom(records), *stragglers(records, device=device),
             exposed_communication(records)]
    return sorted((f for f in found if f is not None), key=lambda f: -f.confidence)


def what_to_change(findings: list[Finding]) -> list[str]:
    """The summary's block: a heading and each finding's lines; nothing for no findings."""
    if not findings:
        return []
    return ["what to change:", *(f"  {line}" for finding in findings for line in finding.lines())]
