"""Benchmark: pipeline stages on 2 CPU ranks for a LLaMA whose vocabulary makes equal layers unbalanced.

    python tools/bench_pipeline.py [--steps 7] [--layers 4] [--vocab 16384] [--json results.json]

The default model's vocabulary is 64 x its hidden size (Llama 3: 128256 / 4096 = 31): the final
projection and loss cost about as much as three of its four decoder layers, and an equal-layer
split puts them all on the last stage.

One command launches 2 gloo ranks (one thread each) and runs, side by side, 1F1B with
--microbatches micro-batches of the same model and batch:
  torch equal layers   torch.distributed.pipelining on the model's own modules, split by hand at
                       half the decoder layers (embedding with the first, norm, projection and loss
                       with the last): the seed framework's way
  picofx layers        picofx.optimize(..., [Pipeline(balance="layers", measure=True)], backend="eager")
  picofx cost          picofx.optimize(..., [Pipeline(balance="cost")], backend="eager"): cut where the
                       calibrated cost model's predicted unit times balance best
  picofx cost measured the same with measure=True: cut where the units' times, measured by running
                       one micro-batch on rank 0 (picofx.runtime.unit_clock), balance best
Step time: median of --steps steps (after one warm-up), taken round-robin across contenders,
each between barriers, as rank 0 sees it; and the step the measured stage times give by the
schedule's formula (M x slowest + the others once): on a machine whose cores other work
shares, ranks do not run side by side, and the measured step follows the total work more than
the slowest stage. Per stage, ms per micro-batch: the plan's prediction (the measured units it
holds, and the link's share), the calibrated cost model's prediction from the compiled graphs
(picofx.cost.device.calibrate: roofline, no measurement of the model), and the stage measured
alone, forward + backward of one micro-batch (PipelineStep.measure_stages), best and median of
--stage-repeats, the ranks taking turns.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from results import result_path  # tools/results.py

PICOFX = {"picofx layers": ("layers", True), "picofx cost": ("cost", False), "picofx cost measured": ("cost", True)}
# A 2048^3 matmul runs ~0.3 s, as long as a stage: its best of 5 sees the same share of a shared
# core as the stages' best of 7 (a short one catches moments when the core is free).
CALIBRATION_MATMUL = 2048


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--json", help="where to write the results (default: a new temporary directory, printed)")
    p.add_argument("--stage-repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class HandStage(nn.Module):
    """A contiguous run of the reference LLaMA's modules, as the seed framework splits it."""

    def __init__(self, model, layers: range, first: bool, last: bool):
        super().__init__()
        self.model, self.layers, self.first, self.last = model, layers, first, last

    def forward(self, x):
        if self.first:
            x = self.model.embedding(x)
        for i in self.layers:
            x = self.model.decoder_layers[i](x, self.model.cos, self.model.sin)
        return self.model.final_proj(self.model.final_norm(x)) if self.last else x


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import picofx
    from picofx.cost.device import calibrate, cpu
    from picofx.cost.model import CostModel
    from picofx.models.llama import CONFIGS, Llama, causal_lm_loss
    from picofx.models.zoo import token_batch
    from picofx.passes import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    rank = args.rank
    # One description for every rank, so that all cut the model at the same places.
    shared = [calibrate(cpu(1), group=dist.group.WORLD, matmul_size=CALIBRATION_MATMUL)]
    dist.broadcast_object_list(shared, src=0)
    device = shared[0]
    config = CONFIGS["small"].__class__(**{**CONFIGS["small"].__dict__, "vocab_size": args.vocab,
                                           "hidden_size": args.hidden, "num_hidden_layers": args.layers})
    ids = token_batch(args.vocab, args.batch, args.seq + 1, seed=0)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    def fresh_model():
        torch.manual_seed(0)
        return Llama(config)

    contenders = {}
    hand_model = fresh_model()
    half = args.layers // 2
    stage_module = HandStage(hand_model, range(half) if rank == 0 else range(half, args.layers), rank == 0, rank == 1)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=causal_lm_loss)

    def hand_step():
        if rank == 0:
            schedule.step(batch["input_ids"])
        else:
            schedule.step(target=batch["labels"])
    contenders["torch equal layers"] = (hand_step, hand_model)

    opts = {}
    for name, (balance, measure) in PICOFX.items():
        model = fresh_model()
        opt = picofx.optimize(model, batch, passes=[Pipeline(stages=2, schedule="1F1B", microbatches=args.microbatches,
                                                             balance=balance, measure=measure)],
                              backend="eager", loss_fn=causal_lm_loss, cost_model=CostModel(device))
        opts[name] = opt
        contenders[name] = (lambda opt=opt: opt.forward_backward(**batch), model)

    samples = {name: [] for name in contenders}
    for step in range(args.steps + 1):
        for name, (fn, model) in contenders.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if step > 0:
                samples[name].append(time.perf_counter() - start)

    mine = {"rank": rank, "step_ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()}, "stages": {}}
    # Each stage measured alone: the ranks take turns (the other waits at a barrier), the
    # contenders round-robin, best and median of --stage-repeats; calibrated just before.
    def hand_stage():
        x = batch["input_ids"][: args.batch // args.microbatches] if rank == 0 else \
            torch.randn(args.batch // args.microbatches, args.seq, args.hidden, requires_grad=True)
        out = stage_module(x)
        (causal_lm_loss(out, batch["labels"][: x.shape[0]]) if rank == 1 else out.sum()).backward()

    stage_runs = {"torch equal layers": hand_stage}
    stage_runs.update({name: (lambda opt=opt: opt.pipeline.measure_stages(repeats=1)) for name, opt in opts.items()})
    stage_samples = {name: [] for name in stage_runs}
    local = None
    for turn in range(2):
        dist.barrier()
        if turn != rank:
            continue
        local = CostModel(calibrate(cpu(1), matmul_size=CALIBRATION_MATMUL))  # this rank, under the load its stages see
        for _ in range(args.stage_repeats):
            for name, run in stage_runs.items():
                start = time.perf_counter()
                result = run()
                seconds = time.perf_counter() - start
                stage_samples[name].append(min(result[rank]) if isinstance(result, dict) else seconds)
    dist.barrier()
    for name, opt in opts.items():
        pipe = opt.pipeline
        plan = pipe.layout.plan
        stage = plan.stages[rank]
        mine["stages"][name] = {
            "stage": rank, "from": pipe.layout.units[stage.units.start].label,
            "plan_ms": stage.time * 1e3, "plan_compute_ms": stage.compute * 1e3,
            "plan_comm_ms": stage.communication * 1e3,
            "predicted_ms": pipe.predict_stages(local)[rank] * 1e3,
            "predicted_step_ms": plan.step_time * 1e3, "predicted_bubble": plan.bubble, "table": pipe.layout.table()}
    for name, samples in stage_samples.items():
        mine["stages"].setdefault(name, {"stage": rank}).update(
            measured_best_ms=1e3 * min(samples), measured_median_ms=1e3 * statistics.median(samples))
    mine["device"] = {"name": device.name, "fp32_gflops": device.peak_flops[torch.float32] / 1e9,
                      "bandwidth_gbs": device.memory_bandwidth / 1e9, "link_gbs": device.link_bandwidth / 1e9}
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(args.json).write_text(json.dumps({"config": vars(args), "ranks": gathered}, indent=1))
    dist.destroy_process_group()


def report(path: str) -> None:
    data = json.loads(Path(path).read_text())
    ranks = data["ranks"]
    steps = ranks[0]["step_ms"]
    base = steps["torch equal layers"]
    print(f"2 CPU ranks, 1F1B, {data['config']['microbatches']} micro-batches; cost model on "
          f"{ranks[0]['device']['name']} ({ranks[0]['device']['fp32_gflops']:.0f} GFLOP/s fp32)")
    print(f"{'contender':20s} {'step ms':>9s} {'vs torch':>9s} {'from stages':>11s} {'vs torch':>9s} "
          f"{'pred step':>9s} {'bubble':>7s}   per stage, ms per "
          "micro-batch: from / plan (compute+comm) / predicted from compiled graphs / measured best, median")
    microbatches = data["config"]["microbatches"]

    def from_stages(name):
        times = [r["stages"][name]["measured_median_ms"] for r in ranks]
        return microbatches * max(times) + sum(times) - max(times)

    for name, ms in steps.items():
        stages = [r["stages"][name] for r in ranks]
        pred = stages[0].get("predicted_step_ms")
        cells = []
        for s in stages:
            measured = f"{s['measured_best_ms']:.1f}, {s['measured_median_ms']:.1f}"
            cells.append(f"{s['from'][:22]} / {s['plan_compute_ms']:.1f}+{s['plan_comm_ms']:.1f} / "
                         f"{s['predicted_ms']:.1f} / {measured}" if "from" in s else f"- / - / - / {measured}")
        print(f"{name:20s} {ms:9.1f} {ms / base:9.2f} {from_stages(name):11.1f} "
              f"{from_stages(name) / from_stages('torch equal layers'):9.2f} {'-' if pred is None else f'{pred:.1f}':>9s} "
              f"{'-' if pred is None else format(stages[0]['predicted_bubble'], '.1%'):>7s}   " + " | ".join(cells))
    print(f"\npicofx cost measured plan (rank 0):\n{ranks[0]['stages']['picofx cost measured']['table']}")
    print("\nper-stage prediction / measured median - 1, stage 0, stage 1 (target: within 20%):")
    for name, (_, measure) in PICOFX.items():
        errors = [r["stages"][name]["plan_ms"] / r["stages"][name]["measured_median_ms"] - 1 for r in ranks]
        graphs = [r["stages"][name]["predicted_ms"] / r["stages"][name]["measured_median_ms"] - 1 for r in ranks]
        print(f"  {name:21s} plan ({'measured units' if measure else 'cost model'}) "
              f"{', '.join(f'{e:+.0%}' for e in errors):12s}  cost model on the compiled graphs "
              f"{', '.join(f'{e:+.0%}' for e in graphs)}")
    for name in ("picofx cost", "picofx cost measured"):
        print(f"{name} / torch equal layers: step {steps[name] / base:.2f}, from measured stages "
              f"{from_stages(name) / from_stages('torch equal layers'):.2f} (target <= 0.85)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rank is not None:
        return worker(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.json = str(result_path(args.json, "bench_pipeline.json"))  # the ranks write it, this process reads it
    passthrough = [*(argv if argv is not None else sys.argv[1:]), "--json", args.json]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, *passthrough, "--rank", str(r), "--port", str(port)], env=env)
             for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        sys.exit(f"a rank failed (exit codes {[p.returncode for p in procs]})")
    report(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
