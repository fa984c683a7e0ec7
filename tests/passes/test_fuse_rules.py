"""The fuse pass's rules one at a time, on small modules: match, no-match (and why), numerics
(the manager compares outputs and gradients with the unfused graph), idempotence; the rule API."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from picofx.models.llama import MLP, Attention, LlamaConfig, RMSNorm, get_cos_sin
from picofx.models.zoo import ZooModel
from picofx.passes.fuse.fuse import Fuse
from picofx.rules import Rule, register_rule, registered_rules, tensor, unregister_rule
from picofx.testing import captured, count_ops, op_counts, run_pass

aten, picofx_ops = torch.ops.aten, torch.ops.picofx
CONFIG = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def fuse(module, *, rules=None, verify="numerics", keep_logits=False, **inputs):
    torch.manual_seed(0)
    gm, ctx = captured(ZooModel(module, inputs, None))
    record = run_pass(Fuse(rules=rules, explain=True, keep_logits=keep_logits), gm, ctx, verify=verify)
    return gm, ctx, record


def near_miss(record, rule):
    misses = [m for m in record.notes["near_misses"] if m["rule"] == rule]
    assert len(misses) == 1, record.notes["near_misses"]
    return misses[0]


# ---- modules: the blocks as the reference LLaMA and Hugging Face write them -------------------

class Residual(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.proj = norm, nn.Linear(32, 32)

    def forward(self, x, residual):
        total = self.proj(x) + residual  # (B, T, C); the projection gives the sum a gradient
        return total, self.norm(total)


class GatedMLP(nn.Module):
    """silu(gate(x)) * up(x), with biases, or with an up projection whose one feature broadcasts."""

    def __init__(self, bias=False, up_features=48):
        super().__init__()
        self.gate, self.up = nn.Linear(32, 48, bias=bias), nn.Linear(32, up_features, bias=bias)

    def forward(self, x):
        return F.silu(self.gate(x)) * self.up(x)


class Rotary(nn.Module):
    """q and k from projections (so that they have gradients), rotated like the reference or HF."""

    def __init__(self, head_dim=8, by_slices=False):
        super().__init__()
        self.proj = nn.Linear(32, 6 * head_dim, bias=False)
        self.head_dim, self.by_slices = head_dim, by_slices
        cos, sin = get_cos_sin(16, head_dim + head_dim % 2, 10000.0)
        self.register_buffer("cos", cos[:, :head_dim])
        self.register_buffer("sin", sin[:, :head_dim])

    def rotate_half(self, x):
        if self.by_slices:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self.proj(x).view(b, t, 6, self.head_dim).split([4, 2], dim=2)  # (B, T, H, D), GQA heads
        cos, sin = self.cos[:t, None, :], self.sin[:t, None, :]
        return q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin


class PairwiseRotary(nn.Module):
    """RoPE as GLM writes it: neighbouring channels rotated as pairs, on the first half of the head
    dim, tables with each frequency repeated for its pair."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 6 * 8, bias=False)
        cos, sin = get_cos_sin(16, 4, 10000.0)  # (T, 4): the rotated half of head dim 8
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self.proj(x).view(b, t, 6, 8).transpose(1, 2).split([4, 2], dim=1)  # (B, H, T, D), GQA heads
        cos, sin = self.cos[None, None, :t], self.sin[None, None, :t]  # (1, 1, T, 4)
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        out = []
        for x_ in (q, k):
            rotated, passed = x_[..., :4], x_[..., 4:]
            pairs = torch.stack((-rotated[..., 1::2], rotated[..., 0::2]), dim=-1).flatten(-2)
            out.append(torch.cat([rotated * cos + pairs * sin, passed], dim=-1))
        return tuple(out)


