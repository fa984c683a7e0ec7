"""A LLaMA written the way Meta's reference code writes it: torch.nn.RMSNorm, RoPE as complex
multiplication (`view_as_complex` of pairs of channels times `polar` frequencies, back through
`view_as_real`), repeated k/v heads by expand + reshape, SwiGLU as w2(silu(w1 x) * w3 x), and the
loss over logits flattened with `view(B * T, -1)`. fp32 RoPE: q and k are upcast before the
complex product and cast back after it.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MetaLlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_dim: int = 176
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 128


def rope_frequencies(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """(length, head_dim / 2) complex64: e^(i * position * frequency)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated pairwise by freqs (T, D / 2), computed in fp32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D / 2)
    rotated = torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3)  # (B, T, H, D)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, c: MetaLlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)

    def forward(self, x, freqs):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = rotate(q, freqs), rotate(k, freqs)
        repeats = self.n_heads // self.n_kv_heads
        k = k[:, :, :, None, :].expand(b, t, self.n_kv_heads, repeats, self.head_dim).reshape(b, t, -1, self.head_dim)
        v = v[:, :, :, None, :].expand(b, t, self.n_kv_heads, repeats, self.head_dim).reshape(b, t, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c: MetaLlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, c: MetaLlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: MetaLlamaConfig = MetaLlamaConfig()):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.register_buffer("freqs", rope_frequencies(c.dim // c.n_heads, c.max_seq_len, c.rope_theta),
                             persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h)).float()  # (B, T, V)


def loss_over_flattened_tokens(logits, labels):
    b, t, _ = logits.shape
    return F.cross_entropy(logits.view(b * t, -1), labels.view(b * t))
