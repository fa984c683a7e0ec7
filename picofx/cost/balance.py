"""Where to cut a chain of work into pipeline stages, and what a pipeline schedule then costs.

A training step is a chain of units (runs of graph nodes between the places a cut may go). Per
micro-batch each unit has a forward + backward time and activation bytes (kept until that
micro-batch's backward); it holds parameter bytes (kept with their gradients and optimizer state).
A cut after a unit sends `boundary_bytes` forward and the same bytes of gradient back.

`balanced_cuts` minimises the slowest stage's time by dynamic programming over the chain,
subject to every stage's memory fitting the device; `schedule_cost` prices a set of cuts:

    step   = M * T_max + (sum of all stage times - T_max) / v
    bubble = 1 - (M * mean rank time) / step

M micro-batches, v stages per rank (interleaving), T_max the slowest rank's time per micro-batch.
For v = 1 this is the fill and drain of the pipeline (every stage once) plus M - 1 micro-batches
at the bottleneck's pace; for equal stages it is the textbook (M + S - 1) * t (GPipe, 1F1B) and
(v M + S - 1) * t / v (interleaved 1F1B).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from picofx.cost.comm import send_seconds
from picofx.cost.device import Link
from picofx.cost.units import format_bytes

# Micro-batches whose activations a rank holds at its peak, by schedule.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
INTERLEAVED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS")


def microbatch_refusal(pp: int, microbatches: int, schedule: str = "1F1B") -> str | None:
    """The one micro-batch rule (the planner, the recipe, the pipeline pass and picofx train ask it): why
    `microbatches` cannot run `pp` pipeline ranks under `schedule` (None: they can). It is torch 2.13's own,
    schedule by schedule (tests/planner/test_plan_interleaved.py builds torch's schedules to check it):
    Schedule1F1B refuses fewer micro-batches than ranks; ScheduleInterleaved1F1B runs them in
    max(1, microbatches // pp) rounds that must divide them, however many stages each rank holds (Llama 3's
    16 micro-batches on 16 ranks of 8 stages run); GPipe and LoopedBFS take any number."""
    if pp == 1:  # micro-batches of one stage: gradient accumulation, which the planner plans too
        return None
    if schedule == "1F1B" and microbatches < pp:
        return f"{microbatches} micro-batches are fewer than the {pp} pipeline stages: torch's 1F1B refuses them"
    rounds = max(1, microbatches // pp)
    if schedule == "Interleaved1F1B" and microbatches % rounds:
        return (f"{schedule} runs micro-batches in rounds of {pp} (one per stage rank): {microbatches} is not a "
                f"whole number of rounds; {rounds * pp} is")
    return None


def in_flight(schedule: str, rank: int, ranks: int, microbatches: int, virtual: int = 1) -> int:
    """Micro-batches (of one stage's activations) rank `rank` keeps alive at once.
    GPipe runs every forward first: all M. 1F1B starts a backward as soon as it can: stage r holds
    ranks - r. Interleaved 1F1B warms up with (v - 1) * ranks + 2 (ranks - 1 - r) forwards; the
    rank's v stages share them, so per stage that count divided by v (at most M)."""
    if schedule in ("GPipe", "LoopedBFS"):
        return microbatches
    if schedule == "1F1B":
        return min(ranks - rank, microbatches)
    warmup = (virtual - 1) * ranks + 2 * (ranks - 1 - rank) + 1
    return min(microbatches, math.ceil(warmup / virtual))


@dataclass(frozen=True)
class Unit:
    label: str                # where it is, e.g. "decoder_layers.3"
    time: float               # s, forward + backward of one micro-batch
    parameter_bytes: int
    activation_bytes: int     # per micro-batch, until its backward
    boundary_bytes: int = 0   # sent to the next stage if a cut follows this unit


@dataclass
class StageCost:
    index: int
    rank: int
    units: range
    compute: float            # s per micro-batch
    communication: float      # s per micro-batch: activations in and out, gradients back
    parameter_bytes: int
    state_bytes: int          # parameters + gradients + optimizer state
    activation_bytes: int     # per micro-batch
    in_flight: int

    @property
    def time(self) -> float:
        return self.compute + self.communication

    @property
    def memory(self) -> int:
        return self.state_bytes + self.in_flight * self.activation_bytes


@dataclass
class PipelinePlan:
    schedule: str
    microbatches: int
    virtual: int
    stages: list[StageCost]
    step_time: float
    bubble: float
    capacity: int | None
    reasons: list[str] = field(default_factory=list)  # one per cut

    @property
    def cuts(self) -> list[int]:
        """Unit indices where stages 1.. begin."""
        return [s.units.start for s in self.stages[1:]]

    def table(self, units: list[Unit]) -> str:
        lines = [f"{self.schedule}, {len(self.stages)} stages ({self.virtual} per rank), {self.microbatches} "
                 f"micro-batches: step {self.step_time * 1e3:.2f} ms predicted, bubble {self.bubble:.1%}",
                 "stage  rank  from                          ms/micro-batch  (comm)  memory      in flight"]
        for s in self.stages:
            lines.append(f"{s.index:5d}  {s.rank:4d}  {units[s.units.start].label[:28]:28s}  {s.time * 1e3:14.3f}  "
                         f"{s.communication * 1e3:6.3f}  {format_bytes(s.memory):>10}  {s.in_flight:9d}")
        lines += [f"cut {i + 1}: {reason}" for i, reason in enumerate(self.reasons)]
        return "\n".join(lines)


def stage_cost(units: list[Unit], index: int, lo: int, hi: int, *, ranks: int, schedule: str,
               microbatches: int, virtual: int, link: Link, state_per_parameter_byte: float) -> StageCost:
    """Stage `index` (on rank index % ranks) made of units[lo:hi]."""
    chunk = units[lo:hi]
    comm = 0.0
    for edge in ([lo - 1] if lo > 0 else []) + ([hi - 1] if hi < len(units) else []):
        comm += 2 * send_seconds(units[edge].boundary_bytes, link)  # activation, then gradient
    params = sum(u.parameter_bytes for u in chunk)
    rank = index % ranks
    return StageCost(index=index, rank=rank, units=range(lo, hi), compute=sum(u.time for u in chunk),
                     communication=comm, parameter_bytes=params, state_bytes=int(params * state_per_parameter_byte),
                     activation_bytes=sum(u.activation_bytes for u in chunk),
                     in_flight=in_flight(schedule, rank, ranks, microbatches, virtual))


def stage_costs(units: list[Unit], bounds: list[int], **plan_args) -> list[StageCost]:
    """Costs of the stages that begin at `bounds` (unit indices, first 0), in order."""
    ends = bounds[1:] + [len(units)]
    ranks = len(bounds) // plan_args["virtual"]
    return [stage_cost(units, k, lo, hi, ranks=ranks, **plan_args) for k, (lo, hi) in enumerate(zip(bounds, ends))]


def schedule_cost(stages: list[StageCost], microbatches: int, virtual: int) -> tuple[float, float]:
    """(step seconds, bubble fraction) of running `stages` (placed round-robin on ranks)."""
    ranks = len(stages) // virtual
    rank_time = [sum(s.time for s in stages if s.rank == r) for r in range(ranks)]
    slowest = max(rank_time)
    step = microbatches * slowest + (sum(s.time for s in stages) - slowest) / virtual
    bubble = 1 - microbatches * (sum(rank_time) / ranks) / step
    return step, bubble


def plan_for(units: list[Unit], bounds: list[int], *, schedule: str, microbatches: int, virtual: int,
             link: Link, state_per_parameter_byte: float, capacity: int | None = None) -> PipelinePlan:
    stages = stage_costs(units, bounds, schedule=schedule, microbatches=microbatches, virtual=virtual, link=link,
                         state_per_parameter_byte=state_per_parameter_byte)
    step, bubble = schedule_cost(stages, microbatches, virtual)
    plan = PipelinePlan(schedule, microbatches, virtual, stages, step, bubble, capacity)
    plan.reasons = explain_cuts(units, plan)
    return plan


def balanced_cuts(units: list[Unit], num_stages: int, *, schedule: str, microbatches: int, virtual: int = 1,
                  link: Link, state_per_parameter_byte: float, capacity: int | None = None) -> PipelinePlan:
    """The cuts that minimise the slowest stage's time with every stage's memory within `capacity`
    (a rank's `virtual` stages share it). best[k][i]: least slowest-stage time over stages 0..k-1
    covering units[:i]; O(stages x units^2)."""
    n = len(units)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} cuts, but the graph has only {n - 1} "
                         f"places to cut (unit boundaries); use fewer stages.")
    plan_args = dict(schedule=schedule, microbatches=microbatches, virtual=virtual, link=link,
                     state_per_parameter_byte=state_per_parameter_byte)

    ranks = num_stages // virtual

    def cost(k: int, lo: int, hi: int) -> float:
        stage = stage_cost(units, k, lo, hi, ranks=ranks, **plan_args)
        if capacity is not None and stage.memory * virtual > capacity:
            return math.inf
        return stage.time

    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    start = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == math.inf:
                    continue
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], start[k][i] = value, j
    if best[num_stages][n] == math.inf:
        smallest = plan_for(units, even_bounds(n, num_stages), **plan_args)
        raise MemoryError(f"no {num_stages}-stage split fits {format_bytes(capacity)} per device: an even split "
                          f"needs up to {format_bytes(max(s.memory for s in smallest.stages) * virtual)}; use more "
                          "stages, fewer micro-batches in flight (1F1B), or checkpointing.")
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        i = start[k][i]
        bounds.append(i)
    return refine(units, bounds[::-1], capacity, plan_args)


