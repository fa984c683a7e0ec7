"""Random windows of a token stream as batches, prepared ahead by DataLoader workers.

The start positions are drawn in this process from one seeded generator, exactly as a loop
drawing one batch at a time would draw them; the workers only read and stack the windows. The
loader draws a few batches ahead of the step, so it remembers the generator's state after each
batch it drew: `position` is the state after the last batch handed out, which is what a saved run
records and a resumed run continues from.
"""
from __future__ import annotations

import collections
import functools
import os
import signal
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from picofx.data.tokens import MappedTokens

PREFETCH_PER_WORKER = 2  # batches each worker prepares ahead of the step


class Windows(Dataset):
    """`windows[start]`: tokens start to start + seq + 1 (int64) of a tensor or a token file."""

    def __init__(self, tokens: torch.Tensor | MappedTokens, seq: int):
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return len(self.tokens) - self.seq

    def __getitem__(self, start: int) -> torch.Tensor:
        if isinstance(self.tokens, MappedTokens):
            return self.tokens.read(start, self.seq + 1)
        return self.tokens[start:start + self.seq + 1]

    def starts(self, generator: torch.Generator, batch: int) -> list[int]:
        """`batch` start positions drawn uniformly; the last token of a window is its last label."""
        return torch.randint(0, len(self.tokens) - self.seq - 1, (batch,), generator=generator).tolist()


def inputs_and_labels(windows: list[torch.Tensor]) -> dict:
    stacked = torch.stack(windows)  # (B, T + 1)
    return {"input_ids": stacked[:, :-1].contiguous(), "labels": stacked[:, 1:].contiguous()}


class DrawnStarts(Sampler):
    """Batches of start positions drawn without end; `states` holds the generator's state after
    each batch drawn and not yet handed out."""

    def __init__(self, windows: Windows, generator: torch.Generator, batch: int):
        self.windows, self.generator, self.batch = windows, generator, batch
        self.states: collections.deque = collections.deque()

    def __iter__(self):
        while True:
            starts = self.windows.starts(self.generator, self.batch)
            self.states.append(self.generator.get_state())
            yield starts


def rank_decides_when_to_stop(rank_pid: int, worker: int) -> None:
    """A DataLoader worker's setup. A preemption signals every process of the job (SLURM's scancel)
    or of the rank's process group (torchrun): the rank checkpoints at its next step and ends, and a
    worker that died first would end it at once. So the worker leaves the rank's process group,
    ignores Ctrl-C, and takes SIGTERM from its rank alone (DataLoader's and multiprocessing's
    terminate at shutdown); it still ends when its rank does (DataLoader's parent check)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here inherit the mask
    threading.Thread(target=end_on_rank_sigterm, args=(rank_pid,), name="picofx worker signals", daemon=True).start()


def end_on_rank_sigterm(rank_pid: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank_pid:
            os._exit(128 + signal.SIGTERM)  # as if terminated: the rank asked


class WindowLoader:
    """Batches of `windows` from `generator`'s draws, `workers` DataLoader processes preparing them
    ahead (0: each is prepared when asked for), in pinned memory and copied without blocking when
    `device` is a GPU. `waited` is the time `next` spent waiting for batches."""

    def __init__(self, windows: Windows, generator: torch.Generator, batch: int, *, workers: int, device: str):
        self.device = torch.device(device)
        self.sampler = DrawnStarts(windows, generator, batch)
        self.loader = DataLoader(windows, batch_sampler=self.sampler, collate_fn=inputs_and_labels,
                                 num_workers=workers, pin_memory=self.device.type == "cuda",
                                 prefetch_factor=PREFETCH_PER_WORKER if workers else None, persistent_workers=False,
                                 worker_init_fn=functools.partial(rank_decides_when_to_stop, os.getpid()))
        self.batches = iter(self.loader)  # the workers start now, and begin preparing batches
        self.position = generator.get_state()
        self.waited, self.handed_out = 0.0, 0

    def next(self) -> dict:
        start = time.perf_counter()
        batch = next(self.batches)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        self.waited += time.perf_counter() - start
        self.position = self.sampler.states.popleft()
        self.handed_out += 1
        return batch

    def stop(self) -> torch.Tensor:
        """End the workers; returns the generator state after the last batch handed out."""
        self.batches = None  # the last reference: the iterator's finalizer ends its workers
        return self.position
