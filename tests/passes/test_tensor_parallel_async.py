"""tensor_parallel's async_overlap: two gloo ranks (spawned, hard timeout), the same batch on each;
sequence parallelism with chunked, overlapped collectives against it without them."""
from __future__ import annotations

import re

import pytest
import torch

import tensor_parallel_async_ranks
from spawn_ranks import run_ranks

LOSS = dict(rtol=1e-5, atol=1e-7)
GRAD = dict(rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def eager_ranks():
    return run_ranks(tensor_parallel_async_ranks.eager, 2, timeout=300, collective_timeout=120)


@pytest.mark.parametrize("case", ["reference", "hf"])
def test_loss_and_gradients_equal_sequence_parallel_without_overlap(eager_ranks, case):
    for rank in eager_ranks:
        sync, overlapped = rank[(case, False)], rank[(case, True)]
        torch.testing.assert_close(overlapped["loss"], sync["loss"], **LOSS)
        for name, grad in sync["grads"].items():
            torch.testing.assert_close(overlapped["grads"][name], grad, **GRAD, msg=lambda m, n=name: f"{n}: {m}")


def test_each_chunk_is_issued_then_a_matmul_runs_then_it_is_waited_for(eager_ranks):
    result = eager_ranks[0][("reference", True)]
    assert result["chunked"][0] == {"gathers": 4, "scatters": 4}  # the forward: 2 layers x (attention, MLP)
    for role in ("forward", "backward"):
        order = " ".join(result["order"][role])
        assert "all_gather_into_tensor all_gather_into_tensor wait_tensor mm" in order
        assert "reduce_scatter_tensor mm" in order  # the next chunk's matmul under the reduce-scatter
    sync = " ".join(eager_ranks[0][("reference", False)]["order"]["forward"])  # whole gathers, one by one
    assert "sp_gather" not in sync and sync.count("all_gather_into_tensor wait_tensor") == 5
    assert "all_gather_into_tensor all_gather_into_tensor" not in sync


@pytest.mark.slow
def test_inductor_keeps_the_interleaving_in_its_generated_code():
    ranks = run_ranks(tensor_parallel_async_ranks.inductor, 2, timeout=900, collective_timeout=300)
    for rank in ranks:
        torch.testing.assert_close(rank[True]["loss"], rank[False]["loss"], **LOSS)
        for name, grad in rank[False]["grads"].items():
            torch.testing.assert_close(rank[True]["grads"][name], grad, **GRAD)
    calls = re.findall(r"_c10d_functional\.(\w+)\.default\(|extern_kernels\.(mm)\(", ranks[0]["code"])
    text = " ".join(collective or mm for collective, mm in calls)
    assert "all_gather_into_tensor all_gather_into_tensor wait_tensor mm wait_tensor mm" in text
    assert "mm reduce_scatter_tensor mm reduce_scatter_tensor" in text  # the second chunk's matmul under the first's
