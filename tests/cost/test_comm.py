"""picofx.cost.comm: the collectives' bytes on the wire per rank and their ring time on a link."""
from __future__ import annotations

import pytest

from picofx.cost.comm import (all_gather_bytes, all_gather_seconds, all_reduce_bytes, all_reduce_seconds,
                              all_reduce_size_sending, all_to_all_bytes, all_to_all_seconds, reduce_scatter_bytes,
                              reduce_scatter_seconds, send_seconds)
from picofx.cost.device import Link

LINK = Link("test link", bandwidth=1e9, latency=0.0)
SLOW_START = Link("latency only", bandwidth=1e30, latency=1e-3)


def test_each_rank_sends_all_but_its_own_share():
    assert all_reduce_bytes(800, 8) == 1400  # reduce-scatter, then all-gather: 2 x 7/8
    assert reduce_scatter_bytes(800, 8) == all_gather_bytes(800, 8) == all_to_all_bytes(800, 8) == 700
    for formula in (all_reduce_bytes, reduce_scatter_bytes, all_gather_bytes, all_to_all_bytes):
        assert formula(800, 1) == 0  # one rank sends nothing


def test_ring_time_is_the_bytes_sent_over_the_bandwidth_plus_a_latency_per_step():
    assert all_gather_seconds(8e9, 8, LINK) == pytest.approx(7.0)
    assert reduce_scatter_seconds(8e9, 8, LINK) == all_to_all_seconds(8e9, 8, LINK) == pytest.approx(7.0)
    assert all_reduce_seconds(8e9, 8, LINK) == pytest.approx(14.0)
    assert all_gather_seconds(8e9, 1, LINK) == all_reduce_seconds(8e9, 1, LINK) == 0.0
    assert all_reduce_seconds(8, 8, SLOW_START) == pytest.approx(14e-3)  # 2(n-1) steps
    assert all_gather_seconds(8, 8, SLOW_START) == pytest.approx(7e-3)  # n-1 steps
    assert send_seconds(8e9, LINK) == pytest.approx(8.0) and send_seconds(0, SLOW_START) == pytest.approx(1e-3)


def test_a_compressed_exchange_is_timed_as_the_all_reduce_sending_as_much():
    size = all_reduce_size_sending(1400, 8)
    assert size == pytest.approx(800) and all_reduce_bytes(int(size), 8) == 1400
    assert all_reduce_seconds(size, 8, LINK) == pytest.approx(1400 / LINK.bandwidth)
    assert all_reduce_size_sending(1400, 1) == 1400


def test_a_call_latency_is_paid_once_per_collective_and_not_by_a_send():
    waking = Link("ranks sharing cores", bandwidth=1e30, latency=1e-3, call_latency=5e-3)
    assert all_reduce_seconds(8, 2, waking) == pytest.approx(2e-3 + 5e-3)
    assert all_gather_seconds(8, 2, waking) == reduce_scatter_seconds(8, 2, waking) == pytest.approx(1e-3 + 5e-3)
    assert send_seconds(8, waking) == pytest.approx(1e-3)  # the receiver is already waiting
