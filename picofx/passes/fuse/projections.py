"""Fusion rules for projections that read the same input: SwiGLU's (and GeGLU's) gate and up,
attention's Q, K, V; and the gated activation alone, after a merged gate/up projection that the
model already has (Phi-3's gate_up_proj chunked, MoE experts' grouped matmul split in two).

The merged weight is `cat` of the model's own parameters inside the graph, so the state_dict, the
optimizer and checkpoints keep seeing the original parameters; the matmul's outputs are split back.
"""
import torch
import torch.nn.functional as F

import picofx.kernels  # noqa: F401  (registers torch.ops.picofx)
from picofx.rewrite import Rule, register_rule, tensor


# The merged matmul is one GEMM over more output columns, which the BLAS may block differently:
# the sums over the input dim can round differently from the separate GEMMs' (a few ulps in fp32).
MERGED_MATMUL_TOLERANCE = (1e-5, 1e-5)
MERGED_MATMUL_TOLERANCE_REASON = "the merged GEMM may order the sums over the input dim differently"


def _cat(*tensors):
    return None if tensors[0] is None else torch.cat(tensors)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# the activation -> the fused op computing act(gate) * up
GATED_OPS = {F.silu: "silu_mul", gelu_tanh: "gelu_mul"}


def _gated(act, gate, up):
    return getattr(torch.ops.picofx, GATED_OPS[act])(gate, up)


def swiglu_pattern(x, w_gate, w_up, b_gate, b_up, act):
    return act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


def swiglu_replacement(x, w_gate, w_up, b_gate, b_up, act):
    gate_up = F.linear(x, torch.cat([w_gate, w_up]), _cat(b_gate, b_up))  # (..., 2 * intermediate)
    gate, up = gate_up.split([w_gate.shape[0], w_up.shape[0]], dim=-1)
    return _gated(act, gate, up)


def gated_activation_pattern(gate, up, act, up_first):
    return up * act(gate) if up_first else act(gate) * up


def gated_activation_replacement(gate, up, act, up_first):
    return _gated(act, gate, up)


def same_shape(match):
    gate, up = match.val("gate"), match.val("up")
    if tuple(gate.shape) != tuple(up.shape):
        return f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape: the product broadcasts"
    return None


def qkv_projection_pattern(x, w_q, w_k, w_v, b_q, b_k, b_v):
    return F.linear(x, w_q, b_q), F.linear(x, w_k, b_k), F.linear(x, w_v, b_v)


def qkv_projection_replacement(x, w_q, w_k, w_v, b_q, b_k, b_v):
    qkv = F.linear(x, torch.cat([w_q, w_k, w_v]), _cat(b_q, b_k, b_v))  # (..., heads + 2 * kv heads, head dim)
    return qkv.split([w_q.shape[0], w_k.shape[0], w_v.shape[0]], dim=-1)


def mergeable(weights, biases):
    """The weights (and the biases) concatenate without a cast: one dtype, one device."""
    def weights_concatenate(match):
        tensors = [match.val(n) for n in (*weights, *biases) if match.bindings.get(n) is not None]
        kinds = {(t.dtype, t.device) for t in tensors}
        if len(kinds) > 1:
            return f"{', '.join(weights)} and their biases differ in dtype or device: {sorted(map(str, kinds))}"
        if any(match.val(n).dim() != 2 for n in weights):
            return "a weight is not a matrix"
        return None
    return weights_concatenate


def _bias_variants(*names):
    """Without biases (LLaMA), and with one per projection (e.g. Qwen2's Q, K, V)."""
    return ({n: None for n in names}, {n: tensor(32) for n in names})


SWIGLU = register_rule(Rule(
    name="swiglu", pattern=swiglu_pattern, replacement=swiglu_replacement,
    inputs={"x": tensor(2, 8, 16), "w_gate": tensor(32, 16), "w_up": tensor(32, 16), "b_gate": None, "b_up": None,
            "act": F.silu},
    variants=[{**bias, "dtype": dtype, "act": act} for bias in _bias_variants("b_gate", "b_up")
              for dtype in (torch.float32, torch.bfloat16)  # silu computes in fp32 for bf16 inputs
              for act in GATED_OPS],
    checks=(mergeable(("w_gate", "w_up"), ("b_gate", "b_up")),),
    tolerance=MERGED_MATMUL_TOLERANCE, tolerance_reason=MERGED_MATMUL_TOLERANCE_REASON,
))

QKV_PROJECTION = register_rule(Rule(
    name="qkv_projection", pattern=qkv_projection_pattern, replacement=qkv_projection_replacement,
    inputs={"x": tensor(2, 8, 16), "w_q": tensor(32, 16), "w_k": tensor(32, 16), "w_v": tensor(32, 16),
            "b_q": None, "b_k": None, "b_v": None},
    variants=_bias_variants("b_q", "b_k", "b_v"),
    checks=(mergeable(("w_q", "w_k", "w_v"), ("b_q", "b_k", "b_v")),),
    tolerance=MERGED_MATMUL_TOLERANCE, tolerance_reason=MERGED_MATMUL_TOLERANCE_REASON,
))

# After swiglu (which takes the merges it can make): act(gate) * up on halves of one projection.
GATED_ACTIVATION = register_rule(Rule(
    name="gated_activation", pattern=gated_activation_pattern, replacement=gated_activation_replacement,
    inputs={"gate": tensor(2, 8, 32), "up": tensor(2, 8, 32), "act": F.silu, "up_first": False},
    variants=[{"act": act, "up_first": up_first, "dtype": dtype} for act in GATED_OPS for up_first in (False, True)
              for dtype in (torch.float32, torch.bfloat16)],
    checks=(same_shape,),
))
