"""Data-parallel step time and exposed communication: 2 gloo ranks on the CPU, side by side.

    python tools/bench_overlap.py [--size small] [--batch 2] [--seq 64] [--steps 10] [--compress KIND]
                                  [--json bench_overlap.json]

Each rank trains the same model on its own batch of the same shape. Contenders, measured in
interleaved rounds (one step of each per round, so a noisy neighbour hits all alike), medians:

  floor (eager) / floor (Inductor)       one rank's step with no communication (both ranks run it at once)
  DDP eager                              torch DistributedDataParallel, 25 MB buckets, autograd hooks
  DDP + torch.compile                    torch.compile(DDP(model)): DDPOptimizer splits the graph per bucket
  picofx, all-reduce after backward      picofx (Inductor) then one bucketed all-reduce once the backward ends
  picofx Overlap (eager / Inductor)      pass `overlap`: buckets all-reduced inside the backward graph
                                         (exchanged as --compress says: Overlap(compress=KIND))

Exposed communication = step - the floor of the same execution (eager or compiled). The CPU is
shared: run it on an idle machine, and read the ratios, not the milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from picofx.parallel.launch import run_ranks

import picofx
from picofx.models.llama import CONFIGS, causal_lm_loss
from picofx.passes import Overlap
from quiet_ranks import quiet_rank  # tools/quiet_ranks.py
from rank_model import reference_model_and_batch  # tools/rank_model.py
from results import write_json  # tools/results.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=2, help="per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bucket", default="auto")
    p.add_argument("--compress", metavar="KIND", help="Overlap(compress=KIND) for picofx's Overlap rows, e.g. "
                                                      "sparse_rows, bf16, int8, sparse_rows+int8 (default: none)")
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    return p.parse_args(argv)


def all_reduce_after_backward(model, world: int, bucket_bytes: int = 25 << 20):
    """The step's gradients all-reduced in buckets once the backward has finished (no overlap)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket, size = [], 0
    for g in [*grads, None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= bucket_bytes):
            flat = torch.cat([x.reshape(-1) for x in bucket])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for x in bucket:
                x.copy_(flat[offset:offset + x.numel()].view_as(x))
                offset += x.numel()
            bucket, size = [], 0


def contenders(model_for, batch, world: int, bucket, compress=None):
    """name -> (kind of floor, step function); each step runs forward and backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids, labels = batch["input_ids"], batch["labels"]
    out = {}
    plain = model_for()
    out["floor (eager)"] = ("eager", lambda m=plain: causal_lm_loss(m(ids), labels).backward())
    ddp = DDP(model_for())
    out["DDP eager"] = ("eager", lambda m=ddp: causal_lm_loss(m(ids), labels).backward())
    compiled = torch.compile(model_for())
    out["floor (torch.compile)"] = ("torch.compile", lambda m=compiled: causal_lm_loss(m(ids), labels).backward())
    ddp_compiled = torch.compile(DDP(model_for()))
    out["DDP + torch.compile"] = ("torch.compile", lambda m=ddp_compiled: causal_lm_loss(m(ids), labels).backward())
    base = model_for()
    inductor = picofx.optimize(base, batch, [], backend="inductor", loss_fn=causal_lm_loss)
    out["floor (picofx Inductor)"] = ("picofx Inductor", lambda: inductor.forward_backward(**batch))
    after = picofx.optimize(model_for(), batch, [], backend="inductor", loss_fn=causal_lm_loss)

    def after_step(opt=after):
        opt.forward_backward(**batch)
        all_reduce_after_backward(opt._model, world)

    out["picofx, all-reduce after backward"] = ("picofx Inductor", after_step)
    overlap_pass = Overlap(bucket=bucket, compress=compress)
    overlap_eager = picofx.optimize(model_for(), batch, [overlap_pass], backend="eager", loss_fn=causal_lm_loss)
    out["floor (picofx eager)"] = ("picofx eager", (lambda opt=picofx.optimize(model_for(), batch, [], backend="eager",
                                                                                loss_fn=causal_lm_loss):
                                                    opt.forward_backward(**batch)))
    out["picofx Overlap (eager)"] = ("picofx eager", lambda: overlap_eager.forward_backward(**batch))
    overlap = picofx.optimize(model_for(), batch, [overlap_pass], backend="inductor", loss_fn=causal_lm_loss)
    out["picofx Overlap + Inductor"] = ("picofx Inductor", lambda: overlap.forward_backward(**batch))
    return out, overlap.report


def measure(rank: int, world: int, args) -> dict:
    quiet_rank()
    model_for, batch = reference_model_and_batch(args.size, args.batch, args.seq, rank)
    steps, report = contenders(model_for, batch, world, args.bucket, args.compress)
    times = {name: [] for name in steps}
    for round_ in range(args.steps + 2):  # two warm-up rounds
        for name, (_, step) in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            if round_ >= 2:
                times[name].append(seconds)
    slowest = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    notes = next((r.notes for r in report.records if r.name == "overlap" and r.graph_role == "backward"), {})
    return {"median_s": dict(zip(times, slowest.tolist())), "floors": {n: k for n, (k, _) in steps.items()},
            "overlap_notes": {k: v for k, v in notes.items() if isinstance(v, (int, float, str, list))}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run_ranks(measure, 2, args, timeout=3600, collective_timeout=900)[0]
    kinds, medians = result["floors"], result["median_s"]
    floor = {kinds[n]: medians[n] for n in medians if n.startswith("floor")}
    rows = []
    print(f"\n2 gloo ranks on CPU, Llama {args.size}, per rank {args.batch} x {args.seq} tokens; medians of {args.steps} steps"
          + (f"; Overlap(compress={args.compress!r})" if args.compress else ""))
    print(f"{'contender':36s} {'step ms':>9s} {'floor ms':>9s} {'exposed comm ms':>16s}")
    for name, seconds in medians.items():
        base = floor[kinds[name]]
        exposed = None if name.startswith("floor") else seconds - base
        rows.append({"contender": name, "step_ms": seconds * 1e3, "floor_ms": base * 1e3,
                     "exposed_ms": None if exposed is None else exposed * 1e3})
        print(f"{name:36s} {seconds * 1e3:9.1f} {base * 1e3:9.1f} {'' if exposed is None else f'{exposed * 1e3:16.1f}'}")
    by = {r["contender"]: r for r in rows}
    ours, ddp = by["picofx Overlap + Inductor"], by["DDP + torch.compile"]
    ratios = {"exposed_vs_ddp_compile": ours["exposed_ms"] / ddp["exposed_ms"] if ddp["exposed_ms"] > 0 else None,
              "step_vs_ddp_compile": ours["step_ms"] / ddp["step_ms"]}
    print(f"\npicofx Overlap + Inductor vs DDP + torch.compile: exposed comm x{ratios['exposed_vs_ddp_compile']:.2f}, "
          f"step x{ratios['step_vs_ddp_compile']:.2f} (target: <= 0.7 and <= 1.0)")
    print(f"Overlap's plan: {result['overlap_notes']}")
    out = {"args": vars(args), "rows": rows, "ratios": ratios, "overlap_notes": result["overlap_notes"]}
    write_json(out, args.json, "bench_overlap.json")
    return out


if __name__ == "__main__":
    main()
