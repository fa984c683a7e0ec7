"""picofx.cost.shard: the sharded step's memory terms and its overlapped collectives."""
from __future__ import annotations

import pytest

from picofx.cost.device import Link
from picofx.cost.shard import ADAMW_STATE_BYTES, Layer, overlapped, predict_sharded

LINK = Link("test link", bandwidth=1e9, latency=0.0)


def test_collectives_hide_behind_longer_compute_except_the_first_gather_and_the_last_reduce():
    assert overlapped([1.0] * 3, [0.1] * 3, [0.0] * 3, prefetch=1) == pytest.approx(3.1)
    assert overlapped([1.0] * 34, [0.3] * 34, [0.6] * 34, prefetch=1) == pytest.approx(34.9)
    # communication longer than compute: the link sets the pace
    assert overlapped([0.1] * 4, [1.0] * 4, [0.0] * 4, prefetch=1) == pytest.approx(4.1)
    # without prefetch a layer's gather waits for the previous layer's compute
    assert overlapped([1.0] * 3, [0.5] * 3, [0.0] * 3, prefetch=0) > overlapped([1.0] * 3, [0.5] * 3, [0.0] * 3, 1)


def test_sharded_state_is_sixteen_bytes_per_parameter_over_the_ranks():
    layers = [Layer("embedding", 1000, 0.0, 0.0)] + [Layer(f"layers.{i}", 4000, 1.0, 2.0) for i in range(4)]
    p = predict_sharded(layers, activation_bytes=10_000, world=4, link=LINK)
    assert p.parameters == 17_000 and p.state_bytes == 17_000 * ADAMW_STATE_BYTES // 4
    assert p.gathered_bytes == (4000 + 4000) * 4 + (4000 + 4000) * 4  # two layers gathered, two full gradients
    assert p.memory_per_rank == p.state_bytes + 10_000 + p.gathered_bytes
    assert p.compute_s == pytest.approx(12.0) and p.step_s >= p.compute_s
    kept = predict_sharded(layers, 10_000, 4, LINK, reshard_after_forward=False)
    assert kept.communication_s < p.communication_s
    assert any("16 bytes / 4 ranks" in line for line in p.arithmetic())
    hsdp = predict_sharded(layers, 10_000, 4, LINK, replicas=2)  # each shard also all-reduced across 2 replicas
    assert hsdp.state_bytes == p.state_bytes and hsdp.communication_s > p.communication_s
