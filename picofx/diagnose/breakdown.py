"""Where each traced step's time went on one rank, measured from a torch.profiler trace.

A step (torch.profiler's `ProfilerStep#N` range, on the thread that called `step()`) is split into
parts that do not overlap and add up to it:

    data            waiting for the batch (the `picofx.data` range)
    forward         the `picofx.forward_backward` range outside the backward
    backward        the autograd engine's work in that range (`autograd::engine::evaluate_function`)
    optimizer       from the end of forward_backward to the end of the `picofx.optimizer` range (the
                    gradient norm, clipping and the optimizer step)
    checkpoint      saving a checkpoint (the `picofx.checkpoint` range: what the step waits for; an
                    asynchronous save writes the rest behind the steps)
    exposed_comm    the stepping thread inside a collective or a wait for one (c10d, gloo, NCCL,
                    functional collectives' `wait_tensor`), wherever in the step; or running no op
                    at all while a collective was in flight: blocked in a wait the trace does not
                    record (a blocking `dist.all_reduce`, `Work.wait()`)
    idle            time outside the ranges above in which the thread ran no op (Python between phases)
    unattributed    time outside the ranges above in which it ran ops (zero_grad, logging, metrics)

`hidden_comm` is not a part of the sum: the time a collective was in flight while the rank computed
(forward, backward or optimizer). On a CPU, where collectives have no stream of their own, a
collective is in flight from its issue (a functional collective such as
`_c10d_functional::all_reduce`, matched in order with the `wait_tensor`s after it) to the end of
the wait for it; and for as long as its work runs on gloo's (or NCCL's) worker thread, which the
trace records as a `gloo:<op>` range up to the collective's completion
(picofx.diagnose.collectives). On CUDA the same rule reads the collectives' kernels, which run on
their own stream.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

COMPONENTS = ("data", "forward", "backward", "optimizer", "checkpoint", "exposed_comm", "idle", "unattributed")
MARK = "picofx."  # the prefix of the phase ranges picofx.profile records
COMM_WORDS = ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
              "broadcast", "wait_tensor", "barrier", "send", "recv", "all_to_all")
ISSUES = ("_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor",
          "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::broadcast",
          "_c10d_functional::all_to_all_single")
WAIT = "_c10d_functional::wait_tensor"
BACKWARD = "autograd::engine::evaluate_function"
STEP = "ProfilerStep"  # "ProfilerStep#N" in the trace file, "ProfilerStep*" in events()


@dataclass(frozen=True)
class Span:
    """One profiler event: its name, [start, end) in seconds, its thread and whether it is a root
    (no parent on its thread)."""

    name: str
    start: float
    end: float
    thread: int = 0
    root: bool = True


def spans_of(events) -> list[Span]:
    """A torch.profiler profile's `events()` as Spans (their times are in microseconds)."""
    return [Span(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6, e.thread, e.cpu_parent is None)
            for e in events if e.time_range.end >= e.time_range.start]


