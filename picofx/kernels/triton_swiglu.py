"""Triton kernels for picofx::silu_mul and silu_mul_backward.

Inputs are viewed as (rows, cols) with a row stride each, so the two halves of a merged
gate/up matmul's output are read in place; outputs are contiguous. Rounding follows the
unfused graph: silu(a) is rounded to a.dtype before it is multiplied by b.
"""
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

BLOCK_ROWS = 8
BLOCK_COLS = 256


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.shape == b.shape and a.dtype == b.dtype


@triton.jit
def _tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's (rows, cols) tile: its indices and mask. It takes no pointer: Inductor reads
    a kernel's loads and stores to know what it writes, and assumes a callee given a pointer writes it."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS))[None, :]
    return rows, cols, (rows < n_rows) & (cols < n_cols)


@triton.jit
def _silu_mul_forward_kernel(
    a_ptr, b_ptr, out_ptr, n_rows, n_cols, stride_a, stride_b,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    a = tl.load(a_ptr + rows * stride_a + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + rows * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    af = a.to(tl.float32)
    silu = (af * tl.sigmoid(af)).to(a.dtype).to(tl.float32)
    tl.store(out_ptr + rows * n_cols + cols, (silu * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(
    grad_ptr, a_ptr, b_ptr, grad_a_ptr, grad_b_ptr, n_rows, n_cols, stride_a, stride_b,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    a = tl.load(a_ptr + rows * stride_a + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + rows * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    af = a.to(tl.float32)
    sigmoid = tl.sigmoid(af)
    silu = (af * sigmoid).to(a.dtype).to(tl.float32)
    grad_silu = (grad * b).to(a.dtype).to(tl.float32)
    grad_a = grad_silu * sigmoid * (1.0 + af * (1.0 - sigmoid))
    out = rows * n_cols + cols
    tl.store(grad_a_ptr + out, grad_a.to(grad_a_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_b_ptr + out, (grad * silu).to(grad_b_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., cols) -> (rows, cols) with unit column stride, a view where possible."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 else t.contiguous()


def _grid(n_rows, n_cols):
    return (triton.cdiv(n_rows, BLOCK_ROWS), triton.cdiv(n_cols, BLOCK_COLS))


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a2, b2 = _as_rows(a), _as_rows(b)  # (R, I)
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    n_rows, n_cols = a2.shape
    wrap_triton(_silu_mul_forward_kernel)[_grid(n_rows, n_cols)](
        a2, b2, out, n_rows, n_cols, a2.stride(0), b2.stride(0),
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
    )
    return out


def silu_mul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    a2, b2 = _as_rows(a), _as_rows(b)  # (R, I)
    grad = grad.contiguous()
    grad_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    grad_b = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    n_rows, n_cols = a2.shape
    wrap_triton(_silu_mul_backward_kernel)[_grid(n_rows, n_cols)](
        grad, a2, b2, grad_a, grad_b, n_rows, n_cols, a2.stride(0), b2.stride(0),
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
    )
    return grad_a, grad_b
