"""The order passes run in: the caller's, changed only where a PassInfo says so.

A pass names, in its PassInfo, the passes it must run before (`runs_before`) or after
(`runs_after`) when they are given too. The manager sorts the passes it is given by those
constraints, stably: where no constraint speaks, the caller's order stays, so
`[Shard(), TensorParallel()]` and `[TensorParallel(), Shard()]` run the same. Stages still run
in their fixed order (forward, joint, partitioned), each stage's passes in the sorted order, so a
constraint between passes of different stages is already met. Only what cannot be honoured is
refused, naming the passes: constraints that form a cycle, or one that asks a pass to run before
another whose stages all come earlier. A pass a given one `requires` is added, when missing, just
before the first pass that requires it, and runs before it.
"""
from __future__ import annotations

from dataclasses import dataclass

from picofx.manager.passes import Stage, pass_info, pass_name, resolve_pass

STAGE_ORDER = {stage: i for i, stage in enumerate(Stage)}


@dataclass(frozen=True)
class Constraint:
    first: int   # index in the given list of the pass that runs first
    then: int    # ... and of the pass that runs after it
    why: str     # the declaration, as the report and errors quote it

    def violated_by_given_order(self) -> bool:
        return self.first > self.then


def constraints(passes: list) -> list[Constraint]:
    """Every declared constraint between two of `passes` (by index), each with its declaration."""
    names = [pass_name(p) for p in passes]
    found = []
    for i, p in enumerate(passes):
        info = pass_info(p)
        for j, other in enumerate(names):
            if j == i:
                continue
            if other in info.runs_before:
                found.append(Constraint(i, j, f"{names[i]} declares runs_before={other!r}"))
            if other in info.runs_after:
                found.append(Constraint(j, i, f"{names[i]} declares runs_after={other!r}"))
            if other in info.requires:
                found.append(Constraint(j, i, f"{names[i]} declares requires={other!r}"))
    return found


def left_open_by_stages(passes: list, found: list[Constraint]) -> list[Constraint]:
    """The constraints the fixed order of stages leaves to the list order (the passes share a
    stage). One it already honours is dropped; one it breaks (the first pass runs only at stages
    after every stage of the other) is refused."""
    left = []
    for c in found:
        first, then = pass_info(passes[c.first]), pass_info(passes[c.then])
        first_stages, then_stages = [STAGE_ORDER[s] for s in first.stages], [STAGE_ORDER[s] for s in then.stages]
        if min(first_stages) > max(then_stages):
            a, b = pass_name(passes[c.first]), pass_name(passes[c.then])
            raise ValueError(f"passes {a!r} and {b!r} cannot both run: {c.why}, but {a!r} runs at the "
                             f"{first.stage.value} stage, after every stage of {b!r} "
                             f"({', '.join(s.value for s in then.stages)}).")
        if max(first_stages) >= min(then_stages):
            left.append(c)
    return left


def cycle_message(passes: list, left: list[int], found: list[Constraint]) -> str:
    """The passes of one cycle among `left` (each waits for another of them), and the declarations."""
    waits_for = {i: [c for c in found if c.then == i and c.first in left] for i in left}
    path, at = [], left[0]
    while at not in path:  # every pass left waits for one left: walking back must come round
        path.append(at)
        at = waits_for[at][0].first
    cycle = path[path.index(at):][::-1]  # each runs before the next, the last before the first
    start = cycle.index(min(cycle))  # told from the pass given first
    cycle = cycle[start:] + cycle[:start]
    names = [pass_name(passes[i]) for i in cycle]
    whys = [next(c.why for c in waits_for[b] if c.first == a) for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    listed, every = (" and ", "both") if len(names) == 2 else (", ", "all")
    return (f"passes {listed.join(map(repr, names))} cannot {every} run: their declared order is a cycle "
            f"({'; '.join(whys)}). Drop one of them, or the constraint that is wrong.")


def with_required(passes: list) -> tuple[list, list[str]]:
    """`passes` and the passes they require that are missing, each added (with its defaults) just
    before the first pass requiring it; and a line for each added."""
    out, added = list(passes), []
    at = 0
    while at < len(out):
        given = {pass_name(p) for p in out}
        missing = [name for name in pass_info(out[at]).requires if name not in given]
        if not missing:
            at += 1
            continue
        added += [f"added {name}: {pass_name(out[at])} declares requires={name!r}" for name in missing]
        out[at:at] = [resolve_pass(name) for name in missing]  # they may require others: looked at next
    return out, added


def run_order(passes: list) -> tuple[list, str | None]:
    """`passes`, with what they require, sorted by their declared constraints, the caller's order
    kept where none speaks (a stable topological sort: the earliest given pass whose predecessors
    have all been placed goes next); and, when that changed the passes or their order, what
    changed and which declarations did it."""
    given = passes
    passes, added = with_required(passes)
    found = left_open_by_stages(passes, constraints(passes))
    waits_for = {i: {c.first for c in found if c.then == i} for i in range(len(passes))}
    order: list[int] = []
    while len(order) < len(passes):
        ready = next((i for i in range(len(passes)) if i not in order and waits_for[i] <= set(order)), None)
        if ready is None:
            raise ValueError(cycle_message(passes, [i for i in range(len(passes)) if i not in order], found))
        order.append(ready)
    ordered = [passes[i] for i in order]
    moved = [c for c in found if c.violated_by_given_order()]
    if not moved and not added:
        return ordered, None
    lines = [f"given {', '.join(pass_name(p) for p in given)}; run as {', '.join(pass_name(p) for p in ordered)}",
             *(f"  {line}" for line in added)]
    lines += [f"  {pass_name(passes[c.first])} before {pass_name(passes[c.then])}: {c.why}" for c in moved]
    return ordered, "\n".join(lines)
