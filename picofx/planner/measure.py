"""`picofx plan --measure`: run the top plans for a few steps on this machine's ranks (gloo) and time them.

Each plan becomes picofx's passes on a ParallelMesh of its layout (tensor_parallel, fuse, pipeline,
shard or overlap), trains the model with AdamW on random tokens for a few steps (backend eager;
gradient accumulation over the micro-batches where there is no pipeline), and reports the median
step of its slowest rank. On a CPU the ranks share the cores: the device the predictions are made
for is calibrated here (one thread, as each rank runs) and its rates divided among the ranks that
share a core.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from picofx.cost.device import calibrate, cpu
from picofx.parallel.launch import run_ranks

TIMEOUT_S = 900


def measurable(layout) -> str | None:
    """Why this plan cannot be run here (None: it can)."""
    if layout.checkpoint:
        return "checkpointing to a budget is not part of the measured passes"
    if layout.tp > 1 and (layout.pp > 1 or layout.shard):
        return "tensor parallel with pipeline or sharding is not built yet"
    return None


def shared_cpu(world: int):
    """The CPU as `world` single-threaded ranks see it: calibrated on one thread, its compute and
    memory rates divided by the ranks that share each core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = calibrate(cpu(1))
    finally:
        torch.set_num_threads(threads)
    share = min(1.0, (os.cpu_count() or 1) / world)
    return dataclasses.replace(device, name=f"{device.name}, {world} ranks on {os.cpu_count()} cores",
                               peak_flops={k: v * share for k, v in device.peak_flops.items()},
                               memory_bandwidth=device.memory_bandwidth * share,
                               op_overhead=device.op_overhead / share)


def single_rank_step(config, seq: int, batch: int, steps: int = 5) -> float:
    """The median seconds of a one-process training step (fuse, eager, AdamW) of `batch` sequences."""
    from picofx.optimize import optimize  # not the package: picofx.plan(...) reaches this module
    from picofx.examples.llama import Llama, causal_lm_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Llama(dataclasses.replace(config, max_position_embeddings=max(seq, 8)))
        ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
        inputs = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        opt = optimize(model, inputs, ["fuse"], backend="eager", loss_fn=causal_lm_loss)
        optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-4)
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            opt.forward_backward(**inputs)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:])


def scaled(device, factor: float):
    """`device` running `factor` times slower: its compute and memory rates divided, its per-op
    overhead multiplied."""
    return dataclasses.replace(device, peak_flops={k: v / factor for k, v in device.peak_flops.items()},
                               memory_bandwidth=device.memory_bandwidth / factor,
                               op_overhead=device.op_overhead * factor)


def link_rates(rank: int, world: int) -> dict:
    """On one rank: the gloo link's bandwidth and latency among the `world` ranks (all of them)."""
    from picofx.cost.device import calibrate_link

    return calibrate_link(None)


def passes_and_mesh(layout):
    from picofx.manager import PASSES  # the passes by their registered names (the core imports no pass)
    from picofx.parallel import ParallelMesh

    passes = [PASSES["tensor_parallel"](sequence_parallel=layout.sequence_parallel)] if layout.tp > 1 else []
    passes.append("fuse")
    if layout.pp > 1:
        passes.append(PASSES["pipeline"](stages=layout.pp, microbatches=layout.microbatches))
    if layout.dp > 1:
        passes.append("shard" if layout.shard else "overlap")
    mesh = ParallelMesh.build(pp=layout.pp, tp=layout.tp, dp_shard=layout.dp if layout.shard else 1,
                              dp_replicate=1 if layout.shard else layout.dp)
    return passes, mesh


def step_seconds(rank: int, world: int, layout, config, seq: int, global_batch: int, steps: int) -> float:
    """On one rank: the median seconds of `steps` training steps (after one warm-up)."""
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
    accumulate = 1 if layout.pp > 1 else layout.microbatches
    times = []
    for _ in range(steps + 1):
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
    return statistics.median(times[1:])


def measure(predictions: list, run, top: int, steps: int = 3) -> list:
    """Fill `measured_step_s` of the first `top` plans that fit and can run here; returns them."""
    chosen = [p for p in predictions if p.fits and measurable(p.layout) is None][:top]
    for p in chosen:
        seconds = run_ranks(step_seconds, run.gpus, p.layout, run.costs.config, run.costs.seq, run.global_batch,
                            steps, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S / 2)
        p.measured_step_s = max(seconds)
    return chosen
