"""Context parallelism: picofx `ContextParallel` (all-gather and ring) against every rank running the whole sequence.

    python tools/bench_cp.py [--world 2] [--size tiny] [--batch 1] [--seq 1024] [--steps 5] [--backend eager]
                             [--budget-seq 1024] [--max-seq 16384] [--bisect 2] [--json bench_cp.json]

Every rank trains the reference LLaMA on the same batch of whole sequences; one step is forward,
backward, AdamW step, zero_grad. Contenders, in interleaved rounds (one step of each per round),
medians, a step taking as long as its slowest rank:

  whole sequence          picofx.optimize with no pass: each rank computes every token (cp = 1)
  cp allgather            ContextParallel(): its part of every sequence, keys and values all-gathered
  cp allgather unbalanced ContextParallel(load_balance=False): chunk i of cp on rank i
  cp ring                 ContextParallel(method="ring"): key/value blocks passed around the ring

Columns: step (median ms), peak bytes per rank (`picofx.cost.memory.measure_peak` of a whole step:
parameters + the most it allocates), forward peak (the most the forward alone allocates, its loss
and what it saves kept alive) and stored activations (what the forward graph that runs keeps for
the backward and that depends on the batch). Target: stored activations and forward peak of cp
<= 0.6x the whole sequence's at --world 2. Exposed communication: the time a step spends in the
waits of the ring's transfers (and, for the all-gather, of its gathers), from torch.profiler.

Longest sequence at a fixed per-rank memory budget: the budget is one rank's peak (as above) when
it trains --budget-seq tokens alone; for cp = 1 (no pass), and cp = 2 and 4 with each method, the
longest sequence whose per-rank peak (the most any rank reaches) stays within it: doubled from
--budget-seq while it fits (up to --max-seq), then --bisect bisection steps in multiples of 2·cp.
Targets: allgather 1.8x (cp 2) and 3.4x (cp 4), ring 3.6x (cp 4) of cp = 1. The search is coarse
(each probe captures and runs a step; 4 ranks share this machine's cores). The CPU is shared:
read the ratios, not the milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import picofx
from picofx.cost.memory import measure_peak
from picofx.models.llama import CONFIGS, causal_lm_loss
from picofx.parallel import ParallelMesh
from picofx.parallel.launch import run_ranks
from picofx.passes import ContextParallel
from quiet_ranks import quiet_rank  # tools/quiet_ranks.py
from rank_model import interleaved_step_times, reference_model_and_batch  # tools/rank_model.py
from results import write_json  # tools/results.py

WHOLE, CP, UNBALANCED, RING = "whole sequence", "cp allgather", "cp allgather unbalanced", "cp ring"
TARGETS = {"stored": 0.6, "forward_peak": 0.6, "longest": {"allgather": {2: 1.8, 4: 3.4}, "ring": {4: 3.6}}}
CONTENDERS = ((WHOLE, []), (CP, [ContextParallel()]), (UNBALANCED, [ContextParallel(load_balance=False)]),
              (RING, [ContextParallel(method="ring")]))
WAITED = {CP: "all_gather_into_tensor", RING: "all_to_all_single"}  # whose waits are the method's transfers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks, all of them context parallel")
    p.add_argument("--size", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=1, help="every rank the same batch")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    p.add_argument("--budget-seq", type=int, default=1024, help="the budget: one rank's peak at this many tokens")
    p.add_argument("--max-seq", type=int, default=16384, help="the longest sequence the search tries")
    p.add_argument("--bisect", type=int, default=2, help="bisection steps after the doubling")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


class Contender:
    def __init__(self, opt, batch):
        self.opt, self.batch = opt, batch
        self.optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-3)

    def forward(self) -> torch.Tensor:
        return self.opt(**self.batch)

    def step(self) -> None:
        self.forward().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def stored_bytes(opt) -> int:
    """Bytes the forward graph that runs keeps for the backward that depend on the batch."""
    forward = opt.graphs["forward"]
    batch = {n for n in forward.graph.nodes if n.op == "placeholder" and not n.meta["val"].is_floating_point()}
    depends: dict = {}
    for node in forward.graph.nodes:
        depends[node] = node in batch or any(depends[a] for a in node.all_input_nodes)
    saved = {n for n in forward.graph.output_node().args[0][1:] if isinstance(n, torch.fx.Node)}
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in saved
               if depends[n] and isinstance(n.meta.get("val"), torch.Tensor))


def measure(rank: int, world: int, args) -> dict:
    quiet_rank()
    model_for, batch = reference_model_and_batch(args.size, args.batch, args.seq, 0)  # one batch for all ranks
    mesh = ParallelMesh.build(cp=world)
    runs = {name: Contender(picofx.optimize(model_for(), batch, passes, backend=args.backend, loss_fn=causal_lm_loss,
                                            mesh=mesh), batch)
            for name, passes in CONTENDERS}
    times = interleaved_step_times(runs, args.steps)
    exposed = {name: exposed_seconds(runs[name], WAITED[name], args.steps) for name in WAITED}
    peaks, forward_peaks = {}, {}
    for name, c in runs.items():
        dist.barrier()
        peaks[name] = measure_peak(c.step, resident=list(c.opt.parameters()))
        forward_peaks[name] = measure_peak(lambda: keep_alive(c.forward()))
    slowest = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"median_s": dict(zip(times, slowest.tolist())), "peak_bytes": peaks, "forward_peak_bytes": forward_peaks,
            "stored_bytes": {name: stored_bytes(c.opt) for name, c in runs.items()}, "exposed_s": exposed}


def exposed_seconds(contender: Contender, issued_by: str, steps: int) -> float:
    """Median over `steps` steps of the time this rank spends in the waits of `issued_by`'s
    collectives. The eager backend runs the forward and backward graphs node by node, so the step's
    n-th wait_tensor event is the graphs' n-th wait node, whose input names its collective."""
    waits = [n for role in ("forward", "backward") for n in contender.opt.graphs[role].graph.nodes
             if n.target is torch.ops._c10d_functional.wait_tensor.default]
    ours = [n.args[0].target.__name__.startswith(issued_by) for n in waits]
    per_step = []
    for _ in range(steps):
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            contender.step()
        events = [e for e in prof.events() if e.name == "_c10d_functional::wait_tensor"]
        if len(events) != len(waits):
            raise RuntimeError(f"{len(events)} waits ran, the graphs hold {len(waits)}: cannot match them")
        per_step.append(sum(e.cpu_time_total for e, mine in zip(events, ours) if mine) / 1e6)
    return statistics.median(per_step)


