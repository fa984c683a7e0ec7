"""Which linear layers compute in float8, and why: the choice `Precision(float8=...)` reports.

    float8_layers="all"     every linear layer whose dimensions the float8 kernels take (each of
                            M, K, N divisible by 16), the output projection included (torchao's default).
    float8_layers="auto"    those of them where the cost rule below predicts a gain; the output
                            projection stays high-precision, as torchtitan keeps it.
    float8_layers=[globs]   those whose module path matches a glob (fnmatch, as `overrides`).

The cost rule is `picofx.cost.float8`'s model, the one the planner reads: a layer's three
matmuls at the device's bf16 and float8 rates, the casts as memory-bound bytes, their launches
(torchao measures the turn on an H100: 1024 x 2048 x 1024 loses, 0.80x; 4096 x 8192 x 16384 gains,
1.39x). The input's amax is priced as fused with the op that produces it, unless that is attention.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from picofx.cost.float8 import FLOAT8, linear_times

KERNEL_MULTIPLE = 16  # _scaled_mm's operands: every dimension a multiple of 16


@dataclass(frozen=True)
class Linear:
    name: str    # the matmul node's name
    path: str    # its module path
    m: int
    k: int
    n: int
    output_projection: bool
    amax_fused: bool = True  # its input's amax is computed by the kernel that produces the input


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
    if FLOAT8 not in device.peak_flops:
        return Choice(False, f"{device.name} has no float8 rate in its description")
    bf16, fp8 = step_seconds(linear, recipe, device)
    verdict = "float8 pays" if fp8 < bf16 else "float8 does not pay"
    unfused = "" if linear.amax_fused else ", its input's amax read on its own (attention produces it)"
    return Choice(fp8 < bf16, f"{verdict}: predicted {fp8 * 1e6:.3g} us vs bf16 {bf16 * 1e6:.3g} us "
                              f"({bf16 / fp8:.2g}x{unfused})")


def step_seconds(linear: Linear, recipe: str, device) -> tuple[float, float]:
    """Predicted seconds of the layer's three matmuls with their casts: (bf16, float8)."""
    times = linear_times(device, linear.m, linear.k, linear.n, recipe, amax_fused=linear.amax_fused)
    return times.bf16, times.float8
