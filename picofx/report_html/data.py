"""Plain data for the page's charts, read from the graphs and layouts the passes left: the
predicted live bytes over the step, one rank's compute and communication over the step, and a
pipeline plan's stages run micro-batch by micro-batch."""
from __future__ import annotations

from torch import fx

from picofx.cost.balance import in_flight
from picofx.cost.comm import (all_gather_seconds, all_reduce_seconds, all_to_all_seconds, link_for,
                              reduce_scatter_seconds)
from picofx.cost.model import BACKWARD_PER_FORWARD, CostModel
from picofx.cost.liveness import tensor_values
from picofx.parallel.layouts import recorded

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
BACKWARD_SHARE = BACKWARD_PER_FORWARD / (1 + BACKWARD_PER_FORWARD)  # of a stage's forward + backward time


def collective_kind(node: fx.Node) -> str | None:
    """"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor", or None."""
    if node.op != "call_function":
        return None
    namespace, _, rest = str(node.target).partition(".")
    return rest.split(".")[0] if namespace in COLLECTIVE_NAMESPACES else None


def value_bytes(node) -> int:
    if not isinstance(node, fx.Node):
        return 0
    return sum(t.numel() * t.element_size() for t in tensor_values(node.meta.get("val")))


def collective_seconds(node: fx.Node, kind: str, world: int, link) -> float:
    if kind == "all_reduce":
        return all_reduce_seconds(value_bytes(node.args[0]), world, link)
    if kind.startswith("all_gather"):
        return all_gather_seconds(value_bytes(node), world, link)
    if kind.startswith("all_to_all"):
        return all_to_all_seconds(value_bytes(node.args[0]), world, link)
    return reduce_scatter_seconds(value_bytes(node.args[0]), world, link)


def layout_world(graphs: dict) -> int:
    """The most ranks any recorded layout of the step's graphs communicates over (1: none)."""
    worlds = [1]
    for gm in graphs.values():
        if isinstance(gm, fx.GraphModule):
            found = recorded(gm)
            worlds += [layout.world for layout in (found.buckets, found.shards, found.tensor_parallel) if layout]
    return max(worlds)


def memory_curve(graphs: dict, cost: CostModel | None = None) -> dict | None:
    """Predicted live bytes (resident included) at each node of the forward, then the backward,
    against predicted milliseconds; None without both graphs."""
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if not isinstance(forward, fx.GraphModule) or not isinstance(backward, fx.GraphModule):
        return None
    cost = cost or CostModel()
    lines = cost.timelines(forward, backward)
    memory = cost.step_memory(forward, backward, timelines=lines)
    points, clock = [(0.0, memory.resident + lines[0].input_bytes)], 0.0
    for line in lines:
        for node, live in zip(line.nodes, line.live):
            clock += cost.node_time(node) * 1e3
            points.append((clock, memory.resident + live))
        if line is lines[0]:
            backward_starts = clock
    return {"points": points, "backward_starts_ms": backward_starts, "resident": memory.resident,
            "peak": memory.peak, "peak_at": memory.backward_peak_at if memory.peak_phase == "backward"
            else memory.forward_peak_at, "peak_phase": memory.peak_phase}


