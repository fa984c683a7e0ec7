"""`picofx plan --measure`: run the top plans for a few steps on this machine's ranks (gloo) and time them.

Each plan becomes picofx's passes on a ParallelMesh of its layout (tensor_parallel, fuse, pipeline,
shard or overlap), trains the model with AdamW on random tokens for a few steps (backend eager;
gradient accumulation over the micro-batches where there is no pipeline), and reports the median
step of its slowest rank.

The device the predictions are made for is calibrated here, in one single-threaded rank as each
measured rank runs: matmul rate and memory bandwidth (`calibrate`), the eager step's cost per
graph op (the model's own step at sizes where compute is negligible: dispatch, autograd, the
runtime's wrappers), AdamW's cost per parameter tensor and a DTensor parameter's extra
(`calibrate_parameters`), each the best of its repeats; among all the ranks, the gloo link
(`calibrate_link`) and the share of a core each rank gets while all compute (`cpu_share`: cores /
ranks on an idle machine, less where other processes run). Rates are multiplied by that share,
per-op and per-tensor costs divided by it.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from picofx.cost.device import Device, calibrate, calibrate_parameters, cpu
from picofx.parallel.mesh import resolve_dim
from picofx.parallel.launch import run_ranks

TIMEOUT_S = 900


def measurable(layout) -> str | None:
    """Why this plan cannot be run here (None: it can)."""
    if layout.checkpoint:
        return "checkpointing to a budget is not part of the measured passes"
    return None


def shared(device: Device, world: int, cores: int | None = None, share: float | None = None) -> Device:
    """`device` (one rank's, on a core of its own) as each of `world` ranks sees it when they share
    `cores`: compute and memory rates times the share of a core each rank gets, per-op and
    per-tensor costs divided by it. `share`: as measured (`cpu_share`, other processes included);
    None: cores / world, at most 1."""
    cores = cores or os.cpu_count() or 1
    share = min(1.0, cores / world) if share is None else min(1.0, share)
    return dataclasses.replace(at_share(device, share), name=f"{device.name}, {world} ranks on {cores} cores")


def at_share(device: Device, share: float) -> Device:
    """`device` with `share` of a core (instead of its `cpu_share`): rates scaled by the ratio, per-op
    and per-tensor costs by its inverse."""
    ratio = share / device.cpu_share
    return dataclasses.replace(device, peak_flops={k: v * ratio for k, v in device.peak_flops.items()},
                               memory_bandwidth=device.memory_bandwidth * ratio,
                               op_overhead=device.op_overhead / ratio,
                               optimizer_tensor_overhead=device.optimizer_tensor_overhead / ratio,
                               dtensor_parameter_overhead=device.dtensor_parameter_overhead / ratio,
                               cpu_share=share)


def cpu_share(seconds: float = 1.0) -> float:
    """The share of a core this process gets while it computes for `seconds` of wall time (its CPU
    time over the wall time): 1 on a core of its own, less where ranks or other processes share it."""
    x = torch.ones(256)
    wall, cpu_time = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        for _ in range(100):
            x.mul_(1.0)
    return (time.process_time() - cpu_time) / (time.perf_counter() - wall)


def shrunk(config):
    """`config` at sizes where the step's compute is negligible against its dispatch: two
    dimensions per head, 8 intermediate, 16 tokens of vocabulary (heads and layers kept)."""
    return dataclasses.replace(config, hidden_size=2 * config.num_attention_heads, intermediate_size=8,
                               vocab_size=16)


def eager_op_overhead(config, layers: int = 2, seq: int = 4, repeats: int = 10) -> float:
    """Seconds per graph op (the ops the planner counts) of picofx's eager training step (fuse) on
    this thread: the best forward + backward of `config` shrunk, over its ops."""
    from picofx.optimize import optimize  # not the package: picofx.plan(...) reaches this module
    from picofx.examples.llama import Llama, causal_lm_loss
    from picofx.planner.costs import count_ops
    from picofx.planner.models import with_layers

    torch.manual_seed(0)
    small = shrunk(config)
    model = Llama(with_layers(small, layers, seq))
    ids = torch.randint(0, small.vocab_size, (1, seq + 1))
    inputs = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    opt = optimize(model, inputs, ["fuse"], backend="eager", loss_fn=causal_lm_loss)
    ops = count_ops(opt.graphs["forward"]) + count_ops(opt.graphs["backward"])
    for _ in range(2):
        opt.forward_backward(**inputs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        opt.forward_backward(**inputs)
        best = min(best, time.perf_counter() - start)
    return best / ops


def one_rank_device(rank: int, world: int, config) -> Device:
    """On one single-threaded rank of its own group: this CPU as one rank sees it (see the module),
    its matmul rate at the model's hidden size (at most 1024), as the step's matmuls run."""
    size = max(64, min(1024, config.hidden_size))
    ranks = resolve_dim(None, None, "dp_shard", "picofx plan --measure").as_device_mesh("cpu")
    device = calibrate_parameters(calibrate(cpu(1), matmul_size=size), mesh=ranks)
    return dataclasses.replace(device, op_overhead=eager_op_overhead(config))


def calibrated_device(config, world: int, link: dict | None = None, say=print) -> Device:
    """This machine's CPU as `world` single-threaded gloo ranks of `config`'s step see it. `link`:
    the ranks' link rates (picofx.cost.device.calibrate_link) and, optionally, `cpu_share`; None:
    both measured on `world` gloo ranks."""
    one = run_ranks(one_rank_device, 1, config, timeout=300, collective_timeout=120)[0]
    link = dict(link or run_ranks(link_rates, world, timeout=300, collective_timeout=120)[0])
    share = link.pop("cpu_share", None)
    device = dataclasses.replace(shared(one, world, share=share), **link)
    say(f"calibrated: one rank (a core of its own): matmul {one.peak_flops[torch.float32] / 1e9:.0f} GFLOP/s, copy "
        f"{one.memory_bandwidth / 1e9:.0f} GB/s, {one.op_overhead * 1e6:.0f} us per eager graph op, AdamW "
        f"{one.optimizer_tensor_overhead * 1e6:.0f} us per tensor, a DTensor parameter +"
        f"{one.dtensor_parameter_overhead * 1e6:.0f} us; {world} ranks get {device.cpu_share:.2f} core each; gloo "
        f"between "
        f"{world} ranks: {link['link_bandwidth'] / 1e9:.2f} GB/s, {link['link_latency'] * 1e6:.0f} us per ring step")
    return device


def busy_latency(world: int, iterations: int = 20) -> float:
    """Seconds per ring step of a small all-reduce issued between bursts of computing (about 1 ms of
    small ops), as a training step issues them: the peers and gloo's threads must be scheduled back
    in, and the all-reduce waits for the rank the scheduler held longest. Every rank calls it."""
    import torch.distributed as dist

    x, work = torch.zeros(1), torch.ones(256)

    def burst():
        for _ in range(200):
            work.mul_(1.0)

    seconds = []
    for communicate in (False, True):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            burst()
            if communicate:
                dist.all_reduce(x)
        seconds.append(time.perf_counter() - start)
    cost = torch.tensor([max(0.0, seconds[1] - seconds[0]) / iterations], dtype=torch.float64)
    dist.all_reduce(cost, op=dist.ReduceOp.MAX)
    return cost.item() / (2 * (world - 1))


def link_rates(rank: int, world: int) -> dict:
    """On one rank: the gloo link's bandwidth and latency among the `world` ranks (all of them; the
    latency the larger of a tight loop's and `busy_latency`), and `cpu_share`, the share of a core
    each rank gets while all of them compute (their mean)."""
    import torch.distributed as dist

    from picofx.cost.device import calibrate_link

    link = calibrate_link(None)
    latency = max(link["link_latency"], busy_latency(world))
    share = torch.tensor([cpu_share()], dtype=torch.float64)
    dist.all_reduce(share)
    return {**link, "link_latency": latency, "network_latency": latency, "cpu_share": share.item() / world}


def measured_passes(layout) -> list:
    """The passes of `layout`, in train_llama.py's order: under a pipeline the cut comes first and
    tensor_parallel splits each stage's graph."""
    from picofx.manager import PASSES  # the passes by their registered names (the core imports no pass)

    tp = [PASSES["tensor_parallel"](sequence_parallel=layout.sequence_parallel)] if layout.tp > 1 else []
    pipeline = [PASSES["pipeline"](stages=layout.pp, microbatches=layout.microbatches)] if layout.pp > 1 else []
    data = ["shard" if layout.shard else "overlap"] if layout.dp > 1 else []
    return [*pipeline, *tp, "fuse", *data] if tp else ["fuse", *pipeline, *data]


def passes_and_mesh(layout):
    from picofx.parallel import ParallelMesh

    return measured_passes(layout), ParallelMesh.build(pp=layout.pp, tp=layout.tp,
                                                       dp_shard=layout.dp if layout.shard else 1,
                                                       dp_replicate=1 if layout.shard else layout.dp)


def step_seconds(rank: int, world: int, layout, config, seq: int, global_batch: int, steps: int) -> tuple:
    """On one rank: the seconds of each of `steps` training steps (after two warm-ups: the first
    compiles, the second the gradient-accumulation variants), and the share of a core each rank got
    just before them (`cpu_share`, all ranks computing)."""
    from picofx.optimize import optimize  # not the package: picofx.plan(...) reaches this module
    from picofx.examples.llama import Llama, causal_lm_loss

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(config, max_position_embeddings=max(seq, 8)))
    passes, mesh = passes_and_mesh(layout)
    replica_batch = global_batch // layout.dp
    micro = replica_batch if layout.pp > 1 else replica_batch // layout.microbatches
    ids = torch.randint(0, config.vocab_size, (micro, seq + 1), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    opt = optimize(model, batch, passes, backend="eager", loss_fn=causal_lm_loss, mesh=mesh)
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-4)
    share = torch.tensor([cpu_share()], dtype=torch.float64)  # what other processes leave the ranks now
    torch.distributed.all_reduce(share)
    accumulate = 1 if layout.pp > 1 else layout.microbatches
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        for k in range(accumulate):
            if k < accumulate - 1 and layout.dp > 1:
                with opt.no_sync():
                    opt.forward_backward(**batch)
            else:
                opt.forward_backward(**batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[2:], share.item() / world


def measure(predictions: list, run, top: int, steps: int = 8) -> list:
    """Fill `measured_step_s` of the first `top` plans that fit and can run here (the median step of
    the slowest rank); returns them. On a calibrated CPU, whose share other processes change between
    the calibration and a plan's run, the plan is predicted again at the share measured just before
    its steps (the ranking stays the calibration's)."""
    from picofx.planner.layouts import predict

    chosen = [p for p in predictions if p.fits and measurable(p.layout) is None][:top]
    for p in chosen:
        out = run_ranks(step_seconds, run.gpus, p.layout, run.costs.config, run.costs.seq, run.global_batch,
                        steps, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S / 2)
        slowest = [max(ranks) for ranks in zip(*(times for times, _ in out))]
        p.measured_step_s = statistics.median(slowest)
        share, note = out[0][1], ""
        if run.device.source == "measured" and run.device.cpu_share < 1:
            again = predict(dataclasses.replace(run, device=at_share(run.device, share)), p.layout)
            note = f"; {share:.2f} core per rank then: predicted {p.step_s:.4f} -> {again.step_s:.4f} s"
            p.step_s, p.time, p.tokens_per_s, p.mfu = again.step_s, again.time, again.tokens_per_s, again.mfu
        print(f"measured {p.layout.describe()}: median step {p.measured_step_s:.4f} s of {steps} "
              f"(best {min(slowest):.4f} s){note}")
    return chosen
