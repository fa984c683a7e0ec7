"""The planner's own memory does not grow with the sequence it plans: its captures run on fake
tensors, and the one real call they make (the precision pass's dtype check of a custom op) runs
on shapes halved to CHECK_BYTES."""
from __future__ import annotations

import dataclasses

import pytest

from picofx.cost.device import devices
from picofx.cost.memory import peak_allocated_during
from picofx.cost.model import CostModel
from picofx.models.llama import CONFIGS
from picofx.passes.precision.casts import CHECK_BYTES
from picofx.planner.costs import capture


@pytest.mark.slow  # two captures: ~15 s of CPU
def test_a_capture_allocates_no_more_at_four_times_the_sequence():
    config = dataclasses.replace(CONFIGS["tiny"], num_attention_heads=8, num_key_value_heads=8, hidden_size=128)
    # attention's scratch is measured apart (inputs to 256 MiB)
    cost_model = CostModel(devices()["h100"], attention_scratch=False)
    peaks = {}
    for seq in (16384, 65536):  # rope's q at 65,536 tokens: 16 MiB of bf16, past CHECK_BYTES
        peaks[seq] = peak_allocated_during(lambda: capture(config, 1, seq, cost_model, ("fuse", "precision")))
    assert peaks[65536] < 1.5 * peaks[16384] + 1e6, peaks
    assert peaks[65536] < 4 * CHECK_BYTES, peaks
