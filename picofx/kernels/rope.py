"""Rotary position embedding (rotate-half form) applied to queries and keys in one op.

    picofx::rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor q_out, Tensor k_out)
        x * cos + rotate_half(x) * sin for x in (q, k), rotate_half(x) = cat(-x2, x1) over the
        halves of the last dim. cos and sin broadcast to q and to k, e.g. q (B, T, H, D) with
        cos (T, 1, D), or q (B, H, T, D) with cos (B, 1, T, D); q and k may have different
        head counts (grouped-query attention). Outputs are contiguous, of q's (k's) shape, in
        the promotion of the input dtypes.

    picofx::rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin) -> (Tensor, Tensor)
        The gradient with respect to q and k (the transposed rotation), in grad's dtype.

cos and sin get gradients too when they require them (summed to their shapes); only then are
q and k saved for the backward.
"""
import torch
from torch import Tensor

try:
    from picofx.kernels import triton_rope
except ImportError:  # no triton: CUDA runs the generic code below
    triton_rope = None


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_transposed(y: Tensor) -> Tensor:
    """The adjoint of rotate_half: cat(y2, -y1)."""
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat((y2, -y1), dim=-1)


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_backward_reference(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return (grad_q * cos + rotate_half_transposed(grad_q * sin),
            grad_k * cos + rotate_half_transposed(grad_k * sin))


def _out_like(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    torch._check(tuple(torch.broadcast_shapes(x.shape, cos.shape, sin.shape)) == tuple(x.shape),
                 lambda: f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must broadcast to {tuple(x.shape)}")
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op("picofx::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    q_out, k_out = rope_reference(q, k, cos, sin)
    return q_out.contiguous(), k_out.contiguous()


@rope.register_fake
def _(q, k, cos, sin):
    return _out_like(q, cos, sin), _out_like(k, cos, sin)


def _rope_setup_context(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.cos_sin_need_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.cos_sin_need_grad else ()))


def _rope_backward(ctx, grad_q, grad_k):
    cos, sin, *q_k = ctx.saved_tensors
    grad_q_in, grad_k_in = torch.ops.picofx.rope_backward(grad_q, grad_k, cos, sin)
    grad_cos = grad_sin = None
    if ctx.cos_sin_need_grad:
        q, k = q_k
        grad_cos = ((grad_q * q).sum_to_size(cos.shape) + (grad_k * k).sum_to_size(cos.shape)).to(cos.dtype)
        grad_sin = ((grad_q * rotate_half(q)).sum_to_size(sin.shape)
                    + (grad_k * rotate_half(k)).sum_to_size(sin.shape)).to(sin.dtype)
    return grad_q_in.to(ctx.q_dtype), grad_k_in.to(ctx.k_dtype), grad_cos, grad_sin


rope.register_autograd(_rope_backward, setup_context=_rope_setup_context)


@torch.library.custom_op("picofx::rope_backward", mutates_args=())
def rope_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    grad_q_in, grad_k_in = rope_backward_reference(grad_q, grad_k, cos, sin)
    return grad_q_in.contiguous(), grad_k_in.contiguous()


@rope_backward.register_fake
def _(grad_q, grad_k, cos, sin):
    return _out_like(grad_q, cos, sin), _out_like(grad_k, cos, sin)


if triton_rope is not None:
    @rope.register_kernel("cuda")
    def _(q, k, cos, sin):
        if not (triton_rope.supports(q, cos, sin) and triton_rope.supports(k, cos, sin)):
            return tuple(t.contiguous() for t in rope_reference(q, k, cos, sin))
        return triton_rope.rope(q, cos, sin), triton_rope.rope(k, cos, sin)

    @rope_backward.register_kernel("cuda")
    def _(grad_q, grad_k, cos, sin):
        if not (triton_rope.supports(grad_q, cos, sin) and triton_rope.supports(grad_k, cos, sin)):
            return tuple(t.contiguous() for t in rope_backward_reference(grad_q, grad_k, cos, sin))
        return triton_rope.rope(grad_q, cos, sin, transposed=True), triton_rope.rope(grad_k, cos, sin, transposed=True)
