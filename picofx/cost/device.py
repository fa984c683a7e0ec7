"""What a device can do, for the cost model: peak FLOP/s per dtype, memory, links.

The GPU entries are profiles (`picofx.cost.gpus`): datasheet peaks and what kernels and
collectives reach of them. `calibrate` replaces the compute and bandwidth figures with what a
short matmul and copy benchmark measures on the machine at hand, which is what the nominal CPU
entry needs before it is trusted.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from picofx.cost.gpus import A100_80GB as A100, GPUS as DEVICES, H100, H200  # noqa: F401
from picofx.cost.hardware import GB, GiB, Device, Link  # noqa: F401

MAX_MEMORY_FRACTION = 0.95  # what a step may use of a device's memory: the rest is kept for the allocator and
                            # fragmentation (the planner's fit, the checkpoint budget of a planned recipe)


def cpu(cores: int | None = None) -> Device:
    """A nominal x86-64 CPU: per core 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP x 2.5 GHz = 80 GFLOP/s,
    bf16 at the fp32 rate (no AMX assumed), one DDR4-3200 channel (25.6 GB/s) shared by the cores.
    Order-of-magnitude only: use `calibrate(cpu())` for decisions that depend on the balance."""
    cores = cores or torch.get_num_threads()
    per_core = 2 * 8 * 2 * 2.5e9
    return Device(name=f"CPU ({cores} {'core' if cores == 1 else 'cores'}, nominal)",
                  peak_flops={torch.float32: cores * per_core},
                  memory_bandwidth=25.6e9, memory_capacity=16 * GiB,
                  link_bandwidth=1e9, link_latency=50e-6, network_bandwidth=1e9, network_latency=50e-6,
                  source="nominal", link_name="gloo (TCP loopback)", network_name="gloo (TCP)",
                  link_source="nominal: calibrate(..., group=...) measures it")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def devices() -> dict[str, Device]:
    """Every entry as of now: DEVICES and the nominal CPU with the threads torch uses at this call."""
    return {**DEVICES, "cpu": cpu()}


def device_for(device: torch.device | str) -> Device:
    """The entry for a torch device, read at this call: a CUDA device by its name (the longest
    DEVICES key whose words are all in it) with its real memory capacity, anything else as the nominal CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu()
    name = torch.cuda.get_device_name(device).lower()
    keys = sorted((key for key in DEVICES if all(word in name for word in key.split("-"))), key=len, reverse=True)
    if not keys:
        raise KeyError(f"no description for {name!r}; add one to picofx.cost.device.DEVICES "
                       f"(known: {', '.join(DEVICES)}) or use calibrate()")
    capacity = torch.cuda.get_device_properties(device).total_memory
    return dataclasses.replace(DEVICES[keys[0]], memory_capacity=capacity)


def calibrate(base: Device, device: torch.device | str = "cpu", dtypes=(torch.float32,),
              matmul_size: int = 1024, copy_bytes: int = 64 * 2**20, repeats: int = 5, group=None) -> Device:
    """`base` with peak FLOP/s (per dtype in `dtypes`), memory bandwidth and per-op overhead
    measured on `device`: the best of `repeats` runs of an n x n matmul (2 n^3 FLOPs), of a copy
    (reads and writes `copy_bytes` each) and of an add of two one-element tensors. With a process
    `group` (every rank calls it), also the link: `calibrate_link`."""
    if group is not None:
        base = dataclasses.replace(base, **calibrate_link(group, device, repeats=repeats))
    device = torch.device(device)
    flops = {**base.peak_flops, **{dtype: matmul_flops(dtype, device, matmul_size, repeats) for dtype in dtypes}}
    src = torch.empty(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, repeats)
    bandwidth = 2 * copy_bytes / seconds
    one = torch.ones(1, device=device)
    overhead = _best_time(lambda: [torch.add(one, one) for _ in range(100)], device, repeats) / 100
    return dataclasses.replace(base, name=f"{base.name}, calibrated", peak_flops=flops,
                               memory_bandwidth=bandwidth, op_overhead=overhead, source="measured")


def matmul_flops(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", size: int = 1024,
                 repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul (2 n^3 FLOPs) in `dtype` on `device`, the best of `repeats` runs,
    at the threads torch uses now."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / _best_time(lambda: torch.mm(a, b), device, repeats)


def calibrate_link(group, device: torch.device | str = "cpu", large_bytes: int = 16 * 2**20, repeats: int = 5) -> dict:
    """Link bandwidth and latency measured by all-reduces on `group` (every rank calls it): the
    latency from a 4-byte all-reduce (2(n-1) ring steps), the bandwidth from a `large_bytes` one
    (2(n-1)/n x bytes cross the link). Each rank takes the slowest rank's times, so all agree."""
    import torch.distributed as dist

    device = torch.device(device)
    world = dist.get_world_size(group)
    steps = 2 * (world - 1)
    times = []
    for nbytes in (4, large_bytes):
        x = torch.zeros(nbytes // 4, device=device)
        times.append(_best_time(lambda x=x: dist.all_reduce(x, group=group), device, repeats))
    times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    small, large = times.tolist()
    latency = small / max(steps, 1)
    bandwidth = steps / world * large_bytes / max(large - small, 1e-9)
    backend = dist.get_backend(group)
    return {"link_bandwidth": bandwidth, "link_latency": latency, "network_bandwidth": bandwidth,
            "network_latency": latency, "link_name": f"{backend}, {world} ranks",
            "network_name": f"{backend}, {world} ranks", "link_source": "measured"}


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best

