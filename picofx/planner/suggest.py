"""What to change in a plan: its neighbouring layouts (one option changed), each predicted by the
planner's own model, kept where it is faster (or, where the plan does not fit, where it fits), best
first, each naming the bottleneck it addresses: the time term it shrinks most, or memory.

Neighbours: twice or half the micro-batches, sequence parallelism on or off, each other checkpointing
(none, selective, full), each other precision the device multiplies in (bf16, the float8 recipes),
sharded or replicated data parallelism, each other compressor planned, the next count of pipeline stages
per rank either way (or none), and another tp, pp or cp
(twice or half, the data-parallel ranks making up the GPUs; the micro-batches the fastest of those
that divide the replicas' batch). A neighbour the run cannot have (its batch does
not divide, tp past a node) is left out. Every neighbour is predicted as it would be planned on its
own, so a suggestion's gains are those of `picofx plan --layout` of the two layouts."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from picofx.planner.layouts import (BOTTLENECKS, CHECKPOINTS, DOES_NOT_FIT, SHARD_STAGES, Checkpointing, Layout,
                                    Prediction, Run, predict, valid)
from picofx.planner.pipeline import virtual_stage_counts
from picofx.planner.search import compressed, divisors, precisions
from picofx.planner.sharding import STAGE_NAMES

MIN_GAIN = 0.01  # a faster neighbour is suggested when it saves at least this share of the step
NONE_HELPS = "no neighbouring change helps"
CHECKPOINT_CHANGES = {Checkpointing.NONE: "no checkpointing", Checkpointing.SELECTIVE: "selective checkpointing",
                      Checkpointing.FULL: "full checkpointing (every layer)"}
PRECISION_CHANGES = {"bf16": "bf16 matmuls", "float8": "float8 matmuls (tensorwise)",
                     "float8_rowwise": "float8 matmuls (rowwise)"}


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


class Neighbourhood:
    """The predictions of a run's layouts, each made once: the plans' own and their neighbours'.
    `kinds`: the compressors planned for replicated layouts."""

    def __init__(self, run: Run, kinds: tuple = (), predictions: list[Prediction] = ()):
        self.run, self.kinds = run, tuple(kinds)
        self.predicted: dict[Layout, Prediction | None] = {p.layout: p for p in predictions}
        self.best: dict[Layout, Prediction | None] = {}  # best_with's answers, by the layout with 1 micro-batch

    def prediction(self, layout: Layout) -> Prediction | None:
        """`layout` predicted, or None where the run cannot have it."""
        if layout not in self.predicted:
            self.predicted[layout] = predict(self.run, layout) if valid(self.run, layout) is None else None
        return self.predicted[layout]

    def neighbours(self, layout: Layout) -> list[tuple[str, Prediction]]:
        """The layouts one change away from `layout` the run can have, predicted, each with what the change is."""
        m, replace = layout.microbatches, dataclasses.replace
        changes = [(micro_batches(2 * m), replace(layout, microbatches=2 * m))]
        if m > 1:
            changes.append((micro_batches(m // 2), replace(layout, microbatches=m // 2)))
        if layout.tp > 1:
            changes.append(("no sequence parallelism" if layout.sequence_parallel else "sequence parallelism",
                            replace(layout, sequence_parallel=not layout.sequence_parallel)))
        changes += [(CHECKPOINT_CHANGES[c], replace(layout, checkpoint=c)) for c in CHECKPOINTS
                    if c is not layout.checkpoint]
        changes += [(PRECISION_CHANGES[p], replace(layout, precision=p)) for p in precisions(self.run.device)
                    if p != layout.precision]
        if layout.dp * layout.cp > 1:
            changes.append(("replicated data parallel" if layout.shard else "sharded data parallel",
                            replace(layout, shard=not layout.shard, compress=None, shard_stage=3)))
            changes += [(f"shard stage {stage} ({STAGE_NAMES[stage]} sharded)",
                         replace(layout, shard=True, shard_stage=stage, compress=None))
                        for stage in SHARD_STAGES if layout.shard and stage != layout.shard_stage]
        if layout.pp > 1:
            changes += [(f"interleaved 1F1B, {v} stages per rank" if v > 1 else "no interleaving",
                         replace(layout, virtual_stages=v, schedule="1F1B"))
                        for v in neighbouring_counts(self.run.costs.layers, layout.pp, layout.virtual_stages)]
        plain = replace(layout, compress=None)
        if layout.compress:
            changes.append(("uncompressed gradients", plain))
        changes += [(f"{other.compress} gradient exchange", other) for other in compressed(self.run, plain, self.kinds)
                    if other != layout]
        out = [(what, p) for what, other in changes if (p := self.prediction(other)) is not None]
        for tp, pp, cp in self.other_shapes(layout):
            p = self.best_with(layout, tp, pp, cp)
            if p is not None:
                what = f"tp {tp}" if cp == layout.cp else f"{'more' if cp > layout.cp else 'less'} cp: cp {cp}" + \
                    (f", tp {tp}" if tp != layout.tp else "")
                what = f"pp {pp}" if pp != layout.pp else what
                if p.layout.microbatches != m:
                    what += f", {micro_batches(p.layout.microbatches)}"
                out.append((what, p))
        return out

    def other_shapes(self, layout: Layout) -> list[tuple[int, int, int]]:
        """(tp, pp, cp) of the neighbours: tp or pp twice or half; cp twice or half, the data-parallel
        ranks making up the GPUs, else tp (half or twice) where dp cannot."""
        tp, pp, cp, dp = layout.tp, layout.pp, layout.cp, layout.dp
        shapes = [(2 * tp, pp, cp), (tp // 2, pp, cp), (tp, 2 * pp, cp), (tp, pp // 2, cp)]
        shapes.append((tp, pp, 2 * cp) if dp % 2 == 0 else (tp // 2, pp, 2 * cp))
        if cp > 1:
            shapes.append((tp, pp, cp // 2) if self.run.global_batch % (2 * dp) == 0 else (2 * tp, pp, cp // 2))
        return shapes

    def best_with(self, layout: Layout, tp: int, pp: int, cp: int = 1) -> Prediction | None:
        """`layout` over `tp` x `pp` x `cp` (the data-parallel ranks making up the GPUs) with the
        micro-batches that make it fastest (fit first), or None where the run cannot have it."""
        gpus = layout.gpus
        if min(tp, pp, cp) < 1 or gpus % (tp * pp * cp):
            return None
        dp = gpus // (tp * pp * cp)
        if self.run.global_batch % dp:
            return None
        same = dataclasses.replace(layout, dp=dp, tp=tp, pp=pp, cp=cp, shard=layout.shard and dp * cp > 1,
                                   sequence_parallel=layout.sequence_parallel and tp > 1,
                                   compress=layout.compress if dp > 1 and cp == 1 else None)
        key = dataclasses.replace(same, microbatches=1)  # many plans share their neighbour over tp x pp x cp
        if key not in self.best:
            found = [self.prediction(dataclasses.replace(same, microbatches=m))
                     for m in divisors(self.run.global_batch // dp) if m >= pp]
            self.best[key] = best_of([p for p in found if p is not None])
        return self.best[key]

    def suggest(self, plan: Prediction) -> list[Suggestion]:
        """`plan`'s neighbours that help, best first: faster ones by the time they save, or, where `plan`
        does not fit, those that fit, fastest first; else NONE_HELPS."""
        helping = []
        for what, other in self.neighbours(plan.layout):
            if not other.fits or (plan.fits and other.step_s > plan.step_s * (1 - MIN_GAIN)):
                continue
            helping.append(Suggestion(what, addresses(plan, other), plan.step_s - other.step_s,
                                      plan.memory_per_gpu - other.memory_per_gpu, other.layout))
        helping.sort(key=lambda s: -s.step_seconds_gain)
        if not helping:
            return [Suggestion(NONE_HELPS, plan.bottleneck, 0.0, 0.0)]
        return helping


def neighbouring_counts(layers: int, pp: int, virtual: int) -> list[int]:
    """Stages per rank one step from `virtual` among those planned: the next count either way, and none."""
    counts = virtual_stage_counts(layers, pp)
    fewer, more = [v for v in counts if v < virtual], [v for v in counts if v > virtual]
    return sorted({*fewer[-1:], *more[:1], *([1] if virtual > 1 else [])})


def micro_batches(m: int) -> str:
    return f"{m} micro-batch{'es' if m > 1 else ''}"


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


def with_suggestions(run: Run, predictions: list[Prediction], kinds: tuple = ()) -> list[Prediction]:
    """`predictions` (of `run`), each given its suggestions; returned."""
    neighbourhood = Neighbourhood(run, kinds, predictions)
    for p in predictions:
        p.suggestions = neighbourhood.suggest(p)
    return predictions
