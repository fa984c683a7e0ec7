"""What a later pipeline stage receives along the sequence: the activations the stage before
sends, which tensor parallelism's sequence shards and context parallelism's token split both
resize to one rank's part. Shared by those passes, so no pass imports another's.
"""
from __future__ import annotations

from torch import fx

from picofx.capture.annotate import fake_mode_of
from picofx.capture.vocabulary import input_slot
from picofx.parallel.layouts import recorded


def received_sequence_shards(gm: fx.GraphModule, sequence_dim: int, ranks: int) -> list[fx.Node]:
    """The inputs of a later pipeline stage's graph that the stage before sends (floating-point
    activations, not the step's inputs travelling along), resized to one of `ranks` shards along
    `sequence_dim`; [] for the first stage and for a graph that is no pipeline stage."""
    stage = recorded(gm).stage
    if stage is None or stage.index == 0:
        return []
    received = [n for n in gm.graph.nodes if n.op == "placeholder" and input_slot(n) is None
                and n.meta["val"].is_floating_point()]
    mode = fake_mode_of(gm)
    for node in received:
        shape = list(node.meta["val"].shape)
        if len(shape) <= sequence_dim or shape[sequence_dim] % ranks:
            raise ValueError(f"Pipeline: stage {stage.index} receives {node.name} of shape {tuple(shape)}, whose "
                             f"dimension {sequence_dim} (the sequence) {ranks} sequence-parallel ranks do not "
                             f"divide; use a sequence length that is a multiple of {ranks}.")
        shape[sequence_dim] //= ranks
        with mode:
            node.meta["val"] = node.meta["val"].new_empty(shape)
    return received
