"""picofx.cost.gpus: what a GPU profile says kernels and collectives reach, and how the cost
model reads it (the nominal CPU entry keeps the peaks)."""
from __future__ import annotations

import dataclasses
import types

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from picofx.cost import device as devices
from picofx.cost.comm import all_gather_seconds
from picofx.cost.gpus import A100_40GB, A100_80GB, GPUS, H100, H100_96GB, H200, NETWORKS
from picofx.cost.model import CostModel, compute_rate


def test_every_profile_is_named_as_the_planner_takes_it_and_keeps_its_datasheet_peak():
    assert {"h100", "h100-96gb", "a100-40gb", "a100-80gb", "h200"} <= GPUS.keys()
    assert H100.flops_per_second(torch.bfloat16) == H100_96GB.flops_per_second(torch.bfloat16) == 989e12
    assert A100_40GB.memory_capacity == 40e9 and A100_80GB.memory_capacity == 80e9 and H200.memory_capacity == 141e9
    assert H200.memory_bandwidth > H100.memory_bandwidth > H100_96GB.memory_bandwidth > A100_80GB.memory_bandwidth


def test_kernels_reach_less_than_the_peak_and_small_matmuls_less_than_large_ones():
    bf16 = torch.bfloat16
    large, small = H100.matmul_rate(bf16, 8192), H100.matmul_rate(bf16, 256)
    assert large < 0.8 * 989e12 and small < 0.7 * large
    assert H100_96GB.matmul_rate(bf16, 8192) < large  # the 500 W part's clock
    assert H100.attention_rate(bf16, backward=True, causal=False) < H100.attention_rate(bf16, False, False)
    # a causal kernel skips half of the score matrix the graph's FLOPs count
    assert H100.attention_rate(bf16, False, causal=True) == 2 * H100.attention_rate(bf16, False, causal=False)
    assert H100.pointwise_bandwidth() < H100.memory_bandwidth


def test_the_cost_model_times_a_matmul_at_its_shapes_rate():
    gm = make_fx(torch.mm, tracing_mode="fake")(torch.randn(16384, 256, dtype=torch.bfloat16),
                                                  torch.randn(256, 16384, dtype=torch.bfloat16))
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    mm.meta["flops"] = 2 * 16384 * 256 * 16384  # what capture annotates
    assert compute_rate(H100, mm) == H100.matmul_rate(torch.bfloat16, 256)
    plain = dataclasses.replace(H100, matmul_efficiency=1.0, matmul_half_dim=0, pointwise_efficiency=1.0,
                                sustained=1.0, op_overhead=0.0)
    profiled = dataclasses.replace(H100, op_overhead=0.0)
    assert CostModel(profiled).node_time(mm) > 1.5 * CostModel(plain).node_time(mm)  # compute-bound at 2/3 of 80%


def test_a_ring_across_nodes_uses_a_port_per_rank_of_the_node():
    assert H100.network_bandwidth_for(8) == 8 * H100.network_bandwidth_for(1)
    assert H100.network_bandwidth_for(16) == H100.network_bandwidth_for(8)  # no more ports than that
    assert H100.inter_node_link.bandwidth == H100.network_bandwidth_for(8)
    one_port = dataclasses.replace(H100, network_ports=1)
    assert all_gather_seconds(1e9, 64, one_port.inter_node_link) > 4 * all_gather_seconds(1e9, 64, H100.inter_node_link)


def test_a_profile_sits_on_its_clusters_network_and_can_be_moved_to_another():
    assert [g.network_name for g in (H100, H200, H100_96GB, A100_80GB, A100_40GB)] == \
        [NETWORKS[k].name for k in ("ib-ndr", "ib-ndr", "roce-400", "ib-hdr", "ib-hdr")]
    assert A100_80GB.inter_node_link.bandwidth == 8 * 0.9 * 200e9 / 8  # 8 HDR ports at 90% of line rate
    p4d, p5 = A100_80GB.on(NETWORKS["efa-p4d"]), H100.on(NETWORKS["efa-p5"])
    assert p4d.inter_node_link.bandwidth == A100_80GB.inter_node_link.bandwidth / 4  # 4 x 100 Gb/s against 8 x 200
    assert p4d.network_bandwidth_for(1) == p4d.network_bandwidth_for(8) / 4  # two GPUs to a port
    assert p4d.network_bandwidth_for(4) == p4d.network_bandwidth_for(8)
    assert p5.network_bandwidth_for(1) == 4 * p5.network_bandwidth  # four ports to a GPU
    assert p5.inter_node_link.bandwidth == H100.inter_node_link.bandwidth  # 32 x 100 Gb/s = 8 x 400
    assert p4d.matmul_rate(torch.bfloat16, 4096) == A100_80GB.matmul_rate(torch.bfloat16, 4096)


def test_a_cuda_device_is_matched_by_every_word_of_a_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=42e9))
    for cuda_name, profile in (("NVIDIA A100-SXM4-40GB", A100_40GB), ("NVIDIA A100-SXM4-80GB", A100_80GB),
                               ("NVIDIA H100 80GB HBM3", H100), ("NVIDIA H200", H200)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=cuda_name: name)
        found = devices.device_for("cuda:0")
        assert found.name == profile.name and found.memory_capacity == 42e9, cuda_name
