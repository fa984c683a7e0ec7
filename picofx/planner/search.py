"""The planner's search: every layout of a run's GPUs that can run (picofx.planner.layouts.valid),
each predicted, those that fit first and fastest first. Pipelines are enumerated with 1 and 2 stages per
rank; more stages per rank are tried from there while they pay (`deeper_interleaving`)."""
from __future__ import annotations

import dataclasses

from picofx.planner.compress import embedding_as_rows, scatter_exchange
from picofx.planner.context import LONG_SEQUENCE, cp_degrees
from picofx.planner.float8 import FLOAT8
from picofx.planner.layouts import (CHECKPOINTS, PRECISIONS, SHARD_STAGES, Layout, Prediction, Run, predict,
                                    runs_float8, valid)
from picofx.planner.pipeline import virtual_stage_counts
from picofx.planner.recipe import refusal


DEEPER_GAIN = 0.01  # of the step: a count of stages per rank saving less ends the search for deeper ones


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(run: Run, compress: tuple = (), context: bool = False) -> list[Layout]:
    """Every valid layout; replicated data parallel also with each compressor named in `compress`
    that changes its bytes (sparse_rows only where the embedding goes as rows). `context`: also each
    cp of the GPUs left after tp and pp that splits the sequence (picofx.planner.context)."""
    layouts = []
    for tp in [d for d in divisors(run.gpus) if d <= run.gpus_per_node]:
        for pp, cp in [(pp, cp) for pp in divisors(run.gpus // tp)
                       for cp in [1, *(cp_degrees(run.costs.seq, run.gpus // (tp * pp)) if context else [])]]:
            dp = run.gpus // (tp * pp * cp)
            per_replica = run.global_batch // dp if run.global_batch % dp == 0 else 0
            for micro in sorted({m for m in divisors(per_replica) if m >= pp} if per_replica else set()):
                for shard, stage in [(False, 3), *([(True, s) for s in SHARD_STAGES] if dp * cp > 1 else [])]:
                    options = [(c, sp, v) for c in CHECKPOINTS for sp in ((False, True) if tp > 1 else (False,))
                               for v in virtual_stage_counts(run.costs.layers, pp)[:2]]  # more: deeper_interleaving
                    for checkpoint, sp, v in options:
                        for precision in precisions(run.device):
                            layout = Layout(dp, tp, pp, shard, micro, "1F1B", checkpoint, sp, cp=cp,
                                            shard_stage=stage, virtual_stages=v, precision=precision)
                            if valid(run, layout) is None:
                                layouts.append(layout)
                                layouts += [c for c in compressed(run, layout, compress) if refusal(c) is None]
    return layouts


def precisions(device) -> tuple:
    """The precisions layouts are planned with: the float8 recipes too where the device multiplies float8."""
    return PRECISIONS if FLOAT8 in device.peak_flops else ("bf16",)


def compressed(run: Run, layout: Layout, kinds: tuple) -> list[Layout]:
    """`layout` with each compressor of `kinds` that applies: dp > 1, replicated or sharded,
    sparse_rows where the embedding goes as rows."""
    if layout.dp == 1 or layout.compress or layout.cp > 1 or (layout.shard and layout.shard_stage < 3):
        return []
    out = []
    for kind in kinds:
        other = dataclasses.replace(layout, compress=kind)
        if kind.startswith("sparse_rows"):
            tokens = run.global_batch // (layout.dp * layout.microbatches) * run.costs.seq
            rows = scatter_exchange(run.costs.config, other, tokens, run.device).rows if layout.shard else \
                embedding_as_rows(run.costs.config, other, tokens)[0]
            if rows != "rows":
                continue
        out.append(other)
    return out


def plan_layouts(run: Run, compress: tuple = ()) -> list[Prediction]:
    """Every valid layout predicted (replicated ones also with each compressor of `compress`), with
    cp where the sequence is long or where nothing fits without it: those that fit first, fastest
    first; then the rest."""
    predictions = [predict(run, layout) for layout in enumerate_layouts(run, compress)]
    if run.costs.seq >= LONG_SEQUENCE or not any(p.fits for p in predictions):
        predictions += [predict(run, layout) for layout in enumerate_layouts(run, compress, context=True)
                        if layout.cp > 1]
    # a float8 layout none of whose linears pays in float8 is its bf16 twin: left out
    predictions = [p for p in predictions if p.layout.precision == "bf16" or runs_float8(p)]
    predictions += deeper_interleaving(run, predictions)
    predictions.sort(key=lambda p: (not p.fits, p.step_s if p.fits else p.memory_per_gpu))
    return predictions


def deeper_interleaving(run: Run, predictions: list[Prediction]) -> list[Prediction]:
    """The interleaved plans of `predictions` with more stages per rank (picofx.planner.pipeline's counts),
    each count tried while the one before it pays: it does not fit yet, or it saves DEEPER_GAIN of the
    step of the count below it. Past a count that fits and saves less, the bubble deeper counts remove
    shrinks as 1 / v while the sends they add grow as v: where the counts double, all of them together
    save less than that count did. Nor is a plan deepened that cannot win: deeper counts save at most
    its bubble, and its step less its bubble is no faster than the fastest plan that fits."""
    predicted = {p.layout: p for p in predictions}
    fastest = min((p.step_s for p in predictions if p.fits), default=float("inf"))
    deeper = []
    for plan in predictions:
        if plan.layout.virtual_stages != 2:
            continue
        counts = virtual_stage_counts(run.costs.layers, plan.layout.pp)
        below = predicted.get(dataclasses.replace(plan.layout, virtual_stages=1, schedule="1F1B"))
        for v in counts[counts.index(2) + 1:]:
            if plan.step_s - plan.time["bubble"] >= fastest:
                break
            if below is not None and below.fits and plan.step_s > below.step_s * (1 - DEEPER_GAIN):
                break
            layout = dataclasses.replace(plan.layout, virtual_stages=v)
            if valid(run, layout) is not None:
                break
            below, plan = plan, predict(run, layout)
            deeper.append(plan)
            fastest = min(fastest, plan.step_s) if plan.fits else fastest
    return deeper