class HFAttentionCore(nn.Module):
    """SDPA after Hugging Face's repeat_kv (expand + reshape), with an explicit mask."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 64, bias=False)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.proj(x).view(b, t, 8, 8).transpose(1, 2).split([4, 2, 2], dim=1)  # (B, H, T, D)
        k = k[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8)
        v = v[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)


class EagerAttention(nn.Module):
    """Attention as Hugging Face's eager implementation writes it, after repeat_kv."""

    def __init__(self, mask=True):
        super().__init__()
        self.proj, self.mask = nn.Linear(32, 64, bias=False), mask

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.proj(x).view(b, t, 8, 8).transpose(1, 2).split([4, 2, 2], dim=1)  # (B, H, T, D)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * 8 ** -0.5
        if self.mask:
            scores = scores + torch.full((t, t), float("-inf")).triu(1)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=0.0, training=self.training)
        return torch.matmul(probs, v)


class LossHead(nn.Module):
    """The final projection and cross-entropy, as the seed writes it or as Hugging Face does."""

    def __init__(self, hf_style=False, reduction="mean", ignore_index=-100, use_logits=False):
        super().__init__()
        self.head = nn.Linear(32, 96, bias=False)
        self.hf_style, self.reduction, self.ignore_index = hf_style, reduction, ignore_index
        self.use_logits = use_logits

    def forward(self, x, labels):
        logits = self.head(x)
        if self.hf_style:
            labels = F.pad(labels, (0, 1), value=self.ignore_index)[..., 1:].contiguous()
            scores = logits.float()
        else:
            scores = logits
        loss = F.cross_entropy(scores.view(-1, scores.size(-1)), labels.view(-1), ignore_index=self.ignore_index,
                               reduction=self.reduction)
        if self.use_logits:
            return loss, logits, logits.argmax(-1)
        return (loss, logits) if self.hf_style else loss


def x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def labels(*shape, vocab=96, ignore_index=-100):
    out = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(2))
    out[0, :3] = ignore_index  # some ignored tokens
    return out


# ---- match, numerics, idempotence -------------------------------------------------------------

MATCHING = {
    "rms_norm": (lambda: RMSNorm(32, 1e-5), dict(x=x(2, 8, 32)), {"picofx.rms_norm.default": 1}),
    "add_rms_norm": (lambda: Residual(RMSNorm(32, 1e-6)), dict(x=x(2, 8, 32), residual=x(2, 8, 32)),
                     {"picofx.add_rms_norm.default": 1, "picofx.rms_norm.default": 0, "aten.add.Tensor": 0}),
    "swiglu": (lambda: MLP(CONFIG), dict(x=x(2, 8, 32)),
               {"picofx.silu_mul.default": 1, "aten.linear.default": 3, "aten.sigmoid.default": 0,
                "aten.cat.default": 0}),  # gate, up and down as the model has them, no weight merged
    "swiglu with biases": (lambda: GatedMLP(bias=True), dict(x=x(2, 8, 32)),
                           {"picofx.silu_mul.default": 1, "aten.linear.default": 2, "aten.cat.default": 0}),
    "rope by chunks": (lambda: Rotary(), dict(x=x(2, 8, 32)), {"picofx.rope.default": 1, "aten.neg.default": 0}),
    "rope by slices": (lambda: Rotary(by_slices=True), dict(x=x(2, 8, 32)), {"picofx.rope.default": 1}),
    "interleaved_rope": (PairwiseRotary, dict(x=x(2, 8, 32)),
                         {"picofx.rope.default": 1, "aten.neg.default": 0, "aten.stack.default": 0}),
    "grouped_query_attention": (lambda: Attention(CONFIG), dict(x=x(2, 8, 32), cos=get_cos_sin(8, 8, 1e4)[0],
                                                                 sin=get_cos_sin(8, 8, 1e4)[1]),
                                {"aten.expand.default": 0, "aten.clone.default": 0}),
    "grouped_query_attention with a mask": (HFAttentionCore, dict(x=x(2, 8, 32), mask=torch.ones(8, 8).tril().bool()),
                                            {"aten.expand.default": 0}),
    "attention": (lambda: EagerAttention(), dict(x=x(2, 8, 32)),
                  {"aten.bmm.default": 0, "aten._softmax.default": 0, "aten.scaled_dot_product_attention.default": 1}),
    "attention without a mask": (lambda: EagerAttention(mask=False), dict(x=x(2, 8, 32)),
                                 {"aten.bmm.default": 0, "aten.scaled_dot_product_attention.default": 1}),
    "linear_cross_entropy": (lambda: LossHead(), dict(x=x(2, 8, 32), labels=labels(2, 8)),
                             {"picofx.linear_cross_entropy.default": 1, "aten._log_softmax.default": 0,
                              "aten.linear.default": 0}),
    "linear_cross_entropy, sum, ignore_index=-1": (lambda: LossHead(reduction="sum", ignore_index=-1),
                                                  dict(x=x(2, 8, 32), labels=labels(2, 8, ignore_index=-1)),
                                                  {"picofx.linear_cross_entropy.default": 1}),
}


