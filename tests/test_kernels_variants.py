"""The fused ops' variants for the LLaMA family as it is written, against the unfused code:
rms_norm and add_rms_norm with an offset (Gemma's (1 + weight)), gelu_mul (Gemma's GeLU-tanh
gated MLP), rope with interleaved pairs (Meta's complex RoPE), and linear_cross_entropy with a
scale (Granite) and a soft-cap (Gemma 2). fp32: rtol 1e-5, atol 1e-6; bf16: a few steps."""
import pytest
import torch
import torch.nn.functional as F
from kernel_checks import EPS, check_matches_unfused, randn
from torch._subclasses.fake_tensor import FakeTensorMode

from picofx.kernels import linear_cross_entropy

ops = torch.ops.picofx


def gemma_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


def test_rms_norm_with_offset_scales_by_one_plus_weight():
    x, weight = randn(3, 5, 24), randn(24)
    check_matches_unfused(lambda x, w, eps: ops.rms_norm(x, w, eps, 1.0), gemma_rms_norm, x, weight, EPS)


def test_add_rms_norm_with_offset():
    x, residual, weight = randn(3, 24), randn(3, 24), randn(24)

    def unfused(x, residual, weight, eps):
        total = x + residual
        return total, gemma_rms_norm(total, weight, eps)
    check_matches_unfused(lambda *a: ops.add_rms_norm(*a, 1.0), unfused, x, residual, weight, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mul_on_halves_of_merged_gate_up(dtype):
    gate_up = randn(4, 6, 2 * 20, dtype=dtype)

    def fused(t):
        return ops.gelu_mul(*t.chunk(2, -1))

    def unfused(t):
        gate, up = t.chunk(2, -1)
        return F.gelu(gate, approximate="tanh") * up
    check_matches_unfused(fused, unfused, gate_up, low_precision=dtype != torch.float32)


def complex_rotate(x, freqs):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


@pytest.mark.parametrize("tables_need_grad", [False, True])
def test_interleaved_rope_is_the_complex_product(tables_need_grad):
    q, k = randn(2, 5, 4, 16), randn(2, 5, 2, 16)  # (B, T, H, D), grouped-query k
    angles = torch.randn(5, 8)
    cos, sin = (t[None, :, None, :].clone().requires_grad_(tables_need_grad) for t in (angles.cos(), angles.sin()))

    def unfused(q, k, cos, sin):
        freqs = torch.complex(cos, sin)
        return complex_rotate(q, freqs), complex_rotate(k, freqs)
    check_matches_unfused(lambda *a: ops.rope(*a, True), unfused, q, k, cos, sin)


def test_interleaved_rope_rejects_tables_of_the_full_head_dim():
    with FakeTensorMode():  # what export and torch.compile see
        q, k = torch.empty(2, 5, 4, 16), torch.empty(2, 5, 2, 16)
        with pytest.raises(RuntimeError, match=r"broadcast.*\[2, 5, 4, 8\]"):
            ops.rope(q, k, torch.ones(5, 1, 16), torch.ones(5, 1, 16), True)


def capped_unfused(scale, softcap):
    def loss(x, weight, labels):
        scores = F.linear(x, weight) / scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        return F.cross_entropy(scores.float().flatten(0, 1), labels.flatten())
    return loss


@pytest.mark.parametrize("scale, softcap", [(4.0, 0.0), (1.0, 3.0), (2.0, 3.0)], ids=["scale", "softcap", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_with_scale_and_softcap(scale, softcap, dtype):
    x, weight = randn(2, 37, 16, dtype=dtype), (2 * torch.randn(50, 16, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, 50, (2, 37))
    labels[0, ::3] = -100

    def fused(x, weight, labels):
        return linear_cross_entropy(x, weight, labels, chunk_size=16, scale=scale, softcap=softcap)
    check_matches_unfused(fused, capped_unfused(scale, softcap), x, weight, labels,
                          low_precision=dtype != torch.float32)


OPCHECK_CASES = {
    "rms_norm_offset": (ops.rms_norm.default, lambda: (randn(3, 16), randn(16), EPS, 1.0)),
    "add_rms_norm_offset": (ops.add_rms_norm.default, lambda: (randn(3, 16), randn(3, 16), randn(16), EPS, 1.0)),
    "gelu_mul": (ops.gelu_mul.default, lambda: randn(3, 2 * 8).chunk(2, -1)),
    "rope_interleaved": (ops.rope.default, lambda: (randn(2, 3, 4, 8), randn(2, 3, 2, 8), torch.randn(3, 1, 4),
                                                    torch.randn(3, 1, 4), True)),
    "linear_cross_entropy_softcap": (ops.linear_cross_entropy.default, lambda: (
        randn(6, 8), randn(20, 8), None, torch.randint(0, 20, (6,)), -100, "mean", True, 4, True, 2.0, 3.0)),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    op, make_args = OPCHECK_CASES[case]
    torch.library.opcheck(op, make_args())
