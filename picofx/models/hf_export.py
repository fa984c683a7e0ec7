"""Weights in Hugging Face's layout: the reference LLaMA as `LlamaForCausalLM`, and a Hugging Face
model's own weights found under whatever prefix the training wrapped them in.

The reference LLaMA and `LlamaForCausalLM` compute the same function, so the weights move over
unchanged, only renamed: RMSNorm in fp32 scaled after the cast back, RoPE as rotate-half with each
frequency in both halves of the head (HF's layout; an interleaved-pairs RoPE would need the q and
k rows permuted, this one needs none), grouped-query SDPA scaled by 1/sqrt(head_dim), a SwiGLU MLP.
"""
from __future__ import annotations

import re

import torch

from picofx.models.llama import LlamaConfig

# picofx name -> LlamaForCausalLM name; {i} is the decoder layer's index
REFERENCE_TO_HF = (
    ("embedding.weight", "model.embed_tokens.weight"),
    ("decoder_layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("decoder_layers.{i}.attention.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("decoder_layers.{i}.attention.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("decoder_layers.{i}.attention.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("decoder_layers.{i}.attention.out_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("decoder_layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("decoder_layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("decoder_layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("decoder_layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("final_norm.weight", "model.norm.weight"),
    ("final_proj.weight", "lm_head.weight"),
)
PATTERNS = [(re.compile(re.escape(ours).replace(r"\{i\}", r"(\d+)") + "$"), theirs) for ours, theirs in REFERENCE_TO_HF]


class NoMapping(ValueError):
    """Weights picofx cannot name in a Hugging Face model."""


def reference_names(config: LlamaConfig) -> list[str]:
    """The reference LLaMA's parameter names for `config`, in the model's order."""
    layers = [ours.format(i=i) for i in range(config.num_hidden_layers) for ours, _ in REFERENCE_TO_HF if "{i}" in ours]
    return ["embedding.weight", *layers, "final_norm.weight", "final_proj.weight"]


def hf_name(name: str) -> str:
    """The LlamaForCausalLM name of one of the reference LLaMA's parameters."""
    for pattern, theirs in PATTERNS:
        found = pattern.match(name)
        if found:
            return theirs.format(i=found.group(1)) if found.groups() else theirs
    raise NoMapping(f"{name} is not a parameter of the reference LLaMA")


def is_reference_llama(names) -> bool:
    return all(any(p.match(n) for p, _ in PATTERNS) for n in names) and "embedding.weight" in names


def tied(weights: dict) -> bool:
    """The output projection is the embedding itself (bit-equal), as in a model that ties them."""
    head, embedding = weights.get("final_proj.weight"), weights.get("embedding.weight")
    return head is not None and embedding is not None and torch.equal(head, embedding)


def llama_hf_config(config: LlamaConfig, *, tie_word_embeddings: bool = False):
    """A `transformers.LlamaConfig` for the reference LLaMA of `config`. The byte-level vocabulary
    has no special tokens, so none is named."""
    from transformers import LlamaConfig as HFLlamaConfig

    hf = HFLlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                       num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                       rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta, hidden_act="silu",
                       attention_bias=False, mlp_bias=False, tie_word_embeddings=tie_word_embeddings,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf.architectures = ["LlamaForCausalLM"]
    return hf


def reference_to_hf(weights: dict, config: LlamaConfig) -> tuple[dict, object]:
    """The reference LLaMA's weights (name -> tensor, every parameter of `config`'s model) as
    LlamaForCausalLM's, and its config; a tied head is written once, as the embedding."""
    missing = [n for n in reference_names(config) if n not in weights]
    if missing:
        raise NoMapping(f"the reference LLaMA's {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                        f"({len(missing)} of {len(reference_names(config))} parameters) are missing")
    tie = tied(weights)
    renamed = {hf_name(n): t for n, t in weights.items() if not (tie and n == "final_proj.weight")}
    return renamed, llama_hf_config(config, tie_word_embeddings=tie)


def hf_model_names(config) -> list[str]:
    """The state-dict names of the Hugging Face causal LM `config` describes (built without memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.state_dict())


def hf_to_hf(weights: dict, config) -> dict:
    """A Hugging Face model's weights under its own names, found under the prefix a training
    wrapper gave them (`model.` of an optimized module, say); a tied head is left to the config."""
    expected = hf_model_names(config)
    anchor = next((e for e in expected if e.endswith("embed_tokens.weight")), expected[0])
    holder = next((n for n in weights if n.endswith(anchor)), None)
    if holder is None:
        raise NoMapping(f"no {anchor} among the weights ({', '.join(list(weights)[:3])} ...), so they are not "
                        f"those of the {config.model_type} model the checkpoint names")
    prefix = holder[: len(holder) - len(anchor)]
    found = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}
    tied_head = getattr(config, "tie_word_embeddings", False)
    missing = [e for e in expected if e not in found and not (tied_head and e == "lm_head.weight")]
    if missing:
        raise NoMapping(f"the {config.model_type} model's {', '.join(missing[:3])} ({len(missing)} of "
                        f"{len(expected)}) are not in the checkpoint")
    return {n: t for n, t in found.items() if n in expected and not (tied_head and n == "lm_head.weight")}
