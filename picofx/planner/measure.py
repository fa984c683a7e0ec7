"""`picofx plan --measure`: run the top plans for a few steps on this machine's ranks (gloo) and time them.

Each plan becomes picofx's passes on a ParallelMesh of its layout by the one recipe
(picofx.planner.recipe: tensor_parallel, fuse, pipeline, shard or overlap), trains the model with
AdamW on random tokens for a few steps (backend eager; gradient accumulation over the micro-batches
where there is no pipeline), and reports the median step of its slowest rank.

The device the predictions are made for is calibrated on the same number of single-threaded gloo
ranks, all measuring at once, each figure the slowest rank's median (`lockstep_seconds`): so the
ranks' contention for the cores (oversubscription, the scheduler, cache) and the wait for the
slowest rank are in the calibration, not scaled from one rank alone. The figures: matmul rate at the
model's hidden size and copy bandwidth, the eager step's cost per graph op (the model's own step at
sizes where compute is negligible: dispatch, autograd, the runtime's wrappers), AdamW's cost per
parameter tensor and a DTensor parameter's extra; the gloo link (`calibrate_link`, the latencies
between bursts of compute, `busy_latencies`). Other processes change the machine's speed between the
calibration and a plan's run, so the same per-op probe runs before each of the plan's steps and the
plan is predicted again at the ratio of the two.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from picofx.cost.comm import all_reduce_steps
from picofx.cost.device import Device, cpu
from picofx.parallel.mesh import resolve_dim
from picofx.parallel.launch import run_ranks
from picofx.planner.recipe import recipe

TIMEOUT_S = 900
COPY_BYTES = 8 * 2**20
TENSORS = 32  # parameter tensors the per-tensor costs are measured over


def measurable(layout) -> str | None:
    """Why this plan cannot be run here (None: it can)."""
    if layout.checkpoint:
        return "checkpointing to a budget is not part of the measured passes"
    return None


def at_load(device: Device, slowdown: float) -> Device:
    """`device` `slowdown` times slower than when it was calibrated (other processes came or went):
    rates divided by it, per-op and per-tensor costs multiplied."""
    return dataclasses.replace(device, peak_flops={k: v / slowdown for k, v in device.peak_flops.items()},
                               memory_bandwidth=device.memory_bandwidth / slowdown,
                               op_overhead=device.op_overhead * slowdown,
                               optimizer_tensor_overhead=device.optimizer_tensor_overhead * slowdown,
                               dtensor_parameter_overhead=device.dtensor_parameter_overhead * slowdown)


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


def lockstep_seconds(fn, repeats: int = 7, warm_up: bool = True) -> float:
    """Seconds of `fn` as the slowest of the ranks sees it while all run it together: after a warm-up,
    each repeat starts on a barrier and takes the slowest rank's time; the median repeat. Every rank calls it."""
    import torch.distributed as dist

    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(seconds.item())
    return statistics.median(times)


def eager_step(config, layers: int = 2, seq: int = 4):
    """picofx's eager training step (fuse) of `config` shrunk (compute negligible against dispatch) on
    this thread, and the graph ops it runs (the ops the planner counts)."""
    from picofx.api import optimize  # not the package: picofx.plan(...) reaches this module
    from picofx.models.llama import Llama, causal_lm_loss
    from picofx.planner.costs import count_ops
    from picofx.planner.models import with_layers

    torch.manual_seed(0)
    small = shrunk(config)
    model = Llama(with_layers(small, layers, seq))
    ids = torch.randint(0, small.vocab_size, (1, seq + 1))
    inputs = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    opt = optimize(model, inputs, ["fuse"], backend="eager", loss_fn=causal_lm_loss)
    opt.forward_backward(**inputs)
    ops = count_ops(opt.graphs["forward"]) + count_ops(opt.graphs["backward"])
    return (lambda: opt.forward_backward(**inputs)), ops


