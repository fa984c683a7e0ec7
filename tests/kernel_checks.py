"""Shared checks for the kernel tests: a fused op against the unfused graph it replaces."""
import torch
from torch.utils._pytree import tree_leaves

EPS = 1e-5
FP32 = dict(rtol=1e-5, atol=1e-6, equal_nan=True)  # nan: a mean over no tokens


def assert_close_bf16(actual, expected):
    # bf16 keeps 8 significant bits (one step = 2**-8 relative): the fused ops round once where
    # the unfused graph rounds after every op, so values differ by a few steps, and an
    # element near zero by a few steps of the tensor's scale, hence atol relative to the max.
    scale = expected.detach().float().nan_to_num().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2 * scale, equal_nan=True)


def assert_close(actual, expected, low_precision=False):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if low_precision:
        assert_close_bf16(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, **FP32)


def check_matches_unfused(fused, unfused, *inputs, low_precision=False):
    """Same outputs, and the same gradient for every input that requires one."""
    def copies():
        return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                for t in inputs]
    fused_inputs, unfused_inputs = copies(), copies()
    fused_out = tree_leaves(fused(*fused_inputs))
    unfused_out = tree_leaves(unfused(*unfused_inputs))
    for actual, expected in zip(fused_out, unfused_out, strict=True):
        assert_close(actual, expected, low_precision)
    grads_out = [torch.randn_like(t) for t in unfused_out]
    wants_grad = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    fused_grads = torch.autograd.grad(fused_out, [fused_inputs[i] for i in wants_grad], grads_out)
    unfused_grads = torch.autograd.grad(unfused_out, [unfused_inputs[i] for i in wants_grad], grads_out)
    for actual, expected in zip(fused_grads, unfused_grads, strict=True):
        assert_close(actual, expected, low_precision)


def randn(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)
