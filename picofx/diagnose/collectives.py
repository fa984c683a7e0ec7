"""The collectives a trace shows running, and the link rates they imply.

On a CPU, gloo runs each collective on a worker thread of its process group; torch records that
work as a `gloo:<op>` range on the worker thread, from when the worker takes it up to its
completion (NCCL's work shows as `nccl:<op>` the same way). The issuing thread shows only the
enqueue (`c10d::allreduce_`, a few microseconds) and, for a blocking call or `Work.wait()`, nothing
at all while it waits. These ranges are the collectives' time in flight that the breakdown uses
(picofx.diagnose.breakdown), and with `record_shapes` their sizes, from which `link_rates` fits
the link's bandwidth and latency (`picofx train --profile N --calibrate`).

gloo reduce-scatters by all-reducing the whole input (its range is `gloo:all_reduce`): the rates are
fitted per kind of work that ran, which is what the link carried. A range does not name its process
group, but each gloo group has worker threads of its own: a collective keeps the thread it ran on, and
picofx.diagnose.groups names the threads' groups (the mesh dimension each collective ran over).
"""
from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass

WORKER_PREFIXES = ("gloo:", "nccl:")  # a backend's range for one collective's work, issue to completion
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
                 "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1,
                 "c10::Float8_e5m2": 1}
SMALL_BYTES = 64 * 2**10  # a collective below this is timed by its latency, one above by its bandwidth


def is_worker_range(name: str) -> bool:
    return name.startswith(WORKER_PREFIXES)


@dataclass(frozen=True)
class Collective:
    """One collective's work as the trace shows it: its kind ("all_reduce", "all_gather", ...),
    the bytes of its input (None where the trace has no shapes), its seconds in flight, the worker
    thread it ran on and, once known, the mesh dimension of its process group."""

    kind: str
    nbytes: int | None
    seconds: float
    thread: int | None = None
    group: str | None = None


def collectives_of_trace(path: str | pathlib.Path) -> list[Collective]:
    """The worker ranges of a Chrome trace file written by torch.profiler, in the order they started."""
    events = json.loads(pathlib.Path(path).read_text()).get("traceEvents", [])
    ranges = sorted((e for e in events if e.get("ph") == "X" and is_worker_range(str(e.get("name", "")))),
                    key=lambda e: e.get("ts", 0))
    return [Collective(e["name"].split(":", 1)[1], nbytes_of(e.get("args", {})), e.get("dur", 0.0) / 1e6, e.get("tid"))
            for e in ranges]


def nbytes_of(args: dict) -> int | None:
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or types[0] not in ELEMENT_BYTES:
        return None
    count = 1
    for size in dims[0]:
        count *= size
    return count * ELEMENT_BYTES[types[0]]


def fastest_of_ranks(per_rank: list[list[Collective]]) -> list[Collective]:
    """Each collective at its shortest over the ranks: a rank that arrived early waited in it for the
    others, the last to arrive timed the transfer alone. Ranks whose lists differ (other groups,
    other collectives) are left out; the first rank's list is the reference."""
    reference = per_rank[0] if per_rank else []
    same = [r for r in per_rank if [(c.kind, c.nbytes) for c in r] == [(c.kind, c.nbytes) for c in reference]]
    return [min((r[i] for r in same), key=lambda c: c.seconds) for i in range(len(reference))]


RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
              "broadcast": lambda n: n - 1, "all_to_all": lambda n: n - 1}
# the bytes a ring's collective over n ranks sends per rank, from its traced input's: an all-gather's
# input is one rank's piece (picofx.cost.comm times the gathered whole, n pieces); the others' the whole
WIRE_BYTES = {"all_reduce": lambda nbytes, n: 2 * (n - 1) / n * nbytes,
              "all_gather": lambda nbytes, n: (n - 1) * nbytes}
MIN_LARGE = 2  # collectives of SMALL_BYTES or more a bandwidth is fitted from (one alone: no fit)


def wire_bytes(collective: Collective, ranks: int) -> float:
    return WIRE_BYTES.get(collective.kind, lambda nbytes, n: (n - 1) / n * nbytes)(collective.nbytes, ranks)


def ring_fit(samples: list[tuple[Collective, int]]) -> dict:
    """One link's rates from ring collectives, each with the ranks of its group (groups of several
    sizes, and kinds, may be pooled: the rings picofx.cost.comm times all see the same link): the
    latency of a ring step (the median of the small collectives' seconds per step) and the bandwidth
    (the large ones' bytes on the wire over their seconds less their steps' latency; None below
    MIN_LARGE of them), with how many of each were timed. No small collective: a latency of 0 (the
    bandwidth then carries the whole time)."""
    timed = [(c, n) for c, n in samples if c.kind in RING_STEPS and c.nbytes is not None and c.seconds > 0 and n > 1]
    small = [c.seconds / RING_STEPS[c.kind](n) for c, n in timed if c.nbytes < SMALL_BYTES]
    latency = statistics.median(small) if small else 0.0
    large = [(c, n) for c, n in timed if c.nbytes >= SMALL_BYTES]
    wire = sum(wire_bytes(c, n) for c, n in large)
    moving = sum(max(c.seconds - RING_STEPS[c.kind](n) * latency, 1e-9) for c, n in large)
    return {"latency_s": latency, "bandwidth": wire / moving if len(large) >= MIN_LARGE else None,
            "small": len(small), "large": len(large), "kinds": sorted({c.kind for c, _ in timed}),
            "wire_bytes": wire, "ring_steps": sum(RING_STEPS[c.kind](n) for c, n in timed)}


def combined(links: list[dict]) -> dict:
    """One link standing for several fitted ones (mesh dimensions whose groups share a level): the
    bandwidth that moves all their large collectives' bytes in the time their own links take, the
    latency that gives all their collectives' ring steps the time their own do."""
    wire, steps = sum(f["wire_bytes"] for f in links), sum(f["ring_steps"] for f in links)
    return {"latency_s": sum(f["ring_steps"] * f["latency_s"] for f in links) / steps if steps else 0.0,
            "bandwidth": wire / sum(f["wire_bytes"] / f["bandwidth"] for f in links),
            "small": sum(f["small"] for f in links), "large": sum(f["large"] for f in links),
            "kinds": sorted({k for f in links for k in f["kinds"]}), "wire_bytes": wire, "ring_steps": steps}


def link_rates(collectives: list[Collective], ranks: int) -> dict[str, dict]:
    """Per kind of ring collective over `ranks` ranks: ring_fit's rates and the ranks."""
    rates = {}
    for kind in RING_STEPS:
        fit = ring_fit([(c, ranks) for c in collectives if c.kind == kind])
        if fit["small"] + fit["large"]:
            rates[kind] = {**{k: fit[k] for k in ("latency_s", "bandwidth", "small", "large")}, "ranks": ranks}
    return rates
