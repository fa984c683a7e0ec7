"""Tensor parallelism beyond dividing a layer's work: each rank's matmuls at their split shapes, and
full checkpointing's recompute running the layer's all-reduces again."""
from __future__ import annotations

import pytest

from picofx.cost.comm import all_reduce_seconds
from picofx.cost.gpus import GPUS
from picofx.planner.costs import ModelCosts
from picofx.planner.layouts import Layout, Run, predict
from picofx.planner.models import model_config, parameter_count
from picofx.planner.tensor_parallel import RECOMPUTED_ALL_REDUCES, matmul_slowdown


def llama2_7b_costs(matmul_s: float) -> Run:
    """llama2-7b's shape with layer costs in milliseconds, `matmul_s` of the forward's in matmuls."""
    config = model_config("llama2-7b")
    costs = ModelCosts(config, 4096, 10e-3, 20e-3, 10**8, 1e-3, 2e-3, 10**8, 10**8, parameter_count(config), 1e6,
                       layer_matmul_forward_s=matmul_s)
    return Run(costs, GPUS["h100"], 8, 8, 8)


def test_split_gemms_are_slower_per_flop_the_more_so_on_the_larger_gpu():
    config = model_config("llama2-7b")
    assert matmul_slowdown(GPUS["h100"], config, 1) == pytest.approx(1.0)
    h100, a100 = (matmul_slowdown(GPUS[g], config, 8) for g in ("h100", "a100-80gb"))
    assert h100 > a100 > 1.0
    assert matmul_slowdown(GPUS["h100"], config, 2) < h100


def test_a_tensor_parallel_layer_pays_its_split_matmuls_and_a_data_parallel_one_does_not():
    plain, with_matmuls = llama2_7b_costs(0.0), llama2_7b_costs(8e-3)
    tp8, dp8 = Layout(1, 8, 1, microbatches=8), Layout(8, 1, 1, microbatches=1)
    extra_forward = (matmul_slowdown(GPUS["h100"], with_matmuls.costs.config, 8) - 1) * 8e-3
    slots, layers = 8, with_matmuls.costs.layers  # one sequence per micro-batch
    gained = predict(with_matmuls, tp8).time["compute"] - predict(plain, tp8).time["compute"]
    assert gained == pytest.approx(slots * layers * 3 * extra_forward / 8)  # the backward's two matmuls a forward one
    assert predict(with_matmuls, dp8).time["compute"] == pytest.approx(predict(plain, dp8).time["compute"])


def test_full_checkpointing_runs_the_layers_all_reduces_again():
    run = llama2_7b_costs(8e-3)
    none, selective, full = (predict(run, Layout(1, 8, 1, microbatches=8, checkpoint=c)).time["tensor_parallel_comm"]
                             for c in ("none", "selective", "full"))
    assert selective == pytest.approx(none)
    activations = 4096 * run.costs.config.hidden_size * 2  # one bf16 sequence per micro-batch
    again = 8 * RECOMPUTED_ALL_REDUCES * run.costs.layers * all_reduce_seconds(activations, 8, run.link(8))
    assert full - none == pytest.approx(again)


def test_sequence_parallel_pays_an_all_gather_and_a_reduce_scatter_for_each_all_reduce():
    """The same bytes on the wire; where each collective costs a call latency (ranks sharing cores),
    twice the calls."""
    import dataclasses

    run = llama2_7b_costs(8e-3)
    tp, sp = (Layout(1, 8, 1, microbatches=8, sequence_parallel=s) for s in (False, True))
    assert predict(run, sp).time["tensor_parallel_comm"] == pytest.approx(predict(run, tp).time["tensor_parallel_comm"])
    waking = dataclasses.replace(run, device=dataclasses.replace(run.device, collective_latency=1e-3))
    more = predict(waking, sp).time["tensor_parallel_comm"] - predict(waking, tp).time["tensor_parallel_comm"]
    activations_all_reduced = 4 * run.costs.layers + 2
    assert more == pytest.approx(8 * activations_all_reduced * 1e-3)  # 8 micro-batch slots


def test_across_nodes_a_group_gets_the_ports_of_its_ranks_in_each_node():
    """On 16 H100 (two nodes of 8): data parallelism over all 16 rides every port of a node; beside
    tp 8 each data-parallel group has one rank per node and one port; a pipeline stage's send leaves
    through its rank's own port, carrying 1/tp of the activations only where they are split."""
    import dataclasses

    from picofx.cost.comm import send_seconds

    run = dataclasses.replace(llama2_7b_costs(8e-3), gpus=16)  # one sequence per micro-batch
    h100 = GPUS["h100"]
    assert run.link(8).bandwidth == h100.link_bandwidth  # within a node: NVLink
    assert run.link(16).bandwidth == h100.inter_node_link.bandwidth == 8 * h100.network_bandwidth
    assert run.link(16, stride=8).bandwidth == h100.network_bandwidth  # dp beside tp 8: one port
    assert run.link(16, stride=2).bandwidth == 4 * h100.network_bandwidth
    activations = 4096 * run.costs.config.hidden_size * 2
    for layout, sent in ((Layout(1, 8, 2, microbatches=8), activations),
                         (Layout(1, 8, 2, microbatches=8, sequence_parallel=True), activations / 8)):
        assert predict(run, layout).time["pipeline_sends"] == pytest.approx(
            (8 + 1) * 2 * send_seconds(sent, run.link(16, stride=8)))
    scattered = dataclasses.replace(run, sends_scattered=True)  # Megatron's scatter and gather
    assert predict(scattered, Layout(1, 8, 2, microbatches=8)).time["pipeline_sends"] == pytest.approx(
        (8 + 1) * 2 * send_seconds(activations / 8, run.link(16, stride=8)))
