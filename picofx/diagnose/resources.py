"""What the machine's side of a step says: the data wait (more DataLoader workers, pinned memory on
CUDA) and, where the records carry the device's memory, the batch that fits the headroom."""
from __future__ import annotations

import math
import os

from picofx.diagnose.finding import Finding, finite, median, seconds

DATA_WAIT_SHARE = 0.01     # the threshold: a data wait past 1% of the step is worth workers
MEMORY_USE = 0.9           # the share of the device's memory a larger batch may plan to fill
WORKER_MARGIN = 1.25       # workers for a quarter more than the measured preparation rate


def settled(records: list[dict]) -> list[dict]:
    """The steps after the first two (capture, compilation and the workers' start fall there)."""
    return records[2:] if len(records) > 4 else records


def data_wait(records: list[dict]) -> Finding | None:
    timed = [r for r in settled(records) if finite(r.get("data_s")) and finite(r.get("step_s")) and r["step_s"] > 0]
    if not timed:
        return None
    total = sum(r["data_s"] for r in timed) / sum(r["step_s"] for r in timed)
    waits = sorted(r["data_s"] for r in timed)
    wait, step = median(waits), median(r["step_s"] for r in timed)
    if total <= DATA_WAIT_SHARE or waits[len(waits) // 4] <= DATA_WAIT_SHARE * step:
        return None  # stalls on a busy machine come and go: three steps in four must wait
    compute = max(step - wait, 1e-6)
    workers = timed[-1].get("data_workers")
    if isinstance(workers, int) and workers > 0:  # each worker prepares a batch per `workers` steps
        prepare, now = workers * step, f"{workers} worker{'s' if workers > 1 else ''}"
    else:  # prepared in the step: the wait is the preparation
        prepare, now = wait, "batches prepared in the step" if workers == 0 else "the workers it had"
    needed = max(1, math.ceil(WORKER_MARGIN * prepare / compute))
    cores = os.cpu_count() or 1
    advice = f"--data-workers {needed} (from {now}: a batch takes about {seconds(prepare)} to prepare, the " \
             f"step computes for {seconds(compute)})"
    if needed > cores:
        advice += f"; that is more than this machine's {cores} cores: a faster data source (pre-tokenized, local disk)"
    if str(timed[-1].get("device", "")).startswith("cuda"):
        advice += "; on CUDA also pinned memory and non-blocking copies (DataLoader(pin_memory=True), " \
                  ".to(device, non_blocking=True); picofx train does both)"
    return Finding("data_wait", (timed[0]["step"], timed[-1]["step"]),
                   f"the steps waited {100 * total:.1f}% of their time for batches (median {seconds(wait)} of a "
                   f"{seconds(step)} step)", advice, 0.9 if wait > 4 * DATA_WAIT_SHARE * step else 0.7,
                   f"up to {100 * total:.0f}% faster steps once batches are ready ahead",
                   {"data_wait_share": total, "median_wait_s": wait, "median_step_s": step,
                    "workers": workers, "suggested_workers": needed})


def memory_headroom(records: list[dict]) -> Finding | None:
    """Only where the records carry the device's capacity (a GPU's): the peak scales at most with the
    batch, so a batch grown by capacity x 0.9 / peak fits (the weights' and optimizer's share does not
    grow with it: a lower bound)."""
    timed = [r for r in settled(records) if finite(r.get("peak_memory_bytes")) and finite(r.get("memory_capacity_bytes"))]
    if not timed or not isinstance(timed[-1].get("batch"), int):
        return None
    peak, capacity, batch = max(r["peak_memory_bytes"] for r in timed), timed[-1]["memory_capacity_bytes"], timed[-1]["batch"]
    if peak <= 0:
        return None
    fits = math.floor(batch * MEMORY_USE * capacity / peak)
    gib = f"peak {peak / 2**30:.1f} GiB of the device's {capacity / 2**30:.1f} GiB"
    if peak > 0.97 * capacity:
        return Finding("memory", (timed[0]["step"], timed[-1]["step"]), f"the step's {gib}: at the edge",
                       f"--batch {max(1, fits)} or --passes checkpoint", 0.7, "no out-of-memory error on a longer "
                       "sequence or a fuller batch", {"peak_bytes": peak, "capacity_bytes": capacity})
    if fits < 1.5 * batch:
        return None
    return Finding("memory", (timed[0]["step"], timed[-1]["step"]), f"the step's {gib} at --batch {batch}",
                   f"--batch {fits} (the peak grows at most in proportion to the batch)", 0.6,
                   f"{fits / batch:.1f}x the tokens per step; usually a higher MFU",
                   {"peak_bytes": peak, "capacity_bytes": capacity, "batch": batch, "suggested_batch": fits})
