"""Fusion rule for RoPE over interleaved pairs written with real tensors (GLM, GLM-4, ERNIE 4.5):
rotate_half takes the odd and even channels, stacks (-odd, even) pairwise, and the cos and sin
tables are their first halves repeated pairwise (repeat_interleave(2)). It is the rotation Meta's
complex form makes, so it becomes the same op: picofx::rope with interleaved=True, which takes the
tables' first halves, one entry per pair. With a partial rotary factor the rotated channels are a
slice of q and k, and the rest is concatenated back after: the rule fuses the rotated part.
"""
import torch

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.rewrite import Rule, register_rule, tensor
from picofx.rewrite.rewriter import cycle_reason


def rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # (..., D): (-x1, x0, -x3, x2, ...)


def pairwise(table):
    return table[..., : table.shape[-1] // 2].repeat_interleave(2, dim=-1)  # (..., D): t0, t0, t1, t1, ...


def interleaved_rope_pattern(q, k, cos, sin):
    cos, sin = pairwise(cos), pairwise(sin)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


def interleaved_rope_replacement(q, k, cos, sin):
    half = cos.shape[-1] // 2
    return torch.ops.picofx.rope(q, k, cos[..., :half], sin[..., :half], True)


def tables_cover_the_pairs(match):
    """One table entry per pair of q's and k's channels, broadcasting over the other dims."""
    for table in ("cos", "sin"):
        half = match.val(table).shape[-1] // 2
        for name in ("q", "k"):
            shape = tuple(match.val(name).shape)
            pairs = (*shape[:-1], shape[-1] // 2)
            try:
                fits = tuple(torch.broadcast_shapes((*match.val(table).shape[:-1], half), pairs)) == pairs
            except RuntimeError:
                fits = False
            if shape[-1] % 2 or not fits:
                return f"{table} {tuple(match.val(table).shape)} does not give one entry per pair of {name} {shape}"
    return None


INTERLEAVED_ROPE = register_rule(Rule(
    name="interleaved_rope", pattern=interleaved_rope_pattern, replacement=interleaved_rope_replacement,
    inputs={"q": tensor(2, 4, 8, 16), "k": tensor(2, 2, 8, 16), "cos": tensor(2, 1, 8, 16),
            "sin": tensor(2, 1, 8, 16)},
    checks=(cycle_reason, tables_cover_the_pairs),  # cycle_reason: q and k of one attention
    # the op computes x0 * c - x1 * s where the pattern adds x0 * c and (-x1) * s: equal, but an FMA
    # may contract one and not the other
    tolerance=(1e-5, 1e-5), tolerance_reason="the op may contract a multiply-add the written-out form does not",
))
