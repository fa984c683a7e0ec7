"""Fusion rules for gated MLPs: SwiGLU's (and GeGLU's) act(gate) * up over two projections of one
input, and the gated activation alone, after a merged gate/up projection that the model already has
(Phi-3's gate_up_proj chunked, MoE experts' grouped matmul split in two).

The projections stay the model's own matmuls, one per weight; no rule merges them. A merged matmul
would need the weights in one tensor: concatenated in the graph, that copies every weight each step
and concatenates the gradients in the backward (at Llama-3.2-1B's shape in bf16, ~2.5 GB and ~10 GB
a step) to save re-reading the input in matmuls whose time is compute, not memory; see
docs/passes/fuse.md, "Projections".
"""
import torch
import torch.nn.functional as F

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.rewrite import Rule, register_rule, tensor


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# the activation -> the fused op computing act(gate) * up
GATED_OPS = {F.silu: "silu_mul", gelu_tanh: "gelu_mul"}


def _gated(act, gate, up):
    return getattr(torch.ops.picofx, GATED_OPS[act])(gate, up)


def swiglu_pattern(x, w_gate, w_up, b_gate, b_up, act):
    return act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


def swiglu_replacement(x, w_gate, w_up, b_gate, b_up, act):
    return _gated(act, F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up))


def gated_activation_pattern(gate, up, act, up_first):
    return up * act(gate) if up_first else act(gate) * up


def gated_activation_replacement(gate, up, act, up_first):
    return _gated(act, gate, up)


def same_shape(match):
    gate, up = match.val("gate"), match.val("up")
    if tuple(gate.shape) != tuple(up.shape):
        return f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape: the product broadcasts"
    return None


def same_projection_shape(match):
    """The fused op takes gate and up of one shape: the weights must give it (no broadcast)."""
    gate, up = match.val("w_gate"), match.val("w_up")
    if tuple(gate.shape) != tuple(up.shape):
        return f"w_gate {tuple(gate.shape)} and w_up {tuple(up.shape)} differ in shape: the product broadcasts"
    return None


def _bias_variants(*names):
    """Without biases (LLaMA), and with one per projection."""
    return ({n: None for n in names}, {n: tensor(32) for n in names})


# Exact: the same two matmuls, then act(gate) * up in one kernel (which rounds once in bf16).
SWIGLU = register_rule(Rule(
    name="swiglu", pattern=swiglu_pattern, replacement=swiglu_replacement,
    inputs={"x": tensor(2, 8, 16), "w_gate": tensor(32, 16), "w_up": tensor(32, 16), "b_gate": None, "b_up": None,
            "act": F.silu},
    variants=[{**bias, "dtype": dtype, "act": act} for bias in _bias_variants("b_gate", "b_up")
              for dtype in (torch.float32, torch.bfloat16)  # silu computes in fp32 for bf16 inputs
              for act in GATED_OPS],
    checks=(same_projection_shape,),
))

# After swiglu (which takes the gated MLPs over two projections): act(gate) * up on any two tensors,
# e.g. the halves of one projection.
GATED_ACTIVATION = register_rule(Rule(
    name="gated_activation", pattern=gated_activation_pattern, replacement=gated_activation_replacement,
    inputs={"gate": tensor(2, 8, 32), "up": tensor(2, 8, 32), "act": F.silu, "up_first": False},
    variants=[{"act": act, "up_first": up_first, "dtype": dtype} for act in GATED_OPS for up_first in (False, True)
              for dtype in (torch.float32, torch.bfloat16)],
    checks=(same_shape,),
))
