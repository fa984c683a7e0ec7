"""Gated activations after a merged gate/up projection: SwiGLU's silu(gate) * up, and the
GeLU-tanh variant (Gemma's GeGLU), gelu(gate, approximate="tanh") * up.

    picofx::silu_mul(Tensor a, Tensor b) -> Tensor
        F.silu(a) * b. a and b have the same shape; they may be strided views (the two halves
        of a merged gate/up matmul's output), the result is contiguous. Output dtype is the
        promotion of a's and b's dtypes.

    picofx::silu_mul_backward(Tensor grad, Tensor a, Tensor b) -> (Tensor grad_a, Tensor grad_b)

    picofx::gelu_mul(Tensor a, Tensor b) -> Tensor
    picofx::gelu_mul_backward(Tensor grad, Tensor a, Tensor b) -> (Tensor grad_a, Tensor grad_b)
        The same with F.gelu(a, approximate="tanh") for F.silu(a). It has no Triton kernel: on
        CUDA it runs the plain-torch code (Inductor fuses it when it compiles the graph).

The backward saves a and b only; the activation is recomputed.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from picofx.kernels.lowering import register_triton_lowering

try:
    from picofx.kernels import triton_swiglu
except ImportError:  # no triton: CUDA runs the generic code below
    triton_swiglu = None


def silu_mul_reference(a: Tensor, b: Tensor) -> Tensor:
    return F.silu(a) * b


def silu_mul_backward_reference(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    grad_a = torch.ops.aten.silu_backward(grad.mul(b).to(a.dtype), a)
    grad_b = grad.mul(F.silu(a)).to(b.dtype)
    return grad_a, grad_b


def gelu_mul_reference(a: Tensor, b: Tensor) -> Tensor:
    return F.gelu(a, approximate="tanh") * b


def gelu_mul_backward_reference(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    grad_a = torch.ops.aten.gelu_backward(grad.mul(b).to(a.dtype), a, approximate="tanh")
    grad_b = grad.mul(F.gelu(a, approximate="tanh")).to(b.dtype)
    return grad_a, grad_b


def gated_product_ops(name: str, reference, backward_reference):
    """The custom op `picofx::<name>` (reference(a, b), contiguous) and its backward op
    `picofx::<name>_backward`, which saves a and b and recomputes the activation."""

    @torch.library.custom_op(f"picofx::{name}", mutates_args=())
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return reference(a, b).contiguous()

    @forward.register_fake
    def _(a, b):
        torch._check(a.shape == b.shape, lambda: f"{name}: a and b must have the same shape")
        return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))

    @torch.library.custom_op(f"picofx::{name}_backward", mutates_args=())
    def backward(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        grad_a, grad_b = backward_reference(grad, a, b)
        return grad_a.contiguous(), grad_b.contiguous()

    @backward.register_fake
    def _(grad, a, b):
        return a.new_empty(a.shape), b.new_empty(b.shape)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    forward.register_autograd(lambda ctx, grad: backward(grad, *ctx.saved_tensors), setup_context=setup_context)
    return forward, backward


silu_mul, silu_mul_backward = gated_product_ops("silu_mul", silu_mul_reference, silu_mul_backward_reference)
gelu_mul, gelu_mul_backward = gated_product_ops("gelu_mul", gelu_mul_reference, gelu_mul_backward_reference)


if triton_swiglu is not None:
    def _silu_mul_kernel(a, b):
        if not triton_swiglu.supports(a, b):
            return silu_mul_reference(a, b).contiguous()
        return triton_swiglu.silu_mul(a, b)

    def _silu_mul_backward_kernel(grad, a, b):
        if not triton_swiglu.supports(a, b):
            return tuple(t.contiguous() for t in silu_mul_backward_reference(grad, a, b))
        return triton_swiglu.silu_mul_backward(grad, a, b)

    silu_mul.register_kernel("cuda")(_silu_mul_kernel)
    silu_mul_backward.register_kernel("cuda")(_silu_mul_backward_kernel)
    register_triton_lowering(silu_mul, _silu_mul_kernel)
    register_triton_lowering(silu_mul_backward, _silu_mul_backward_kernel, serves=("picofx::silu_mul",))