def refine(units: list[Unit], bounds: list[int], capacity: int | None, plan_args: dict) -> PipelinePlan:
    """Move single cuts one unit either way while that lowers the predicted step: the DP balances
    stages, but the step also pays the other stages once (fill and drain), and with several
    stages per rank (interleaving) each rank's sum of stages sets the pace."""
    best = plan_for(units, bounds, capacity=capacity, **plan_args)
    improved = True
    while improved:
        improved = False
        for k in range(1, len(bounds)):
            for step in (-1, 1):
                moved = best.cuts.copy()
                moved[k - 1] += step
                trial = [0] + moved
                if trial != sorted(set(trial)) or trial[-1] >= len(units):
                    continue
                plan = plan_for(units, trial, capacity=capacity, **plan_args)
                fits = capacity is None or all(s.memory * plan.virtual <= capacity for s in plan.stages)
                if fits and plan.step_time < best.step_time - 1e-12:
                    best, improved = plan, True
    return best


def even_bounds(n: int, num_stages: int) -> list[int]:
    return [round(k * n / num_stages) for k in range(num_stages)]


def explain_cuts(units: list[Unit], plan: PipelinePlan) -> list[str]:
    """Why each cut is where it is: what the neighbouring stages would cost one unit either way."""
    slowest = max(plan.stages, key=lambda s: s.time)
    reasons = []
    for a, b in zip(plan.stages, plan.stages[1:]):
        cut = b.units.start
        text = f"before {units[cut].label}: stage {a.index} {a.time * 1e3:.3f} ms, stage {b.index} {b.time * 1e3:.3f} ms"
        if len(b.units) > 1:
            later = a.time + units[cut].time
            text += f"; one unit later stage {a.index} would take {later * 1e3:.3f} ms"
        if len(a.units) > 1:
            earlier = b.time + units[cut - 1].time
            text += f"; one unit earlier stage {b.index} would take {earlier * 1e3:.3f} ms"
        text += f" (slowest stage {slowest.index}: {slowest.time * 1e3:.3f} ms)"
        reasons.append(text)
    return reasons
