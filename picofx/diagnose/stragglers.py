"""A rank slower than the others, named with what made it slow.

Ranks that meet in collectives every step end their steps together: the fast ones wait for the
slow one inside the step, so equal step times hide a straggler. Each rank's record therefore says
where its own time went: `data_s` (waiting for its batch), `cpu_s` (CPU time its process spent
in the step: computing on a CPU; a rank blocked in a gloo collective spends next to none) and
`step_s`. Each rank is compared with the median of the other ranks (over the settled steps'
medians): it is named when it waited for data longer than they did by more than a tenth of the step
(data), spent 1.5x their CPU time (compute), or took a tenth longer a step without either
(communication or other waits). On CUDA, CPU time is the launches', not the kernels': compute is
not judged there. A rank slowed by a busier core does the same work (the same CPU time) in longer:
in lockstep with the others, it is not seen.
"""
from __future__ import annotations

from picofx.diagnose.finding import Finding, finite, median, seconds

STEP_SHARE = 0.1       # an excess past a tenth of the median step names a rank
CPU_RATIO = 1.5        # a rank computing 1.5x the other ranks' CPU time is slow by its compute
FIGURES = ("step_s", "data_s", "cpu_s")


def gather_rank_figures(figures: dict) -> list[dict] | None:
    """Every rank's `figures` (FIGURES: seconds of this step) on rank 0, in rank order, by one gather
    of a few floats; None on the other ranks and in a single process (no collective at all)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    mine = torch.tensor([float(figures.get(k, float("nan"))) for k in FIGURES], dtype=torch.float64)
    rank = dist.get_rank()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(mine, every, dst=0)
    if rank != 0:
        return None
    return [dict(zip(FIGURES, (round(v, 6) for v in t.tolist()))) for t in every]


def per_rank_medians(records: list[dict]) -> list[dict]:
    """Each rank's median of each figure over the steps that carry every rank's figures."""
    rows = [r["ranks"] for r in records if isinstance(r.get("ranks"), list) and r["ranks"]]
    settled = rows[2:] if len(rows) > 4 else rows
    if not settled:
        return []
    world = len(settled[-1])
    settled = [row for row in settled if len(row) == world]
    return [{k: median(row[rank].get(k) for row in settled) for k in FIGURES} for rank in range(world)]


def cause(rank: dict, typical: dict) -> tuple[str, float, float] | None:
    """(what made `rank` slow, its excess in seconds a step, confidence), or None for a healthy rank."""
    step = typical["step_s"]
    data_excess = rank["data_s"] - typical["data_s"]
    if data_excess > STEP_SHARE * step:
        return "data", data_excess, 0.9
    if finite(rank["cpu_s"]) and finite(typical["cpu_s"]) and typical["cpu_s"] > 0 and \
            rank["cpu_s"] > CPU_RATIO * typical["cpu_s"]:
        busy = step - rank["data_s"]  # the others wait for the part of it they did not compute
        return "compute", busy * (1 - typical["cpu_s"] / rank["cpu_s"]), 0.6
    if rank["step_s"] - step > STEP_SHARE * step:
        return "communication or other waits", rank["step_s"] - step, 0.5
    return None


ADVICE = {
    "data": "give rank {rank} faster batches: more --data-workers, or its data on local disk; check its machine's "
            "load",
    "compute": "check rank {rank}'s machine: other processes on its cores, its threads (OMP_NUM_THREADS), a slower "
               "or throttled device",
    "communication or other waits": "check rank {rank}'s link and what else its process does between steps",
}


def stragglers(records: list[dict], *, device: str = "cpu") -> list[Finding]:
    ranks = per_rank_medians(records)
    if len(ranks) < 2:
        return []
    steps = [r["step"] for r in records if isinstance(r.get("ranks"), list)]
    found = []
    for index, rank in enumerate(ranks):
        typical = {k: median(r[k] for i, r in enumerate(ranks) if i != index) for k in FIGURES}
        if str(device).startswith("cuda"):
            typical["cpu_s"] = float("nan")  # a GPU's compute is not the process's CPU time
        why = cause(rank, typical)
        if why is None:
            continue
        kind, excess, confidence = why
        detail = {"data": f"it waited {seconds(rank['data_s'])} a step for its batches, the other ranks "
                          f"{seconds(typical['data_s'])}",
                  "compute": f"it spent {rank['cpu_s'] / typical['cpu_s']:.1f}x the other ranks' CPU time a step "
                             f"({seconds(rank['cpu_s'])} against {seconds(typical['cpu_s'])})",
                  "communication or other waits": f"its step took {seconds(rank['step_s'])}, the other ranks' "
                                                   f"{seconds(typical['step_s'])}, with no more data wait or compute"}
        found.append(Finding("straggler", (steps[0], steps[-1]),
                             f"rank {index} is slow ({kind}): {detail[kind]}; the other ranks wait for it about "
                             f"{seconds(excess)} of each {seconds(typical['step_s'])} step",
                             ADVICE[kind].format(rank=index), confidence,
                             f"steps up to {seconds(excess)} shorter on every rank",
                             {"rank": index, "cause": kind, "excess_s": excess, "rank_figures": rank,
                              "others_figures": typical}))
    return found
