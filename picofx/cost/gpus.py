"""GPU profiles: what each GPU delivers to a training step, not only what its datasheet promises.

A profile keeps the datasheet peaks (MFU is reported against them) and adds what kernels reach:
- matmuls: the largest bf16 GEMM's share of the peak (the maximum achievable matmul FLOP/s,
  measured), less where a GEMM's smallest dimension is small (`matmul_half_dim`);
- attention: the FlashAttention-2 kernel (PyTorch's SDPA flash backend) forward and backward
  share of the peak at head dimension 128, causal, long sequences;
- pointwise and norm kernels: their share of the memory bandwidth;
- collectives: NCCL's bus bandwidth in a node (NVLink) and per network port, the latency of each
  ring step (small messages are latency-bound: the alpha-beta model NCCL's own tuning uses); the
  network is the cluster's (`NETWORKS`), each profile with the one its GPU most often sits on;
- a gap between kernels, the power-limited clock (`clock`: the share of the datasheet's boost
  clock the tensor cores sustain), and `sustained`: the share of the kernels' own rates a whole
  training step keeps up (clocks under a long full load, communication kernels taking SMs and
  memory bandwidth beside the compute, the host), the same for every GPU.
Every figure and its source is listed in docs/planner.md ("GPU profiles"). `FITTED` names the
figures fitted to published runs (tools/plan_published.py --fit) and the runs they were fitted on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from picofx.cost.hardware import GB, GiB, Device, Link


# Of a network port's line rate, the bus bandwidth NCCL's rings reach across nodes: assumed, below the
# 96% NVIDIA measures on a DGX A100's InfiniBand (192 GB/s of 8 x 200 Gb/s, nccl issue 812), which
# the RoCE and EFA networks do not reach.
LINE_RATE_SHARE = 0.9


@dataclass(frozen=True)
class Network:
    """A cluster's network between nodes of 8 GPUs: the ports each node has and their line rate."""

    key: str
    name: str
    ports: int
    gbit_per_port: float
    source: str
    latency: float = 8e-6  # s per ring step, a typical small message across nodes

    @property
    def port_bandwidth(self) -> float:
        return LINE_RATE_SHARE * self.gbit_per_port * 1e9 / 8


NETWORKS = {n.key: n for n in (
    Network("ib-ndr", "InfiniBand NDR, 8 x 400 Gb/s per node", 8, 400,
            "DGX H100: a ConnectX-7 400 Gb/s port per GPU"),
    Network("roce-400", "RDMA (RoCE), 8 x 400 Gb/s per node", 8, 400,
            "Meta's Grand Teton H100 hosts, as torchtitan's 2024 benchmarks name them: a 400 Gb/s RDMA port per GPU"),
    Network("ib-hdr", "InfiniBand HDR, 8 x 200 Gb/s per node", 8, 200,
            "DGX A100 and NVIDIA's Selene (Narayanan et al. 2021, Korthikanti et al. 2022): a 200 Gb/s HDR port "
            "per GPU"),
    Network("efa-p4d", "AWS EFA, 4 x 100 Gb/s per node (p4d)", 4, 100,
            "AWS p4d.24xlarge (8 x A100): 400 Gb/s of EFA per node, a port for two GPUs"),
    Network("efa-p5", "AWS EFA, 32 x 100 Gb/s per node (p5)", 32, 100,
            "AWS p5.48xlarge (8 x H100): 3,200 Gb/s of EFA per node, four ports per GPU"),
)}


