"""Communication cost: what each collective puts on the wire and how long it takes on a link, and
gradient buckets planned to hide the all-reduces behind the backward.

The collectives are timed as rings (NCCL's and gloo's large-message algorithm). Over n ranks, for
a tensor of `nbytes` (all-reduce, all-to-all and reduce-scatter: each rank's input; all-gather:
the gathered result), each rank sends
    all-reduce       2(n-1)/n x nbytes in 2(n-1) steps (a reduce-scatter, then an all-gather)
    reduce-scatter   (n-1)/n x nbytes in n-1 steps
    all-gather       (n-1)/n x nbytes in n-1 steps
    all-to-all       (n-1)/n x nbytes in n-1 steps (one chunk to each other rank)
    send             nbytes in one step (point to point)
and each step pays the link's latency once; each collective also pays the link's call latency once
(ranks that share cores: every peer's threads scheduled back in; zero on a GPU's link). A send pays
only the step's: its receiver is already waiting for it.

A data-parallel backward produces gradients one after another; each bucket of gradients is
all-reduced once its last gradient exists, while the rest of the backward still computes. The
bucket's communication is hidden if it finishes before the backward does; what runs past the
backward's end is exposed. Collectives run one at a time on the link, in bucket order.
"""
from __future__ import annotations

from dataclasses import dataclass

from picofx.cost.device import Device, Link


def all_reduce_steps(world: int) -> int:
    return 2 * (world - 1)


def all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends all-reducing `nbytes`."""
    return all_reduce_steps(world) * nbytes // world if world > 1 else 0


def reduce_scatter_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends reduce-scattering its `nbytes` (keeping 1/world of the sum)."""
    return (world - 1) * nbytes // world if world > 1 else 0


def all_gather_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends gathering `nbytes` in all (world pieces, one its own)."""
    return (world - 1) * nbytes // world if world > 1 else 0


def all_to_all_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends of its `nbytes` cut in world chunks, one to each rank (its own stays)."""
    return (world - 1) * nbytes // world if world > 1 else 0


def ring_seconds(nbytes: float, world: int, steps: int, link: Link) -> float:
    """`steps` ring steps, each moving nbytes/world over the link and paying its latency once, and
    the link's call latency once for the collective."""
    if world <= 1 or nbytes == 0:
        return 0.0
    return steps / world * nbytes / link.bandwidth + steps * link.latency + link.call_latency


def all_reduce_seconds(nbytes: float, world: int, link: Link) -> float:
    return ring_seconds(nbytes, world, all_reduce_steps(world), link)


def reduce_scatter_seconds(nbytes: float, world: int, link: Link) -> float:
    return ring_seconds(nbytes, world, world - 1, link)


def all_gather_seconds(nbytes: float, world: int, link: Link) -> float:
    return ring_seconds(nbytes, world, world - 1, link)


def all_to_all_seconds(nbytes: float, world: int, link: Link) -> float:
    return ring_seconds(nbytes, world, world - 1, link)


def send_seconds(nbytes: float, link: Link) -> float:
    """One message of `nbytes` from one rank to another."""
    return nbytes / link.bandwidth + link.latency


def all_reduce_size_sending(sent: float, world: int) -> float:
    """The all-reduce that puts `sent` bytes per rank on the wire (what a compressed exchange
    sending `sent` bytes is timed as)."""
    return sent * world / all_reduce_steps(world) if world > 1 else sent


def link_for(device: Device, world: int, ranks_per_node: int = 8) -> Link:
    """The link a ring over `world` ranks is bound by: the node's own link (NVLink, or the CPU
    entry's gloo link) while all ranks share a node, the network (InfiniBand) once they do not."""
    return device.intra_node_link if world <= ranks_per_node else device.inter_node_link


@dataclass(frozen=True)
class Gradient:
    name: str
    nbytes: int
    ready: float  # s after the backward starts when the gradient exists


