"""A pipeline in a plan: which rank is the slowest and how long a step's schedule runs.

Stages. picofx's pipeline pass cuts by predicted cost (`Pipeline(balance="cost")`), and so do
runs that give the last stage fewer layers to make room for the head and the loss (Llama 3 takes
a layer off its first and last stages): the slowest rank is then the one the balanced cut leaves
busiest, with or without the head. Megatron-LM splits the layers evenly (the layers a multiple of
pp) and puts the head beside the last stage's share: `even_stages`.

Slots. A step of m micro-batches on pp ranks of v stages each runs m + (pp - 1) / v micro-batches
of one rank's work: the fill and drain of an interleaved schedule run chunks of 1/v of a rank.

Stages per rank. A plan may have 1, 2 or each count that splits a rank's layers into equal chunks;
the embedding and the head may each take a chunk's place (Llama 3 runs its 126 layers as 16 ranks x 8
chunks). The search tries the deeper counts while they pay (`picofx.planner.search.deeper_interleaving`).
"""
from __future__ import annotations

from typing import NamedTuple


class BusiestRank(NamedTuple):
    """Per micro-batch, the slowest rank's work: its decoder layers and whether the head and loss
    (the rest of the model) run there; `most_layers`: the most layers any rank holds (memory)."""

    layers: int
    with_rest: bool
    most_layers: int


def busiest_rank(layers: int, pp: int, rest_in_layers: float, even_stages: bool = False) -> BusiestRank:
    """The slowest rank of `layers` decoder layers over `pp` ranks when the rest of the model (the
    head and the loss, `rest_in_layers` layers' worth of time) runs on the last one."""
    even = -(-layers // pp)
    if pp == 1 or even_stages:
        return BusiestRank(even, True, even)
    best = None
    for last in range(0, min(even, layers) + 1):  # the last rank's layers; the others share the rest evenly
        others = -(-(layers - last) // (pp - 1))
        load = max(others, last + rest_in_layers)
        if best is None or load < best[0]:
            best = (load, last, others)
    _, last, others = best
    with_rest = last + rest_in_layers >= others
    return BusiestRank(last if with_rest else others, with_rest, max(last, others))


def pipeline_slots(microbatches: int, pp: int, virtual: int = 1) -> float:
    """A pipelined step's length in micro-batches of one rank's work (all its stages' forward and
    backward): the m micro-batches, and the fill and drain of (pp - 1) / virtual (1F1B: one stage per
    rank; interleaved 1F1B: each of the rank's `virtual` stages holds 1/virtual of its layers)."""
    return microbatches + (pp - 1) / virtual


END_CHUNKS = 2  # the embedding and the head: each may fill a chunk of its own


def virtual_stage_counts(layers: int, pp: int) -> list[int]:
    """Stages per rank a plan of `layers` decoder layers on `pp` ranks may have, fewest first: 1; with a
    pipeline, 2 and every divisor of a rank's layers, as long as the chunks find a place each."""
    if pp == 1:
        return [1]
    per_rank = -(-layers // pp)
    counts = {1, 2} | {v for v in range(2, per_rank + 1) if per_rank % v == 0}
    return sorted(v for v in counts if pp * v <= layers + END_CHUNKS)


def pipeline_refusal(layers: int, pp: int, virtual: int) -> str | None:
    """Why `pp` ranks of `virtual` stages each cannot hold `layers` decoder layers (None: they can)."""
    if pp > layers:
        return f"pp {pp} exceeds the {layers} layers"
    if virtual > 1 and pp == 1:
        return "virtual_stages without a pipeline (pp 1)"
    if pp * virtual > layers + END_CHUNKS:
        return (f"pp {pp} x {virtual} stages per rank exceeds the {layers} layers and the embedding and head "
                f"({layers + END_CHUNKS} chunks)")
    return None
