"""LLaMA-style models built from one description, for tests that sweep configurations.

`LlamaVariant` names every knob the family varies: widths and heads (grouped-query ratio),
layers, biases, tied embeddings, the RoPE form, the norm's epsilon, the gated MLP's activation,
the vocabulary. `build(variant, batch, seq)` gives a ZooModel, written by one of three codebases:

- "picofx": the seed's Llama (examples.llama) with each knob open: RoPE as rotate-half, as
  interleaved pairs in real tensors (GLM's form), or as complex multiplication (torchtitan's,
  examples.titan_llama); any activation; biases on every projection;
- "hf-llama": transformers' LlamaForCausalLM (rotate-half RoPE; attention_bias, mlp_bias);
- "hf-qwen2": transformers' Qwen2ForCausalLM (rotate-half RoPE; q/k/v always carry a bias).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from picofx.models.llama import RMSNorm, apply_rotary_pos_emb, causal_lm_loss, get_cos_sin
from picofx.models.titan_llama import precompute_freqs_cis
from picofx.models.zoo import ZooModel, token_batch

ROPE_FORMS = ("rotate_half", "interleaved", "complex")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
CODEBASES = ("picofx", "hf-llama", "hf-qwen2")
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class LlamaVariant:
    head_dim: int = 16
    kv_heads: int = 2
    group: int = 2                # query heads per key/value head
    layers: int = 2
    intermediate_size: int = 96
    vocab_size: int = 128
    bias: bool = False
    tied: bool = False
    rope: str = "rotate_half"
    norm_eps: float = 1e-5
    activation: str = "silu"
    codebase: str = "picofx"
    max_positions: int = 64

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def hidden_size(self) -> int:
        return self.heads * self.head_dim

    def __post_init__(self):
        if self.rope not in ROPE_FORMS or self.activation not in ACTIVATIONS or self.codebase not in CODEBASES:
            raise ValueError(f"rope in {ROPE_FORMS}, activation in {tuple(ACTIVATIONS)}, codebase in {CODEBASES}; "
                             f"got {self.rope!r}, {self.activation!r}, {self.codebase!r}")
        if self.codebase != "picofx" and self.rope != "rotate_half":
            raise ValueError(f"{self.codebase} writes RoPE as rotate-half only, not {self.rope!r}")


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., D): channel pairs (x0, x1), (x2, x3), ... turned a quarter: (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class Rotary(nn.Module):
    """The RoPE tables for one form and the rotation of q or k (B, T, H, D) by them."""

    def __init__(self, form: str, head_dim: int, length: int):
        super().__init__()
        self.form = form
        if form == "complex":
            self.register_buffer("freqs_cis", precompute_freqs_cis(head_dim, length, ROPE_THETA), persistent=False)
            return
        cos, sin = get_cos_sin(length, head_dim, ROPE_THETA)  # (T, D): each frequency in both halves
        if form == "interleaved":  # each frequency twice in a row, for its pair of channels
            cos, sin = (t[:, : head_dim // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.form == "complex":  # computed in fp32, as torchtitan does
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D / 2)
            return torch.view_as_real(pairs * self.freqs_cis[None, :t, None, :]).flatten(3).type_as(x)
        cos, sin = self.cos[:t, None, :], self.sin[:t, None, :]  # (T, 1, D)
        if self.form == "rotate_half":
            return apply_rotary_pos_emb(x, cos, sin)
        return x * cos + rotate_pairs(x) * sin


class Attention(nn.Module):
    def __init__(self, v: LlamaVariant):
        super().__init__()
        self.v = v
        self.q_proj = nn.Linear(v.hidden_size, v.heads * v.head_dim, bias=v.bias)
        self.k_proj = nn.Linear(v.hidden_size, v.kv_heads * v.head_dim, bias=v.bias)
        self.v_proj = nn.Linear(v.hidden_size, v.kv_heads * v.head_dim, bias=v.bias)
        self.o_proj = nn.Linear(v.heads * v.head_dim, v.hidden_size, bias=v.bias)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotary(self.q_proj(x).view(b, t, self.v.heads, self.v.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k = rotary(self.k_proj(x).view(b, t, self.v.kv_heads, self.v.head_dim)).transpose(1, 2)  # (B, Hkv, T, D)
        values = self.v_proj(x).view(b, t, self.v.kv_heads, self.v.head_dim).transpose(1, 2)
        k, values = (y.repeat_interleave(self.v.group, dim=1) for y in (k, values))  # (B, H, T, D)
        out = F.scaled_dot_product_attention(q, k, values, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, v: LlamaVariant):
        super().__init__()
        self.activation = ACTIVATIONS[v.activation]
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size, bias=v.bias)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size, bias=v.bias)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size, bias=v.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, v: LlamaVariant):
        super().__init__()
        self.input_layernorm = RMSNorm(v.hidden_size, v.norm_eps)
        self.attention = Attention(v)
        self.post_attention_layernorm = RMSNorm(v.hidden_size, v.norm_eps)
        self.mlp = GatedMLP(v)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class VariantLlama(nn.Module):
    def __init__(self, v: LlamaVariant):
        super().__init__()
        self.embedding = nn.Embedding(v.vocab_size, v.hidden_size)
        self.rotary = Rotary(v.rope, v.head_dim, v.max_positions)
        self.decoder_layers = nn.ModuleList(DecoderLayer(v) for _ in range(v.layers))
        self.final_norm = RMSNorm(v.hidden_size, v.norm_eps)
        self.final_proj = nn.Linear(v.hidden_size, v.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.normal_(module.bias, std=0.02)  # zero biases would hide a fusion that drops them
        if v.tied:
            self.final_proj.weight = self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)  # (B, T, C)
        for layer in self.decoder_layers:
            x = layer(x, self.rotary)
        return self.final_proj(self.final_norm(x))  # (B, T, V)


def hf_model(v: LlamaVariant) -> nn.Module:
    import transformers

    fields = dict(vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_hidden_layers=v.layers, num_attention_heads=v.heads, num_key_value_heads=v.kv_heads,
                  head_dim=v.head_dim, max_position_embeddings=v.max_positions, rms_norm_eps=v.norm_eps,
                  hidden_act=HF_ACTIVATIONS[v.activation], tie_word_embeddings=v.tied, use_cache=False,
                  attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if v.codebase == "hf-llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields, attention_bias=v.bias,
                                                                       mlp_bias=v.bias))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    return model.train()


def build(v: LlamaVariant, batch: int = 2, seq: int = 16, seed: int = 0) -> ZooModel:
    """The variant's model, a batch of token ids and labels, and its loss function."""
    torch.manual_seed(seed)
    if v.codebase == "picofx":
        ids = token_batch(v.vocab_size, batch, seq + 1, seed)
        return ZooModel(VariantLlama(v), {"input_ids": ids[:, :-1], "labels": ids[:, 1:].contiguous()},
                        causal_lm_loss)
    ids = token_batch(v.vocab_size, batch, seq, seed)
    return ZooModel(hf_model(v), {"input_ids": ids, "labels": ids}, None)