@pytest.mark.parametrize("case", sorted(MATCHING))
def test_rule_matches_computes_the_same_and_is_idempotent(case):
    make, inputs, expected = MATCHING[case]
    rule = case.split(" ")[0].rstrip(",")
    gm, ctx, record = fuse(make(), **inputs)  # the manager checks outputs and gradients against the unfused graph
    assert record.notes[rule] >= 1, record.notes
    counts = op_counts(gm)
    assert {op: counts[op] for op in expected} == expected
    if rule == "grouped_query_attention":
        assert [n.kwargs.get("enable_gqa") for n in gm.graph.nodes
                if n.target is aten.scaled_dot_product_attention.default] == [True]
    before = str(gm.graph)
    again = run_pass(Fuse(), gm, ctx)
    assert not any(again.notes[r.name] for r in registered_rules()), again.notes
    assert str(gm.graph) == before


def test_loss_rule_keeps_the_matched_ignore_index_and_reduction():
    gm, _, _ = fuse(LossHead(reduction="sum", ignore_index=-1), x=x(2, 8, 32), labels=labels(2, 8, ignore_index=-1))
    (node,) = [n for n in gm.graph.nodes if n.target is picofx_ops.linear_cross_entropy.default]
    assert node.args[4:6] == (-1, "sum")


class NormedAfterRotary(Rotary):
    """q and k normed after RoPE (HunYuan): the norm's input is RoPE's last add, not a residual add."""

    def __init__(self):
        super().__init__()
        self.q_norm, self.k_norm = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6)

    def forward(self, x):
        q, k = super().forward(x)
        return self.q_norm(q), self.k_norm(k)


def test_add_rms_norm_leaves_the_rotation_of_a_rope_to_the_rope_rule():
    gm, _, record = fuse(NormedAfterRotary(), x=x(2, 8, 32))
    assert (record.notes["rope"], record.notes["rms_norm"], record.notes["add_rms_norm"]) == (1, 2, 0)
    assert {m["check"] for m in record.notes["near_misses"] if m["rule"] == "add_rms_norm"} == {"not_a_rope"}


def test_rms_norm_matches_the_bf16_form_with_its_casts():
    gm, _, record = fuse(RMSNorm(32, 1e-5).to(torch.bfloat16), verify="invariants", x=x(2, 8, 32).bfloat16())
    assert record.notes["rms_norm"] == 1 and count_ops(gm, aten._to_copy.default) == 0


# ---- no-match: no candidate, or a check rejects it and explain says which ----------------------

class RMSNormWithTensorEps(RMSNorm):
    def __init__(self):
        super().__init__(32, 1e-5)
        self.register_buffer("eps_tensor", torch.tensor(1e-5))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps_tensor)).to(x.dtype)


