"""RMSNorm, alone and fused with the residual add before it.

    picofx::rms_norm(Tensor x, Tensor weight, float eps, float offset=0.0, ScalarType? out_dtype=None) -> Tensor
        (weight + offset) * (xf * rsqrt(mean(xf ** 2, -1) + eps)).to(x.dtype), with xf = x.float().
        Statistics in fp32; the output dtype is the promotion of weight's and x's dtypes
        (an fp32 weight times a bf16 x gives fp32), or out_dtype where given: the product is then
        rounded to it once, at the end (the precision pass hands bf16 matmuls the norm of an fp32
        stream so, as autocast does). weight is (C,), x is (..., C). offset is 0
        for LLaMA's norm, 1 for Gemma's, which scales by (1 + weight).

    picofx::add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset=0.0,
                         ScalarType? out_dtype=None) -> (Tensor sum, Tensor normed)
        sum = x + residual; normed = rms_norm(sum, weight, eps, offset, out_dtype), in one pass over
        the row. x and residual have the same shape; out_dtype applies to normed only.

    picofx::rms_norm_backward(Tensor grad_out, Tensor x, Tensor weight, float eps, Tensor? grad_sum)
        -> (Tensor grad_x, Tensor grad_weight)
        The gradient of rms_norm (weight here is the scale, weight + offset); grad_sum (the gradient flowing into add_rms_norm's `sum`
        output) is added to grad_x in the same pass.

The backward saves x (for add_rms_norm: sum) and weight only: the per-row rstd is recomputed
from x in the backward, where it is one more reduction over a row the backward reads anyway,
instead of being an extra op output that every graph using rms_norm would have to carry.
All outputs are contiguous.
"""
from typing import Optional

import torch
from torch import Tensor

from picofx.kernels.lowering import register_triton_lowering

try:
    from picofx.kernels import triton_rms_norm
except ImportError:  # no triton: CUDA runs the generic code below
    triton_rms_norm = None


