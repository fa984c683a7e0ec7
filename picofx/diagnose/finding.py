"""One finding about a run, and the robust statistics the detectors share."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    """What a run's numbers show (`seen`), over which steps, with the numbers themselves; what to
    change (`advice`), how sure the finding is (0 to 1) and what the change should bring (`effect`)."""

    kind: str                 # divergence, loss_spikes, warmup, plateau, data_wait, memory, straggler
    steps: tuple[int, int]    # the first and last step the evidence covers
    seen: str
    advice: str
    confidence: float
    effect: str
    evidence: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        first, last = self.steps
        where = f"step {first}" if first == last else f"steps {first}-{last}"
        return [f"- {self.kind} ({where}, confidence {self.confidence:.0%}): {self.seen}",
                f"  change: {self.advice}",
                f"  expected: {self.effect}"]

    def as_dict(self) -> dict:
        return {"kind": self.kind, "steps": list(self.steps), "seen": self.seen, "advice": self.advice,
                "confidence": self.confidence, "effect": self.effect, "evidence": self.evidence}


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def median(values) -> float:
    values = [v for v in values if finite(v)]
    return statistics.median(values) if values else math.nan


def spread(values) -> float:
    """The median absolute deviation scaled to a normal distribution's standard deviation."""
    centre = median(values)
    return 1.4826 * median([abs(v - centre) for v in values if finite(v)])


def seconds(value: float) -> str:
    return f"{1e3 * value:.0f} ms" if value < 10 else f"{value:.1f} s"


def number(value: float) -> str:
    """A learning rate or loss as a person writes it: 0.075, 3e-04."""
    return f"{value:.2g}" if 1e-2 <= abs(value) < 1e3 else f"{value:.1e}"
