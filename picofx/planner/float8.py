"""Float8 matmuls in a plan: what `Layout.precision` "float8" (torchao's tensorwise recipe, sharded
layouts gathering their weights in float8 as FSDP2's float8 all-gather does) and "float8_rowwise"
(torchao's rowwise recipe, gathering bf16) change in a layer's time and in what sharding gathers.

Each linear of M tokens x K inputs -> N outputs runs three GEMMs (forward, input gradient, weight
gradient), 2 M K N FLOPs each: in bf16 at the device's bf16 rate, in float8 at its float8 rate
(`peak_flops[torch.float8_e4m3fn]`) times `TENSORWISE_GEMM_SHARE` (rowwise: `ROWWISE_GEMM_SHARE`),
plus the casts, memory-bound, bytes per element of each tensor (the amax read, the cast's read and
float8 write, the transposed copy the weight gradient's GEMM takes):
- tensorwise: the input 6 (its amax fused with the norm or SwiGLU that produces it; attention's
  output is read once more for it), the gradient 4, the weight 6 per call; sharded, the weight is
  cast on each rank's shard before the gather (5 bytes / dp, forward and backward) and only its
  transposed copy (2) is made whole;
- rowwise: each tensor again along its other axis for the backward (scales per row do not
  transpose): input 8, gradient 8, weight 10 per call; the weights gathered in bf16.
Each float8 linear adds `CAST_KERNELS` kernel launches. A linear runs in float8 where that is faster
at the micro-batch's tokens (torchao measures a small linear losing, 0.80x at 1024 x 2048 x 1024,
and a large one gaining, 1.39x at 4096 x 8192 x 16384; `speedup` reproduces both); the output
projection (the head) stays bf16, as torchtitan leaves it. The weights kept for the backward are
the high-precision ones (torchao recasts in the backward), so activations do not change.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from picofx.planner.costs import ModelCosts

FLOAT8 = torch.float8_e4m3fn
RECIPES = {"float8": "tensorwise", "float8_rowwise": "rowwise"}  # Layout.precision -> torchao's recipe name
# A float8 GEMM's share of the float8 peak over a bf16 GEMM's share of the bf16 peak: chosen so that
# `speedup` gives torchao's 1.39x at 4096 x 8192 x 16384 on the H100 (torchao/float8/README.md, "Performance");
# it then gives 0.83x at 1024 x 2048 x 1024 (torchao: 0.80) unfitted (tests/planner/test_plan_float8.py checks both).
TENSORWISE_GEMM_SHARE = 0.785
# Rowwise-scaled GEMMs (a scale per row) against tensorwise ones: chosen so that the planner gives
# torchao's Llama3-8B layout (8 x H100, FSDP2 + compile, per-op SAC, batch 1 x 8192) rowwise's tokens/s
# over tensorwise's as torchao's table measures them: 6,768 / 7,689.5 = 0.88 (torchao/float8/README.md).
ROWWISE_GEMM_SHARE = 0.84
CAST_BYTES = {  # per element: (input, gradient, weight per call, weight per call when gathered in float8)
    "tensorwise": (6, 4, 6, 2),
    "rowwise": (8, 8, 10, 10),
}
UNFUSED_AMAX_BYTES = 2  # an input whose producer cannot take its amax reduction (attention) is read once more
SHARD_CAST_BYTES = 5    # the shard's amax read and cast (read, write), before each of the two gathers
CAST_KERNELS = {"tensorwise": 3, "rowwise": 6}  # kernels a float8 linear launches beyond the bf16 one's


@dataclass(frozen=True)
class Linear:
    name: str
    inputs: int   # K, on one tp rank
    outputs: int  # N, on one tp rank
    amax_fused: bool = True  # its input's amax is computed by the kernel that produces the input


def layer_linears(config, tp: int = 1) -> list[Linear]:
    """A decoder layer's linears at their tp-split shapes (q, k, v, gate and up split their outputs;
    o and down their inputs)."""
    h, kv, mlp = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size
    return [Linear("q", h, h // tp), Linear("k", h, kv // tp), Linear("v", h, kv // tp),
            Linear("o", h // tp, h, amax_fused=False), Linear("gate", h, mlp // tp), Linear("up", h, mlp // tp),
            Linear("down", mlp // tp, h)]


def refusal(device, precision: str) -> str | None:
    """Why `device` cannot run `precision` (None: it can)."""
    if precision in RECIPES and FLOAT8 not in device.peak_flops:
        return (f"precision={precision}: the {device.name} has no float8 matmuls (they need compute capability "
                "8.9 or later: H100, H200); use precision=bf16")
    return None


def gather_bytes_per_parameter(costs: ModelCosts) -> float:
    """What a sharded layer's parameters are gathered in, per parameter: under the tensorwise recipe the
    weights of the linears that run in float8 in float8, everything else in bf16."""
    if RECIPES.get(costs.precision) != "tensorwise":
        return 2.0
    return 2.0 - costs.layer_float8_parameters / costs.layer_parameters


@dataclass(frozen=True)
class LinearTimes:
    """One linear's seconds: bf16's three GEMMs; float8's GEMMs with the casts of the tokens' tensors
    (both proportional to the tokens); per call, float8's weight casts and its casts' kernel launches."""

    bf16_forward: float
    bf16_backward: float
    float8_forward: float
    float8_backward: float
    weight_forward: float
    weight_backward: float
    launches: float

    def speedup(self) -> float:
        float8 = self.float8_forward + self.float8_backward + self.weight_forward + self.weight_backward
        return (self.bf16_forward + self.bf16_backward) / (float8 + self.launches)


def linear_times(device, tokens: int, linear: Linear, recipe: str, gathered_over: int = 0) -> LinearTimes:
    """`linear` on `tokens` tokens; `gathered_over`: the shard group's size where the weight is gathered in float8."""
    m, k, n = tokens, linear.inputs, linear.outputs
    smallest = max(1, min(m, k, n))
    share = TENSORWISE_GEMM_SHARE * (ROWWISE_GEMM_SHARE if recipe == "rowwise" else 1.0)
    gemm = 2 * m * k * n
    bf16 = gemm / device.matmul_rate(torch.bfloat16, smallest)
    float8 = gemm / (device.matmul_rate(FLOAT8, smallest) * share)
    x, g, w, w_gathered = CAST_BYTES[recipe]
    bandwidth = device.pointwise_bandwidth()
    # the forward casts the input (read, float8 write: 3 bytes, and its amax where not fused); the backward the rest
    x_forward = m * k * (3 + (0 if linear.amax_fused else UNFUSED_AMAX_BYTES))
    x_backward, g_backward = m * k * (x - 3), m * n * g
    weight = k * n * (w_gathered + 2 * SHARD_CAST_BYTES / gathered_over if gathered_over else w)
    backward = 2 * float8 + (x_backward + g_backward) / bandwidth
    return LinearTimes(bf16, 2 * bf16, float8 + x_forward / bandwidth, backward, weight / 2 / bandwidth,
                       weight / 2 / bandwidth, CAST_KERNELS[recipe] * device.op_overhead)


