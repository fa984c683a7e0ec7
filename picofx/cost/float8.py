"""What a linear layer costs in float8 against bf16: the one float8 cost model. The precision pass's
"auto" rule (which layers run in float8) and the planner (a layout's step time) both read it.

A linear of M tokens x K inputs -> N outputs runs three GEMMs per step (the output, the input
gradient, the weight gradient), 2 M K N FLOPs each, at `device.matmul_rate` for its dtype: bf16's
rate, or the float8 rate (`peak_flops[torch.float8_e4m3fn]`) times the recipe's GEMM share for the
GEMMs the recipe casts. The casts are memory-bound, priced as bytes at `device.pointwise_bandwidth()`
(`RecipeCost.cast_bytes`: the amax read, the cast's read and float8 write, the transposed copy a
backward GEMM takes), and each adds a kernel launch (`device.op_overhead`). A weight Shard gathers in
float8 is cast on its shard instead, before each gather (`SHARD_GATHER_BYTES`, `SHARD_REGATHER_BYTES`).

Fitted points (torchao's float8 microbenchmark on an H100, fwd + bwd of one linear against bf16,
both under torch.compile; the README's text gives two of the tensorwise table's points):
    M, K, N = 1024, 2048, 1024       torchao 0.80x     this model 0.83x (not fitted: a check)
    M, K, N = 4096, 8192, 16384      torchao 1.39x     this model 1.39x (fits TENSORWISE_GEMM_SHARE)
Rowwise's table is published only as an image: its GEMM share is fitted on torchao's end-to-end run
instead (Llama3-8B, 8 x H100: rowwise 6,768 tokens/s against tensorwise's 7,689.5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT8 = torch.float8_e4m3fn
# A float8 GEMM's share of the float8 peak over a bf16 GEMM's share of the bf16 peak, fitted on
# torchao's 1.39x at 4096 x 8192 x 16384 (module doc).
TENSORWISE_GEMM_SHARE = 0.785
# Rowwise-scaled GEMMs (a scale per row) against tensorwise ones: the planner then gives torchao's
# Llama3-8B rowwise tokens/s over tensorwise's, 6,768 / 7,689.5 = 0.88 (torchao's float8 README).
ROWWISE_GEMM_SHARE = 0.84
UNFUSED_AMAX_BYTES = 2  # an input whose producer cannot take its amax reduction (attention) is read once more
# A weight gathered in float8 (Shard's float8 gather), per element of its fp32 shard, as Inductor compiles it
# (one CPU kernel each, read from the generated code): the amax reads the shard (4), apart from the cast
# since the scales' all-reduce runs between them; the cast reads it again and writes a byte (5); the bucket's
# concatenation copies the bytes into the gather's input (2: read, write). The backward's re-gather keeps
# the scales: the cast and the copy again.
SHARD_AMAX_BYTES = 4
SHARD_CAST_BYTES = 5
SHARD_PACK_BYTES = 2
SHARD_GATHER_BYTES = SHARD_AMAX_BYTES + SHARD_CAST_BYTES + SHARD_PACK_BYTES  # 11, the forward's
SHARD_REGATHER_BYTES = SHARD_CAST_BYTES + SHARD_PACK_BYTES                   # 7, the backward's
SCALE_BYTES = 4  # an amax in the forward's one all-reduce of the scales (fp32), per weight gathered in float8


@dataclass(frozen=True)
class RecipeCost:
    """What a recipe costs beyond its GEMMs. `cast_bytes`, per element: the input, the output
    gradient, the weight per call, the weight per call when it is gathered in float8 (cast on the
    shard before the gather, only its transposed copy made whole, for the backward's input gradient)."""

    float8_gemms: tuple[bool, bool, bool]  # output, grad_input, grad_weight
    gemm_share: float
    cast_bytes: tuple[int, int, int, int]
    cast_kernels: int  # launches beyond the bf16 linear's


RECIPE_COSTS = {
    # x: cast 3 (its amax fused with the producer), its transposed copy 2 and scale 1; the gradient 4;
    # the weight 6 per call
    "tensorwise": RecipeCost((True, True, True), TENSORWISE_GEMM_SHARE, (6, 4, 6, 2), 3),
    # each tensor again along its other axis (scales per row do not transpose): twice the casts
    "rowwise": RecipeCost((True, True, True), TENSORWISE_GEMM_SHARE * ROWWISE_GEMM_SHARE, (8, 8, 10, 10), 6),
    # the weight gradient in high precision: x cast once (forward), the gradient along one axis, the
    # weight rowwise for the output and tensorwise for the input gradient
    "rowwise_with_gw_hp": RecipeCost((True, True, False), TENSORWISE_GEMM_SHARE * ROWWISE_GEMM_SHARE,
                                     (3, 4, 10, 10), 4),
}


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

    @property
    def bf16(self) -> float:
        return self.bf16_forward + self.bf16_backward

    @property
    def float8(self) -> float:
        return (self.float8_forward + self.float8_backward + self.weight_forward + self.weight_backward
                + self.launches)

    def speedup(self) -> float:
        return self.bf16 / self.float8


def linear_times(device, tokens: int, inputs: int, outputs: int, recipe: str, *, amax_fused: bool = True,
                 gathered_over: int = 0, regathered: bool = True) -> LinearTimes:
    """A linear of `tokens` x `inputs` -> `outputs` in bf16 and in float8 under `recipe` (torchao's names).
    `amax_fused`: the input's amax is computed by the kernel that produces it (a norm, SwiGLU);
    `gathered_over`: the shard group's size where the weight is gathered in float8 (0: not gathered);
    `regathered`: the backward gathers it again (reshard_after_forward), casting its shard again."""
    if recipe not in RECIPE_COSTS:
        raise ValueError(f"float8 cost: recipe {recipe!r} is unknown; use one of {', '.join(RECIPE_COSTS)}")
    r = RECIPE_COSTS[recipe]
    m, k, n = tokens, inputs, outputs
    smallest = max(1, min(m, k, n))
    gemm = 2 * m * k * n
    bf16 = gemm / device.matmul_rate(torch.bfloat16, smallest)
    float8 = gemm / (device.matmul_rate(FLOAT8, smallest) * r.gemm_share)
    output, grad_input, grad_weight = (float8 if cast else bf16 for cast in r.float8_gemms)
    x, g, w, w_gathered = r.cast_bytes
    bandwidth = device.pointwise_bandwidth()
    # the forward casts the input (read, float8 write: 3 bytes, and its amax where not fused); the backward the rest
    x_forward = m * k * (3 + (0 if amax_fused else UNFUSED_AMAX_BYTES))
    x_backward, g_backward = m * k * (x - 3), m * n * g
    if gathered_over:  # the shard's casts (1 / gathered_over of the weight); the backward's transposed copy
        weight_forward = k * n * SHARD_GATHER_BYTES / gathered_over
        weight_backward = k * n * (w_gathered + (SHARD_REGATHER_BYTES / gathered_over if regathered else 0))
    else:
        weight_forward = weight_backward = k * n * w / 2
    return LinearTimes(bf16, 2 * bf16, output + x_forward / bandwidth,
                       grad_input + grad_weight + (x_backward + g_backward) / bandwidth,
                       weight_forward / bandwidth, weight_backward / bandwidth, r.cast_kernels * device.op_overhead)


def speedup(device, m: int, k: int, n: int, recipe: str = "tensorwise") -> float:
    """A linear's fwd + bwd bf16 seconds over float8's, as torchao's microbenchmark table gives them."""
    return linear_times(device, m, k, n, recipe).speedup()
