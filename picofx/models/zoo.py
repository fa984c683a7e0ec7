"""Named reference models: `zoo.build("llama-tiny")` gives a model, its example inputs and loss.

Each entry is what `picofx.optimize` and `picofx dump` take: the model, the example inputs (a
dict of keyword arguments), and the loss function (None when the model computes its own loss).
"""
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from picofx.models.gpt2 import GPT2, GPT2Config
from picofx.models.llama import CONFIGS, Llama, causal_lm_loss


@dataclass
class ZooModel:
    model: nn.Module
    example_inputs: dict
    loss_fn: Callable | None


def token_batch(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def reference_llama(size: str = "tiny", batch: int = 2, seq: int = 32, seed: int = 0, **overrides) -> ZooModel:
    torch.manual_seed(seed)
    config = dataclasses.replace(CONFIGS[size], **overrides)
    ids = token_batch(config.vocab_size, batch, seq + 1, seed)
    return ZooModel(Llama(config), {"input_ids": ids[:, :-1], "labels": ids[:, 1:].contiguous()}, causal_lm_loss)


def hf_llama_config(size: str = "tiny", **overrides):
    from transformers import LlamaConfig

    c = CONFIGS[size]
    fields = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.rms_norm_eps, use_cache=False, attn_implementation="sdpa")
    return LlamaConfig(**{**fields, **overrides})


def hf_llama(size: str = "tiny", batch: int = 2, seq: int = 32, seed: int = 0, **overrides) -> ZooModel:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = hf_llama_config(size, **overrides)
    ids = token_batch(config.vocab_size, batch, seq, seed)
    return ZooModel(LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}, None)


def gpt2(batch: int = 2, seq: int = 32, seed: int = 0, config: GPT2Config = GPT2Config()) -> ZooModel:
    torch.manual_seed(seed)
    ids = token_batch(config.vocab_size, batch, seq + 1, seed)
    return ZooModel(GPT2(config), {"input_ids": ids[:, :-1], "labels": ids[:, 1:].contiguous()}, causal_lm_loss)


MODELS: dict[str, Callable[..., ZooModel]] = {
    "llama-tiny": lambda **kw: reference_llama("tiny", **kw),
    "llama-small": lambda **kw: reference_llama("small", **kw),
    "hf-llama-tiny": lambda **kw: hf_llama("tiny", **kw),
    "hf-llama-small": lambda **kw: hf_llama("small", **kw),
    "gpt2-tiny": gpt2,
}


def build(name: str, **kwargs) -> ZooModel:
    if name not in MODELS:
        raise KeyError(f"unknown zoo model {name!r}; available: {', '.join(sorted(MODELS))}")
    return MODELS[name](**kwargs)
