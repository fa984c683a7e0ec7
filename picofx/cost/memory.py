"""Measure the peak memory of a training step, defined the way the cost model predicts it.

Peak = bytes of the tensor storages that are resident when the step starts (the ones named in
`resident`: parameters, buffers, inputs, gradients and optimizer state that already exist)
+ the largest amount the step allocates on top of them at any moment.

On CPU there are no allocator statistics, so the allocations and frees the CPU allocator
reports to the profiler (`profile_memory=True`) are summed in time order (frees of storages
allocated before the step count as negative): this counts every
storage the step allocates, including those inside compiled (Inductor) code, at its requested
size. On CUDA it is `torch.cuda.max_memory_allocated` over the step.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def resident_bytes(*objects) -> int:
    """Bytes of the distinct storages behind tensors, modules (parameters, buffers, gradients),
    optimizers (their state) and nested lists/dicts of those. Aliases are counted once."""
    seen: dict[int, int] = {}
    for t in _tensors(objects):
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors(state)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v)


def measure_peak(fn: Callable[[], object], resident=(), device: torch.device | str | None = None) -> int:
    """Peak bytes of live tensor storages while `fn()` runs, `resident` included (see module doc).

    `fn`'s return value is dropped before the measurement ends, so return nothing you want
    counted as freed. The device defaults to where the resident tensors live (CPU if none)."""
    base = resident_bytes(resident)
    device = torch.device(device) if device is not None else _device_of(resident)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return base + torch.cuda.max_memory_allocated(device) - start
    return base + peak_allocated_during(fn)


def peak_allocated_during(fn: Callable[[], object]) -> int:
    """The largest net amount `fn` has allocated on the CPU at any moment (bytes, ≥ 0)."""
    with _profiler_lines_hidden(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((e.start_time_ns, e.extra_fields.alloc_size)
                     for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu")
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _profiler_lines_hidden():
    """The profiler's C++ side writes a line to the process's stderr (fd 2) at each start and stop;
    send fd 2 to /dev/null meanwhile, so measuring prints nothing on the user's terminal."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _device_of(resident) -> torch.device:
    for t in _tensors(resident):
        return t.device
    return torch.device("cpu")
