"""Rotary position embedding applied to queries and keys in one op: rotate-half form
(Hugging Face, the seed) or interleaved pairs (Meta's complex form).

    picofx::rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> (Tensor q_out, Tensor k_out)
        x * cos + rotate_half(x) * sin for x in (q, k), rotate_half(x) = cat(-x2, x1) over the
        halves of the last dim. cos and sin broadcast to q and to k, e.g. q (B, T, H, D) with
        cos (T, 1, D), or q (B, H, T, D) with cos (B, 1, T, D); q and k may have different
        head counts (grouped-query attention). Outputs have q's (k's) shape and dimension order
        (a transposed projection's (B, H, T, D) view stays (B, T, H, D) in memory, so the
        attention output after it reshapes back without a copy), in the promotion of the input
        dtypes.
        interleaved=True rotates pairs of neighbouring channels, as view_as_complex(x viewed as
        (..., D / 2, 2)) * (cos + i sin) does: out[2j] = x[2j] cos_j - x[2j+1] sin_j,
        out[2j+1] = x[2j+1] cos_j + x[2j] sin_j; cos and sin then broadcast to (..., D / 2).
        It has no Triton kernel: on CUDA it runs the plain-torch code.

    picofx::rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, bool interleaved=False)
        -> (Tensor, Tensor)
        The gradient with respect to q and k (the transposed rotation), in grad's dtype and
        dimension order.

cos and sin get gradients too when they require them (summed to their shapes); only then are
q and k saved for the backward.
"""
import torch
from torch import Tensor

from picofx.kernels.lowering import register_triton_lowering

try:
    from picofx.kernels import triton_rope
except ImportError:  # no triton: CUDA runs the generic code below
    triton_rope = None


def dim_order(x: Tensor) -> list[int]:
    """x's dimensions from the outermost in memory to the innermost (ties in dimension order)."""
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


def layout_like(x: Tensor, y: Tensor) -> Tensor:
    """y (of x's shape) dense in x's dimension order: a permuted copy where the orders differ."""
    order = dim_order(x)
    dense = y.permute(order)
    if dense.is_contiguous():
        return y
    return dense.contiguous().permute(sorted(range(len(order)), key=order.__getitem__))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_transposed(y: Tensor) -> Tensor:
    """The adjoint of rotate_half: cat(y2, -y1)."""
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat((y2, -y1), dim=-1)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, transposed: bool = False) -> Tensor:
    """x (..., D) as D / 2 pairs (x0, x1) rotated by the angle whose cos and sin are (..., D / 2)."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., D / 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    if transposed:  # the adjoint: rotation by the opposite angle
        return torch.stack((x0 * cos + x1 * sin, x1 * cos - x0 * sin), dim=-1).flatten(-2)
    return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    if interleaved:
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_backward_reference(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                            interleaved: bool = False) -> tuple[Tensor, Tensor]:
    if interleaved:
        return rotate_pairs(grad_q, cos, sin, transposed=True), rotate_pairs(grad_k, cos, sin, transposed=True)
    return (grad_q * cos + rotate_half_transposed(grad_q * sin),
            grad_k * cos + rotate_half_transposed(grad_k * sin))


def _table_grads(grad: Tensor, x: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """d(out)/d(cos) and d(out)/d(sin) contracted with grad, before summing to the tables' shapes."""
    if interleaved:
        g, p = grad.unflatten(-1, (-1, 2)), x.unflatten(-1, (-1, 2))
        return g[..., 0] * p[..., 0] + g[..., 1] * p[..., 1], g[..., 1] * p[..., 0] - g[..., 0] * p[..., 1]
    return grad * x, grad * rotate_half(x)


def _out_like(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    rotated = (*x.shape[:-1], x.shape[-1] // 2) if interleaved else tuple(x.shape)
    torch._check(tuple(torch.broadcast_shapes(rotated, cos.shape, sin.shape)) == rotated,
                 lambda: f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must broadcast to {rotated}")
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return torch.empty_permuted(x.shape, dim_order(x), dtype=dtype, device=x.device)  # x's dimension order


def rope_in_place_order(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False):
    """The rotation, each output in its input's dimension order (the op's eager code and its
    decomposition for Inductor)."""
    q_out, k_out = rope_reference(q, k, cos, sin, interleaved)
    return layout_like(q, q_out), layout_like(k, k_out)


def rope_backward_in_place_order(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False):
    grad_q_in, grad_k_in = rope_backward_reference(grad_q, grad_k, cos, sin, interleaved)
    return layout_like(grad_q, grad_q_in), layout_like(grad_k, grad_k_in)


@torch.library.custom_op("picofx::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    return rope_in_place_order(q, k, cos, sin, interleaved)


@rope.register_fake
def _(q, k, cos, sin, interleaved=False):
    return _out_like(q, cos, sin, interleaved), _out_like(k, cos, sin, interleaved)


def _rope_setup_context(ctx, inputs, output):
    q, k, cos, sin, *interleaved = inputs
    ctx.interleaved = bool(interleaved and interleaved[0])
    ctx.cos_sin_need_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.cos_sin_need_grad else ()))


def _rope_backward(ctx, grad_q, grad_k):
    cos, sin, *q_k = ctx.saved_tensors
    grad_q_in, grad_k_in = torch.ops.picofx.rope_backward(grad_q, grad_k, cos, sin, ctx.interleaved)
    grad_cos = grad_sin = None
    if ctx.cos_sin_need_grad:
        (cos_q, sin_q), (cos_k, sin_k) = (_table_grads(g, x, ctx.interleaved) for g, x in zip((grad_q, grad_k), q_k))
        grad_cos = (cos_q.sum_to_size(cos.shape) + cos_k.sum_to_size(cos.shape)).to(cos.dtype)
        grad_sin = (sin_q.sum_to_size(sin.shape) + sin_k.sum_to_size(sin.shape)).to(sin.dtype)
    return grad_q_in.to(ctx.q_dtype), grad_k_in.to(ctx.k_dtype), grad_cos, grad_sin, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup_context)


@torch.library.custom_op("picofx::rope_backward", mutates_args=())
def rope_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                  interleaved: bool = False) -> tuple[Tensor, Tensor]:
    return rope_backward_in_place_order(grad_q, grad_k, cos, sin, interleaved)


@rope_backward.register_fake
def _(grad_q, grad_k, cos, sin, interleaved=False):
    return _out_like(grad_q, cos, sin, interleaved), _out_like(grad_k, cos, sin, interleaved)


if triton_rope is not None:
    def _rope_kernel(q, k, cos, sin, interleaved=False):
        if interleaved or not (triton_rope.supports(q, cos, sin) and triton_rope.supports(k, cos, sin)):
            return rope_in_place_order(q, k, cos, sin, interleaved)
        return tuple(triton_rope.rope(x, cos, sin, out=_out_like(x, cos, sin)) for x in (q, k))

    def _rope_backward_kernel(grad_q, grad_k, cos, sin, interleaved=False):
        if interleaved or not (triton_rope.supports(grad_q, cos, sin) and triton_rope.supports(grad_k, cos, sin)):
            return rope_backward_in_place_order(grad_q, grad_k, cos, sin, interleaved)
        return tuple(triton_rope.rope(g, cos, sin, transposed=True, out=_out_like(g, cos, sin)) for g in (grad_q, grad_k))

    rope.register_kernel("cuda")(_rope_kernel)
    rope_backward.register_kernel("cuda")(_rope_backward_kernel)
    register_triton_lowering(rope, _rope_kernel)
    register_triton_lowering(rope_backward, _rope_backward_kernel, serves=("picofx::rope",))
