"""Float8 matmuls in a plan: what `Layout.precision` "float8" (torchao's tensorwise recipe, sharded
layouts gathering their weights in float8 as FSDP2's float8 all-gather does) and "float8_rowwise"
(torchao's rowwise recipe, gathering bf16) change in a layer's time and in what sharding gathers.

Each linear's time in bf16 and in float8 is `picofx.cost.float8`'s model (the GEMMs at the device's
bf16 and float8 rates, the casts as memory-bound bytes, their launches), the one the precision pass's
"auto" rule reads too. A linear runs in float8 where that is faster at the micro-batch's tokens; the
output projection (the head) stays bf16, as torchtitan leaves it. The weights kept for the backward are
the high-precision ones (torchao recasts in the backward), so activations do not change.

Shard (stage 3) gathers the tensorwise recipe's weights in float8 as picofx's Shard runs it: each
forward casts the shards (their amax, one all-reduce of the scales, the cast) and, resharding after the
forward, the backward casts them again for its second gather (`picofx.cost.float8`'s SHARD_* bytes;
the all-reduce: `picofx.planner.sharding`). Stages 1 and 2 gather nothing in the graph: each linear
casts its whole weight per call, as unsharded. A head tied to the embedding is read by the lookup too,
so Shard gathers it in its own dtype; the planner keeps the head in bf16 either way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from picofx.cost import float8 as float8_cost
from picofx.cost.float8 import FLOAT8, RECIPE_COSTS, LinearTimes, speedup  # noqa: F401
from picofx.planner.costs import ModelCosts
from picofx.planner.models import tied
from picofx.planner.sharding import RESHARD_AFTER_FORWARD

RECIPES = {"float8": "tensorwise", "float8_rowwise": "rowwise"}  # Layout.precision -> torchao's recipe name


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
    """What a sharded layer's parameters are gathered in, per parameter: where Shard gathers float8 (the
    tensorwise recipe, stage 3) the weights of the linears that run in float8 in float8, the rest in bf16."""
    if RECIPES.get(costs.precision) != "tensorwise" or not costs.layer_float8_weights:
        return 2.0
    return 2.0 - costs.layer_float8_parameters / costs.layer_parameters


def linear_times(device, tokens: int, linear: Linear, recipe: str, gathered_over: int = 0,
                 regathered: bool = RESHARD_AFTER_FORWARD) -> LinearTimes:
    """`linear` on `tokens` tokens; `gathered_over`: the shard group's size where the weight is gathered in
    float8; `regathered`: the backward gathers it again."""
    return float8_cost.linear_times(device, tokens, linear.inputs, linear.outputs, recipe,
                                    amax_fused=linear.amax_fused, gathered_over=gathered_over, regathered=regathered)


def with_float8(costs: ModelCosts, device, *, precision: str, tp: int = 1, tokens: int | None = None,
                gathered_over: int = 0, regathered: bool = RESHARD_AFTER_FORWARD) -> tuple[ModelCosts, dict]:
    """`costs` with each of a layer's linears that pays in float8 (at `tokens` per call, default one
    sequence) run in float8, and what each linear runs in and why. `gathered_over`: the shard group
    where weights are gathered in float8 (tensorwise, stage 3), else 0; `regathered`: gathered again
    for the backward (reshard_after_forward)."""
    recipe = RECIPES[precision]
    tokens = tokens or costs.seq
    fw = bw = call_fw = call_bw = 0.0
    ops, weights, count, chosen = 0, 0, 0, {}
    for linear in layer_linears(costs.config, tp):
        at_call = linear_times(device, tokens, linear, recipe, gathered_over, regathered)
        if at_call.speedup() <= 1.0:
            chosen[linear.name] = (f"bf16: float8 would run it {at_call.speedup():.2f}x "
                                   f"({tokens} x {linear.inputs} -> {linear.outputs})")
            continue
        chosen[linear.name] = f"{precision}: {at_call.speedup():.2f}x"
        # costs are per sequence and for the whole layer (the plan divides them by tp): one rank's times x tp
        per_seq = linear_times(device, costs.seq, linear, recipe, gathered_over, regathered)
        fw += tp * (per_seq.float8_forward - per_seq.bf16_forward)
        bw += tp * (per_seq.float8_backward - per_seq.bf16_backward)
        call_fw, call_bw = call_fw + tp * per_seq.weight_forward, call_bw + tp * per_seq.weight_backward
        ops += RECIPE_COSTS[recipe].cast_kernels
        weights, count = weights + linear.inputs * linear.outputs * tp, count + 1
    chosen["head"] = "bf16: the output projection stays bf16, as torchtitan leaves it" + \
        (" (tied to the embedding: Shard would gather it in its own dtype)" if tied(costs.config) else "")
    changed = dataclasses.replace(
        costs, layer_forward_s=costs.layer_forward_s + fw, layer_backward_s=costs.layer_backward_s + bw,
        layer_matmul_forward_s=costs.layer_matmul_forward_s + fw,  # the matmuls with their casts
        layer_call_forward_s=costs.layer_call_forward_s + call_fw,
        layer_call_backward_s=costs.layer_call_backward_s + call_bw,
        layer_ops=costs.layer_ops + ops, precision=precision, layer_float8_parameters=weights,
        layer_float8_weights=count if gathered_over else 0)
    return changed, chosen


def at_precision(costs: ModelCosts, device, layout, tokens: int) -> tuple[ModelCosts, dict]:
    """`costs` (bf16, or already at `layout`'s precision) at `layout`'s precision, for micro-batches of
    `tokens` tokens per rank, and what each linear runs in (empty where nothing changed)."""
    if layout.precision == costs.precision:
        return costs, {}
    if costs.precision != "bf16":
        raise ValueError(f"costs at precision {costs.precision} cannot be planned at {layout.precision}: "
                         "start from the bf16 costs (picofx.planner.costs.model_costs)")
    # Shard gathers float8 weights at stage 3 only (1 and 2 gather whole parameters outside the graph)
    float8_gathered = layout.shard and layout.shard_stage == 3 and RECIPES[layout.precision] == "tensorwise"
    return with_float8(costs, device, precision=layout.precision, tp=layout.tp, tokens=tokens,
                       gathered_over=layout.dp_shard * layout.cp if float8_gathered else 0)  # HSDP: a replica's shards