@dataclass(frozen=True)
class GpuProfile(Device):
    matmul_efficiency: float = 1.0    # largest bf16 GEMM / peak
    matmul_half_dim: int = 0          # a GEMM whose smallest dimension is this runs at half that rate
    attention_efficiency: tuple = (1.0, 1.0)  # FlashAttention forward, backward / peak (causal FLOPs)
    pointwise_efficiency: float = 1.0  # memory-bound kernels / memory bandwidth
    network_ports: int = 8            # network ports per node (8 GPUs)
    clock: float = 1.0                # sustained tensor-core clock / datasheet boost clock
    sustained: float = 1.0            # of the kernels' rates, what a whole training step keeps up (fitted)
    sources: str = ""

    def matmul_rate(self, dtype: torch.dtype, smallest_dim: int) -> float:
        """FLOP/s of a GEMM whose smallest of M, N, K is `smallest_dim`."""
        size = smallest_dim / (smallest_dim + self.matmul_half_dim) if self.matmul_half_dim else 1.0
        return self.flops_per_second(dtype) * self.clock * self.sustained * self.matmul_efficiency * size

    def attention_rate(self, dtype: torch.dtype, backward: bool, causal: bool) -> float:
        """FLOP/s over the FLOPs the graph counts (all of the score matrix): a causal kernel skips
        the masked half of them."""
        rate = self.flops_per_second(dtype) * self.clock * self.sustained * self.attention_efficiency[backward]
        return 2 * rate if causal else rate

    def pointwise_bandwidth(self) -> float:
        return self.memory_bandwidth * self.sustained * self.pointwise_efficiency

    @property
    def inter_node_link(self) -> Link:
        """The network as a ring across nodes sees it when each node's 8 GPUs are in it (data parallel
        with tp 1): one ring per port, all the node's ports."""
        return self.network_link(8)

    def network_link(self, ranks_per_node: int) -> Link:
        """The network as a group across nodes with `ranks_per_node` of its ranks in each node sees it
        (`network_bandwidth_for`)."""
        return Link(self.network_name, self.network_bandwidth_for(ranks_per_node), self.network_latency,
                    self.link_source, self.collective_latency)

    def network_bandwidth_for(self, ranks_per_node: int) -> float:
        """Bus bandwidth of a ring across nodes with `ranks_per_node` of its ranks in each node: NCCL
        runs one ring per port, and a rank reaches the ports beside it (two GPUs share one on a p4d,
        a GPU has four on a p5), so a group uses its ranks' share of the node's ports."""
        ports_per_rank = max(1, self.network_ports // 8)
        return self.network_bandwidth * max(1, min(ranks_per_node * ports_per_rank, self.network_ports))

    def on(self, network: Network) -> "GpuProfile":
        """This GPU in a cluster whose nodes are joined by `network`."""
        return dataclasses.replace(self, network_bandwidth=network.port_bandwidth, network_ports=network.ports,
                                   network_latency=network.latency, network_name=network.name)


# Fitted to published runs (tools/plan_published.py --fit): the runs named in FIT_RUNS, no others.
FITTED = {"sustained": 0.96, "h100-96gb clock": 0.77}
FIT_RUNS = ("Llama 3 8B, selective op checkpointing", "GPT 175B, TP 8 x PP 8, sequence parallel + selective",
            "Llama 3.1 8B, FSDP + compile, 8 GPUs")

_BF16 = (torch.bfloat16, torch.float16)


def clock_at_power(clock: float, watts: float, other_watts: float) -> float:
    """The sustained clock a part power-capped at `other_watts` keeps, from the same die's `clock` at
    `watts`: under a power cap the voltage follows the clock down, so dynamic power goes as the clock
    cubed (capped at the datasheet's boost clock)."""
    return min(1.0, clock * (other_watts / watts) ** (1 / 3))


H100 = GpuProfile(
    name="NVIDIA H100 SXM 80GB (700 W)",
    peak_flops={torch.float64: 67e12, torch.float32: 494.5e12, torch.bfloat16: 989e12, torch.float16: 989e12,
                torch.float8_e4m3fn: 1979e12},
    memory_bandwidth=3.35e12, memory_capacity=80 * GB,
    link_bandwidth=460e9, link_latency=3e-6, network_bandwidth=0.0, network_latency=0.0,
    op_overhead=2e-6, matmul_efficiency=0.80, matmul_half_dim=512, attention_efficiency=(0.37, 0.30),
    pointwise_efficiency=0.85, sustained=FITTED["sustained"], clock=clock_at_power(FITTED["h100-96gb clock"], 500, 700),
    source="profile", link_name="NVLink 4 (NCCL bus bandwidth)", link_source="nccl-tests bus bandwidth",
    sources="docs/planner.md#gpu-profiles").on(NETWORKS["ib-ndr"])

H100_96GB = dataclasses.replace(
    H100, name="NVIDIA H100 SXM 96GB HBM2e (500 W)", memory_bandwidth=2.4e12, memory_capacity=95 * GiB,
    clock=FITTED["h100-96gb clock"]).on(NETWORKS["roce-400"])

H200 = dataclasses.replace(H100, name="NVIDIA H200 SXM 141GB (700 W)", memory_bandwidth=4.8e12,
                           memory_capacity=141 * GB)

A100_80GB = GpuProfile(
    name="NVIDIA A100 SXM 80GB",
    peak_flops={torch.float64: 19.5e12, torch.float32: 156e12, torch.bfloat16: 312e12, torch.float16: 312e12},
    memory_bandwidth=2.039e12, memory_capacity=80 * GB,
    link_bandwidth=235e9, link_latency=3e-6, network_bandwidth=0.0, network_latency=0.0,
    op_overhead=2e-6, matmul_efficiency=0.859, matmul_half_dim=128, attention_efficiency=(0.70, 0.55),
    pointwise_efficiency=0.85, sustained=FITTED["sustained"], source="profile",
    link_name="NVLink 3 (NCCL bus bandwidth)", link_source="nccl-tests bus bandwidth",
    sources="docs/planner.md#gpu-profiles").on(NETWORKS["ib-hdr"])

A100_40GB = dataclasses.replace(A100_80GB, name="NVIDIA A100 SXM 40GB", memory_bandwidth=1.555e12,
                                memory_capacity=40 * GB)

# By name for --gpu; a CUDA device is matched by the words of a key in the name CUDA reports
# ("NVIDIA A100-SXM4-40GB" -> "a100-40gb", "NVIDIA H100 80GB HBM3" -> "h100"). "a100" is the 80 GB part.
GPUS = {"h100": H100, "h200": H200, "a100": A100_80GB, "h100-96gb": H100_96GB, "a100-40gb": A100_40GB,
        "a100-80gb": A100_80GB}
