"""Which linear layers compute in float8, and why: the choice `Precision(float8=...)` reports.

    float8_layers="all"     every linear layer whose dimensions the float8 kernels take (each of
                            M, K, N divisible by 16), the output projection included (torchao's default).
    float8_layers="auto"    those of them where the cost rule below predicts a gain; the output
                            projection stays high-precision, as torchtitan keeps it.
    float8_layers=[globs]   those whose module path matches a glob (fnmatch, as `overrides`).

The cost rule prices one training step of a layer (x: (M, K), weight: (N, K)): three matmuls of
2MKN FLOPs each, at the device's float8 rate (`peak_flops[torch.float8_e4m3fn]`) for those the
recipe casts and its bf16 rate otherwise, plus the casts at the device's memory bandwidth: each
cast reads its operand twice (amax, then scale and cast: 2 + 2 bytes an element) and writes one
byte, and the backward's transposed operands are copied once more (1 + 1 bytes). Against three
bf16 matmuls. torchao measures the same turn: 1024 x 2048 x 1024 loses (0.80x on an H100),
4096 x 8192 x 16384 gains (1.39x); the rule predicts 0.53x and 1.35x there
(it prices no launch or tile effects, so it is harsher on small layers).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from picofx.passes.precision.float8_linear import RECIPES

KERNEL_MULTIPLE = 16  # _scaled_mm's operands: every dimension a multiple of 16
CAST_BYTES = 2 + 2 + 1  # per element of a cast operand: read for the amax, read again, write float8
TRANSPOSE_BYTES = 1 + 1  # per element of a float8 operand the backward needs in the other layout


@dataclass(frozen=True)
class Linear:
    name: str    # the matmul node's name
    path: str    # its module path
    m: int
    k: int
    n: int
    output_projection: bool


@dataclass(frozen=True)
class Choice:
    float8: bool
    reason: str


def choose(linear: Linear, layers, recipe: str, device) -> Choice:
    """Float8 or not for one linear layer, with the reason in words."""
    odd = [f"{d}={v}" for d, v in (("M", linear.m), ("K", linear.k), ("N", linear.n)) if v % KERNEL_MULTIPLE]
    if odd:
        return Choice(False, f"shape not divisible by {KERNEL_MULTIPLE} ({', '.join(odd)}): the float8 "
                             "kernels cannot take it")
    if layers == "all":
        return Choice(True, "float8_layers='all'")
    if layers != "auto":
        hit = next((g for g in layers if fnmatch.fnmatchcase(linear.path, g)
                    or fnmatch.fnmatchcase(linear.path, g + ".*")), None)
        return Choice(True, f"matches {hit!r}") if hit else Choice(False, "matches no glob of float8_layers")
    if linear.output_projection:
        return Choice(False, "output projection: auto keeps it bf16 (its logits feed the loss)")
    if torch.float8_e4m3fn not in device.peak_flops:
        return Choice(False, f"{device.name} has no float8 rate in its description")
    bf16, fp8 = step_seconds(linear, recipe, device)
    verdict = "float8 pays" if fp8 < bf16 else "float8 does not pay"
    return Choice(fp8 < bf16, f"{verdict}: predicted {fp8 * 1e6:.3g} us vs bf16 {bf16 * 1e6:.3g} us "
                              f"({bf16 / fp8:.2f}x)")


def step_seconds(linear: Linear, recipe: str, device) -> tuple[float, float]:
    """Predicted seconds of the layer's three matmuls and casts: (bf16, float8)."""
    m, k, n = linear.m, linear.k, linear.n
    flops = 2 * m * k * n
    bf16_rate = device.peak_flops.get(torch.bfloat16, device.peak_flops[torch.float32])
    fp8_rate = device.peak_flops[torch.float8_e4m3fn]
    r = RECIPES[recipe]
    matmuls = {"output": ((m, k), (k, n)), "grad_input": ((m, n), (n, k)), "grad_weight": ((n, m), (m, k))}
    seconds, cast_elements, transposed = 0.0, 0, 0
    for name, (a, b) in matmuls.items():
        in_float8 = getattr(r, name)[0].dtype is not None
        seconds += flops / (fp8_rate if in_float8 else bf16_rate)
        if in_float8:
            cast_elements += a[0] * a[1] + b[0] * b[1]
            transposed += (b[0] * b[1]) if name != "output" else 0
    seconds += (CAST_BYTES * cast_elements + TRANSPOSE_BYTES * transposed) / device.memory_bandwidth
    return 3 * flops / bf16_rate, seconds
