"""What to change in a plan: its neighbouring layouts (one option changed), each predicted by the
planner's own model, kept where it is faster (or, where the plan does not fit, where it fits), best
first, each naming the bottleneck it addresses: the time term it shrinks most, or memory.

Neighbours: twice or half the micro-batches, sequence parallelism on or off, checkpointing on or off,
sharded or replicated data parallelism, each other compressor planned, and another tp or pp (twice
or half, the data-parallel ranks making up the GPUs; micro-batches re-chosen, as they must divide the
replicas' batch)."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from picofx.planner.layouts import BOTTLENECKS, DOES_NOT_FIT, Layout, Prediction

MIN_GAIN = 0.01  # a faster neighbour is suggested when it saves at least this share of the step
NONE_HELPS = "no neighbouring change helps"


@dataclass(frozen=True)
class Suggestion:
    """A neighbouring layout, as a plan's suggestion: gains are this plan's figure minus the
    neighbour's (positive: the neighbour is faster, or needs less memory per GPU)."""

    change: str                 # what to change, e.g. "8 micro-batches", "sharded data parallel"
    addresses: str              # the bottleneck it addresses, e.g. "pipeline bubble", "memory: does not fit"
    step_seconds_gain: float
    memory_bytes_gain: float
    layout: Layout | None = None  # the neighbour (None with NONE_HELPS)

    def describe(self, plan: Prediction) -> str:
        if self.layout is None:
            return self.change
        step = -self.step_seconds_gain / plan.step_s
        memory = -self.memory_bytes_gain / plan.memory_per_gpu
        return (f"{self.change} ({self.layout.describe()}): step {step:+.0%}, memory {memory:+.0%}; "
                f"addresses {self.addresses}")


class Planned:
    """The predictions of a run, found by layout, and by layout whatever its compressor or its micro-batches."""

    def __init__(self, predictions: list[Prediction]):
        self.by_layout = {p.layout: p for p in predictions}
        self.compressed, self.by_microbatches = defaultdict(list), defaultdict(list)
        for p in predictions:
            self.compressed[dataclasses.replace(p.layout, compress=None)].append(p)
            self.by_microbatches[dataclasses.replace(p.layout, microbatches=0)].append(p)


def neighbours(layout: Layout, planned: Planned) -> list[tuple[str, Prediction]]:
    """The planned layouts one change away from `layout`, each with what the change is."""
    m, replace = layout.microbatches, dataclasses.replace
    exact = [(f"{2 * m} micro-batches", replace(layout, microbatches=2 * m)),
             (f"{m // 2} micro-batch{'es' if m // 2 > 1 else ''}", replace(layout, microbatches=m // 2)),
             ("no sequence parallelism" if layout.sequence_parallel else "sequence parallelism",
              replace(layout, sequence_parallel=not layout.sequence_parallel)),
             ("no checkpointing" if layout.checkpoint else "checkpointing every layer",
              replace(layout, checkpoint=not layout.checkpoint)),
             ("replicated data parallel" if layout.shard else "sharded data parallel",
              replace(layout, shard=not layout.shard, compress=None))]
    out = [(what, planned.by_layout[other]) for what, other in exact if other != layout and other in planned.by_layout]
    for p in planned.compressed[replace(layout, compress=None)]:  # the other compressors planned for this layout
        if p.layout != layout:
            out.append((f"{p.layout.compress} gradient exchange" if p.layout.compress else "uncompressed gradients", p))
    for tp, pp in ((2 * layout.tp, layout.pp), (layout.tp // 2, layout.pp),
                   (layout.tp, 2 * layout.pp), (layout.tp, layout.pp // 2)):
        if tp < 1 or pp < 1 or (layout.dp * layout.tp * layout.pp) % (tp * pp):
            continue
        dp = layout.dp * layout.tp * layout.pp // (tp * pp)
        same = replace(layout, dp=dp, tp=tp, pp=pp, microbatches=0, shard=layout.shard and dp > 1,
                       sequence_parallel=layout.sequence_parallel and tp > 1,
                       compress=layout.compress if dp > 1 else None)
        p = best_of(planned.by_microbatches[same])
        if p is not None:
            what = f"tp {tp}" if tp != layout.tp else f"pp {pp}"
            out.append((what + (f", {p.layout.microbatches} micro-batches" if p.layout.microbatches != m else ""), p))
    return out


def best_of(predictions: list[Prediction]) -> Prediction | None:
    """The fastest that fits, else the one needing the least memory."""
    if not predictions:
        return None
    return min(predictions, key=lambda p: (not p.fits, p.step_s if p.fits else p.memory_per_gpu))


def addresses(plan: Prediction, other: Prediction) -> str:
    """The bottleneck `other` relieves: memory where `plan` does not fit, else the time term it shrinks most."""
    if not plan.fits:
        return DOES_NOT_FIT
    term = max(BOTTLENECKS, key=lambda t: plan.time.get(t, 0.0) - other.time.get(t, 0.0))
    return BOTTLENECKS[term]


def suggest(plan: Prediction, planned: Planned) -> list[Suggestion]:
    """`plan`'s neighbours among the `planned` predictions that help, best first: faster ones by the
    time they save, or, where `plan` does not fit, those that fit, fastest first; else NONE_HELPS."""
    helping = []
    for what, other in neighbours(plan.layout, planned):
        if not other.fits or (plan.fits and other.step_s > plan.step_s * (1 - MIN_GAIN)):
            continue
        helping.append(Suggestion(what, addresses(plan, other), plan.step_s - other.step_s,
                                  plan.memory_per_gpu - other.memory_per_gpu, other.layout))
    helping.sort(key=lambda s: -s.step_seconds_gain)
    if not helping:
        return [Suggestion(NONE_HELPS, plan.bottleneck, 0.0, 0.0)]
    return helping