def step_peak(args, seq: int, passes, mesh) -> int:
    """The most any rank allocates in one training step of `seq` tokens (parameters included)."""
    model_for, batch = reference_model_and_batch(args.size, args.batch, seq, 0)
    contender = Contender(picofx.optimize(model_for(), batch, passes, backend=args.backend,
                                          loss_fn=causal_lm_loss, mesh=mesh), batch)
    peak = torch.tensor([float(measure_peak(contender.step, resident=list(contender.opt.parameters())))])
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def longest(args, budget: int, unit: int, passes, mesh) -> dict:
    """The longest multiple of `unit` tokens whose step peak fits `budget`: doubled from
    --budget-seq, then bisected --bisect times. Every rank decides alike (the peak is the max)."""
    probes, fits = {}, lambda seq: probes.setdefault(seq, step_peak(args, seq, passes, mesh)) <= budget
    good = args.budget_seq
    while not fits(good) and good > unit:
        good = max(unit, good // 2 // unit * unit)
    bad = None
    while bad is None:
        if 2 * good > args.max_seq:
            bad = 2 * good  # not tried: the search's ceiling
        elif fits(2 * good):
            good *= 2
        else:
            bad = 2 * good
    for _ in range(args.bisect):
        middle = (good + bad) // 2 // unit * unit
        if middle in (good, bad):
            break
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return {"longest": good, "probes": {str(k): v for k, v in sorted(probes.items())},
            "capped": good * 2 > args.max_seq and bad == 2 * good}


def search(rank: int, world: int, args, budget: int | None) -> dict:
    quiet_rank()
    start = time.perf_counter()
    if world == 1:
        budget = step_peak(args, args.budget_seq, [], None)
        found = {"one rank": longest(args, budget, 2, [], None)}
    else:
        mesh = ParallelMesh.build(cp=world)
        found = {method: longest(args, budget, 2 * world, [ContextParallel(method=method)], mesh)
                 for method in ("allgather", "ring")}
    return {"budget": budget, "found": found, "seconds": time.perf_counter() - start}


def longest_table(args) -> dict:
    one = run_ranks(search, 1, args, None, timeout=3600, collective_timeout=900)[0]
    budget, rows = one["budget"], {"cp 1": one["found"]["one rank"]}
    for cp in (2, 4):
        found = run_ranks(search, cp, args, budget, timeout=3600, collective_timeout=900)[0]["found"]
        rows.update({f"cp {cp} {method}": r for method, r in found.items()})
    base = rows["cp 1"]["longest"]
    print(f"\nlongest sequence at a per-rank budget of {budget / 2**20:.1f} MB (one rank's peak at {args.budget_seq} "
          f"tokens); doubling then {args.bisect} bisection steps, so within a factor "
          f"{1 + 2 ** -args.bisect:.2f} below")
    print(f"{'run':18s} {'longest':>8s} {'x cp 1':>7s} {'target':>7s}")
    for name, r in rows.items():
        cp, method = (int(name.split()[1]), name.split()[2] if len(name.split()) > 2 else None)
        target = TARGETS["longest"].get(method, {}).get(cp)
        r["ratio"] = r["longest"] / base
        print(f"{name:18s} {r['longest']:8d} {r['ratio']:7.2f} {'>= ' + str(target) if target else '':>7s}"
              f"{' (the search ceiling, --max-seq)' if r['capped'] else ''}")
    return {"budget_bytes": budget, "rows": rows}


def keep_alive(loss: torch.Tensor) -> None:
    """Nothing: `loss` and the autograd graph it holds stay alive until the measured call returns."""


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run_ranks(measure, args.world, args, timeout=3600, collective_timeout=900)[0]
    print(f"\n{args.world} gloo ranks on CPU ({args.backend}), Llama {args.size}, every rank {args.batch} x {args.seq} "
          f"tokens; medians of {args.steps} steps (forward, backward, AdamW)")
    print(f"{'contender':26s} {'step ms':>8s} {'peak MB':>8s} {'forward peak MB':>15s} {'stored MB':>9s}")
    rows = {}
    for name, seconds in result["median_s"].items():
        rows[name] = {"step_ms": seconds * 1e3, "peak_bytes": result["peak_bytes"][name],
                      "forward_peak_bytes": result["forward_peak_bytes"][name],
                      "stored_bytes": result["stored_bytes"][name]}
        r = rows[name]
        print(f"{name:26s} {r['step_ms']:8.1f} {r['peak_bytes'] / 2**20:8.1f} {r['forward_peak_bytes'] / 2**20:15.1f} "
              f"{r['stored_bytes'] / 2**20:9.1f}")
    whole = rows[WHOLE]
    ratios = {name: {"step": rows[name]["step_ms"] / whole["step_ms"],
                     "peak": rows[name]["peak_bytes"] / whole["peak_bytes"],
                     "forward_peak": rows[name]["forward_peak_bytes"] / whole["forward_peak_bytes"],
                     "stored": rows[name]["stored_bytes"] / whole["stored_bytes"]} for name in (CP, UNBALANCED, RING)}
    for name, r in ratios.items():
        print(f"{name} / whole sequence: step x{r['step']:.2f}, peak x{r['peak']:.2f}, forward peak "
              f"x{r['forward_peak']:.2f} (target <= {TARGETS['forward_peak']}), stored x{r['stored']:.2f} "
              f"(target <= {TARGETS['stored']})")
    for name, seconds in result["exposed_s"].items():
        print(f"{name}: exposed communication (waits of its transfers) {seconds * 1e3:.1f} ms a step, "
              f"{seconds * 1e3 / rows[name]['step_ms']:.0%} of the step")
    out = {"args": vars(args), "rows": rows, "ratios": ratios, "targets": TARGETS,
           "exposed_s": result["exposed_s"], "longest": longest_table(args)}
    write_json(out, args.json, "bench_cp.json")
    return out


if __name__ == "__main__":
    main()
