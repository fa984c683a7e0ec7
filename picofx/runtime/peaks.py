"""Matmul rates measured once per machine and kept: the CPU peak that picofx train's MFU divides
by, and what bf16 costs against fp32 on a CPU (`low_precision_cost`, for the precision pass's
warning). The CPU peak: a matmul's FLOP/s
varies between runs by a factor of two or more on a shared machine, so a figure measured at every
start makes runs incomparable. The first run on a machine measures it (every rank at once, as the
run shares the machine) and stores it in picofx's cache directory (`peaks/`, beside the graph
cache), keyed by the machine, the CPU, torch, the dtype, the threads and the ranks; later runs read
it, and the MFU line says when it was measured. Delete the file to measure again."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import socket

import torch

from picofx.cost.device import matmul_flops
from picofx.runtime.cache import default_directory

COST_MATMUL = 1024  # the side of the matmuls that compare bf16 with fp32: picofx train's peak's, so fp32's is shared


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_file(folder: str, what: str) -> pathlib.Path:
    """The file in picofx's cache directory's `folder` of a figure measured on this machine (its host,
    CPU and torch) under `what` (dtype, threads, ranks, ...)."""
    directory = pathlib.Path(os.environ.get("PICOFX_CACHE_DIR") or default_directory()) / folder
    key = f"{socket.gethostname()} {cpu_model()} torch {torch.__version__} {what}"
    return directory / f"cpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def peak_file(dtype: torch.dtype, threads: int, ranks: int) -> pathlib.Path:
    return machine_file("peaks", f"{dtype} {threads} threads {ranks} ranks")


def read_peak(path: pathlib.Path) -> dict | None:
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found.get("flops"), float) and isinstance(found.get("measured"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def cached_cpu_peak(measure, dtype: torch.dtype, threads: int, ranks: int, total=None) -> tuple[float, str]:
    """(FLOP/s of one rank, when measured): the stored figure, or `measure()` averaged over the
    ranks (`total`: the sum over them, a collective every rank calls) and stored. Ranks use the
    stored figure only where every one of them found it, so all measure together or none does."""
    path = peak_file(dtype, threads, ranks)
    found = read_peak(path)
    if ranks > 1 and round(total(1.0 if found else 0.0)) != ranks:
        found = None
    if found is not None:
        return found["flops"], f"measured {found['measured']}, read from picofx's cache"
    flops = measure()
    if ranks > 1:
        flops = total(flops) / ranks
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"flops": float(flops), "measured": when}))
        partial.replace(path)
    except OSError:  # a cache that cannot be written: measured again next time
        pass
    return flops, f"measured {when}, now (kept in picofx's cache for later runs)"


def low_precision_cost(dtype: torch.dtype, threads: int | None = None) -> tuple[float, float, str]:
    """(fp32 FLOP/s, `dtype` FLOP/s, "measured <when>") of a matmul on this machine's CPU at `threads`
    (default: torch's now), each measured once per machine and kept beside the CPU peak."""
    threads = threads or torch.get_num_threads()
    rates = [cached_cpu_peak(lambda d=d: matmul_flops(d, "cpu", size=COST_MATMUL, repeats=3), d, threads, 1)
             for d in (torch.float32, dtype)]
    return rates[0][0], rates[1][0], rates[1][1].partition(",")[0]  # "measured <date>"
