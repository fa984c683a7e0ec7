"""The Triton kernels of picofx.kernels against the generic (plain torch) implementations.

Without CUDA the kernels run on CPU under the Triton interpreter, which triton enables when
the @triton.jit decorators run, at import, if TRITON_INTERPRET=1: so
test_kernels_under_interpreter re-runs this file in a fresh process with that variable set,
and the kernel tests skip in the parent process. With CUDA they run on the GPU directly.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import picofx.kernels  # noqa: E402,F401  registers torch.ops.picofx
from picofx.kernels import (  # noqa: E402
    triton_cross_entropy, triton_rms_norm, triton_rope, triton_swiglu,
)
from picofx.kernels.linear_cross_entropy import _linear_cross_entropy_chunked, cross_entropy_chunk  # noqa: E402
from picofx.kernels.rms_norm import (  # noqa: E402
    add_rms_norm_reference, rms_norm_backward_reference, rms_norm_reference,
)
from picofx.kernels.rope import rope_backward_reference, rope_reference  # noqa: E402
from picofx.kernels.swiglu import silu_mul_backward_reference, silu_mul_reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
EPS = 1e-5

runs_kernels = pytest.mark.skipif(not (HAS_CUDA or INTERPRETED),
                                  reason="no CUDA: runs in test_kernels_under_interpreter's subprocess")


@pytest.mark.skipif(HAS_CUDA or INTERPRETED, reason="the kernels run directly")
def test_kernels_under_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[1],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert " passed" in result.stdout


def assert_close(actual, expected, low_precision=False):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if low_precision or expected.dtype == torch.bfloat16:
        # bf16 keeps 8 significant bits: the kernels round once where the generic code rounds
        # after each op, and the interpreter truncates fp32 -> bf16 where GPUs round to
        # nearest, so values differ by a step or two (of the tensor's scale near zero).
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2 * scale)
    else:
        # fp32, differently ordered arithmetic (fused multiply-adds, one-pass formulas).
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@runs_kernels
@pytest.mark.parametrize("x_dtype,weight_dtype", DTYPES)
def test_rms_norm_forward(x_dtype, weight_dtype):
    x, residual, weight = randn(2, 5, 40, dtype=x_dtype), randn(2, 5, 40, dtype=x_dtype), randn(40, dtype=weight_dtype)
    low_precision = x_dtype == torch.bfloat16
    assert_close(triton_rms_norm.rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), low_precision)
    for actual, expected in zip(triton_rms_norm.add_rms_norm(x, residual, weight, EPS),
                                add_rms_norm_reference(x, residual, weight, EPS)):
        assert_close(actual, expected, low_precision)


@runs_kernels
def test_rms_norm_forward_with_out_dtype():
    x, residual, weight = randn(2, 5, 40), randn(2, 5, 40), randn(40)
    bf16 = torch.bfloat16
    assert_close(triton_rms_norm.rms_norm(x, weight, EPS, bf16), rms_norm_reference(x, weight, EPS, out_dtype=bf16))
    for actual, expected in zip(triton_rms_norm.add_rms_norm(x, residual, weight, EPS, bf16),
                                add_rms_norm_reference(x, residual, weight, EPS, out_dtype=bf16)):
        assert_close(actual, expected)


@runs_kernels
@pytest.mark.parametrize("x_dtype,weight_dtype", DTYPES)
@pytest.mark.parametrize("with_grad_sum", [False, True])
def test_rms_norm_backward(x_dtype, weight_dtype, with_grad_sum):
    n_rows = 11  # not a multiple of the rows each program handles
    x, weight = randn(n_rows, 40, dtype=x_dtype), randn(40, dtype=weight_dtype)
    grad_out = randn(n_rows, 40, dtype=torch.promote_types(x_dtype, weight_dtype))
    grad_sum = randn(n_rows, 40, dtype=x_dtype) if with_grad_sum else None
    for actual, expected in zip(triton_rms_norm.rms_norm_backward(grad_out, x, weight, EPS, grad_sum),
                                rms_norm_backward_reference(grad_out, x, weight, EPS, grad_sum)):
        assert_close(actual, expected, low_precision=x_dtype == torch.bfloat16)


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_on_strided_halves(dtype):
    gate, up = randn(3, 5, 2 * 300, dtype=dtype).chunk(2, dim=-1)  # row stride 600, 2 column blocks
    assert_close(triton_swiglu.silu_mul(gate, up), silu_mul_reference(gate, up))
    grad = randn(3, 5, 300, dtype=dtype)
    for actual, expected in zip(triton_swiglu.silu_mul_backward(grad, gate, up),
                                silu_mul_backward_reference(grad, gate, up)):
        assert_close(actual, expected)


ROPE_LAYOUTS = {
    "reference (B, T, H, D), cos (T, 1, D)": lambda: (
        randn(2, 5, 6, 8), randn(2, 5, 2, 8), randn(5, 1, 8), randn(5, 1, 8)),
    "hugging face (B, H, T, D) strided, cos (B, 1, T, D)": lambda: (
        randn(2, 5, 6, 8).transpose(1, 2), randn(2, 5, 2, 8).transpose(1, 2), randn(2, 1, 5, 8), randn(2, 1, 5, 8)),
    "3-d (T, H, D), cos (T, 1, D)": lambda: (randn(5, 6, 8), randn(5, 2, 8), randn(5, 1, 8), randn(5, 1, 8)),
}


@runs_kernels
@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_rope(layout):
    q, k, cos, sin = ROPE_LAYOUTS[layout]()
    expected_outputs, expected_grads = rope_reference(q, k, cos, sin), rope_backward_reference(q, k, cos, sin)
    for x, expected, expected_grad in zip((q, k), expected_outputs, expected_grads):
        assert_close(triton_rope.rope(x, cos, sin), expected)
        assert_close(triton_rope.rope(x, cos, sin, transposed=True), expected_grad)


@runs_kernels
def test_rope_writes_into_the_layout_it_is_given():
    q, _, cos, sin = ROPE_LAYOUTS["hugging face (B, H, T, D) strided, cos (B, 1, T, D)"]()
    out = torch.empty(2, 5, 6, 8).transpose(1, 2)  # q's own (B, T, H, D) memory order
    assert triton_rope.rope(q, cos, sin, out=out) is out
    assert_close(out, rope_reference(q, q, cos, sin)[0])


@runs_kernels
def test_rope_bf16_with_fp32_tables():
    q, cos, sin = randn(2, 5, 4, 8, dtype=torch.bfloat16), randn(5, 1, 8), randn(5, 1, 8)
    assert_close(triton_rope.rope(q, cos, sin), rope_reference(q, q, cos, sin)[0], low_precision=True)


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compute_grad", [False, True])
def test_cross_entropy_chunk(dtype, compute_grad, monkeypatch):
    monkeypatch.setattr(triton_cross_entropy, "MAX_BLOCK", 64)  # 300 columns: 5 blocks per sweep
    logits = randn(6, 300, dtype=dtype)
    labels = torch.randint(0, 300, (6,), device=DEVICE)
    labels[[1, 4]] = -100
    grad_scale = torch.tensor(0.25, device=DEVICE)
    expected_loss, loss = torch.empty(6, device=DEVICE), torch.empty(6, device=DEVICE)
    expected_grad = cross_entropy_chunk(logits.clone(), labels, expected_loss, grad_scale, -100, compute_grad)
    grad = triton_cross_entropy.cross_entropy_chunk(logits.clone(), labels, loss, grad_scale, -100, compute_grad)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    if compute_grad:
        assert_close(grad, expected_grad)
        assert (grad[[1, 4]] == 0).all()
    else:
        assert grad is None and expected_grad is None


@runs_kernels
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_with_triton_chunks(reduction):
    x, weight, bias = randn(13, 16), randn(70, 16), randn(70)
    labels = torch.randint(0, 70, (13,), device=DEVICE)
    labels[::4] = -100
    args = (x, weight, bias, labels, -100, reduction, True, 5, True)
    for actual, expected in zip(_linear_cross_entropy_chunked(*args, triton_cross_entropy.cross_entropy_chunk),
                                _linear_cross_entropy_chunked(*args, cross_entropy_chunk)):
        assert_close(actual, expected)


# ---- the registered CUDA kernels, end to end against the unfused graph -----------------------

@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_match_unfused(dtype):
    ops = torch.ops.picofx
    x = randn(4, 64, 256, dtype=dtype).requires_grad_()
    weight = torch.ones(256, device=DEVICE, requires_grad=True)
    gate_up = randn(4, 64, 2 * 512, dtype=dtype).requires_grad_()
    head = randn(1000, 256, dtype=dtype).mul_(0.05).requires_grad_()
    labels = torch.randint(0, 1000, (4, 64), device=DEVICE)

    def fused():
        normed = ops.rms_norm(x, weight, EPS).to(dtype)
        hidden = ops.silu_mul(*gate_up.chunk(2, dim=-1))
        loss = ops.linear_cross_entropy(normed, head, None, labels, -100, "mean", True, 100, True)[0]
        return loss + hidden.float().square().mean()

    def unfused():
        xf = x.float()
        normed = (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        logits = F.linear(normed, head).float()
        return F.cross_entropy(logits.view(-1, 1000), labels.view(-1)) + (F.silu(gate) * up).float().square().mean()

    tensors = (x, weight, gate_up, head)
    fused_loss, unfused_loss = fused(), unfused()
    low_precision = dtype == torch.bfloat16
    for actual, expected in zip(torch.autograd.grad(fused_loss, tensors), torch.autograd.grad(unfused_loss, tensors)):
        assert_close(actual, expected, low_precision)
    assert_close(fused_loss, unfused_loss, low_precision)
