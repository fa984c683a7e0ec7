"""Triton kernel for one chunk of picofx::linear_cross_entropy: loss and grad of the logits.

One program per token row, two sweeps over the vocabulary in BLOCK-wide slices: an online
max / sum-of-exponentials gives the log-sum-exp, then (with COMPUTE_GRAD) the row is
overwritten in place with (softmax - one_hot) * grad_scale in the logits' dtype, so the
chunk needs no second (n, V) buffer. Statistics are fp32. Ignored tokens get loss 0 and
gradient 0. The matmuls around it stay in torch (cuBLAS).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096


@triton.jit
def _cross_entropy_chunk_kernel(
    logits_ptr, labels_ptr, loss_ptr, grad_scale_ptr,
    n_cols, stride_row, ignore_index,
    COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    safe_label = tl.where(valid, label, 0)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(values, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(values - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(row_ptr + safe_label).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.load(grad_scale_ptr), 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            values = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(values - lse) - tl.where(cols == safe_label, 1.0, 0.0)
            tl.store(row_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor, loss_out: torch.Tensor,
                        grad_scale: Optional[torch.Tensor], ignore_index: int,
                        compute_grad: bool) -> Optional[torch.Tensor]:
    """Same contract as the generic `cross_entropy_chunk`; the gradient overwrites `logits`."""
    n_rows, n_cols = logits.shape  # (n, V)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    loss_rows = loss_out if loss_out.is_contiguous() else torch.empty_like(loss_out)
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    _cross_entropy_chunk_kernel[(n_rows,)](
        logits, labels.contiguous(), loss_rows,
        torch.ones((), device=logits.device) if grad_scale is None else grad_scale.to(torch.float32),
        n_cols, logits.stride(0), ignore_index,
        COMPUTE_GRAD=compute_grad, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )
    if loss_rows is not loss_out:
        loss_out.copy_(loss_rows)
    return logits if compute_grad else None