def comm_timeline(graphs: dict, world: int | None = None, cost: CostModel | None = None) -> dict | None:
    """One rank's step over `world` ranks (else the ranks the graphs' layouts were made for) as the
    cost model predicts it: compute runs in graph order; a collective starts when issued and the link
    is free; a wait for one not yet finished stalls compute (exposed). Milliseconds. "payload_bytes":
    what the collectives carry per rank, sent or not (one rank sends nothing). None when the graphs
    have no collective."""
    steps = [(phase, n) for phase in ("forward", "backward") if isinstance(graphs.get(phase), fx.GraphModule)
             for n in graphs[phase].graph.nodes if n.op not in ("placeholder", "output")]
    collectives = [n for _, n in steps if collective_kind(n) not in (None, "wait_tensor")]
    if not collectives:
        return None
    cost = cost or CostModel()
    world = world or layout_world(graphs)
    link = link_for(cost.device, world)
    payload = sum(value_bytes(n if collective_kind(n).startswith("all_gather") else n.args[0]) for n in collectives)
    compute, comm, exposed = [], [], []
    clock = link_free = 0.0
    finishes: dict[fx.Node, float] = {}
    for phase, node in steps:
        kind = collective_kind(node)
        if kind == "wait_tensor":
            done = finishes.pop(node.args[0], clock)
            if done > clock:
                exposed.append((clock, done, f"waits for {node.args[0].name}"))
                clock = done
        elif kind:
            start = max(clock, link_free)
            link_free = finishes[node] = start + collective_seconds(node, kind, world, link) * 1e3
            comm.append((start, link_free, f"{kind.replace('_tensor', '').replace('_into', '')} {node.name}"))
        else:
            seconds = cost.node_time(node) * 1e3
            if compute and compute[-1][2] == phase and compute[-1][1] == clock:
                compute[-1] = (compute[-1][0], clock + seconds, phase)
            else:
                compute.append((clock, clock + seconds, phase))
            clock += seconds
    if finishes and max(finishes.values()) > clock:  # collectives no wait of these graphs covers
        exposed.append((clock, max(finishes.values()), "after the step's last op"))
    end = max([clock] + [e for _, e, _ in comm])
    return {"world": world, "link": link.name, "compute": compute, "comm": comm, "exposed": exposed,
            "step_ms": end, "exposed_ms": sum(e - s for s, e, _ in exposed),
            "comm_ms": sum(e - s for s, e, _ in comm), "collectives": len(collectives), "payload_bytes": payload}


def pipeline_schedule(layout) -> dict | None:
    """A PipelineLayout's plan run as a list schedule: each rank runs, whenever it is free, the
    first ready task (GPipe: forwards first; 1F1B and interleaved: backwards first, with no more
    micro-batches in flight than the schedule allows). Forward is 1/3 of a stage's time, backward 2/3."""
    plan = getattr(layout, "plan", None)
    if plan is None or not plan.stages:
        return None
    stages, m, ranks = plan.stages, plan.microbatches, layout.stages
    forwards_first = plan.schedule.lower().startswith("gpipe")
    done: dict[tuple, float] = {}
    free = [0.0] * ranks
    bars: list[list] = [[] for _ in range(ranks)]
    started = [0] * ranks
    todo = {(kind, s.index, mb) for s in stages for mb in range(m) for kind in "FB"}
    last = len(stages) - 1
    capped = not forwards_first
    while todo:
        choices = []
        for kind, k, mb in todo:
            rank = stages[k].rank
            before = [("F", k - 1, mb)] if kind == "F" and k > 0 else \
                [("F", k, mb)] + ([("B", k + 1, mb)] if k < last else []) if kind == "B" else []
            if any(b not in done for b in before):
                continue
            if kind == "F" and capped and k == min(s.index for s in stages if s.rank == rank) and \
                    started[rank] - sum(1 for (kk, kx, _) in done if kk == "B" and kx == k) >= \
                    in_flight(plan.schedule, rank, ranks, m, layout.virtual):
                continue
            ready = max([free[rank]] + [done[b] for b in before])
            order = (0 if (kind == "F") == forwards_first else 1, mb, -k if kind == "B" else k)
            choices.append((ready, order, kind, k, mb, rank))
        if not choices:  # the in-flight cap holds every rank back: run the rest uncapped
            capped = False
            continue
        ready, _, kind, k, mb, rank = min(choices)
        seconds = stages[k].time * 1e3 * (BACKWARD_SHARE if kind == "B" else 1 - BACKWARD_SHARE)
        done[(kind, k, mb)] = free[rank] = ready + seconds
        if kind == "F" and k == min(s.index for s in stages if s.rank == rank):
            started[rank] += 1
        bars[rank].append((ready, ready + seconds, kind, mb, k))
        todo.discard((kind, k, mb))
    end = max(free)
    busy = sum(e - s for row in bars for s, e, *_ in row)
    return {"schedule": plan.schedule, "microbatches": m, "ranks": ranks, "virtual": layout.virtual,
            "rows": [sorted(row) for row in bars], "step_ms": end, "bubble": 1 - busy / (end * ranks),
            "predicted_bubble": plan.bubble}