def speedup(device, m: int, k: int, n: int, recipe: str = "tensorwise") -> float:
    """A linear's fwd + bwd bf16 seconds over float8's, as torchao's microbenchmark table gives them."""
    return linear_times(device, m, Linear("linear", k, n), recipe).speedup()


def with_float8(costs: ModelCosts, device, *, precision: str, tp: int = 1, tokens: int | None = None,
                gathered_over: int = 0) -> tuple[ModelCosts, dict]:
    """`costs` with each of a layer's linears that pays in float8 (at `tokens` per call, default one
    sequence) run in float8, and what each linear runs in and why. `gathered_over`: the shard group
    where weights are gathered in float8 (tensorwise and sharded), else 0."""
    recipe = RECIPES[precision]
    tokens = tokens or costs.seq
    fw = bw = call_fw = call_bw = 0.0
    ops, weights, chosen = 0, 0, {}
    for linear in layer_linears(costs.config, tp):
        at_call = linear_times(device, tokens, linear, recipe, gathered_over)
        if at_call.speedup() <= 1.0:
            chosen[linear.name] = (f"bf16: float8 would run it {at_call.speedup():.2f}x "
                                   f"({tokens} x {linear.inputs} -> {linear.outputs})")
            continue
        chosen[linear.name] = f"{precision}: {at_call.speedup():.2f}x"
        # costs are per sequence and for the whole layer (the plan divides them by tp): one rank's times x tp
        per_seq = linear_times(device, costs.seq, linear, recipe, gathered_over)
        fw += tp * (per_seq.float8_forward - per_seq.bf16_forward)
        bw += tp * (per_seq.float8_backward - per_seq.bf16_backward)
        call_fw, call_bw = call_fw + tp * per_seq.weight_forward, call_bw + tp * per_seq.weight_backward
        ops += CAST_KERNELS[recipe]
        weights += linear.inputs * linear.outputs * tp
    chosen["head"] = "bf16: the output projection stays bf16, as torchtitan leaves it"
    changed = dataclasses.replace(
        costs, layer_forward_s=costs.layer_forward_s + fw, layer_backward_s=costs.layer_backward_s + bw,
        layer_matmul_forward_s=costs.layer_matmul_forward_s + fw,  # the matmuls with their casts
        layer_call_forward_s=costs.layer_call_forward_s + call_fw,
        layer_call_backward_s=costs.layer_call_backward_s + call_bw,
        layer_ops=costs.layer_ops + ops, precision=precision, layer_float8_parameters=weights)
    return changed, chosen


def at_precision(costs: ModelCosts, device, layout, tokens: int) -> tuple[ModelCosts, dict]:
    """`costs` (bf16, or already at `layout`'s precision) at `layout`'s precision, for micro-batches of
    `tokens` tokens per rank, and what each linear runs in (empty where nothing changed)."""
    if layout.precision == costs.precision:
        return costs, {}
    if costs.precision != "bf16":
        raise ValueError(f"costs at precision {costs.precision} cannot be planned at {layout.precision}: "
                         "start from the bf16 costs (picofx.planner.costs.model_costs)")
    tensorwise_shard = layout.shard and RECIPES[layout.precision] == "tensorwise"
    return with_float8(costs, device, precision=layout.precision, tp=layout.tp, tokens=tokens,
                       gathered_over=layout.dp * layout.cp if tensorwise_shard else 0)