@dataclass(frozen=True)
class Bucket:
    first: int  # index of its first gradient in production order
    last: int  # index of its last gradient (inclusive): the all-reduce is issued after it
    nbytes: int
    issue: float  # s after the backward starts: when the last gradient exists
    start: float  # when the link is free for it
    seconds: float  # predicted all-reduce time
    exposed: float  # of its time, how much runs past the end of the backward

    @property
    def finish(self) -> float:
        return self.start + self.seconds


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]
    backward_seconds: float
    link: Link
    world: int

    @property
    def comm_seconds(self) -> float:
        return sum(b.seconds for b in self.buckets)

    @property
    def exposed_seconds(self) -> float:
        return max((b.finish for b in self.buckets), default=0.0) - self.backward_seconds if self.buckets else 0.0

    def notes(self) -> dict:
        ms = lambda s: round(s * 1e3, 4)  # noqa: E731
        return {"buckets": len(self.buckets), "bucket_bytes": [b.nbytes for b in self.buckets],
                "predicted_comm_ms": [ms(b.seconds) for b in self.buckets],
                "predicted_exposed_ms": ms(max(self.exposed_seconds, 0.0)),
                "predicted_backward_ms": ms(self.backward_seconds), "link": self.link.name, "world": self.world}


def schedule(grads: list[Gradient], bounds: list[int], backward_seconds: float, world: int, link: Link) -> BucketPlan:
    """Time the buckets that end at `bounds` (indices of each bucket's last gradient, ascending)."""
    buckets, first, link_free = [], 0, 0.0
    for last in bounds:
        nbytes = sum(g.nbytes for g in grads[first:last + 1])
        issue = grads[last].ready
        start = max(issue, link_free)
        seconds = all_reduce_seconds(nbytes, world, link)
        link_free = start + seconds
        exposed = max(0.0, link_free - max(backward_seconds, start))
        buckets.append(Bucket(first, last, nbytes, issue, start, seconds, exposed))
        first = last + 1
    return BucketPlan(tuple(buckets), backward_seconds, link, world)


def fixed_bounds(grads: list[Gradient], bucket_bytes: int, first_bucket_bytes: int) -> list[int]:
    """Close a bucket once it holds `bucket_bytes` (the first one: `first_bucket_bytes`), as DDP does."""
    bounds, size, cap = [], 0, first_bucket_bytes
    for i, g in enumerate(grads):
        size += g.nbytes
        if size >= cap:
            bounds.append(i)
            size, cap = 0, bucket_bytes
    if grads and (not bounds or bounds[-1] != len(grads) - 1):
        bounds.append(len(grads) - 1)
    return bounds


def plan_buckets(grads: list[Gradient], backward_seconds: float, world: int, link: Link,
                 first_bucket_bytes: int) -> BucketPlan:
    """Bucket bounds that finish the last all-reduce earliest. The first bucket closes at
    `first_bucket_bytes` so communication starts early; after it, dynamic programming over where
    each bucket ends: finish(j) = min over i of max(finish(i), ready(j)) + allreduce(bytes i+1..j).
    Many small buckets pay the latency often, one big bucket starts late; this balances the two."""
    if not grads:
        return schedule(grads, [], backward_seconds, world, link)
    head = fixed_bounds(grads, 1 << 62, first_bucket_bytes)[0]
    n = len(grads)
    prefix = [0]
    for g in grads:
        prefix.append(prefix[-1] + g.nbytes)
    finish = {head: grads[head].ready + all_reduce_seconds(prefix[head + 1], world, link)}
    came_from = {head: None}
    for j in range(head + 1, n):
        best, arg = float("inf"), None
        for i in range(head, j):
            t = max(finish[i], grads[j].ready) + all_reduce_seconds(prefix[j + 1] - prefix[i + 1], world, link)
            if t < best:
                best, arg = t, i
        finish[j], came_from[j] = best, arg
    bounds, j = [], n - 1
    while j is not None:
        bounds.append(j)
        j = came_from[j]
    return schedule(grads, bounds[::-1], backward_seconds, world, link)


def no_overlap(grads: list[Gradient], backward_seconds: float, world: int, link: Link, bucket_bytes: int) -> BucketPlan:
    """All-reduce after the backward (every bucket issued when the backward ends): all of it exposed."""
    late = [Gradient(g.name, g.nbytes, backward_seconds) for g in grads]
    return schedule(late, fixed_bounds(late, bucket_bytes, bucket_bytes), backward_seconds, world, link)
