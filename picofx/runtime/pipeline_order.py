"""Every rank of a pipeline stage issues its compiled graphs' collectives in one order.

The ranks of one stage (its tensor-parallel, sharded and replicated data-parallel, context-parallel
peers) run the same stage graph, each scheduled by the passes on that rank. Where two of them
order a collective differently (a sharded gradient's reduce-scatter before a parameter's gather
on one rank, after it on its dp_shard peer), each waits in its own for the other's, and the
schedule stops without a word. So before the first micro-batch the peers along each dimension
exchange the sequence their forward and backward graphs issue, and a difference is an error that
names the stage, the dimension, the peer and the first collective where they part.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import fx

from picofx.errors import DistributedError
from picofx.parallel.mesh import ParallelMesh

PEERS = ("dp_replicate", "dp_shard", "cp", "tp")  # a stage's ranks; pp's differ by design
ROLES = ("forward", "backward")


def issued(gm: fx.GraphModule, names: dict[str, str]) -> list[str]:
    """`gm`'s collectives in graph order as "op@dimension" (`names`: group name -> dimension;
    another group is "other", since its name differs between peers)."""
    out = []
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op != "call_function" or "_c10d_functional" not in target or "wait_tensor" in target:
            continue
        group = [a for a in node.args if isinstance(a, str)]
        out.append(f"{target.split('.')[-2]}@{names.get(group[-1], 'other') if group else 'other'}")
    return out


def first_difference(mine: dict, theirs: dict) -> str | None:
    """Where two ranks' sequences (by graph role) part first, in words; None where they agree."""
    for role in sorted(set(mine) | set(theirs)):
        a, b = mine.get(role, []), theirs.get(role, [])
        if a == b:
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ours = a[at] if at < len(a) else "nothing more"
        peer = b[at] if at < len(b) else "nothing more"
        return f"the {role} graph's collective {at + 1} is {ours} here, {peer} there"
    return None


def check_same_order(stage: int, graphs: dict, mesh: ParallelMesh | None) -> None:
    """Raise DistributedError where a peer of this rank on `stage` issues `graphs`' collectives (a
    compiled stage's graphs by role) in another order. Every rank of the stage calls it."""
    if mesh is None or mesh.device_mesh is None:
        return
    dims = [mesh.dim(name) for name in PEERS if mesh.size(name) > 1]
    dims = [d for d in dims if d.group is not None]
    names = {d.group_name: d.name for d in dims}
    mine = {role: issued(gm, names) for role, gm in graphs.items()
            if role in ROLES and isinstance(gm, fx.GraphModule)}
    for dim in dims:
        everyone: list = [None] * dim.size
        dist.all_gather_object(everyone, mine, group=dim.group)
        for peer, theirs in enumerate(everyone):
            where = first_difference(mine, theirs)
            if where is not None:
                raise DistributedError(
                    f"pipeline stage {stage}: {dim.name} rank {peer} issues its collectives in another order than "
                    f"{dim.name} rank {dim.rank} ({where}), so both would wait for ever; every rank of a stage "
                    "must run the same passes on the same graph (a pass whose order depends on the rank: report it).")
