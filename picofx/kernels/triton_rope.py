"""Triton kernel for picofx::rope and rope_backward.

x is viewed as (S0, S1, S2, D) with its own strides (any 4-D or smaller layout with a unit
last stride: (B, T, H, D) and the transposed (B, H, T, D) alike), cos and sin are broadcast
to it with stride-0 views, so they are read in place, never expanded in memory. Each program
rotates BLOCK_ROWS rows into an output of x's shape with its own strides (the caller's layout).

    forward:    out1 = x1 * c1 - x2 * s1,   out2 = x2 * c2 + x1 * s2
    transposed: out1 = g1 * c1 + g2 * s2,   out2 = g2 * c2 - g1 * s1   (the backward)
"""
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

BLOCK_ROWS = 16


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return x.numel() > 0 and x.shape[-1] % 2 == 0 and max(x.dim(), cos.dim(), sin.dim()) <= 4


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    n_rows, size1, size2, half,
    x_stride0, x_stride1, x_stride2,
    out_stride0, out_stride1, out_stride2,
    cos_stride0, cos_stride1, cos_stride2,
    sin_stride0, sin_stride1, sin_stride2,
    TRANSPOSED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    i0 = rows // (size1 * size2)
    i1 = (rows // size2) % size1
    i2 = rows % size2
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < half)
    x_row = (i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2)[:, None] + cols
    cos_row = (i0 * cos_stride0 + i1 * cos_stride1 + i2 * cos_stride2)[:, None] + cols
    sin_row = (i0 * sin_stride0 + i1 * sin_stride1 + i2 * sin_stride2)[:, None] + cols
    x1 = tl.load(x_ptr + x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + cos_row, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cos_row + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + sin_row, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + sin_row + half, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSED:
        out1 = x1 * c1 + x2 * s2
        out2 = x2 * c2 - x1 * s1
    else:
        out1 = x1 * c1 - x2 * s1
        out2 = x2 * c2 + x1 * s2
    out_row = (i0 * out_stride0 + i1 * out_stride1 + i2 * out_stride2)[:, None] + cols
    tl.store(out_ptr + out_row, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out_row + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D) rotated by cos/sin broadcast to x's shape, into `out` (x's shape, a unit last
    stride; default: a new contiguous tensor in the promoted dtype)."""
    shape4 = (1,) * (4 - x.dim()) + tuple(x.shape)
    x4 = _unit_last_stride(x).view(shape4) if x.dim() < 4 else _unit_last_stride(x)
    cos4 = _unit_last_stride(cos).broadcast_to(shape4)
    sin4 = _unit_last_stride(sin).broadcast_to(shape4)
    if out is None:
        dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    out4 = out[(None,) * (4 - out.dim())]  # leading dimensions of size 1: their strides are never used
    size0, size1, size2, dim = shape4
    n_rows = size0 * size1 * size2
    wrap_triton(_rope_kernel)[(triton.cdiv(n_rows, BLOCK_ROWS),)](
        x4, cos4, sin4, out, n_rows, size1, size2, dim // 2,
        *x4.stride()[:3], *out4.stride()[:3], *cos4.stride()[:3], *sin4.stride()[:3],
        TRANSPOSED=transposed, BLOCK_ROWS=BLOCK_ROWS, BLOCK_HALF=triton.next_power_of_2(dim // 2),
    )
    return out
