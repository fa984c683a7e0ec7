"""Triton kernels for picofx::rms_norm, add_rms_norm and rms_norm_backward.

One program normalizes one row held in registers, so rows up to MAX_COLS wide are supported
(`supports`); the op registrations fall back to plain torch beyond that. The backward gives
each program a contiguous range of rows and writes one fp32 partial sum of grad_weight per
program, summed by torch afterwards. Rounding follows the unfused graph: the normalized row
is rounded to x.dtype before it meets the weight, in the forward and in the backward.
"""
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

MAX_COLS = 65536


def supports(x: torch.Tensor) -> bool:
    return x.numel() > 0 and x.shape[-1] <= MAX_COLS


def _num_warps(block: int) -> int:
    return min(16, max(4, block // 512))


def _num_programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)  # the interpreter: few programs keep it fast


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    grad_out_ptr, x_ptr, weight_ptr, grad_sum_ptr, grad_x_ptr, grad_weight_partial_ptr,
    n_rows, n_cols, rows_per_program, eps,
    HAS_GRAD_SUM: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # the row loop below counts in int64
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)
        grad_weight += grad_out * normed
        grad_normed = (grad_out * weight).to(x.dtype).to(tl.float32)
        row_dot = tl.sum(grad_normed * xf, axis=0) / n_cols
        grad_x = rstd * (grad_normed - xf * (rstd * rstd) * row_dot)
        if HAS_GRAD_SUM:
            grad_x += tl.load(grad_sum_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_weight_partial_ptr + pid * n_cols + cols, grad_weight, mask=mask)


def _forward(x, residual, weight, eps, out_dtype=None):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()  # (N, C)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = out_dtype if out_dtype is not None else torch.promote_types(sum_dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = None
    if residual is not None:
        residual = residual.reshape(-1, n_cols).contiguous()
        total = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    block = triton.next_power_of_2(n_cols)
    wrap_triton(_rms_norm_forward_kernel)[(x2.shape[0],)](
        x2, residual, weight.contiguous(), total, out, n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype=None) -> torch.Tensor:
    return _forward(x, None, weight, eps, out_dtype)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype=None):
    return _forward(x, residual, weight, eps, out_dtype)


def rms_norm_backward(grad_out, x, weight, eps, grad_sum=None):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()  # (N, C)
    n_rows = x2.shape[0]
    grad_out = grad_out.reshape(-1, n_cols).contiguous()
    if grad_sum is not None:
        grad_sum = grad_sum.reshape(-1, n_cols).contiguous()
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows_per_program = triton.cdiv(n_rows, _num_programs(n_rows, x.device))
    n_programs = triton.cdiv(n_rows, rows_per_program)
    grad_weight_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    wrap_triton(_rms_norm_backward_kernel)[(n_programs,)](
        grad_out, x2, weight.contiguous(), grad_sum, grad_x, grad_weight_partial,
        n_rows, n_cols, rows_per_program, eps,
        HAS_GRAD_SUM=grad_sum is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return grad_x, grad_weight_partial.sum(0).to(weight.dtype)
