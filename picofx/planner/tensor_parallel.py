"""What splitting a decoder layer over tp ranks changes beyond dividing its work by tp.

- Its matmuls run at their split shapes: q, k, v, gate and up keep their input's width and split
  their outputs, o and down split their inputs, so each rank's GEMM has a smaller dimension than the
  whole layer's, and a GPU runs a GEMM with a small dimension at less of its peak
  (`GpuProfile.matmul_rate`). The captured layer is timed whole (`picofx.planner.costs`); here its
  matmul seconds are scaled by the split GEMMs' time over the whole ones' (the backward's two
  matmuls per forward one alike).
- Full checkpointing runs each layer's forward again in the backward, its two all-reduces (or the
  all-gathers and reduce-scatters of sequence parallelism) with it.
"""
from __future__ import annotations

import dataclasses

import torch

from picofx.planner.costs import ModelCosts

RECOMPUTED_ALL_REDUCES = 2  # per layer under full checkpointing: attention's and the MLP's, run again


def _layer_gemms(config, tp: int) -> list[tuple[int, int]]:
    """(weights, smallest weight dimension on a rank) of each matmul of a layer split tp ways; the
    tokens' dimension is the largest."""
    h, kv, mlp = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size
    return [(h * h, h // tp), (h * kv, kv // tp), (h * kv, kv // tp), (h * h, h // tp),
            (h * mlp, min(h, mlp // tp)), (h * mlp, min(h, mlp // tp)), (h * mlp, min(h, mlp // tp))]


def matmul_slowdown(device, config, tp: int) -> float:
    """Seconds of a layer's matmuls split tp ways over those of the whole layer's, per FLOP."""
    def seconds(split: int) -> float:
        return sum(w / device.matmul_rate(torch.bfloat16, max(1, d)) for w, d in _layer_gemms(config, split))

    whole = seconds(1)
    return seconds(tp) / whole if whole else 1.0


def split_layer_costs(costs: ModelCosts, device, tp: int) -> ModelCosts:
    """`costs` with a layer's matmul seconds, forward and backward, at their tp-split shapes."""
    if tp == 1 or not costs.layer_matmul_forward_s:
        return costs
    extra = (matmul_slowdown(device, costs.config, tp) - 1) * costs.layer_matmul_forward_s
    return dataclasses.replace(costs, layer_forward_s=costs.layer_forward_s + extra,
                               layer_backward_s=costs.layer_backward_s + 2 * extra,
                               layer_matmul_forward_s=costs.layer_matmul_forward_s + extra)
