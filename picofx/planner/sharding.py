"""Sharded data parallel in a plan, by ZeRO stage (`Layout.shard_stage`): what each stage keeps per
rank and what it sends per step, over a shard group of `world` ranks, per pipeline stage's units
(the embedding and head, each decoder layer) of P parameters in all, m micro-batches a step.

- stage 1 (optimizer state sharded; Megatron's distributed optimizer): the fp32 parameters and the
  gradients are whole on every rank, accumulated over the micro-batches; each unit's gradient is
  reduce-scattered once per step (fp32), as the last micro-batch's backward produces it, and the
  updated parameters all-gathered once after the optimizer (bf16), behind the next step's first
  forward, unit by unit (Megatron's overlapped parameter gather). Memory: 8 P whole + 8 P / world.
- stage 2 (and the gradients; the variant priced is DeepSpeed's: each micro-batch's gradients
  reduce-scattered into a sharded fp32 accumulator, so no whole gradient buffer is kept): the
  parameters all-gathered once per step (bf16) and kept across the micro-batches, as Llama 3's
  FSDP without resharding after the forward; m reduce-scatters a step. Nothing reads a gradient
  shard before the optimizer, so a micro-batch's reduce-scatters run on while the rank computes the
  next micro-batches (its forwards and backwards, a pipeline's other micro-batches): exposed is what
  the link cannot finish of all m by the step's end, at least the last micro-batch's tail (the
  runtime, picofx.runtime.shard_stages, issues each asynchronously and waits for it at the end of the
  next backward: one in flight, the same exposure when the micro-batches are alike). Memory: 16 P / world, the stage's bf16 parameters (2 P) and two units' fp32 gradients.
- stage 3 (and the parameters; picofx's Shard, FSDP): per micro-batch each unit gathered for the
  forward and, with `reshard_after_forward`, again for the backward, and its gradient
  reduce-scattered (`picofx.cost.shard`); memory 16 P / world and the units gathered at once. Weights
  gathered in float8 (the tensorwise recipe, stage 3 only: stages 1 and 2 gather outside the graph, in
  bf16) travel in a byte each, and each forward first all-reduces (max) their shards' amaxes, stacked:
  one small collective, waited before any gather can cast, so nothing hides it.

Communication overlaps compute unit by unit (`picofx.cost.shard.overlapped`), except on CPU ranks
sharing cores (`hidden=False`): nothing hides there.
"""
from __future__ import annotations

from dataclasses import dataclass

from picofx.cost.comm import all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds
from picofx.cost.float8 import SCALE_BYTES
from picofx.cost.shard import ADAMW_STATE_BYTES, Layer, overlapped, predict_sharded

GATHERED_BYTES = 2   # bf16 parameters gathered
REDUCED_BYTES = 4    # fp32 gradients reduce-scattered
WHOLE_BYTES_STAGE_1 = 8  # fp32 parameter and gradient, whole on each rank; the two moments sharded
RESHARD_AFTER_FORWARD = True  # Shard()'s default, as the recipe builds it: stage 3 gathers again for the backward
STAGE_NAMES = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}


@dataclass(frozen=True)
class Sharded:
    """Per step: seconds the shard group's collectives add past the compute, and every collective's
    seconds; per rank: bytes of training state and of parameters or gradients held whole at once."""

    exposed_s: float
    communication_s: float
    state_bytes: float
    gathered_bytes: float
    what: str


def sharded_step(stage: int, layers: list[Layer], world: int, link, microbatches: int, *, hidden: bool = True,
                 reshard_after_forward: bool = True, reduce_bytes_per_parameter: float = REDUCED_BYTES,
                 step_compute_s: float | None = None, float8_weights: int = 0) -> Sharded:
    """`layers` (forward order, one micro-batch's compute each) sharded at ZeRO `stage` over `world` ranks;
    `step_compute_s`: the rank's compute time a step (a pipeline's with its bubble; default: m micro-batches');
    `float8_weights`: how many weights stage 3 gathers in float8 (their scales: one all-reduce a forward)."""
    parameters = sum(layer.parameters for layer in layers)
    largest = sorted((layer.parameters for layer in layers), reverse=True)
    if stage == 3:
        one = predict_sharded(layers, 0, world, link, gather_bytes_per_parameter=GATHERED_BYTES,
                              reduce_bytes_per_parameter=reduce_bytes_per_parameter,
                              reshard_after_forward=reshard_after_forward)
        exposed = one.exposed_s if hidden else one.communication_s
        scales = all_reduce_seconds(SCALE_BYTES * float8_weights, world, link) if float8_weights else 0.0
        return Sharded(microbatches * (exposed + scales), microbatches * (one.communication_s + scales),
                       ADAMW_STATE_BYTES * parameters / world, one.gathered_bytes,
                       "parameter all-gathers and gradient reduce-scatters per micro-batch")
    sent = [layer.parameters * GATHERED_BYTES for layer in layers]  # whole parameters, gathered outside the graph
    gathers = [all_gather_seconds(size, world, link) for size in sent]
    reduces = [reduce_scatter_seconds(layer.parameters * reduce_bytes_per_parameter, world, link) for layer in layers]
    forward = [layer.forward_s for layer in layers]
    backward = [layer.backward_s for layer in reversed(layers)]
    gather_exposed = overlapped(forward, gathers, [0.0] * len(layers), 1) - sum(forward)  # once a step
    reduce_exposed = overlapped(backward, [0.0] * len(layers), reduces[::-1], 1) - sum(backward)
    reduce_times = 1 if stage == 1 else microbatches
    communication = sum(gathers) + reduce_times * sum(reduces)
    if stage == 2:  # from the first backward to the step's end the link may run every micro-batch's reduce-scatters
        compute = microbatches * sum(forward + backward) if step_compute_s is None else step_compute_s
        reduce_exposed = max(reduce_exposed, microbatches * sum(reduces) - (compute - sum(forward)))
    exposed = gather_exposed + (1 if stage == 2 else reduce_times) * reduce_exposed if hidden else communication
    if stage == 1:
        state = WHOLE_BYTES_STAGE_1 * parameters + (ADAMW_STATE_BYTES - WHOLE_BYTES_STAGE_1) * parameters / world
        return Sharded(exposed, communication, state, 0.0,
                       "gradient reduce-scatter and parameter all-gather, once a step")
    kept = sum(sent) + sum(largest[:2]) * REDUCED_BYTES
    return Sharded(exposed, communication, ADAMW_STATE_BYTES * parameters / world, kept,
                   "parameter all-gather once a step, gradient reduce-scatters per micro-batch")
