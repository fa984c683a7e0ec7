"""Context parallelism: picofx `ContextParallel` (all-gather) against every rank running the whole sequence.

    python tools/bench_cp.py [--world 2] [--size tiny] [--batch 1] [--seq 1024] [--steps 5] [--backend eager]
                             [--json bench_cp.json]

Every rank trains the reference LLaMA on the same batch of whole sequences; one step is forward,
backward, AdamW step, zero_grad. Contenders, in interleaved rounds (one step of each per round),
medians, a step taking as long as its slowest rank:

  whole sequence          picofx.optimize with no pass: each rank computes every token (cp = 1)
  cp allgather            ContextParallel(): its part of every sequence, keys and values all-gathered
  cp allgather unbalanced ContextParallel(load_balance=False): chunk i of cp on rank i

Columns: step (median ms), peak bytes per rank (`picofx.cost.memory.measure_peak` of a whole step:
parameters + the most it allocates), forward peak (the most the forward alone allocates, its loss
and what it saves kept alive) and stored activations (what the forward graph that runs keeps for
the backward and that depends on the batch). Target: stored activations and forward peak of cp
<= 0.6x the whole sequence's at --world 2. The CPU is shared: read the ratios, not the milliseconds.
"""
from __future__ import annotations

import argparse
import statistics

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

WHOLE, CP, UNBALANCED = "whole sequence", "cp allgather", "cp allgather unbalanced"
TARGETS = {"stored": 0.6, "forward_peak": 0.6}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks, all of them context parallel")
    p.add_argument("--size", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=1, help="every rank the same batch")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="eager", choices=["eager", "inductor"])
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
            for name, passes in ((WHOLE, []), (CP, [ContextParallel()]), (UNBALANCED, [ContextParallel(load_balance=False)]))}
    times = interleaved_step_times(runs, args.steps)
    peaks, forward_peaks = {}, {}
    for name, c in runs.items():
        dist.barrier()
        peaks[name] = measure_peak(c.step, resident=list(c.opt.parameters()))
        forward_peaks[name] = measure_peak(lambda: keep_alive(c.forward()))
    slowest = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"median_s": dict(zip(times, slowest.tolist())), "peak_bytes": peaks, "forward_peak_bytes": forward_peaks,
            "stored_bytes": {name: stored_bytes(c.opt) for name, c in runs.items()}}


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
                     "stored": rows[name]["stored_bytes"] / whole["stored_bytes"]} for name in (CP, UNBALANCED)}
    for name, r in ratios.items():
        print(f"{name} / whole sequence: step x{r['step']:.2f}, peak x{r['peak']:.2f}, forward peak "
              f"x{r['forward_peak']:.2f} (target <= {TARGETS['forward_peak']}), stored x{r['stored']:.2f} "
              f"(target <= {TARGETS['stored']})")
    out = {"args": vars(args), "rows": rows, "ratios": ratios, "targets": TARGETS}
    write_json(out, args.json, "bench_cp.json")
    return out


if __name__ == "__main__":
    main()
