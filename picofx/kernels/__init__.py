"""Fused ops that the fuse pass rewrites LLaMA blocks to call, registered under torch.ops.picofx.

Each op is a torch.library custom op with a fake implementation (export and torch.compile
see through it), an autograd formula calling a fused backward op, a plain-torch
implementation (CPU, and CUDA without triton) and a Triton one for CUDA:

    rms_norm, add_rms_norm, rms_norm_backward          rms_norm.py     / triton_rms_norm.py
    silu_mul, silu_mul_backward                        swiglu.py       / triton_swiglu.py
    gelu_mul, gelu_mul_backward                        swiglu.py       (no Triton kernel)
    rope, rope_backward                                rope.py         / triton_rope.py
    linear_cross_entropy                               linear_cross_entropy.py / triton_cross_entropy.py

Signatures and semantics are in each module's docstring. Under Inductor each pointwise op is either
decomposed (`inductor_decompositions`) or, on CUDA, launched as its Triton kernel through wrap_triton
(lowering.py): never an opaque call.
"""
import torch

from picofx.kernels.linear_cross_entropy import (DEFAULT_CHUNK_SIZE, linear_cross_entropy,
                                                 linear_cross_entropy_decomposition)
from picofx.kernels.rms_norm import add_rms_norm_reference, rms_norm_backward_reference, rms_norm_reference
from picofx.kernels.rope import rope_backward_in_place_order, rope_in_place_order
from picofx.kernels.swiglu import (gelu_mul_backward_reference, gelu_mul_reference, silu_mul_backward_reference,
                                  silu_mul_reference)

__all__ = ["DEFAULT_CHUNK_SIZE", "inductor_decompositions", "linear_cross_entropy"]


def inductor_decompositions() -> dict:
    """Plain-torch decompositions of the pointwise fused ops and their backward ops.

    For compiling with Inductor, on every device: decomposed, they become ordinary ATen nodes
    that Inductor fuses with their neighbours (C++ loops on CPU, Triton on CUDA), instead of
    opaque calls; on CUDA the ops lowered to their Triton kernels (lowering.py) never reach
    this table. They apply below autograd, so the backward is still the op's own formula
    (rms_norm_backward, ...), only decomposed too. linear_cross_entropy decomposes
    with its chunks unrolled (on CPU: one call of its own kernel, measured faster there).
    """
    ops = torch.ops.picofx
    return {
        ops.rms_norm.default: rms_norm_reference,
        ops.add_rms_norm.default: add_rms_norm_reference,
        ops.rms_norm_backward.default: rms_norm_backward_reference,
        ops.silu_mul.default: silu_mul_reference,
        ops.silu_mul_backward.default: silu_mul_backward_reference,
        ops.gelu_mul.default: gelu_mul_reference,
        ops.gelu_mul_backward.default: gelu_mul_backward_reference,
        ops.rope.default: rope_in_place_order,
        ops.rope_backward.default: rope_backward_in_place_order,
        ops.linear_cross_entropy.default: linear_cross_entropy_decomposition,
    }
