"""A linear layer's three matmuls in float8, with dynamic scales, as plain ATen ops.

    float8_linear(x, weight, recipe) == x @ weight.T      x: (..., K), weight: (N, K), out: (..., N)

The forward and both gradients are `torch._scaled_mm` calls on operands cast to float8 just
before them: the amax of each operand (over the whole tensor, or per row along the reduced
dimension), a scale that maps it onto the float8 format's largest finite value, the saturated
cast, and the inverse scales handed to the matmul. `_scaled_mm` has no autograd formula, so the
three matmuls sit in one `torch.autograd.Function`: when aot_autograd traces the graph that
calls it, its forward lands in the forward graph and its backward in the backward graph, every
cast, amax and `_scaled_mm` a node of its own (Inductor fuses the casts with their producers).
The backward saves the high-precision x and weight and casts them again where a gradient needs
them, as torchao's float8 linear does.

Recipes (torchao 0.18's names and numerics):
    tensorwise          one scale per tensor; x, weight in e4m3fn, the output gradient in e5m2.
    rowwise             one scale per row of the reduced dimension, rounded down to a power of 2;
                        every operand in e4m3fn.
    rowwise_with_gw_hp  as rowwise for the output; the input gradient from a rowwise e4m3 output
                        gradient and a tensorwise e4m3 weight; the weight gradient in high precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALLEST_AMAX = 1e-12  # an all-zero operand gets a finite scale


@dataclass(frozen=True)
class Cast:
    """How one operand of a matmul is cast: to `dtype` (None: kept high precision), with one scale
    for the tensor or one per row along the reduced dimension."""
    dtype: torch.dtype | None
    rowwise: bool = False


@dataclass(frozen=True)
class Recipe:
    name: str
    output: tuple[Cast, Cast]        # x, weight.T
    grad_input: tuple[Cast, Cast]    # grad, weight
    grad_weight: tuple[Cast, Cast]   # grad.T, x
    power_of_2_scales: bool


_TENSORWISE_X, _TENSORWISE_GRAD = Cast(E4M3), Cast(E5M2)
_ROWWISE = Cast(E4M3, rowwise=True)
_HIGH = Cast(None)
RECIPES = {r.name: r for r in (
    Recipe("tensorwise", (_TENSORWISE_X, _TENSORWISE_X), (_TENSORWISE_GRAD, _TENSORWISE_X),
           (_TENSORWISE_GRAD, _TENSORWISE_X), power_of_2_scales=False),
    Recipe("rowwise", (_ROWWISE, _ROWWISE), (_ROWWISE, _ROWWISE), (_ROWWISE, _ROWWISE), power_of_2_scales=True),
    Recipe("rowwise_with_gw_hp", (_ROWWISE, _ROWWISE), (_ROWWISE, Cast(E4M3)), (_HIGH, _HIGH),
           power_of_2_scales=True),
)}


def float8_scale(t: Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool) -> Tensor:
    """fp32 scale with t * scale spanning dtype's range: one value (dim None) or one per slice along
    `dim` (kept as a size-1 dimension). Computed in fp64 so eager and compiled code agree."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=SMALLEST_AMAX)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_float8(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """t * scale in fp32, saturated to dtype's finite range, in dtype."""
    largest = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-largest, max=largest).to(dtype)


def scaled_matmul(a: Tensor, b: Tensor, casts: tuple[Cast, Cast], power_of_2: bool, fast_accum: bool,
                  b_float8: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """a @ b (a: (M, C), b: (C, N)) in a's dtype, each operand cast as `casts` says; b_float8: b already
    cast tensorwise, (b8, its scale) (b is then not read)."""
    cast_a, cast_b = casts
    if cast_a.dtype is None:  # the recipes keep both operands of a matmul high-precision, or neither
        return torch.mm(a, b)
    scale_a = float8_scale(a, cast_a.dtype, 1 if cast_a.rowwise else None, power_of_2)   # (M, 1) or ()
    if b_float8 is None:
        scale_b = float8_scale(b, cast_b.dtype, 0 if cast_b.rowwise else None, power_of_2)   # (1, N) or ()
        b8 = to_float8(b, scale_b, cast_b.dtype)
    else:
        b8, scale_b = b_float8
    a8 = to_float8(a, scale_a, cast_a.dtype).contiguous()              # row-major, as _scaled_mm takes it
    b8 = b8.t().contiguous().t()                                       # column-major
    rowwise = cast_a.rowwise or cast_b.rowwise
    if rowwise:  # _scaled_mm's rowwise form wants both scales rowwise: spread a tensorwise one
        scale_a = scale_a.expand(a.shape[0], 1) if not cast_a.rowwise else scale_a
        scale_b = scale_b.expand(1, b.shape[1]) if not cast_b.rowwise else scale_b
    # The rowwise kernels write bf16 only: compute in bf16 and cast, as torchao does.
    out_dtype = torch.bfloat16 if rowwise else a.dtype
    out = torch._scaled_mm(a8, b8, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(),
                           out_dtype=out_dtype, use_fast_accum=fast_accum)
    return out.to(a.dtype)


class Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: str, weight8: Tensor | None = None,
                weight_scale: Tensor | None = None) -> Tensor:
        ctx.recipe = RECIPES[recipe]
        ctx.weight_dtype = weight.dtype
        # given weight8 (the weight cast tensorwise to e4m3 with weight_scale), `weight` only takes its gradient
        ctx.save_for_backward(x, weight if weight8 is None else weight8, weight_scale)
        r = ctx.recipe
        x2 = x.reshape(-1, x.shape[-1])                                                          # (M, K)
        given = None if weight8 is None else (weight8.t(), weight_scale)
        out = scaled_matmul(x2, weight.t(), r.output, r.power_of_2_scales, fast_accum=True, b_float8=given)  # (M, N)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, weight_scale = ctx.saved_tensors
        r = ctx.recipe
        given = None if weight_scale is None else (weight, weight_scale)  # tensorwise: the forward's cast again
        x2, grad2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])               # (M, K), (M, N)
        grad_x = scaled_matmul(grad2, weight, r.grad_input, r.power_of_2_scales, fast_accum=False,   # (M, K)
                               b_float8=given)
        grad_w = scaled_matmul(grad2.t(), x2, r.grad_weight, r.power_of_2_scales, fast_accum=False)  # (N, K)
        return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(ctx.weight_dtype), None, None, None


def float8_linear(x: Tensor, weight: Tensor, recipe: str, weight8: Tensor | None = None,
                  weight_scale: Tensor | None = None) -> Tensor:
    """x @ weight.T with the matmuls of the forward and of both gradients in float8 (`recipe`). With
    weight8 and weight_scale (tensorwise only: the weight's e4m3 cast and its scale, as the shard pass
    gathers them), those are the weight the matmuls read, and `weight`, whose values are not read,
    receives the weight's gradient."""
    if weight8 is not None and recipe != "tensorwise":
        raise ValueError(f"float8_linear: a weight cast ahead (weight8) needs the tensorwise recipe, not {recipe!r} "
                         "(its scales are per tensor); pass the weight alone.")
    return Float8Linear.apply(x, weight, recipe, weight8, weight_scale)
