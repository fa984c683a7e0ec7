"""Fusion rules for RMSNorm: the norm alone, and the residual add before it fused into it.

The norm is matched as four forms: written out as LLaMA does (weight * normed.to(dtype)) or with the
weight on the right (normed.type_as(x) * weight, Meta's and torchtitan's class),
as torch.nn.RMSNorm / F.rms_norm (traced, so the pattern is whatever ATen form capture gives
it), and Gemma's normed * (1 + weight), which becomes the op's offset.
"""
import torch
import torch.nn.functional as F

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.passes.fuse.sites import rotated_half
from picofx.rewrite import Rule, register_rule, scalar, tensor

FLOAT_AND_LOW_PRECISION = ({"dtype": torch.float32}, {"dtype": torch.bfloat16})  # casts vanish in fp32
# The fused backward recomputes rstd and sums the weight gradient in one reduction over rows,
# where autograd through the unfused ops rounds each intermediate: a few ulps in fp32.
RMS_NORM_TOLERANCE = (1e-5, 1e-5)
RMS_NORM_TOLERANCE_REASON = "the fused backward sums in another order than autograd through the unfused ops"


def written_out(x, weight, eps, offset):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def written_out_weight_last(x, weight, eps, offset):
    """Meta's and torchtitan's RMSNorm class: the weight multiplies from the right."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def torch_rms_norm(x, weight, eps, offset):
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def offset_weight(x, weight, eps, offset):
    """Gemma: the scale is (1 + weight), applied in fp32 before the cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)).type_as(x)


def rms_norm_pattern(x, weight, eps, offset, form):
    return form(x, weight, eps, offset)


def rms_norm_replacement(x, weight, eps, offset, form):
    return torch.ops.picofx.rms_norm(x, weight, float(eps), float(offset))


def add_rms_norm_pattern(x, residual, weight, eps, offset):
    total = x + residual
    return total, torch.ops.picofx.rms_norm(total, weight, eps, offset)


def add_rms_norm_replacement(x, residual, weight, eps, offset):
    return torch.ops.picofx.add_rms_norm(x, residual, weight, float(eps), float(offset))


def weight_scales_the_last_dim(match):
    x, weight = match.val("x"), match.val("weight")
    if tuple(weight.shape) != (x.shape[-1],):
        return f"weight is {tuple(weight.shape)}, the fused op takes one weight per channel ({x.shape[-1]},)"
    return None


def same_device(*names):
    def same_device(match):
        devices = {name: match.val(name).device for name in names}
        if len(set(devices.values())) > 1:
            return f"inputs live on different devices: {devices}"
        return None
    return same_device


def not_a_rope(match):
    """q or k normed after RoPE (HunYuan): the add is the rotation's, which the rope rule fuses."""
    if any(rotated_half(match.bindings[name]) for name in ("x", "residual")):
        return "the add sums a RoPE's x * cos and rotate_half(x) * sin: the rope rule fuses it"
    return None


def residual_has_the_same_shape(match):
    x, residual = match.val("x"), match.val("residual")
    if tuple(x.shape) != tuple(residual.shape):
        return f"the add broadcasts {tuple(x.shape)} with {tuple(residual.shape)}: not a residual add"
    if not (x.dtype.is_floating_point and residual.dtype.is_floating_point):
        return f"the add sums {x.dtype} and {residual.dtype}; the fused op adds floating-point tensors"
    return None


RMS_NORM = register_rule(Rule(
    name="rms_norm", pattern=rms_norm_pattern, replacement=rms_norm_replacement,
    inputs={"x": tensor(2, 8, 16), "weight": tensor(16), "eps": scalar(1e-6), "offset": 0.0, "form": written_out},
    variants=[*({**v, "form": form} for form in (written_out, written_out_weight_last, torch_rms_norm)
                for v in FLOAT_AND_LOW_PRECISION),
              {"form": offset_weight, "offset": scalar(0.8125)}],
    checks=(weight_scales_the_last_dim, same_device("x", "weight")),
    tolerance=RMS_NORM_TOLERANCE, tolerance_reason=RMS_NORM_TOLERANCE_REASON,
))

ADD_RMS_NORM = register_rule(Rule(
    name="add_rms_norm", pattern=add_rms_norm_pattern, replacement=add_rms_norm_replacement,
    inputs={"x": tensor(2, 8, 16), "residual": tensor(2, 8, 16), "weight": tensor(16), "eps": scalar(1e-6),
            "offset": scalar(0.8125)},
    checks=(not_a_rope, residual_has_the_same_shape, same_device("x", "residual", "weight")),
    tolerance=RMS_NORM_TOLERANCE, tolerance_reason=RMS_NORM_TOLERANCE_REASON,
))
