"""fuse's causal_attention: SDPA under a mask proven causal (picofx.capture.causal) runs is_causal with
no mask, and the mask's computation is erased; every other mask stays, and attention runs masked.
On one attention of a tiny module per mask (the manager checks the loss and every gradient against
the graph before the pass, fp32), and on Hugging Face Llama given a padding attention_mask.
(Hugging Face's own causal mask and the reference LLaMA: tests/passes/test_fuse.py.)"""
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from picofx.models import real_models
from picofx.models.zoo import ZooModel
from picofx.passes.fuse.fuse import Fuse
from picofx.testing import assert_trains_like_eager, captured, run_pass

SDPA = torch.ops.aten.scaled_dot_product_attention.default
B, T, HEADS, D = 2, 6, 2, 8


def positions_compared(x):  # Hugging Face's sdpa_mask: key position <= query position
    return (torch.arange(T).view(1, 1, 1, T) <= torch.arange(T).view(1, 1, T, 1)).expand(B, 1, T, T)


def additive_tril(x):
    return torch.where(torch.ones(T, T, dtype=torch.bool).tril(), 0.0, float("-inf"))


def meta_reference(x):  # Meta's llama: -inf above the diagonal
    return torch.triu(torch.full((T, T), float("-inf")), diagonal=1)


def sliding_window(x):  # each query attends to itself and the two keys before it
    ones = torch.ones(T, T, dtype=torch.bool)
    return ones.tril() & ones.triu(-2)


def upper_triangle(x):
    return torch.ones(T, T, dtype=torch.bool).triu()


def padding_from_the_input(x):  # causal, and keys whose first feature is negative masked
    return torch.ones(T, T, dtype=torch.bool).tril() & (x[..., 0] >= 0).view(B, 1, 1, T)


def broadcast_one(x):  # a (1, 1) True mask: the 1 x 1 tril, broadcast it masks nothing
    return torch.ones(1, 1, dtype=torch.bool)


class MaskedAttention(nn.Module):
    def __init__(self, make_mask):
        super().__init__()
        self.qkv = nn.Linear(HEADS * D, 3 * HEADS * D)
        self.make_mask = make_mask

    def forward(self, x):  # x (B, T, H * D)
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(x)).square().mean()


def attentions(gm: fx.GraphModule) -> list[tuple]:
    """(mask or None, is_causal) of each SDPA."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        args = [*node.args, None, None, None][:6]
        found.append((node.kwargs.get("attn_mask", args[3]), node.kwargs.get("is_causal", args[5] or False)))
    return found


def square_values(gm: fx.GraphModule, length: int) -> int:
    """Nodes that compute a (..., length, length) tensor: a mask, or attention scores."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
               and tuple(n.meta["val"].shape[-2:]) == (length, length))


CAUSAL = [positions_compared, additive_tril, meta_reference]
MASKED = {sliding_window: "is not the causal tril", upper_triangle: "is not the causal tril",
          padding_from_the_input: "the graph's input", broadcast_one: "is not the square (6 x 6) scores"}


def fused(make_mask, explain=True):
    torch.manual_seed(0)
    gm, ctx = captured(ZooModel(MaskedAttention(make_mask), {"x": torch.randn(B, T, HEADS * D)}, None))
    assert attentions(gm)[0][0] is not None  # captured with its mask
    record = run_pass(Fuse(explain=explain), gm, ctx)  # the loss and every gradient as before the pass
    return gm, record.notes


@pytest.mark.parametrize("make_mask", CAUSAL, ids=[f.__name__ for f in CAUSAL])
def test_a_mask_proven_causal_becomes_is_causal_and_its_computation_is_erased(make_mask):
    gm, notes = fused(make_mask)
    assert notes["causal_attention"] == 1 and notes["near_misses"] == []
    assert attentions(gm) == [(None, True)]
    assert square_values(gm, T) == 0  # no mask made any more


@pytest.mark.parametrize("make_mask", MASKED, ids=[f.__name__ for f in MASKED])
def test_any_other_mask_stays_and_explain_says_why(make_mask):
    gm, notes = fused(make_mask)
    assert notes["causal_attention"] == 0
    [(mask, causal)] = attentions(gm)
    assert mask is not None and not causal
    [missed] = notes["near_misses"]
    assert missed["rule"] == "causal_attention" and MASKED[make_mask] in missed["reason"]


def test_only_when_named_among_the_rules():
    gm, ctx = captured(ZooModel(MaskedAttention(additive_tril), {"x": torch.randn(B, T, HEADS * D)}, None))
    assert "causal_attention" not in run_pass(Fuse(rules=("attention",)), gm, ctx).notes
    assert attentions(gm)[0][0] is not None
    assert run_pass(Fuse(rules=("causal_attention",)), gm, ctx).notes == {"causal_attention": 1}


def test_hugging_face_llama_given_a_padding_attention_mask_attends_masked_and_trains_like_eager():
    """The attention_mask is an input: it may pad any position at run time, so the mask built from it
    is never taken as causal, even where the example holds no zero; with zeros, the numerics hold."""
    model = real_models.hf_model("llama")
    ids = model.example_inputs["input_ids"]
    padding = torch.ones_like(ids)
    padding[1, -5:] = 0  # right padding: every query still attends to a key
    batches = [{"input_ids": ids, "labels": ids, "attention_mask": padding},
               {"input_ids": ids.roll(1, -1), "labels": ids.roll(1, -1), "attention_mask": padding}]
    model = ZooModel(model.model, batches[0], None)
    opt = assert_trains_like_eager(model, [Fuse(explain=True)], backend="eager", tolerance=(1e-5, 1e-5),
                                   batches=batches)
    notes = opt.report.records[0].notes
    assert notes["causal_attention"] == 0
    assert [causal for _, causal in attentions(opt.graph_module)] == [False] * real_models.LAYERS
    assert all(mask is not None for mask, _ in attentions(opt.graph_module))
    missed = [m["reason"] for m in notes["near_misses"] if m["rule"] == "causal_attention"]
    assert len(missed) == real_models.LAYERS and all("input attention_mask" in reason for reason in missed)
