"""picofx::linear_cross_entropy against the unfused projection + F.cross_entropy.

Loss and gradients (fp32: rtol 1e-5, atol 1e-6), FLOPs as FlopCounterMode counts them, and
the largest tensor allocated, to show the (tokens x vocab) logits never exist.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import FP32, check_matches_unfused, randn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from picofx.kernels import linear_cross_entropy

ops = torch.ops.picofx
few_examples = settings(max_examples=15, deadline=None)


def linear_cross_entropy_unfused(x, weight, bias, labels, ignore_index=-100, reduction="mean", upcast=True):
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return F.cross_entropy(logits.float() if upcast else logits, labels.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


def ce_inputs(n_tokens=37, hidden=16, vocab=50, bias=False, dtype=torch.float32, ignored_every=3, leading=()):
    x = randn(*leading, n_tokens, hidden, dtype=dtype)
    weight = (0.3 * torch.randn(vocab, hidden, dtype=dtype)).requires_grad_()
    b = randn(vocab, dtype=dtype) if bias else None
    labels = torch.randint(0, vocab, (*leading, n_tokens))
    labels.view(-1)[::ignored_every] = -100
    return x, weight, b, labels


def fused_loss(chunk_size, **options):
    def loss(x, weight, bias, labels):
        return linear_cross_entropy(x, weight, labels, bias, chunk_size=chunk_size, **options)
    return loss


def unfused_loss(**options):
    def loss(x, weight, bias, labels):
        return linear_cross_entropy_unfused(x, weight, bias, labels, **options)
    return loss


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_matches_unfused(bias, reduction):
    inputs = ce_inputs(n_tokens=37, bias=bias)  # 37 tokens: chunks of 16, 16 and 5
    check_matches_unfused(fused_loss(16, reduction=reduction), unfused_loss(reduction=reduction), *inputs)


@few_examples
@given(n_tokens=st.integers(1, 40), chunk_size=st.integers(1, 17), vocab=st.integers(2, 40),
       ignored_every=st.integers(1, 5), bias=st.booleans())
def test_linear_cross_entropy_any_chunking(n_tokens, chunk_size, vocab, ignored_every, bias):
    inputs = ce_inputs(n_tokens=n_tokens, vocab=vocab, bias=bias, ignored_every=ignored_every + 1)
    check_matches_unfused(fused_loss(chunk_size), unfused_loss(), *inputs)


def test_linear_cross_entropy_flattens_leading_dims():
    inputs = ce_inputs(n_tokens=9, leading=(2,))  # x (2, 9, C), labels (2, 9)
    check_matches_unfused(fused_loss(4), unfused_loss(), *inputs)


@pytest.mark.parametrize("upcast", [True, False])
def test_linear_cross_entropy_bf16(upcast):
    inputs = ce_inputs(n_tokens=37, dtype=torch.bfloat16, bias=True)
    loss = fused_loss(16, upcast=upcast)(*inputs)
    assert loss.dtype == (torch.float32 if upcast else torch.bfloat16)
    check_matches_unfused(fused_loss(16, upcast=upcast), unfused_loss(upcast=upcast), *inputs, low_precision=True)


def test_linear_cross_entropy_all_ignored_mean_is_nan():
    inputs = ce_inputs(n_tokens=5, ignored_every=1)
    fused = fused_loss(2)(*inputs)
    unfused = unfused_loss()(*inputs)
    assert fused.isnan() and unfused.isnan()
    x, weight, _, _ = inputs
    fused_grads = torch.autograd.grad(fused, (x, weight))
    unfused_grads = torch.autograd.grad(unfused_loss()(*inputs), (x, weight))
    for actual, expected in zip(fused_grads, unfused_grads):
        torch.testing.assert_close(actual, expected, equal_nan=True)


def test_linear_cross_entropy_without_grad_skips_gradient_matmuls():
    x, weight, bias, labels = ce_inputs(n_tokens=8, hidden=4, vocab=6)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss = linear_cross_entropy(x, weight, labels)
    assert counter.get_total_flops() == 2 * 8 * 4 * 6  # the projection only
    torch.testing.assert_close(loss, linear_cross_entropy_unfused(x, weight, None, labels), **FP32)


def test_linear_cross_entropy_backward_without_grads_raises():
    x, weight, bias, labels = ce_inputs(n_tokens=8)
    loss = ops.linear_cross_entropy(x, weight, None, labels, compute_grad=False)[0]
    with pytest.raises(RuntimeError, match="compute_grad=False"):
        loss.backward()


@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_counts_the_unfused_matmul_flops(bias):
    inputs = ce_inputs(n_tokens=24, hidden=8, vocab=40, bias=bias)

    def flops(loss_fn):
        with FlopCounterMode(display=False) as counter:
            loss_fn(*inputs).backward()
        return counter.get_total_flops()

    unfused = flops(unfused_loss())
    assert unfused == 3 * 2 * 24 * 8 * 40  # forward, grad_x and grad_weight matmuls
    assert flops(fused_loss(5)) == unfused


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns, inside picofx ops too."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "picofx":  # run its CPU kernel with this mode still active
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_never_materializes_logits(bias):
    n_tokens, hidden, vocab, chunk_size = 256, 16, 512, 32
    inputs = ce_inputs(n_tokens=n_tokens, hidden=hidden, vocab=vocab, bias=bias)

    def largest(loss_fn):
        with LargestTensor() as tracker:
            loss_fn(*inputs).backward()
        return tracker.numel

    assert largest(unfused_loss()) >= n_tokens * vocab  # the tracker sees the logits when they exist
    assert largest(fused_loss(chunk_size)) == chunk_size * vocab  # one chunk's logits at most


# ---- opcheck: schema, fake implementation, autograd registration, aot dispatch --------------

OPCHECK_CASES = {
    "mean": lambda: (*ce_inputs(n_tokens=9), -100, "mean", True, 4, True),
    "bias_sum": lambda: (*ce_inputs(n_tokens=9, bias=True), -100, "sum", True, 4, True),
    "no_grad": lambda: (*[t.detach() if t is not None else None for t in ce_inputs(n_tokens=9)],
                        -100, "mean", False, 4, False),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    torch.library.opcheck(torch.ops.picofx.linear_cross_entropy.default, OPCHECK_CASES[case]())


# ---- low-precision chunks: fp32 sums, one scaling pass ------------------------------------

class WeightShapedOutputs(TorchDispatchMode):
    """(op, dtype) of every op output shaped like the weight, (V, C), inside picofx ops too."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.outputs = torch.Size(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "picofx":  # record what its CPU kernel runs, not the op's own outputs
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        out = func(*args, **kwargs)
        self.outputs += [(func.overloadpacket.__name__, t.dtype) for t in tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.shape == self.shape]
        return out


