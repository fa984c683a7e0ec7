"""Benchmark: what picofx.profile costs the steps it does not trace, and whether the components of the
steps it traces add up to them.

    python tools/bench_doctor.py [--size tiny] [--batch 8] [--seq 128] [--backend eager] [--untraced 20]
                                 [--traced 3] [--json PATH]

Two copies of the same picofx step (the reference LLaMA at --size, AdamW), in one process:
  plain      no profiler
  profiled   inside picofx.profile, its phases wrapping the batches, forward_backward and the optimizer
             (as `picofx train --profile` does)
Their untraced steps are taken in turn (plain, profiled, plain, ...), --untraced before the traced
window and --untraced after it, so they share the machine's load alike; the first two of each copy
(compilation) are left out. The window (one warm-up step and --traced steps) runs alone, since the
profiler records every thread. Reported: each contender's median untraced step in wall-clock and in
CPU time (the process's: what the profiler would add, little moved by other processes on a shared
machine), and the median of the ratios of each profiled step to the plain step just before it
(target: <= 1.05x); for each
traced step the loop's own clock beside the sum of its measured components (target: within 5%),
with the components. The clock runs from the end of one `prof.step()` to the start of the next, as
the trace's step does (the last traced step's `prof.step()` writes the trace).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

import picofx
from picofx.diagnose.breakdown import COMPONENTS
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss
from results import write_json  # tools/results.py


class Contender:
    def __init__(self, args, seed: int):
        torch.manual_seed(seed)
        config = dataclasses.replace(CONFIGS[args.size], vocab_size=256)
        self.ids = torch.randint(0, 256, (args.batch, args.seq))
        self.model = picofx.optimize(Llama(config), {"input_ids": self.ids, "labels": self.ids}, passes=[],
                                     backend=args.backend, loss_fn=causal_lm_loss)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []  # each step's, prof.step() included
        self.cpu: list[float] = []  # each step's CPU time (the process's), prof.step() included
        self.between: list[float] = []  # from one prof.step() to the next: the range of a traced step

    def next(self) -> dict:
        return {"input_ids": self.ids, "labels": self.ids}

    def step(self, prof=None) -> None:
        started, cpu_started = time.perf_counter(), time.process_time()
        self.model.forward_backward(**self.next())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        computed = time.perf_counter()
        if prof is not None:
            prof.step()  # the last traced step's ends here, and its trace is written
        self.times.append(time.perf_counter() - started)
        self.cpu.append(time.process_time() - cpu_started)
        self.between.append(computed - started)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--backend", default="eager")
    p.add_argument("--untraced", type=int, default=20, help="untraced steps of each copy before the window and after")
    p.add_argument("--traced", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--threads", type=int, default=1, help="torch's threads (1: steady on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    plain, profiled = Contender(args, 0), Contender(args, 0)
    prof = picofx.profile(args.traced, wait=args.untraced, warmup=1, directory=tempfile.mkdtemp(prefix="picofx-"))
    with prof:
        for owner, method, phase in ((profiled, "next", "data"), (profiled.model, "forward_backward",
                                     "forward_backward"), (profiled.optimizer, "step", "optimizer")):
            prof.wrap(owner, method, phase)
        for _ in range(args.untraced):
            plain.step()
            profiled.step(prof)
        for _ in range(1 + args.traced):  # the warm-up and the traced steps, alone
            profiled.step(prof)
        window = profiled.between[-args.traced:]
        for _ in range(args.untraced):
            plain.step()
            profiled.step(prof)
    assert not torch.autograd.profiler._is_profiler_enabled  # off after its window
    def untraced(times: list[float]) -> list[float]:
        return times[2:args.untraced] + times[len(times) - args.untraced + 2:]
    rows = {}
    for clock, of in (("wall", lambda c: c.times), ("cpu", lambda c: c.cpu)):
        a, b = untraced(of(plain)), untraced(of(profiled))
        # each profiled step against the plain step just before it: the machine's load drifts less within a pair
        rows[clock] = {"plain_s": statistics.median(a), "profiled_s": statistics.median(b),
                       "paired_ratio": statistics.median(y / x for x, y in zip(a, b))}
    traced = []
    for clock, step in zip(window, prof.breakdowns):
        parts = sum(step.parts[k] for k in COMPONENTS)
        traced.append({"clock_s": clock, "components_s": parts, "difference": parts / clock - 1,
                       **{k: step.parts[k] for k in COMPONENTS}})
    print(f"{args.size}, batch {args.batch} x {args.seq}, backend {args.backend}, {torch.get_num_threads()} thread(s); "
          f"medians of {2 * (args.untraced - 2)} untraced steps each, taken in turn")
    print(f"{'clock':<6} {'plain ms':>9} {'profiled ms':>12} {'paired ratio':>13}")
    for clock, row in rows.items():
        print(f"{clock:<6} {1e3 * row['plain_s']:9.1f} {1e3 * row['profiled_s']:12.1f} {row['paired_ratio']:12.3f}x")
    print(f"\ntraced step  {'clock ms':>9} {'sum ms':>9} {'diff':>7}  " + "  ".join(f"{k:>12}" for k in COMPONENTS))
    for i, row in enumerate(traced):
        print(f"{i:<12} {1e3 * row['clock_s']:9.1f} {1e3 * row['components_s']:9.1f} {100 * row['difference']:6.2f}%  "
              + "  ".join(f"{1e3 * row[k]:12.2f}" for k in COMPONENTS))
    worst = max(abs(r["difference"]) for r in traced)
    print(f"\nuntraced steps under the profiler: {rows['wall']['paired_ratio']:.3f}x plain in wall time, "
          f"{rows['cpu']['paired_ratio']:.3f}x in CPU time (target <= 1.05x); components against the clock: at most "
          f"{100 * worst:.2f}% apart (target <= 5%)")
    result = {"config": vars(args), "untraced": rows, "traced": traced,
              "worst_difference": worst}
    write_json(result, args.json, "bench_doctor.json")
    return result


if __name__ == "__main__":
    main()
