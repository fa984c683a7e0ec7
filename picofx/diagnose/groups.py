"""Which mesh dimension each traced collective ran over, and each dimension's link fitted apart.

A gloo range (`gloo:all_reduce`, picofx.diagnose.collectives) names neither its process group nor
its ranks, but it runs on a worker thread of its group, and each gloo group starts worker threads of
its own. `worker_threads` names them: after the traced steps, inside a `picofx.group:<dimension>`
range per dimension, a few one-float all-reduces on that dimension's group, each group's threads all
kept busy at once (one rank of the group arrives late while the others have queued every all-reduce,
so each queued one waits on a thread of its own), twice, with another rank late the second time.
The threads whose ranges start inside a dimension's range work for its group. Collectives on any
other group (the world's: the gradient norm, the loss) keep no dimension.
"""
from __future__ import annotations

import json
import math
import pathlib
import tempfile
import time

from picofx.diagnose.collectives import Collective, fastest_of_ranks, is_worker_range, ring_fit

GROUP_RANGE = "picofx.group:"
QUEUED = 4  # all-reduces queued at once: a group's worker threads (gloo starts 2) each take one
LATE_S = 0.1  # how late one rank of the group queues its all-reduces


def worker_threads(groups: dict) -> dict[int, str]:
    """{worker thread id, as the trace files name it: the dimension whose group it works for}, for
    `groups` ({dimension: its process group}, every rank calling with the same dimensions in order)."""
    import torch
    import torch.distributed as dist

    with torch.profiler.profile() as prof:
        for name, group in groups.items():
            with torch.profiler.record_function(GROUP_RANGE + name):
                for late in range(min(2, dist.get_world_size(group))):
                    if dist.get_rank(group) == late:
                        time.sleep(LATE_S)
                    queued = [dist.all_reduce(torch.zeros(1), group=group, async_op=True) for _ in range(QUEUED)]
                    for work in queued:
                        work.wait()
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "groups.json"
        prof.export_chrome_trace(str(path))
        return threads_of(json.loads(path.read_text()).get("traceEvents", []))


def threads_of(events: list[dict]) -> dict[int, str]:
    """The worker threads whose ranges start inside a `picofx.group:<dimension>` range, by dimension."""
    spans = [e for e in events if e.get("ph") == "X"]
    marks = [(e["name"][len(GROUP_RANGE):], e["ts"], e["ts"] + e.get("dur", 0.0)) for e in spans
             if str(e.get("name", "")).startswith(GROUP_RANGE)]
    threads = {}
    for e in spans:
        if is_worker_range(str(e.get("name", ""))):
            for name, start, end in marks:
                if start <= e["ts"] <= end:
                    threads[e["tid"]] = name
    return threads


def named(collectives: list[Collective], threads: dict[int, str]) -> list[Collective]:
    """`collectives`, each with the dimension its worker thread works for (None: another group's)."""
    return [Collective(c.kind, c.nbytes, c.seconds, c.thread, threads.get(c.thread)) for c in collectives]


def groups_of(sizes: dict[str, int], dim: str) -> list[list[int]]:
    """The rank lists of dimension `dim`'s groups on a mesh of `sizes` (dimensions outermost first,
    ranks laid out row-major, as torch's DeviceMesh lays them)."""
    names = list(sizes)
    axis, stride = names.index(dim), math.prod(sizes[n] for n in names[names.index(dim) + 1:])
    starts = [r for r in range(math.prod(sizes.values())) if (r // stride) % sizes[names[axis]] == 0]
    return [[start + i * stride for i in range(sizes[dim])] for start in starts]


def dimension_samples(per_rank: list[list[Collective]], sizes: dict[str, int],
                      dim: str) -> list[tuple[Collective, int]]:
    """Dimension `dim`'s collectives, each at its fastest over the ranks of its group (the last to
    arrive timed the transfer alone), every group's, with the group's size."""
    samples = []
    for ranks in groups_of(sizes, dim):
        mine = [[c for c in per_rank[r] if c.group == dim] for r in ranks if r < len(per_rank)]
        samples += [(c, sizes[dim]) for c in fastest_of_ranks(mine)]
    return samples


def dimension_links(per_rank: list[list[Collective]], sizes: dict[str, int]) -> dict[str, dict]:
    """Each dimension's link (ring_fit over its own collectives), by dimension of `sizes`."""
    return {dim: ring_fit(dimension_samples(per_rank, sizes, dim)) for dim in sizes}
