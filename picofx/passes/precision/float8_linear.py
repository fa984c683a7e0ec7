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

Under tensor parallelism (`split` "colwise" or "rowwise", the weight's piece on this rank) an
operand's scale is the one of the whole tensor: where its amax spans a dimension split over the
ranks, the amax is the maximum over `group` (an all-reduce of one value, or of one per row), so
each rank casts its piece exactly as one process casts the whole (torchao's DTensor amax).
Written here beside each cast, those all-reduces are scheduled in the graphs that run by
tensor_parallel's lowering (picofx.parallel.maxima): the weights' in one collective at the start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import picofx.parallel.collectives  # noqa: F401  (registers torch.ops.picofx.tp_max)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LOW_PRECISION = (torch.bfloat16, torch.float16)
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


def as_rounded(t: Tensor) -> Tensor:
    """t itself, or on the CPU a bf16/fp16 t in fp64 (exact). Inductor's C++ code hands a fused
    consumer of a bf16/fp16 value its producer's unrounded fp32 value (pytorch#115260); that moved
    the amax and the float8 roundings of compiled code off eager's. Its fp64 loads are rounded."""
    return t.to(torch.float64) if t.device.type == "cpu" and t.dtype in LOW_PRECISION else t


# Per tensor-parallel split: the dimension of each matmul's operands (a, b) split over the ranks.
SPLIT_OPERANDS = {
    None: {"output": (None, None), "grad_input": (None, None), "grad_weight": (None, None)},
    # weight (N/tp, K): out (M, N/tp) = x (M, K) @ w.T; grad_x partial = grad (M, N/tp) @ w
    "colwise": {"output": (None, 1), "grad_input": (1, 0), "grad_weight": (0, None)},
    # weight (N, K/tp): out partial = x (M, K/tp) @ w.T (K/tp, N); grad_w = grad.T @ x (M, K/tp)
    "rowwise": {"output": (1, 0), "grad_input": (None, 1), "grad_weight": (None, 1)},
}


def float8_scale(t: Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool,
                 split_dim: int | None = None, group: str | None = None) -> Tensor:
    """fp32 scale with t * scale spanning dtype's range: one value (dim None) or one per slice along
    `dim` (kept as a size-1 dimension). Computed in fp64 so eager and compiled code agree. With t
    a piece split along `split_dim` over `group`, the amax spanning it is the group's maximum."""
    t = as_rounded(t)
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    if group is not None and split_dim is not None and dim in (None, split_dim):
        amax = torch.ops.picofx.tp_max(amax, group)
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=SMALLEST_AMAX)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_float8(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """t * scale in fp32, saturated to dtype's finite range, in dtype."""
    largest = torch.finfo(dtype).max
    rounded = as_rounded(t)
    if rounded is t:
        scaled = t.to(torch.float32) * scale
    else:  # exact in fp64: rounded to fp32 it is eager's fp32 product
        scaled = (rounded * scale.to(torch.float64)).to(torch.float32)
    return scaled.clamp(min=-largest, max=largest).to(dtype)


def scaled_matmul(a: Tensor, b: Tensor, casts: tuple[Cast, Cast], power_of_2: bool, fast_accum: bool,
                  splits: tuple = (None, None), group: str | None = None,
                  b_float8: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """a @ b (a: (M, C), b: (C, N)) in a's dtype, each operand cast as `casts` says; `splits`: the
    dimension of each operand split over `group` (None: whole); b_float8: b already cast tensorwise,
    (b8, its scale) (b is then not read)."""
    cast_a, cast_b = casts
    if cast_a.dtype is None:  # the recipes keep both operands of a matmul high-precision, or neither
        return torch.mm(a, b)
    scale_a = float8_scale(a, cast_a.dtype, 1 if cast_a.rowwise else None, power_of_2, splits[0], group)  # (M, 1)/()
    if b_float8 is None:
        scale_b = float8_scale(b, cast_b.dtype, 0 if cast_b.rowwise else None, power_of_2, splits[1], group)  # (1, N)/()
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
    def forward(ctx, x: Tensor, weight: Tensor, recipe: str, split: str | None, group: str | None,
                weight8: Tensor | None = None, weight_scale: Tensor | None = None) -> Tensor:
        ctx.recipe, ctx.splits, ctx.group = RECIPES[recipe], SPLIT_OPERANDS[split], group
        ctx.weight_dtype = weight.dtype
        # given weight8 (the weight cast tensorwise to e4m3 with weight_scale), `weight` only takes its gradient
        ctx.save_for_backward(x, weight if weight8 is None else weight8, weight_scale)
        r = ctx.recipe
        x2 = x.reshape(-1, x.shape[-1])                                                          # (M, K)
        given = None if weight8 is None else (weight8.t(), weight_scale)
        out = scaled_matmul(x2, weight.t(), r.output, r.power_of_2_scales, True, ctx.splits["output"], group,
                            b_float8=given)                                                      # (M, N)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, weight_scale = ctx.saved_tensors
        r = ctx.recipe
        given = None if weight_scale is None else (weight, weight_scale)  # tensorwise: the forward's cast again
        x2, grad2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])               # (M, K), (M, N)
        splits, group = ctx.splits, ctx.group
        grad_x = scaled_matmul(grad2, weight, r.grad_input, r.power_of_2_scales, False, splits["grad_input"], group,
                               b_float8=given)                                                   # (M, K)
        grad_w = scaled_matmul(grad2.t(), x2, r.grad_weight, r.power_of_2_scales, False, splits["grad_weight"], group)
        return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(ctx.weight_dtype), None, None, None, None, None


def float8_linear(x: Tensor, weight: Tensor, recipe: str, split: str | None = None, group: str | None = None,
                  weight8: Tensor | None = None, weight_scale: Tensor | None = None) -> Tensor:
    """x @ weight.T with the matmuls of the forward and of both gradients in float8 (`recipe`);
    `split`: the weight is this rank's colwise or rowwise piece under tensor parallelism over `group`.
    With weight8 and weight_scale (tensorwise only: the weight's e4m3 cast and its scale, as the shard
    pass gathers them), those are the weight the matmuls read, and `weight`, whose values are not
    read, receives the weight's gradient."""
    if weight8 is not None and recipe != "tensorwise":
        raise ValueError(f"float8_linear: a weight cast ahead (weight8) needs the tensorwise recipe, not {recipe!r} "
                         "(its scales are per tensor); pass the weight alone.")
    return Float8Linear.apply(x, weight, recipe, split, group, weight8, weight_scale)