# Sets of time as sorted, disjoint [start, end) intervals.
def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersect(a, b) -> list[tuple[float, float]]:
    a, b, out, i, j = union(a), union(b), [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    out = []
    for start, end in union(a):
        for cut_start, cut_end in union(b):
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
        if end > start:
            out.append((start, end))
    return out


def length(intervals) -> float:
    return sum(end - start for start, end in union(intervals))


def is_comm(name: str) -> bool:
    lowered = name.lower()
    return not lowered.startswith((MARK, STEP.lower())) and any(w in lowered for w in COMM_WORDS)


@dataclass
class StepBreakdown:
    """One traced step on one rank: seconds per component (COMPONENTS add up to `seconds`), and the
    communication hidden behind compute."""

    step: int  # the index of the traced step, from 0
    seconds: float
    parts: dict = field(default_factory=dict)
    hidden_comm: float = 0.0
    in_flight: float = 0.0  # every collective's time in flight, hidden or not

    def as_dict(self) -> dict:
        return {"step": self.step, "seconds": self.seconds, **self.parts, "hidden_comm": self.hidden_comm,
                "comm_in_flight": self.in_flight}


def in_flight(spans: list[Span], main: int) -> list[tuple[float, float]]:
    """When collectives were in flight: functional collectives from issue to the end of their wait
    (issues and waits matched in order), and every collective's own span (a blocking one on the
    stepping thread, or one running on another thread)."""
    issued: deque = deque()
    flying = []
    for span in sorted((s for s in spans if s.thread == main), key=lambda s: s.start):
        if span.name in ISSUES:
            issued.append(span.start)
        elif span.name == WAIT and issued:
            flying.append((issued.popleft(), span.end))
    flying += [(s.start, s.end) for s in spans if is_comm(s.name)]  # blocking ones, and other threads''
    return union(flying)


def step_breakdowns(spans: list[Span]) -> list[StepBreakdown]:
    """The breakdown of every traced step (`ProfilerStep#N` range) in `spans`."""
    steps = sorted((s for s in spans if s.name.startswith(STEP)), key=lambda s: s.start)
    if not steps:
        return []
    main = steps[0].thread
    flying = in_flight(spans, main)
    out = []
    for step in steps:
        window = [(step.start, step.end)]
        inside = [s for s in spans if s.end > step.start and s.start < step.end and s is not step]
        marks = {}
        for s in inside:
            if s.thread == main and s.name.startswith(MARK):
                marks.setdefault(s.name[len(MARK):], []).append((s.start, s.end))
        ops = [(s.start, s.end) for s in inside if s.thread == main and not s.name.startswith((MARK, STEP))]
        waits = [(s.start, s.end) for s in inside if s.thread == main and is_comm(s.name)]
        blocked = subtract(intersect(flying, window), ops)  # no op ran while a collective was in flight
        comm = union(intersect(waits, window) + blocked)
        data, checkpoint = marks.get("data", []), marks.get("checkpoint", [])
        passes = marks.get("forward_backward", [])
        passes_end = max((end for _, end in passes), default=None)  # the optimizer part starts there
        optimizer = [(passes_end if passes_end is not None and passes_end < end else start, end)
                     for start, end in marks.get("optimizer", [])]
        backward = intersect([(s.start, s.end) for s in inside if s.name.startswith(BACKWARD)], passes)
        parts = {"data": subtract(intersect(data, window), comm), "exposed_comm": comm,
                 "checkpoint": subtract(intersect(checkpoint, window), comm)}
        parts["backward"] = subtract(backward, comm + data + checkpoint)
        parts["forward"] = subtract(intersect(passes, window), backward + comm + data + checkpoint)
        parts["optimizer"] = subtract(intersect(optimizer, window), passes + comm + data + checkpoint)
        outside = subtract(window, [i for p in parts.values() for i in p])
        parts["unattributed"] = intersect(outside, ops)
        parts["idle"] = subtract(outside, ops)
        computing = parts["forward"] + parts["backward"] + parts["optimizer"]
        out.append(StepBreakdown(len(out), step.end - step.start, {k: length(parts[k]) for k in COMPONENTS},
                                 length(intersect(flying, computing)), length(intersect(flying, window))))
    return out


def mean_breakdown(steps: list[StepBreakdown]) -> dict:
    """Seconds per step of each component, hidden communication and the step, over `steps`."""
    if not steps:
        return {}
    keys = [*COMPONENTS, "hidden_comm", "comm_in_flight", "seconds"]
    return {k: sum(s.as_dict()[k] for s in steps) / len(steps) for k in keys}


EXPOSED_SHARE = 0.2  # communication that stops the step a fifth of its time is worth changing


def exposed_communication(records: list[dict]):
    """A Finding where a rank's traced steps (records with `breakdown`, written by --profile) waited
    on collectives more than EXPOSED_SHARE of their time; else None."""
    from picofx.diagnose.finding import Finding

    def seconds(value: float) -> str:
        return f"{value * 1e3:.3g} ms"

    traced = [r for r in records if isinstance(r.get("breakdown"), list)]
    if not traced:
        return None
    worst = None
    for rank in range(len(traced[0]["breakdown"])):
        rows = [r["breakdown"][rank] for r in traced if rank < len(r["breakdown"]) and r["breakdown"][rank]]
        step = sum(row["seconds"] for row in rows)
        if step > 0:
            share = sum(row["exposed_comm"] for row in rows) / step
            hidden = sum(row["hidden_comm"] for row in rows) / len(rows)
            worst = max(worst or (share, rank, hidden, step / len(rows)), (share, rank, hidden, step / len(rows)))
    if worst is None or worst[0] <= EXPOSED_SHARE:
        return None
    share, rank, hidden, step = worst
    return Finding("communication", (traced[0]["step"], traced[-1]["step"]),
                   f"rank {rank}'s traced steps waited on collectives {100 * share:.0f}% of their {seconds(step)} "
                   f"({seconds(hidden)} a step more was hidden behind compute)",
                   "hide it behind compute (--dp's pass overlap all-reduces gradient buckets during the backward; "
                   "fewer, larger buckets), send less (--compress bf16), or on a CPU fewer ranks or threads per "
                   "machine (gloo's threads share the cores)",
                   0.6, f"up to {100 * share:.0f}% shorter steps",
                   {"rank": rank, "exposed_share": share, "hidden_s": hidden, "step_s": step})
