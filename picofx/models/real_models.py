"""The LLaMA family as people write it, in tiny sizes built from config classes (no downloads).

`build(name)` gives a ZooModel (model, example inputs, loss_fn). Hugging Face models compute their
own loss from `labels`; the Meta-style reference Llama and the seed's reference Llama take a
loss_fn; nanoGPT computes its loss in forward(idx, targets) and returns (logits, loss).
Every model has 2 layers, hidden 64, 4 query heads over 2 key/value heads where the
architecture has grouped-query attention, vocab 256.
"""
from __future__ import annotations

from typing import Callable

import torch

from picofx.models import titan_llama, zoo
from picofx.models.meta_llama import MetaLlamaConfig, Transformer, loss_over_flattened_tokens
from picofx.models.nanogpt import GPT, GPTConfig
from picofx.models.zoo import ZooModel, token_batch

BATCH, SEQ, VOCAB, LAYERS = 2, 16, 256, 2
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
            attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(experts_implementation="grouped_mm")  # the experts as one grouped matmul (a custom op on CPU)

# architecture -> config overrides beyond TINY
HF_MODELS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {},
    "smollm3": {},
    "olmo2": {},
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                "attention_multiplier": 0.25},
    "phi3": {},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,  # soft-capped attention:
               "attn_implementation": "eager"},  # Hugging Face runs it eagerly
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "layer_types":
               ["sliding_attention", "full_attention"]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, **MOE},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, **MOE},
    "glm": {},  # interleaved RoPE on half the head dim (partial rotary), merged gate/up
    "glm4": {},  # as GLM, plus post-attention and post-MLP norms
    "exaone4": {},  # q/k norms, norms after attention and MLP
    "olmo3": {},
    "arcee": {},  # ReLU^2 MLP: no gate
    "apertus": {},  # xIELU MLP: no gate; q/k norms
    "ministral": {"head_dim": 16},
    "cwm": {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
    "seed_oss": {"attention_dropout": 0.0, "residual_dropout": 0.0},  # defaults 0.1: a random step
    "hunyuan_v1_dense": {"head_dim": 16},  # q/k norms after RoPE
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **MOE},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2, **MOE},
}
CLASS_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "smollm3": "SmolLM3",
               "olmo2": "Olmo2", "granite": "Granite", "phi3": "Phi3", "gemma": "Gemma", "gemma2": "Gemma2",
               "gemma3": "Gemma3Text", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "glm": "Glm", "glm4": "Glm4",
               "exaone4": "Exaone4", "olmo3": "Olmo3", "arcee": "Arcee", "apertus": "Apertus", "ministral": "Ministral",
               "cwm": "Cwm", "seed_oss": "SeedOss", "hunyuan_v1_dense": "HunYuanDenseV1", "qwen3_moe": "Qwen3Moe",
               "granitemoe": "GraniteMoe"}


def hf_model(architecture: str, batch: int = BATCH, seq: int = SEQ, seed: int = 0, **overrides) -> ZooModel:
    import transformers

    name = CLASS_NAMES[architecture]
    config_class = getattr(transformers, f"{name}Config")
    model_class = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    torch.manual_seed(seed)
    config = config_class(**{**TINY, **HF_MODELS[architecture], **overrides})
    ids = token_batch(VOCAB, batch, seq, seed)
    return ZooModel(model_class(config).train(), {"input_ids": ids, "labels": ids}, None)


def meta_llama(batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    ids = token_batch(VOCAB, batch, seq + 1, seed)
    return ZooModel(Transformer(MetaLlamaConfig(vocab_size=VOCAB, ffn_dim=96)),
                    {"tokens": ids[:, :-1], "labels": ids[:, 1:].contiguous()}, loss_over_flattened_tokens)


def torchtitan_llama3(batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    ids = token_batch(VOCAB, batch, seq + 1, seed)
    return ZooModel(titan_llama.Transformer(titan_llama.ModelArgs(vocab_size=VOCAB)),
                    {"tokens": ids[:, :-1], "labels": ids[:, 1:].contiguous()}, titan_llama.cross_entropy_loss)


def nanogpt(batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    ids = token_batch(VOCAB, batch, seq + 1, seed)
    return ZooModel(GPT(GPTConfig(vocab_size=VOCAB)), {"idx": ids[:, :-1], "targets": ids[:, 1:].contiguous()}, None)


def reference_llama(batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> ZooModel:
    return zoo.reference_llama("tiny", batch=batch, seq=seq, seed=seed, intermediate_size=96)


MODELS: dict[str, Callable[..., ZooModel]] = {
    "reference-llama": reference_llama,
    "meta-llama": meta_llama,
    "torchtitan-llama3": torchtitan_llama3,
    "nanogpt": nanogpt,
    **{f"hf-{arch}": (lambda arch: lambda **kw: hf_model(arch, **kw))(arch) for arch in HF_MODELS},
}


def build(name: str, **kwargs) -> ZooModel:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)


def loss_of(output) -> torch.Tensor:
    """The loss from what a model (or its loss_fn) returns: a tensor, an output with .loss, (logits, loss)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return output[-1]
    return output.loss
