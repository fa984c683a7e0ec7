"""Sharded data parallel (ZeRO-3 / FSDP), predicted: memory per rank and step time with the
parameter all-gathers and gradient reduce-scatters overlapped layer by layer.

Memory per rank = the sharded training state (parameters, gradients, AdamW's two moments: 16
bytes per parameter in fp32, over the ranks) + the step's activations (as one rank of the
replicated step predicts them) + the full parameters of the layers gathered at once (the one
computing and `prefetch` ahead) + two layers' full gradients: the one before its reduce-scatter
and the previous one's, whose reduce-scatter is still in flight behind this layer's backward (c10d
holds a collective's input until its wait; the shard pass waits it after the next bucket's matmuls).

HSDP (`replicas` > 1: shards replicated over as many groups of `world` ranks): each layer's
reduce-scattered shard is then all-reduced across the replicas, on `replica_link`.

Time: each layer's gather is issued `prefetch` layers ahead, its compute waits for it; in the
backward each layer is gathered again (`reshard_after_forward`) and its gradient reduce-scattered
once its backward ends. The link runs one collective at a time, in issue order; compute one
layer at a time. What the link adds past the compute is the exposed communication.
"""
from __future__ import annotations

from dataclasses import dataclass

from picofx.cost.comm import all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds
from picofx.cost.device import Link
from picofx.cost.units import format_bytes

ADAMW_STATE_BYTES = 16  # fp32 parameter, gradient and two moments


@dataclass(frozen=True)
class Layer:
    """One unit of sharding: its parameters' count and its compute seconds."""

    name: str
    parameters: int
    forward_s: float
    backward_s: float
    gather_bytes_per_parameter: float | None = None  # where not predict_sharded's (float8 weights: 1)


def overlapped(computes: list[float], gathers: list[float], reduces: list[float], prefetch: int) -> float:
    """Seconds until the last compute and the last collective end. Layer i's gather is issued when
    layer i-1-prefetch's compute ends (at once for the first ones); its compute starts when the
    gather and layer i-1's compute are done; its reduce-scatter is issued when its compute ends."""
    link = compute = 0.0
    ends: list[float] = []
    issued: list[tuple[float, float]] = []  # (issue time, seconds) of reduce-scatters waiting for the link
    for i, (work, gather) in enumerate(zip(computes, gathers)):
        issue = ends[i - 1 - prefetch] if i - 1 - prefetch >= 0 else 0.0
        while issued and issued[0][0] <= issue:  # earlier reduce-scatters go first
            at, seconds = issued.pop(0)
            link = max(link, at) + seconds
        link = max(link, issue) + gather
        compute = max(compute, link if gather else 0.0) + work
        ends.append(compute)
        if reduces[i]:
            issued.append((compute, reduces[i]))
    for at, seconds in issued:
        link = max(link, at) + seconds
    return max(compute, link)


@dataclass(frozen=True)
class ShardPrediction:
    world: int
    parameters: int
    state_bytes: int           # sharded parameters, gradients and moments on one rank
    activation_bytes: int      # the step's activation peak on one rank
    gathered_bytes: int        # full parameters gathered at once, and two layers' full gradients
    compute_s: float
    step_s: float
    communication_s: float     # every collective's time, end to end

    @property
    def memory_per_rank(self) -> int:
        return self.state_bytes + self.activation_bytes + self.gathered_bytes

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s

    def arithmetic(self) -> list[str]:
        return [
            f"state: {self.parameters / 1e9:.2f}B parameters x {ADAMW_STATE_BYTES} bytes / {self.world} ranks = "
            f"{format_bytes(self.state_bytes)}",
            f"activations (one rank's micro-batch, predicted): {format_bytes(self.activation_bytes)}",
            f"gathered layers and two layers' full gradients: {format_bytes(self.gathered_bytes)}",
            f"memory per rank: {format_bytes(self.memory_per_rank)}",
            f"compute {self.compute_s * 1e3:.1f} ms + exposed communication {self.exposed_s * 1e3:.1f} ms "
            f"(of {self.communication_s * 1e3:.1f} ms on the link) = step {self.step_s * 1e3:.1f} ms"]


def predict_sharded(layers: list[Layer], activation_bytes: int, world: int, link: Link, *, prefetch: int = 1,
                    reshard_after_forward: bool = True, gather_bytes_per_parameter: int = 4,
                    reduce_bytes_per_parameter: int = 4, replicas: int = 1,
                    replica_link: Link | None = None) -> ShardPrediction:
    """Memory and step time of one rank when `layers` (in forward order) are sharded over `world`
    (and, HSDP, replicated over `replicas` such groups)."""
    gather = [all_gather_seconds(layer.parameters * (layer.gather_bytes_per_parameter or gather_bytes_per_parameter),
                                 world, link) for layer in layers]
    reduce = [reduce_scatter_seconds(layer.parameters * reduce_bytes_per_parameter, world, link)
              + (all_reduce_seconds(layer.parameters * reduce_bytes_per_parameter / world, replicas,
                                    replica_link or link) if replicas > 1 else 0.0)
              for layer in layers]
    forward = overlapped([layer.forward_s for layer in layers], gather, [0.0] * len(layers), prefetch)
    backward_gathers = gather[::-1] if reshard_after_forward else [0.0] * len(layers)
    backward = overlapped([layer.backward_s for layer in reversed(layers)], backward_gathers, reduce[::-1], prefetch)
    parameters = sum(layer.parameters for layer in layers)
    largest = sorted((layer.parameters for layer in layers), reverse=True)
    held = sorted((layer.parameters * (layer.gather_bytes_per_parameter or gather_bytes_per_parameter) for layer in layers),
                  reverse=True)  # a gathered layer as it is gathered (float8 weights: a byte each)
    gathered = sum(held[:1 + prefetch]) + sum(largest[:2]) * reduce_bytes_per_parameter
    communication = sum(gather) * (2 if reshard_after_forward else 1) + sum(reduce)
    return ShardPrediction(world, parameters, -(-parameters * ADAMW_STATE_BYTES // world), activation_bytes, gathered,
                           sum(layer.forward_s + layer.backward_s for layer in layers), forward + backward,
                           communication)
