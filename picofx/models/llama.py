"""The reference LLaMA, written the way the seed framework writes it.

Module names follow the seed: `embedding`, `decoder_layers.{i}.input_layernorm`,
`.attention.{q,k,v,out}_proj`, `.post_attention_layernorm`, `.mlp.{gate,up,down}_proj`,
`final_norm`, `final_proj`. RMSNorm is computed in fp32, RoPE is rotate-half, attention is
causal SDPA with grouped-query heads, the MLP is SwiGLU, and the loss is computed outside the
model (`causal_lm_loss`), as the seed's training loop does.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# Sizes used by tests, benchmarks and the cost model. The two large ones are for
# prediction (cost model, planner) and GPU benchmarks; nothing in CI instantiates them.
CONFIGS = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024),
    "smollm-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                               max_position_embeddings=2048),
    "llama2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                             max_position_embeddings=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin):
    return x * cos + rotate_half(x) * sin  # x: (B, T, H, D), cos/sin: (T, 1, D)


def get_cos_sin(seq_length: int, head_dim: int, base: float):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_values = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_key_values * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_key_values * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        batch_size, seq_length, _ = x.size()
        q = self.q_proj(x).view(batch_size, seq_length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch_size, seq_length, self.num_key_values, self.head_dim)
        v = self.v_proj(x).view(batch_size, seq_length, self.num_key_values, self.head_dim)
        cos, sin = cos[:seq_length, None, :], sin[:seq_length, None, :]
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # (B, H, T, D)
        k = apply_rotary_pos_emb(k, cos, sin).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.transpose(1, 2)
        k = k.repeat_interleave(self.num_heads // self.num_key_values, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(self.num_heads // self.num_key_values, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(batch_size, seq_length, self.num_heads * self.head_dim)
        return self.out_proj(out)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.final_proj = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = get_cos_sin(config.max_position_embeddings, config.head_dim, config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(_init_weights)

    def forward(self, input_ids):
        x = self.embedding(input_ids)  # (B, T, C)
        for layer in self.decoder_layers:
            x = layer(x, self.cos, self.sin)
        return self.final_proj(self.final_norm(x))  # (B, T, V)


def _init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


def causal_lm_loss(logits, labels):
    """The seed's loss: labels are already the next tokens (shifted by the data loader)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