def parameter_steps(tensors: int = TENSORS, numel: int = 64):
    """Three steps over `tensors` small fp32 parameters: AdamW alone; a forward, backward and AdamW
    step over plain parameters, and the same over DTensor parameters sharded over all ranks (the
    difference is what a DTensor parameter adds)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = resolve_dim(None, None, "dp_shard", "picofx plan --measure").as_device_mesh("cpu")
    plain = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    sharded = [torch.nn.Parameter(distribute_tensor(torch.randn(numel * mesh.size()), mesh, [Shard(0)]))
               for _ in range(tensors)]
    optimizers = {id(plain): torch.optim.AdamW(plain, lr=1e-4), id(sharded): torch.optim.AdamW(sharded, lr=1e-4)}

    def train(params, local):
        sum((p.to_local() if local else p).sum() for p in params).backward()
        optimizers[id(params)].step()
        optimizers[id(params)].zero_grad(set_to_none=True)

    for p in plain:
        p.grad = torch.randn(numel)  # AdamW skips a parameter without one
    return optimizers[id(plain)].step, (lambda: train(plain, False)), (lambda: train(sharded, True))


def ranks_device(rank: int, world: int, config, link: dict | None) -> Device:
    """On each of `world` single-threaded gloo ranks, all measuring at once (each figure the slowest
    rank's, `lockstep_seconds`): this CPU as the ranks of a plan see it (see the module); `link`: the
    ranks' link rates, None: measured here."""
    size = max(64, min(1024, config.hidden_size))
    a, b = torch.randn(size, size), torch.randn(size, size)
    src = torch.empty(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    step, ops = eager_step(config)
    adamw, plain, sharded = parameter_steps()
    link = {k: v for k, v in (link or link_rates(world)).items() if k != "cpu_share"}  # the share: measured here
    share = torch.tensor([cpu_share()], dtype=torch.float64)
    torch.distributed.all_reduce(share)
    tensor_steps = [lockstep_seconds(fn) / TENSORS for fn in (adamw, plain, sharded)]
    return dataclasses.replace(
        cpu(1), name=f"{cpu(1).name}, calibrated on {world} ranks at once",
        peak_flops={torch.float32: 2 * size**3 / lockstep_seconds(lambda: torch.mm(a, b))},
        memory_bandwidth=2 * COPY_BYTES / lockstep_seconds(lambda: dst.copy_(src)),
        op_overhead=lockstep_seconds(step) / ops, optimizer_tensor_overhead=tensor_steps[0],
        dtensor_parameter_overhead=max(0.0, tensor_steps[2] - tensor_steps[1]), source="measured",
        cpu_share=share.item() / world, **link)


def calibrated_device(config, world: int, link: dict | None = None, say=print) -> Device:
    """This machine's CPU as `world` single-threaded gloo ranks of `config`'s step see it, all of them
    measured at once (`ranks_device`). `link`: the ranks' link rates (picofx.cost.device.calibrate_link),
    None: measured on the same ranks."""
    device = run_ranks(ranks_device, world, config, link, timeout=300, collective_timeout=120)[0]
    say(f"calibrated: {world} ranks measuring at once (the slowest rank's median): matmul "
        f"{device.peak_flops[torch.float32] / 1e9:.1f} GFLOP/s, copy {device.memory_bandwidth / 1e9:.1f} GB/s, "
        f"{device.op_overhead * 1e6:.0f} us per eager graph op, AdamW {device.optimizer_tensor_overhead * 1e6:.0f} us "
        f"per tensor, a DTensor parameter +{device.dtensor_parameter_overhead * 1e6:.0f} us; each rank got "
        f"{device.cpu_share:.2f} core; gloo: {device.link_bandwidth / 1e9:.2f} GB/s, "
        f"{device.link_latency * 1e6:.0f} us per ring step and {device.collective_latency * 1e6:.0f} us per collective")
    return device


def busy_seconds(collective, iterations: int = 20, rounds: int = 5) -> float:
    """Seconds `collective` adds when issued between bursts of computing (about 1 ms of small ops), as
    a training step issues it: the peers and gloo's threads must be scheduled back in, and it waits
    for the rank the scheduler held longest (the slowest rank's figure). The median of `rounds`
    paired runs, the bursts alone beside the bursts with the collective: one pair varied 3x between
    runs on a shared CPU. Every rank calls it."""
    import torch.distributed as dist

    work = torch.ones(256)

    def burst():
        for _ in range(200):
            work.mul_(1.0)

    def run(communicate: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            burst()
            if communicate:
                collective()
        return time.perf_counter() - start

    added = sorted(max(0.0, run(True) - run(False)) / iterations for _ in range(rounds))
    cost = torch.tensor([added[rounds // 2]], dtype=torch.float64)
    dist.all_reduce(cost, op=dist.ReduceOp.MAX)
    return cost.item()


def busy_latencies(world: int) -> tuple[float, float]:
    """Per ring step and per collective, the latency of small collectives issued as a step issues
    them (`busy_seconds`): the step's from an all-reduce over every rank (2(n-1) steps), and what a
    collective costs beyond its steps from an all-gather over pairs of ranks (one step each), the
    groups tensor parallelism and small shard groups use (an odd number of ranks: over all of
    them, n-1 steps). Every rank calls it."""
    import torch.distributed as dist

    from picofx.parallel import ParallelMesh

    x = torch.zeros(1)
    step = busy_seconds(lambda: dist.all_reduce(x)) / all_reduce_steps(world)
    pairs = world % 2 == 0
    group = ParallelMesh.build(dp_replicate=world // 2, tp=2).dim("tp").group if pairs else None
    size = 2 if pairs else world
    gathered = torch.zeros(size)
    gather = busy_seconds(lambda: dist.all_gather_into_tensor(gathered, x, group=group))
    return step, max(0.0, gather - (size - 1) * step)


def link_rates(world: int) -> dict:
    """The gloo link's bandwidth and latencies among the `world` ranks (every rank calls it; the step
    latency the larger of a tight loop's and `busy_latencies`')."""
    from picofx.cost.device import calibrate_link

    link = calibrate_link(None)
    step, call = busy_latencies(world)
    latency = max(link["link_latency"], step)
    return {**link, "link_latency": latency, "network_latency": latency, "collective_latency": call}


def step_seconds(rank: int, world: int, layout, config, seq: int, global_batch: int, steps: int) -> tuple:
    """On one rank: the seconds of each of `steps` training steps (after two warm-ups: the first
    compiles, the second the gradient-accumulation variants), and the eager step's cost per graph op
    the ranks saw meanwhile (`ranks_device`'s probe, run in lockstep before each step; the median)."""
    from picofx.api import optimize  # not the package: picofx.plan(...) reaches this module
    from picofx.models.llama import Llama, causal_lm_loss

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(config, max_position_embeddings=max(seq, 8)))
    made = recipe(layout, compute=["fuse"])
    replica_batch = global_batch // layout.dp
    micro = replica_batch if layout.pp > 1 else replica_batch // layout.microbatches
    ids = torch.randint(0, config.vocab_size, (micro, seq + 1), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    opt = optimize(model, batch, made.passes, backend="eager", loss_fn=causal_lm_loss, mesh=made.mesh())
    optimizer = torch.optim.AdamW(opt.parameters(), lr=1e-4)
    probe, ops = eager_step(config)
    accumulate = 1 if layout.pp > 1 else layout.microbatches
    times, probes = [], []
    for _ in range(steps + 2):
        calls = lockstep_seconds(lambda: [probe() for _ in range(layout.microbatches)], repeats=1, warm_up=False)
        probes.append(calls / (ops * layout.microbatches))
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
    return times[2:], statistics.median(probes[2:])


def measure(predictions: list, run, top: int, steps: int = 8) -> list:
    """Fill `measured_step_s` of the first `top` plans that fit and can run here (the median step of
    the slowest rank); returns them. On a calibrated CPU, which other processes slow down or leave
    between the calibration and a plan's run, the plan is predicted again at the per-op cost its
    ranks' probe measured meanwhile (the ranking stays the calibration's)."""
    from picofx.planner.layouts import predict

    chosen = [p for p in predictions if p.fits and measurable(p.layout) is None][:top]
    for p in chosen:
        out = run_ranks(step_seconds, run.gpus, p.layout, run.costs.config, run.costs.seq, run.global_batch,
                        steps, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S / 2)
        slowest = [max(ranks) for ranks in zip(*(times for times, _ in out))]
        p.measured_step_s = statistics.median(slowest)
        per_op, note = out[0][1], ""
        if run.device.source == "measured":
            slowdown = per_op / run.device.op_overhead
            again = predict(dataclasses.replace(run, device=at_load(run.device, slowdown)), p.layout)
            note = (f"; {per_op * 1e6:.0f} us per eager op meanwhile ({slowdown:.2f}x the calibration's): "
                    f"predicted {p.step_s:.4f} -> {again.step_s:.4f} s")
            p.step_s, p.time, p.tokens_per_s, p.mfu = again.step_s, again.time, again.tokens_per_s, again.mfu
        print(f"measured {p.layout.describe()}: median step {p.measured_step_s:.4f} s of {steps} "
              f"(best {min(slowest):.4f} s){note}")
    return chosen