def _scale(weight: Tensor, offset: float) -> Tensor:
    return weight + offset if offset else weight


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                       out_dtype: Optional[torch.dtype] = None) -> Tensor:
    xf = x.float()
    out = _scale(weight, offset) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if out_dtype is None else out.to(out_dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                           out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    total = x + residual
    return total, rms_norm_reference(total, weight, eps, offset, out_dtype)


def rms_norm_backward_reference(grad_out: Tensor, x: Tensor, weight: Tensor, eps: float,
                                grad_sum: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    # The steps are those autograd takes through the unfused graph, in the same order: when
    # the two terms of grad_xf nearly cancel (narrow rows), any other order differs visibly.
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    normed = (xf * rstd).to(x.dtype)
    grad_weight = (grad_out * normed).sum_to_size(weight.shape).to(weight.dtype)  # (C,)
    # The forward rounds to x.dtype before multiplying by weight, so its gradient does too.
    grad_normed = (grad_out * weight).to(x.dtype).float()
    grad_rstd = (grad_normed * xf).sum(-1, keepdim=True)
    grad_mean_square = -0.5 * grad_rstd * rstd.pow(3)
    grad_xf = grad_normed * rstd + (grad_mean_square / x.shape[-1]) * (2 * xf)
    if grad_sum is not None:
        grad_xf = grad_xf + grad_sum.float()
    return grad_xf.to(x.dtype), grad_weight


def _out_dtype(x: Tensor, weight: Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    return out_dtype if out_dtype is not None else torch.promote_types(x.dtype, weight.dtype)


# ---- picofx::rms_norm -------------------------------------------------------------------

@torch.library.custom_op("picofx::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return rms_norm_reference(x, weight, eps, offset, out_dtype).contiguous()


@rms_norm.register_fake
def _(x, weight, eps, offset=0.0, out_dtype=None):
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight, out_dtype))


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, *rest = inputs
    ctx.save_for_backward(x, weight)  # x as it came: with out_dtype, an fp32 stream stays fp32 here
    ctx.eps, ctx.offset = eps, (rest or [0.0])[0]


def _rms_norm_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.picofx.rms_norm_backward(grad_out, x, _scale(weight, ctx.offset), ctx.eps, None)
    return grad_x, grad_weight, None, None, None


rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


# ---- picofx::add_rms_norm ---------------------------------------------------------------

@torch.library.custom_op("picofx::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    total, normed = add_rms_norm_reference(x, residual, weight, eps, offset, out_dtype)
    return total.contiguous(), normed.contiguous()


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset=0.0, out_dtype=None):
    torch._check(x.shape == residual.shape, lambda: "add_rms_norm: x and residual must have the same shape")
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    normed_dtype = out_dtype if out_dtype is not None else torch.promote_types(sum_dtype, weight.dtype)
    return x.new_empty(x.shape, dtype=sum_dtype), x.new_empty(x.shape, dtype=normed_dtype)


def _add_rms_norm_setup_context(ctx, inputs, output):
    x, residual, weight, eps, *rest = inputs
    total, _ = output
    ctx.save_for_backward(total, weight)
    ctx.eps, ctx.offset = eps, (rest or [0.0])[0]
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype


def _add_rms_norm_backward(ctx, grad_sum, grad_normed):
    total, weight = ctx.saved_tensors
    grad_total, grad_weight = torch.ops.picofx.rms_norm_backward(grad_normed, total, _scale(weight, ctx.offset),
                                                                 ctx.eps, grad_sum)
    return grad_total.to(ctx.x_dtype), grad_total.to(ctx.residual_dtype), grad_weight, None, None, None


add_rms_norm.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)


# ---- picofx::rms_norm_backward ----------------------------------------------------------

@torch.library.custom_op("picofx::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad_out: Tensor, x: Tensor, weight: Tensor, eps: float,
                      grad_sum: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    grad_x, grad_weight = rms_norm_backward_reference(grad_out, x, weight, eps, grad_sum)
    return grad_x.contiguous(), grad_weight


@rms_norm_backward.register_fake
def _(grad_out, x, weight, eps, grad_sum=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# ---- CUDA: Triton when it is installed and the row fits in one block ----------------------
# The kernels take the scale: with an offset, weight + offset is one (C,) op before them.

if triton_rms_norm is not None:
    def _rms_norm_kernel(x, weight, eps, offset=0.0, out_dtype=None):
        if not triton_rms_norm.supports(x):
            return rms_norm_reference(x, weight, eps, offset, out_dtype).contiguous()
        return triton_rms_norm.rms_norm(x, _scale(weight, offset), eps, out_dtype)

    def _add_rms_norm_kernel(x, residual, weight, eps, offset=0.0, out_dtype=None):
        if not triton_rms_norm.supports(x):
            return tuple(t.contiguous() for t in add_rms_norm_reference(x, residual, weight, eps, offset, out_dtype))
        return triton_rms_norm.add_rms_norm(x, residual, _scale(weight, offset), eps, out_dtype)

    def _rms_norm_backward_kernel(grad_out, x, weight, eps, grad_sum=None):
        if not triton_rms_norm.supports(x):
            grad_x, grad_weight = rms_norm_backward_reference(grad_out, x, weight, eps, grad_sum)
            return grad_x.contiguous(), grad_weight
        return triton_rms_norm.rms_norm_backward(grad_out, x, weight, eps, grad_sum)

    rms_norm.register_kernel("cuda")(_rms_norm_kernel)
    add_rms_norm.register_kernel("cuda")(_add_rms_norm_kernel)
    rms_norm_backward.register_kernel("cuda")(_rms_norm_backward_kernel)
    # Under Inductor for CUDA (picofx.kernels.lowering): the same kernels, seen and launched by Inductor.
    register_triton_lowering(rms_norm, _rms_norm_kernel)
    register_triton_lowering(add_rms_norm, _add_rms_norm_kernel)
    register_triton_lowering(rms_norm_backward, _rms_norm_backward_kernel,
                             serves=("picofx::rms_norm", "picofx::add_rms_norm"))
