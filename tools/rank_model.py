"""What a benchmark's rank trains: the reference LLaMA of a size, built afresh (same weights on every
rank) by `model_for()`, and this rank's batch of random tokens."""
from __future__ import annotations

import dataclasses

import torch

from picofx.examples.llama import CONFIGS, Llama
from picofx.examples.zoo import token_batch


def reference_model_and_batch(size: str, batch: int, seq: int, rank: int):
    torch.set_num_threads(1)
    config = dataclasses.replace(CONFIGS[size], max_position_embeddings=max(seq, 128))

    def model_for():
        torch.manual_seed(0)
        return Llama(config)

    ids = token_batch(config.vocab_size, batch, seq + 1, seed=rank)
    return model_for, {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
