"""The models `picofx plan` knows by name, and the shapes of the others it is given.

Shapes only: a LlamaConfig (hidden size, layers, heads, key/value heads, MLP width, vocabulary), and
whether the output projection is the embedding (Hugging Face's `tie_word_embeddings`: a `TiedConfig`).
Figures from each model's published config.json."""
from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from picofx.models.llama import CONFIGS, LlamaConfig


@dataclass(frozen=True)
class TiedConfig(LlamaConfig):
    """A model whose head reads the embedding's weight (Qwen2-0.5B, Llama-3.2-1B): one vocabulary x
    hidden matrix, counted, kept and gathered once; its matmul runs all the same."""

    tie_word_embeddings: bool = True


def tied(config: LlamaConfig) -> bool:
    return getattr(config, "tie_word_embeddings", False)

MODELS = {
    "llama-tiny": CONFIGS["tiny"],
    "llama2-7b": CONFIGS["llama2-7b"],
    "llama2-13b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                              num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
    "llama2-70b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                             rope_theta=500000.0),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                               rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                              rope_theta=500000.0),
    "llama3-405b": LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                               num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=8192,
                               rope_theta=500000.0),
    "llama3.1-405b": LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                 num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072,
                                 rope_theta=500000.0),
    "smollm-1.7b": LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048),
}
HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
           "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
           "num_key_value_heads": "num_key_value_heads", "max_position_embeddings": "max_position_embeddings"}


def model_config(spec: str) -> LlamaConfig:
    """A zoo name, a Hugging Face config.json (or the directory holding one), or `module:function`
    returning a LlamaConfig or a model with a `.config` of one."""
    if spec in MODELS:
        return MODELS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return hf_config(json.loads(path.read_text()))
    if ":" in spec:
        module, function = spec.split(":", 1)
        made = getattr(importlib.import_module(module), function)()
        config = made if isinstance(made, LlamaConfig) else getattr(made, "config", None)
        if isinstance(config, LlamaConfig):
            return config
        raise ValueError(f"picofx plan: {spec} returned {type(made).__name__}, not a LlamaConfig or a model with one")
    raise ValueError(f"picofx plan: unknown model {spec!r}; a name from {sorted(MODELS)}, a Hugging Face "
                     "config.json (or its directory), or module:function")


def hf_config(fields: dict) -> LlamaConfig:
    """The shape a Hugging Face config's fields give (a config.json's, or a config object's as a dict)."""
    values = {ours: fields[theirs] for ours, theirs in HF_KEYS.items() if fields.get(theirs) is not None}
    values.setdefault("num_key_value_heads", values.get("num_attention_heads", 1))
    return TiedConfig(**values) if fields.get("tie_word_embeddings") else LlamaConfig(**values)


def with_layers(config: LlamaConfig, layers: int, seq: int) -> LlamaConfig:
    return dataclasses.replace(config, num_hidden_layers=layers, max_position_embeddings=max(seq, 8))


def parameter_count(config: LlamaConfig) -> int:
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    layer = h * (h + 2 * kv + h) + 3 * h * config.intermediate_size + 2 * h
    return config.num_hidden_layers * layer + (1 if tied(config) else 2) * config.vocab_size * h + h