def test_bf16_chunks_add_up_in_fp32_and_the_backward_scales_in_one_pass():
    x, weight, _, labels = ce_inputs(n_tokens=64, hidden=8, vocab=40, dtype=torch.bfloat16)
    with WeightShapedOutputs(weight.shape) as tracker:
        fused_loss(4)(x, weight, None, labels).backward()  # 16 chunks of 4 tokens
    matmuls = [dtype for op, dtype in tracker.outputs if op in ("mm", "addmm", "matmul")]
    others = [op for op, dtype in tracker.outputs if op not in ("mm", "addmm", "matmul", "detach")]
    assert matmuls == [torch.float32] * 16  # each chunk adds into the fp32 sum: no bf16 (V, C) product
    assert sorted(others) == ["_to_copy", "mul"]  # the backward: sum * (grad / count), cast once
    assert weight.grad.dtype == torch.bfloat16


def test_one_bf16_chunk_has_no_accumulator():
    x, weight, _, labels = ce_inputs(n_tokens=16, hidden=8, vocab=40, dtype=torch.bfloat16)
    out = ops.linear_cross_entropy(x.detach(), weight.detach(), None, labels, -100, "mean", True, 16, True, 1.0, 0.0)
    assert out[2].dtype == torch.bfloat16  # one matmul writes the gradient: nothing to add up
    out = ops.linear_cross_entropy(x.detach(), weight.detach(), None, labels, -100, "mean", True, 8, True, 1.0, 0.0)
    assert out[2].dtype == torch.float32  # two chunks: their fp32 sum, rounded once in the backward
