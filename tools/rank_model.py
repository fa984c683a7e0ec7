"""What a benchmark's rank trains: the reference LLaMA of a size, built afresh (same weights on every
rank) by `model_for()`, and this rank's batch of random tokens; and how its contenders are timed."""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from picofx.models.llama import CONFIGS, Llama
from picofx.models.zoo import token_batch


def reference_model_and_batch(size: str, batch: int, seq: int, rank: int):
    torch.set_num_threads(1)
    config = dataclasses.replace(CONFIGS[size], max_position_embeddings=max(seq, 128))

    def model_for():
        torch.manual_seed(0)
        return Llama(config)

    ids = token_batch(config.vocab_size, batch, seq + 1, seed=rank)
    return model_for, {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def interleaved_step_times(runs: dict, steps: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each contender's `step()` over `steps` rounds after `warmup`, one step of each per
    round, every step begun together on all ranks (a barrier)."""
    times = {name: [] for name in runs}
    for round_ in range(steps + warmup):
        for name, contender in runs.items():
            dist.barrier()
            start = time.perf_counter()
            contender.step()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times