class ChannelsFirstRMSNorm(nn.Module):
    """Normalizes over dim 1 of (B, C, T): the same ops, but not over the last dim."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(32, 1))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-5)).to(x.dtype)


class ScalarWeightRMSNorm(RMSNorm):
    def __init__(self):
        super().__init__(1, 1e-5)


def test_rms_norm_rejects_a_tensor_eps():
    _, _, record = fuse(RMSNormWithTensorEps(), x=x(2, 8, 32))
    miss = near_miss(record, "rms_norm")
    assert record.notes["rms_norm"] == 0 and miss["check"] == "inputs" and "eps" in miss["reason"]


def test_rms_norm_rejects_a_mean_over_another_dim():
    _, _, record = fuse(ChannelsFirstRMSNorm(), x=x(2, 32, 8))
    miss = near_miss(record, "rms_norm")
    assert record.notes["rms_norm"] == 0 and miss["check"] == "same_math" and "dim" in miss["reason"]


def test_rms_norm_rejects_a_weight_that_is_not_per_channel():
    _, _, record = fuse(ScalarWeightRMSNorm(), x=x(2, 8, 32))
    miss = near_miss(record, "rms_norm")
    assert record.notes["rms_norm"] == 0 and miss["check"] == "weight_scales_the_last_dim"


def test_swiglu_rejects_an_up_projection_that_broadcasts():
    _, _, record = fuse(GatedMLP(up_features=1), x=x(2, 8, 32))
    assert record.notes["swiglu"] == 0 and near_miss(record, "swiglu")["check"] == "same_projection_shape"


def test_add_rms_norm_rejects_a_broadcasting_add():
    _, _, record = fuse(Residual(RMSNorm(32, 1e-5)), x=x(2, 8, 32), residual=x(32))
    assert record.notes["add_rms_norm"] == 0 and record.notes["rms_norm"] == 1
    assert near_miss(record, "add_rms_norm")["check"] == "residual_has_the_same_shape"


def test_rope_rejects_an_odd_head_dim():
    _, _, record = fuse(Rotary(head_dim=5), x=x(2, 8, 32))
    assert record.notes["rope"] == 0 and near_miss(record, "rope")["check"] == "head_dim_is_even"


def test_loss_rule_keeps_logits_that_other_ops_use():
    _, _, record = fuse(LossHead(use_logits=True), verify="invariants", x=x(2, 8, 32), labels=labels(2, 8))
    # two candidates: the mean, and the sum of the token losses inside it (labels are any int64 input)
    misses = [m for m in record.notes["near_misses"] if m["rule"] == "linear_cross_entropy"]
    assert record.notes["linear_cross_entropy"] == 0 and misses
    assert all(m["check"] == "replacement" and "argmax" in m["reason"] for m in misses), misses


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MultiHeadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 8, 12, 8).transpose(1, 2).split(4, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("make, inputs, rules", [
    (GeluMLP, dict(x=x(2, 8, 32)), ("swiglu",)),
    (MultiHeadAttention, dict(x=x(2, 8, 32)), ("grouped_query_attention",)),
], ids=["gelu MLP", "attention without repeated heads"])
def test_no_candidate_no_change(make, inputs, rules):
    gm, ctx = captured(ZooModel(make(), inputs, None))
    before = op_counts(gm)
    record = run_pass(Fuse(rules=rules, explain=True), gm, ctx)
    assert record.notes[rules[0]] == 0 and not record.notes["near_misses"] and op_counts(gm) == before


# ---- the rule API -------------------------------------------------------------------------------

def gelu_tanh_pattern(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_replacement(x):
    return F.gelu(x, approximate="tanh")


GELU_TANH = Rule(name="gelu_tanh", pattern=gelu_tanh_pattern, replacement=gelu_tanh_replacement,
                 inputs={"x": tensor(4, 8)}, tolerance=(1e-5, 1e-5),
                 tolerance_reason="ATen's gelu kernel evaluates the same formula in another order")


class HandWrittenGELU(nn.Module):
    """GELU as GPT-2's original code writes it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return gelu_tanh_pattern(self.proj(x))


def test_users_register_their_own_rule():
    register_rule(GELU_TANH, before="rms_norm")
    try:
        assert registered_rules()[0] is GELU_TANH
        gm, _, record = fuse(HandWrittenGELU(), x=x(2, 8, 32))
        assert record.notes["gelu_tanh"] == 1 and count_ops(gm, aten.gelu.default) == 1
        assert count_ops(gm, aten.tanh.default) == 0
        with pytest.raises(ValueError, match="already registered"):
            register_rule(GELU_TANH)
    finally:
        unregister_rule("gelu_tanh")
    assert "gelu_tanh" not in [r.name for r in registered_rules()]
    gm, _, record = fuse(HandWrittenGELU(), rules=(GELU_TANH,), x=x(2, 8, 32))  # unregistered rules work too
    assert record.notes == {"gelu_tanh": 1, "near_misses": [], "unfused_sites": []}
